"""``python -m fleetmpi.docs``: every generated file of the checkout is what its code renders
today, and the check names a file that is not."""
import os
import shutil

import pytest

from fleetmpi import docs
from fleetmpi.docs.__main__ import main


def test_every_generated_file_is_current():
    assert docs.stale() == [], "run: python -m fleetmpi.docs regenerate"


def test_the_check_names_a_stale_or_missing_file_and_regenerate_mends_it(tmp_path):
    for path, _ in docs.GENERATED:
        os.makedirs(tmp_path / os.path.dirname(path), exist_ok=True)
        shutil.copy(os.path.join(docs.ROOT, path), tmp_path / path)
    pairs, fields = docs.GENERATED[2][0], docs.GENERATED[1][0]
    with open(tmp_path / pairs, "a") as f:
        f.write("an edit by hand\n")
    os.remove(tmp_path / fields)
    assert docs.stale(str(tmp_path)) == [fields, pairs]
    assert docs.regenerate(str(tmp_path)) == [path for path, _ in docs.GENERATED]
    assert docs.stale(str(tmp_path)) == []


def test_the_command_checks_and_refuses_an_unclear_request(capsys):
    assert main(["--check"]) == 0
    assert "every generated file is up to date" in capsys.readouterr().out
    for argv in ([], ["regenerate", "--check"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert "give either regenerate or --check" in capsys.readouterr().err

"""tests/mpi_pytest.py, which runs the multi-rank stages of tests/run: a test that hangs is
named before pytest-timeout's thread method takes its rank down."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_hanging_test_is_named_in_the_ranks_log(tmp_path):
    (tmp_path / "test_planted.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\n"
        "def test_hangs_here():\n    time.sleep(120)\n")
    log = tmp_path / "rank-0.log"
    program = (f"import sys; sys.path.insert(0, {HERE!r}); import mpi_pytest, pytest\n"
               f"log = open({str(log)!r}, 'w')\n"
               f"pytest.main(['-q', '-p', 'no:cacheprovider', '--timeout=2', "
               f"'--timeout-method=thread', {str(tmp_path)!r}], "
               f"plugins=[mpi_pytest.NameTheHang(0, log)])\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode != 0  # pytest-timeout ended the process
    assert "Timeout" in done.stdout + done.stderr
    assert "[rank 0] test_planted.py::test_hangs_here hangs: still running after 2 s" \
        in log.read_text()
    assert "test_quick" not in log.read_text()

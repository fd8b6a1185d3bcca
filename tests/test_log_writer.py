"""``fleet.LogWriter``: scalars in a CSV and a TensorBoard event file, read back, on rank 0."""
import csv
import glob
import os
import struct
import sys

import numpy as np
import pytest

import fleetmpi as fleet


def read_events(logdir):
    """``[(tag, step, value)]`` of the scalar summaries of the event files under ``logdir``,
    parsed from the TFRecord framing (length, its CRC, the Event, its CRC) and TensorBoard's
    Event protocol buffer."""
    from tensorboardX.proto import event_pb2

    found = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found.append((value.tag, event.step, value.simple_value))
    return found


def test_scalars_land_in_the_csv_and_the_event_file(tmp_path):
    with fleet.LogWriter(tmp_path / "run") as writer:
        for step in range(3):
            writer.add_scalar("train/loss", 1.0 / (step + 1), step)
        writer.add_scalar("eval/acc", fleet.to_tensor(np.array([0.75])), 2)
    with open(tmp_path / "run" / "scalars.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["tag"], int(r["step"]), float(r["value"])) for r in rows] == [
        ("train/loss", 0, 1.0), ("train/loss", 1, 0.5), ("train/loss", 2, 1 / 3),
        ("eval/acc", 2, 0.75)]
    events = read_events(str(tmp_path / "run"))
    assert [(t, s) for t, s, _ in events] == [("train/loss", 0), ("train/loss", 1),
                                               ("train/loss", 2), ("eval/acc", 2)]
    assert [v for _, _, v in events] == pytest.approx([1.0, 0.5, 1 / 3, 0.75])


def test_the_csv_is_never_written_through_a_planted_link(tmp_path):
    (tmp_path / "run").mkdir()
    target = tmp_path / "victim"
    target.write_text("keep")
    os.symlink(target, tmp_path / "run" / "scalars.csv")
    with pytest.raises(OSError, match="it is a symbolic link"):
        fleet.LogWriter(tmp_path / "run", tensorboard=False)
    assert target.read_text() == "keep"


def test_bad_values_are_refused_by_name(tmp_path):
    writer = fleet.LogWriter(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="step must be an integer, not 1.5"):
        writer.add_scalar("loss", 1.0, 1.5)
    with pytest.raises(TypeError, match=r"add_scalar\('loss'\) takes a number"):
        writer.add_scalar("loss", "high", 1)
    writer.close()
    with pytest.raises(ValueError, match="is closed"):
        writer.add_scalar("loss", 1.0, 2)


@pytest.mark.mpi(min_size=2)
def test_only_rank_0_writes(tmp_path_factory):
    from mpi4py import MPI

    fleet.init(is_collective=True)
    world = MPI.COMM_WORLD
    logdir = world.bcast(str(tmp_path_factory.mktemp("logs")) if world.rank == 0 else None)
    writer = fleet.LogWriter(logdir)
    writer.add_scalar("loss", float(world.rank), 0)
    writer.close()
    world.Barrier()
    with open(os.path.join(logdir, "scalars.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["tag"], float(r["value"])) for r in rows] == [("loss", 0.0)]
    assert len(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))) == 1


def test_without_tensorboardx_the_first_writer_says_once_where_it_writes(tmp_path, monkeypatch,
                                                                         fleetmpi_warnings):
    from fleetmpi.training import log_writer

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX fails
    monkeypatch.setattr(log_writer, "_said_csv_only", False)
    for run in ("a", "b"):
        with fleet.LogWriter(tmp_path / run) as writer:
            writer.add_scalar("loss", 1.0, 0)
    said = [message for message in fleetmpi_warnings() if "LogWriter" in message]
    assert len(said) == 1, said
    assert os.path.join(str(tmp_path / "a"), "scalars.csv") in said[0]
    assert "tensorboardX" in said[0] and "pip install 'fleetmpi[logging]'" in said[0]
    assert not glob.glob(str(tmp_path / "a" / "events.out.tfevents.*"))
    with pytest.raises(ImportError, match=r"pip install 'fleetmpi\[logging\]'"):
        fleet.LogWriter(tmp_path / "c", tensorboard=True)

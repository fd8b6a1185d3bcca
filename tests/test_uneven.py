"""Uneven inputs: a rank that ends its script, or leaves its training loop for a barrier, a
checkpoint or an evaluation, while the others wait in a collective, is reported at once, not
after the default stall time (600 s), naming the rank and where it went."""
import pytest

from fleetmpi.core.knobs import DEFAULT_STALL_SECONDS
from job_prefetch import start_the_next_job  # noqa: F401 (an autouse fixture)
from test_stall_repeats import StallJob, reports, waited


@pytest.mark.parametrize("job", [
    StallJob(counts.count(",") + 1, "uneven", idiom=idiom, counts=counts, timeout=None)
    for idiom in ("minimize", "backward") for counts in ("3,5", "5,3", "4,6,6", "6,6,4")],
    ids=str)
def test_a_rank_whose_batches_run_out_first_is_reported_at_once(job):
    steps = [int(v) for v in job.counts.split(",")]
    first = steps.index(min(steps))
    code, text = job.result()
    assert code != 0, text
    found = reports(text)
    assert all(waited(line) < DEFAULT_STALL_SECONDS for line in found.values()), text
    waiting = {r for r, s in enumerate(steps) if s > min(steps)}
    assert found and set(found) <= waiting, text
    for line in found.values():
        # calls #1 and #2 of the world's communicator are distributed_model's: its check that
        # every rank built the same model, and its broadcast
        assert f"in allreduce_many, call #{min(steps) + 3} of its communicator" in line, text
        assert f"rank(s) {first} have not arrived there: rank {first} finished its script " \
               f"after {min(steps) + 2} call(s) of this communicator; they cannot arrive" \
            in line, text
    assert f"rank {first} finished" in text, text  # its script did end


@pytest.mark.parametrize("job, call", [
    (StallJob(2, "leave", where=where, timeout=None), call)
    for where, call in [("barrier", "barrier_worker"), ("checkpoint", "checkpoint.save"),
                        ("evaluate", "allreduce")]], ids=lambda value: str(value))
def test_a_rank_that_leaves_its_training_loop_is_reported_at_once(job, call):
    """Rank 0 leaves after 2 steps for ``where`` while rank 1 trains a third step: each
    waits where the other will never come, which the first to ask sees. The evaluation's
    allreduce runs on the world's communicator, which training uses too: there the two wait
    in different calls of the same number."""
    where = job.where
    code, text = job.result()
    assert code != 0, text
    found = reports(text)
    assert all(waited(line) < DEFAULT_STALL_SECONDS for line in found.values()), text
    assert found, text
    same_communicator = where == "evaluate"
    for rank, line in found.items():
        assert "they cannot arrive" in line, text
        if same_communicator:
            other = "rank 0 waits in a different call at this number: allreduce of" if rank \
                else "rank 1 waits in a different call at this number: allreduce_many of"
            assert other in line, text
            continue
        assert "which this rank has not reached" in line, text
        if rank == 1:
            assert f"rank 0 waits in {call}" in line, text
        else:
            assert "rank 1 waits in allreduce_many" in line, text
    assert "finished" not in text, text

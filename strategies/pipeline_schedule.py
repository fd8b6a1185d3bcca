"""The order in which one pipeline stage runs the forward and backward passes of the
micro-batches of a step, and the idle fraction ("bubble") a schedule leaves.

``"F-then-B"`` (GPipe) runs every forward, then every backward. ``"1F1B"`` runs
``stages - stage - 1`` forwards to fill the pipeline, then alternates one forward and one
backward, then drains the remaining backwards: no stage ever holds the activations of more than
``stages`` micro-batches, where F-then-B holds all of them. With equal stage costs both leave
the same bubble, ``(stages - 1) / (micro_batch + stages - 1)`` of each rank's step.

The order of the messages between two neighbouring stages is what keeps blocking sends and
receives from deadlocking: both sides must issue them in one order. That order is the later
stage's ``compute_order`` (it receives an activation right before each forward and sends a
gradient right after each backward): ``(FORWARD, k)`` is micro-batch k's activation,
``(BACKWARD, k)`` its gradient; the earlier stage follows it.
"""
SCHEDULE_MODES = ("1F1B", "F-then-B")
FORWARD, BACKWARD = "F", "B"


def check_schedule_mode(mode):
    if mode not in SCHEDULE_MODES:
        raise ValueError(f"pipeline_configs['schedule_mode'] is {mode!r}; allowed: "
                         f"{', '.join(repr(m) for m in SCHEDULE_MODES)}")
    return mode


def compute_order(mode, stages, micro_batches, stage):
    """``[(FORWARD or BACKWARD, micro-batch index), ...]`` in the order ``stage`` runs them."""
    check_schedule_mode(mode)
    forwards = [(FORWARD, k) for k in range(micro_batches)]
    backwards = [(BACKWARD, k) for k in range(micro_batches)]
    if mode == "F-then-B":
        return forwards + backwards
    warmup = min(stages - stage - 1, micro_batches)
    order = forwards[:warmup]
    for k in range(micro_batches - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[micro_batches - warmup:]


def in_flight(order):
    """The most micro-batches whose forward has run and backward has not, at any point."""
    most = current = 0
    for kind, _ in order:
        current += 1 if kind == FORWARD else -1
        most = max(most, current)
    return most


def bubble_fraction(stages, micro_batches):
    """The idle share of a step with equal-cost stages: ``(S - 1) / (M + S - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)

"""Paddle's ``FLAGS_*`` environment variables: the ones fleetmpi reads, and what each does.

The collective-training guide sets three of them, and ``fleetmpirun`` passes every ``FLAGS_*``
variable on to the ranks, as Paddle's launcher does:

* ``FLAGS_fuse_parameter_memory_size`` (MB) is ``fuse_grad_size_in_MB`` and
  ``FLAGS_fuse_parameter_groups_size`` (layers) is ``fuse_grad_size_in_TFLOPS``: each gives the
  field its value where the strategy does not set the field itself (a field the script set
  wins, as Paddle's strategy sets these flags);
* ``FLAGS_fraction_of_gpu_memory_to_use`` limits CuPy's memory pool to that fraction of the
  device's memory (``fleetmpi.core.backend``);
* ``FLAGS_check_nan_inf`` (``1``) checks the outputs of every operation, forward and backward,
  and names the first operator and layer that gave an inf or NaN (``fleetmpi.autograd.nan_inf``);
* ``FLAGS_selected_gpus`` is what ``fleetmpirun --gpus`` sets beside ``CUDA_VISIBLE_DEVICES``,
  which is what fleetmpi follows.

Any other ``FLAGS_*`` variable that is set is listed by ``applied_strategy().not_applied``
with ``UNREAD``, so none is ignored without a word.
"""
import os

FIELD_FLAGS = {
    "FLAGS_fuse_parameter_memory_size": "fuse_grad_size_in_MB",
    "FLAGS_fuse_parameter_groups_size": "fuse_grad_size_in_TFLOPS",
}
MEMORY_FRACTION = "FLAGS_fraction_of_gpu_memory_to_use"
SELECTED_GPUS = "FLAGS_selected_gpus"
CHECK_NAN_INF = "FLAGS_check_nan_inf"
# The spellings of a boolean Paddle's flags (gflags) accept.
_BOOLEANS = {"1": True, "true": True, "True": True, "0": False, "false": False, "False": False}
UNREAD = "fleetmpi does not read this Paddle flag"


def _number(name, text, integer):
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = None
    if value is None or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{name}={text!r} must be {kind}")
    return value


def with_flags(strategy, environ=os.environ):
    """``strategy``, or a copy of it with the fields of ``FIELD_FLAGS`` it leaves unset taken
    from their flags."""
    import copy

    taken = {}
    for name, field in FIELD_FLAGS.items():
        text = environ.get(name, "").strip()
        if text and not strategy._message.HasField(field):
            taken[field] = _number(name, text, integer=field == "fuse_grad_size_in_MB")
    if not taken:
        return strategy
    result = copy.deepcopy(strategy)
    for field, value in taken.items():
        setattr(result, field, value)
    return result


def memory_fraction(environ=os.environ):
    """The fraction of device memory ``FLAGS_fraction_of_gpu_memory_to_use`` allows, or None."""
    text = environ.get(MEMORY_FRACTION, "").strip()
    if not text:
        return None
    value = _number(MEMORY_FRACTION, text, integer=False)
    if value > 1:
        raise ValueError(f"{MEMORY_FRACTION}={text!r} must be a fraction in (0, 1]")
    return value


def check_nan_inf(environ=os.environ):
    """Whether ``FLAGS_check_nan_inf`` asks for every operation's outputs to be checked."""
    text = environ.get(CHECK_NAN_INF, "").strip()
    if text == "":
        return False
    if text not in _BOOLEANS:
        raise ValueError(f"{CHECK_NAN_INF}={text!r} must be 1, true, 0 or false")
    return _BOOLEANS[text]


def unread(on_gpu, environ=os.environ):
    """``{variable: why}`` for each ``FLAGS_*`` variable set that changes nothing here."""
    reasons = {}
    for name in sorted(n for n in environ if n.startswith("FLAGS_") and environ[n] != ""):
        if name in FIELD_FLAGS or name == CHECK_NAN_INF:
            continue
        if name == MEMORY_FRACTION:
            if not on_gpu:
                reasons[name] = "there is no GPU memory pool: this process computes on the CPU"
        elif name == SELECTED_GPUS:
            if environ[name] != environ.get("CUDA_VISIBLE_DEVICES"):
                reasons[name] = ("fleetmpi drives the device CUDA_VISIBLE_DEVICES leaves at "
                                 "local_rank % device count; fleetmpirun --gpus sets both")
        else:
            reasons[name] = UNREAD
    return reasons

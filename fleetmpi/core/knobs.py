"""Every ``FLEETMPI_*`` environment variable: its name, default, parser and what it does.

Each behaviour that a job may want to change without touching the script has one variable here
(``KNOBS``), and the module that has the behaviour reads it with ``<KNOB>.value()``. Unset or
empty keeps the default; any other value is parsed, and a bad one is refused with a
ValueError naming the variable, the value and what is allowed. Where a behaviour is also an
argument (``FLEETMPI_PROGRESS`` and ``ProgressBar(mode=...)``, the ``auto_*`` arguments of
``distributed_optimizer``), the argument wins.

The README's table of variables is rendered from ``KNOBS`` (``fleetmpi.docs``).

This module is at the bottom of the layers: it imports nothing from fleetmpi.
"""
import logging
import math
import numbers
import os


class Knob:
    """One environment variable: ``name``, ``default`` (its value when unset or empty),
    ``parse(name, text)`` (its value from the text, or a ValueError naming ``name``),
    ``allowed`` (what a value may be) and ``doc`` (what it does), both for the README."""

    __slots__ = ("name", "default", "parse", "allowed", "doc")

    def __init__(self, name, default, parse, allowed, doc):
        self.name = name
        self.default = default
        self.parse = parse
        self.allowed = allowed
        self.doc = doc

    def value(self, environ=os.environ):
        """The value the variable sets in ``environ``, the default when unset or empty."""
        text = environ.get(self.name, "")
        return self.default if text == "" else self.parse(self.name, text)

    def __repr__(self):
        return f"Knob({self.name!r}, default={self.default!r})"


def _alternatives(values):
    values = list(values)
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def choice(meanings):
    """A parser of one of the texts of ``meanings`` (``{text: (value, what it means)}``, the
    meaning None where the text says it all) into its value."""
    explained = "; ".join(f"{text}: {meaning}" for text, (_, meaning) in meanings.items()
                          if meaning)
    rule = _alternatives(meanings) + (f" ({explained})" if explained else "")

    def parse(name, text):
        if text not in meanings:
            raise ValueError(f"{name}={text!r} must be {rule}")
        return meanings[text][0]
    return parse


def flag(off, on):
    """A parser of ``0`` (``off`` says what it does) or ``1`` (``on``) into False or True."""
    return choice({"0": (False, off), "1": (True, on)})


def names(*values):
    """A parser of one of ``values``, which stand for themselves."""
    return choice({value: (value, None) for value in values})


def env_seconds(name, default, zero_means=None, environ=os.environ):
    """The seconds in variable ``name``, ``default`` when it is unset or empty.

    The value must be a finite number > 0, or >= 0 when ``zero_means`` says what 0 stands for
    (the caller then handles 0 itself)."""
    text = environ.get(name, "")
    if text == "":
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    zero_allowed = zero_means is not None
    if math.isinf(seconds) or not (seconds > 0 or zero_allowed and seconds == 0):
        rule = (f"a number of seconds >= 0 (0: {zero_means}" if zero_allowed
                else "a positive number of seconds (")
        raise ValueError(f"{name}={text!r} must be {rule}; unset: {default:g})")
    return seconds


def seconds(default, zero_means=None):
    """A parser of seconds by the rule of ``env_seconds``."""
    return lambda name, text: env_seconds(name, default, zero_means, {name: text})


def positive_integer(name, text):
    """A whole number >= 1."""
    text = text.strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}={text!r} must be a positive integer")
    return int(text)


def thread_count(name, text):
    """A whole number from 1 to ``MAX_THREADS``: the BLAS takes it as a C int."""
    count = positive_integer(name, text)
    if count > MAX_THREADS:
        raise ValueError(f"{name}={text!r} must be a positive integer up to {MAX_THREADS}")
    return count


def whole_number(name, text):
    """A whole number >= 0."""
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} must be a whole number >= 0")
    return int(text)


def positive_number(name, value):
    """A finite number > 0, from text or from a number (an argument); a float."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} must be a positive number") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number")
    return float(value)


def path(name, text):
    """A file path, as written."""
    return text


def device(name, text):
    """``cpu`` or ``gpu``, in any case and with spaces around; blank: None (automatic)."""
    text = text.strip().lower()
    if text == "":
        return None
    if text not in DEVICES:
        raise ValueError(f"{name}={text!r} is not a device; use one of {DEVICES} "
                         "or leave it unset to pick a GPU when one is usable")
    return text


def log_level(name, text):
    """The name of a ``logging`` level, upper-cased."""
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{name}={level!r} is not a logging level; "
                         "use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def strategy_names(name, value):
    """A frozenset of ``AUTO_ALLOWABLE`` names, from a comma-separated text (``none``: empty)
    or a list (an argument)."""
    if isinstance(value, str):
        text = value.strip()
        listed = [] if text.lower() == "none" else [part.strip() for part in text.split(",")]
    elif isinstance(value, (list, tuple, set, frozenset)):
        listed = list(value)
    else:
        raise ValueError(f"{name}={value!r} must be a comma-separated string or a list of "
                         f"strategy names")
    unknown = [n for n in listed if n not in AUTO_ALLOWABLE]
    if unknown:
        raise ValueError(f"{name}={value!r}: {', '.join(map(repr, unknown))} cannot be allowed; "
                         f"allowed: {', '.join(AUTO_ALLOWABLE)}, or 'none'")
    return frozenset(listed)


DEVICES = ("cpu", "gpu")
AUTO_TRANSPORT = "auto"  # NCCL where every rank has a GPU of its own, else MPI (comm)
TRANSPORTS = (AUTO_TRANSPORT, "mpi", "nccl")
PROGRESS_MODES = ("auto", "bar", "lines", "off")
ALWAYS = "always"
DEFAULT_STALL_SECONDS = 600.0
DEFAULT_PS_TIMEOUT = 300.0
# Strategies auto may choose that only round (the default), then those that change convergence.
AUTO_ROUNDING = ("fp16_allreduce", "amp")
AUTO_CONVERGENCE = ("gradient_merge", "dgc", "localsgd", "adaptive_localsgd")
AUTO_ALLOWABLE = AUTO_ROUNDING + AUTO_CONVERGENCE

DEVICE = Knob(
    "FLEETMPI_DEVICE", None, device, "`cpu`, `gpu`",
    "The array backend; unset: a GPU when CuPy imports and sees a device, else the CPU.")
MAX_THREADS = 1 << 16
NUM_THREADS = Knob(
    "FLEETMPI_NUM_THREADS", None, thread_count, f"a positive integer up to {MAX_THREADS}",
    "BLAS threads per rank on CPU; unset: the node's cores over its ranks, or the user's "
    "`OMP_NUM_THREADS`/`OPENBLAS_NUM_THREADS`/`MKL_NUM_THREADS` where set.")
KEEP_HOST_MEMORY = Knob(
    "FLEETMPI_KEEP_HOST_MEMORY", True,
    flag("glibc's defaults", "keep freed host memory for the next step's arrays"), "`0`, `1`",
    "`1`: freed host memory stays in the process for the next step's arrays (glibc's "
    "`mallopt`); `0`: glibc's defaults.")
LOG_LEVEL = Knob(
    "FLEETMPI_LOG_LEVEL", "WARNING", log_level, "`DEBUG`, `INFO`, `WARNING`, `ERROR`, `CRITICAL`",
    "The level of the `fleetmpi` logger, whose lines carry the rank and node.")
LOCAL_SIZE = Knob(
    "FLEETMPI_LOCAL_SIZE", None, positive_integer, "a divisor of the world size",
    "Each run of k consecutive ranks acts as one node, to exercise multi-node algorithms on "
    "one machine; unset: the nodes MPI sees.")
CHECK_ENVIRONMENT = Knob(
    "FLEETMPI_CHECK_ENVIRONMENT", True,
    flag("skip the check", "check the launcher's variables against MPI"), "`0`, `1`",
    "`fleet.init()` checks the launcher's variables (Open MPI, Hydra, Slurm, Paddle's) "
    "against MPI; `0` skips the check.")
TRANSPORT = Knob(
    "FLEETMPI_TRANSPORT", AUTO_TRANSPORT, names(*TRANSPORTS), "`auto`, `mpi`, `nccl`",
    "`auto`: NCCL when every rank's arrays live on a GPU of its own, as `fleetmpirun --gpus` "
    "arranges, MPI otherwise; when NCCL cannot start, MPI with one warning naming each rank's "
    "reason. `nccl`: NCCL failing to start is an error.")
CHECK_COLLECTIVES = Knob(
    "FLEETMPI_CHECK_COLLECTIVES", True,
    choice({"0": (False, "no check"), "1": (True, "once per distinct call, the default"),
            ALWAYS: (ALWAYS, "every call")}), "`0`, `1`, `always`",
    "The cross-rank argument check: `1` exchanges a call's arguments once per distinct call "
    "in its place of the sequence (a step's calls repeat) and a running hash of the calls in "
    "between at the next new one, so ranks that went different ways are told there; `always` "
    "checks every call, for debugging; `0` none.")
OVERLAP_ALLREDUCE = Knob(
    "FLEETMPI_OVERLAP_ALLREDUCE", True,
    flag("reduce each bucket before backward goes on",
         "reduce buckets asynchronously, wait before the update"), "`0`, `1`",
    "`1`: gradient buckets are reduced on the communicator's thread while backward goes on, "
    "and waited for before the update; `0`: each bucket before backward goes on "
    "([docs/performance.md](docs/performance.md), \"Overlapped gradient reduction\").")
STALL_TIMEOUT = Knob(
    "FLEETMPI_STALL_TIMEOUT", DEFAULT_STALL_SECONDS,
    seconds(DEFAULT_STALL_SECONDS, zero_means="no limit"), "seconds; `0`: no limit",
    "A collective that some rank never reaches is reported after this long, naming the "
    "missing ranks and the call, and the job is aborted.")
ABORT_ON_ERROR = Knob(
    "FLEETMPI_ABORT_ON_ERROR", True,
    flag("install no hook", "an uncaught exception on any rank ends the whole job"), "`0`, `1`",
    "`1`: an uncaught exception on any rank ends the whole job with that rank's traceback; "
    "`0`: no abort hooks.")
TIMELINE = Knob(
    "FLEETMPI_TIMELINE", None, path, "a file path",
    "Every rank records a Perfetto/Chrome trace into this file (`fleetmpirun --timeline` "
    "sets it).")
PROGRESS = Knob(
    "FLEETMPI_PROGRESS", "auto", names(*PROGRESS_MODES), "`auto`, `bar`, `lines`, `off`",
    "Rank 0's training progress (`fleetmpi.training.progress.ProgressBar`, whose `mode` argument "
    "wins): `auto` draws a bar where the output reaches a terminal (under `mpiexec` and "
    "`fleetmpirun` too) and writes lines elsewhere; `bar` and `lines` override it.")
PS_TIMEOUT = Knob(
    "FLEETMPI_PS_TIMEOUT", DEFAULT_PS_TIMEOUT, seconds(DEFAULT_PS_TIMEOUT), "seconds",
    "How long a synchronous parameter server waits for a worker's push, and an asynchronous "
    "one for a silent worker once no other trains.")
AUTO_SECONDS = Knob(
    "FLEETMPI_AUTO_SECONDS", 3.0, positive_number, "a positive number",
    "`strategy.auto`: the most seconds the calibration may take (argument `auto_seconds` "
    "wins).")
AUTO_ALLOW = Knob(
    "FLEETMPI_AUTO_ALLOW", frozenset(AUTO_ROUNDING), strategy_names,
    "comma-separated names of " + ", ".join(f"`{name}`" for name in AUTO_ALLOWABLE)
    + "; or `none`",
    "`strategy.auto`: the strategies that change the training's arithmetic that auto may "
    "choose (argument `auto_allow` wins).")
AUTO_MEMORY_MB = Knob(
    "FLEETMPI_AUTO_MEMORY_MB", None, positive_number, "a positive number",
    "`strategy.auto`: the activation memory one rank may hold before auto enables recompute; "
    "unset: the device's free memory on a GPU, half the available host memory shared by the "
    "ranks of the node on CPU (argument `auto_memory_MB` wins).")
CUDA_GRAPH = Knob(
    "FLEETMPI_CUDA_GRAPH", True,
    flag("every call runs eagerly", "capture after the warm-up calls, then replay"), "`0`, `1`",
    "`fleetmpi.graphed_step`: `1` captures the step after its warm-up calls and replays the "
    "graph (on NumPy a host stand-in); `0` runs every call eagerly through the same static "
    "inputs, to compare or debug (argument `enabled` wins).")
NONFINITE = Knob(
    "FLEETMPI_NONFINITE", "stop",
    choice({"stop": ("stop", "raise fleetmpi.NonFiniteError on every rank"),
            "skip": ("skip", "skip the step on every rank"),
            "off": ("off", "no check")}), "`stop`, `skip`, `off`",
    "A step of `distributed_optimizer` without amp's loss scaling whose loss or gradients hold "
    "an inf or NaN on some rank: `stop` raises `fleetmpi.NonFiniteError` on every rank, naming "
    "the ranks, the step and the first parameter affected, which ends the job; `skip` skips the "
    "step on every rank (parameters, optimizer state and layer buffers untouched), with a "
    "warning on rank 0; `off` checks nothing (docs/strategies.md, \"Non-finite values\").")
RESTART_COUNT = Knob(
    "FLEETMPI_RESTART_COUNT", 0, whole_number, "a whole number >= 0",
    "Set by `fleetmpirun --elastic`: 0, then 1 after the first restart, ...")
ELASTIC_PROGRESS = Knob(
    "FLEETMPI_ELASTIC_PROGRESS", None, path, "a file path",
    "Set by `fleetmpirun --elastic`: where rank 0 records its last committed and reached "
    "steps.")

# The knobs every rank must set alike: their values decide which collectives a rank calls
# (the argument agreement's exchanges, the overlap's thread, the transport, the non-finite
# verdict, a captured step, auto's trials), so ranks that differ would wait on each other for
# good. ``fleetmpi.core.knob_agreement`` compares them at ``fleet.init``.
AGREED = (DEVICE, LOCAL_SIZE, TRANSPORT, CHECK_COLLECTIVES, OVERLAP_ALLREDUCE, NONFINITE,
          CUDA_GRAPH, AUTO_SECONDS, AUTO_ALLOW, AUTO_MEMORY_MB)
KNOBS = (DEVICE, NUM_THREADS, KEEP_HOST_MEMORY, LOG_LEVEL, LOCAL_SIZE, CHECK_ENVIRONMENT,
         TRANSPORT, CHECK_COLLECTIVES, OVERLAP_ALLREDUCE, STALL_TIMEOUT, ABORT_ON_ERROR,
         TIMELINE, PROGRESS, PS_TIMEOUT, AUTO_SECONDS, AUTO_ALLOW, AUTO_MEMORY_MB,
         CUDA_GRAPH, NONFINITE, RESTART_COUNT, ELASTIC_PROGRESS)

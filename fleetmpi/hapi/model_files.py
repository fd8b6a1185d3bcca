"""``Model.save`` and ``Model.load``: the files of Paddle's ``Model``, in Paddle's format.

``save(path)`` writes ``path.pdparams`` (the network's ``state_dict``), ``path.pdopt`` (the
optimizer's) and, under amp, ``path.pdscaler`` (the ``GradScaler``'s), through
``fleetmpi.save``, which writes Paddle's pickle to these names, so ``paddle.load`` reads them.
``load(path)`` reads ``path.pdparams`` by each parameter's structured name, so a
``.pdparams`` that Paddle wrote for the same network loads too (through the restricted
unpickler of ``fleetmpi.load``, which runs nothing from the file). An optimizer file Paddle
wrote names its accumulators Paddle's way, which fleetmpi's optimizers do not read: the
optimizer then keeps its own state, with a warning.
"""
import os
import warnings

from ..core import backend
from ..training.serialization import load, save

SUFFIXES = ("", ".pdparams", ".pdopt", ".pdmodel")


def save_model(path, network, optimizer=None, scaler=None):
    """Write ``path.pdparams``, and ``path.pdopt`` / ``path.pdscaler`` where an optimizer /
    an enabled scaler has state; the folder is made where it is missing."""
    if not isinstance(path, str) or not os.path.basename(path):
        raise ValueError(f"Model.save path {path!r}: a file prefix, 'dirname/prefix' or "
                         "'prefix', to which .pdparams and .pdopt are added")
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    save(network.state_dict(), path + ".pdparams")
    if optimizer is not None and optimizer.state_dict():
        save(optimizer.state_dict(), path + ".pdopt")
    if scaler is not None and scaler.state_dict():
        save(scaler.state_dict(), path + ".pdscaler")


def _matched(network, stored, skip_mismatch):
    """``{name: array}`` of the network's parameters and buffers found in ``stored`` with
    their shapes; a missing or misshapen one raises, or with ``skip_mismatch`` is left as it
    is with a warning. Also whether one was skipped."""
    matched, skipped = {}, False
    for name, current in network.state_dict().items():
        value = stored.get(name)
        if value is None:
            problem = f"{name} is not found in the providing file."
        elif list(value.shape) != list(current.shape):
            problem = (f"{name} receives a shape {list(value.shape)}, but the expected shape "
                       f"is {list(current.shape)}.")
        else:
            matched[name] = value
            continue
        if not skip_mismatch:
            raise ValueError(problem)
        warnings.warn(f"Skip loading for {name}. {problem}")
        skipped = True
    return matched, skipped


def _assign(network, values):
    parameters = dict(network.named_parameters())
    buffers = dict(network.named_buffers())
    for name, value in values.items():
        if name in parameters:
            parameters[name].assign(backend.asarray(value.astype(parameters[name].dtype)))
        else:
            buffers[name][...] = backend.asarray(value)


def load_model(path, network, optimizer=None, scaler=None, skip_mismatch=False,
               reset_optimizer=False):
    """Load ``path.pdparams`` into ``network`` and, unless ``reset_optimizer`` (or a
    parameter was skipped), ``path.pdopt`` into ``optimizer`` and ``path.pdscaler`` into
    ``scaler`` where they exist. ``path`` may end in one of the suffixes."""
    root, suffix = os.path.splitext(path)
    if suffix not in SUFFIXES:
        root = path
    params_file = root + ".pdparams"
    if not os.path.isfile(params_file):
        raise FileNotFoundError(f"Model.load: no parameters at {params_file}")
    matched, skipped = _matched(network, load(params_file, return_numpy=True), skip_mismatch)
    _assign(network, matched)
    if optimizer is not None and not (reset_optimizer or skipped) \
            and os.path.isfile(root + ".pdopt"):
        state = load(root + ".pdopt", return_numpy=True)
        if "step_count" in state:
            optimizer.set_state_dict(state)
        else:
            warnings.warn(f"{root}.pdopt holds optimizer state in Paddle's names, which "
                          "fleetmpi's optimizers do not read: the optimizer keeps its own "
                          "state (pass reset_optimizer=True to say so)")
    if scaler is not None and os.path.isfile(root + ".pdscaler"):
        scaler.load_state_dict(load(root + ".pdscaler", return_numpy=True))

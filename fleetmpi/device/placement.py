"""Paddle's ``set_device`` and ``get_device``. One rank drives one device, the backend's
(``fleetmpi.core.backend``): ``set_device`` chooses between the CPU and that GPU before the
first array is made and confirms the choice afterwards; it cannot pick another GPU index."""
from ..core import backend


def get_device():
    """``"cpu"``, or ``"gpu:N"`` with N the CUDA device this rank drives."""
    index = backend.device_index()
    return "cpu" if index is None else f"gpu:{index}"


def set_device(device):
    """Compute on ``device``: ``"cpu"``, ``"gpu"``, or ``"gpu:N"`` where N is the device this
    rank drives (``local_rank % device_count``). Returns ``get_device()``."""
    name = str(device).lower()
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "gpu") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"set_device({device!r}): allowed are 'cpu', 'gpu' and 'gpu:N'")
    backend.choose(kind)
    if index and int(index) != backend.device_index():
        raise ValueError(f"set_device({device!r}): this rank drives gpu:"
                         f"{backend.device_index()} (local_rank % device_count; one rank, one "
                         "device); start one rank per GPU and call set_device('gpu')")
    return get_device()

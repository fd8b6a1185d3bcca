"""Print the versions a GPU check ran with, as one JSON object on a line that starts with
``RESULT``: device, driver, CUDA, CuPy, NCCL, cuDNN (through NVIDIA's cudnn frontend) and the
frontend, cuBLASLt (through nvmath-python) and nvmath-python, PyTorch, MPI, NumPy, Python, and
where fleetmpi was imported from.

Run as a script in the environment the stages use (``PYTHONPATH`` with the installed copy),
so that it sees what they see. A missing or broken part reads "not installed" or
"unavailable: why"; the probe itself never fails.
"""
import json
import platform
import shutil
import subprocess


def _dotted(code, parts):
    """``code`` split into decimal fields of the widths ``parts`` gives, most significant
    first: ``_dotted(13000, (1000, 10))`` is ``"13.0"``."""
    fields, rest = [], code
    for width in parts:
        fields.append(rest // width)
        rest %= width
    return ".".join(str(f) for f in fields)


def _cuda():
    import cupy

    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(0)
    return {"device": props["name"].decode(), "device_count": str(runtime.getDeviceCount()),
            "cupy": cupy.__version__,
            "cuda_runtime": _dotted(runtime.runtimeGetVersion(), (1000, 10)),
            "cuda_driver_api": _dotted(runtime.driverGetVersion(), (1000, 10))}


def _nccl():
    from cupy.cuda import nccl

    code = nccl.get_version()  # NCCL 2.9 and later: major * 10000 + minor * 100 + patch
    return {"nccl": _dotted(code, (10000, 100, 1)) if code >= 20900 else str(code)}


def _cudnn():
    import cudnn

    # cuDNN 9: major * 10000 + minor * 100 + patch
    return {"cudnn": _dotted(cudnn.backend_version(), (10000, 100, 1)),
            "cudnn_frontend": cudnn.__version__}


def _nvmath():
    import nvmath

    return {"nvmath": nvmath.__version__}


def _cublaslt():
    from nvmath.bindings import cublasLt

    # cuBLASLt: major * 10000 + minor * 100 + patch
    return {"cublaslt": _dotted(cublasLt.get_version(), (10000, 100, 1))}


def _torch():
    import torch

    cuda = torch.version.cuda
    return {"torch": torch.__version__ + (f" (CUDA {cuda})" if cuda else "")}


def _mpi():
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    return {"mpi4py": mpi4py.__version__,
            "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].split())}


def _driver():
    if shutil.which("nvidia-smi") is None:
        raise RuntimeError("nvidia-smi is not on PATH")
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"nvidia-smi exited {done.returncode}")
    return {"driver": done.stdout.splitlines()[0].strip()}


def _fleetmpi():
    import fleetmpi

    return {"fleetmpi": fleetmpi.__file__}


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or what ``platform`` knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _host():
    import numpy

    return {"python": platform.python_version(), "numpy": numpy.__version__, "cpu": cpu_model()}


# Each probe and the keys it fills; what a failed probe leaves is said for each of its keys.
PROBES = (
    (_host, ("python", "numpy", "cpu")),
    (_fleetmpi, ("fleetmpi",)),
    (_cuda, ("device", "device_count", "cupy", "cuda_runtime", "cuda_driver_api")),
    (_driver, ("driver",)),
    (_nccl, ("nccl",)),
    (_cudnn, ("cudnn", "cudnn_frontend")),
    (_nvmath, ("nvmath",)),
    (_cublaslt, ("cublaslt",)),
    (_torch, ("torch",)),
    (_mpi, ("mpi4py", "mpi_library")),
)


def versions():
    found = {}
    for probe, keys in PROBES:
        try:
            found.update(probe())
        except ImportError as exc:
            found.update({key: f"not installed ({exc.name or exc})" for key in keys
                          if key not in found})
        except Exception as exc:  # noqa: BLE001 - the probe reports every failure as text
            found.update({key: f"unavailable: {type(exc).__name__}: {exc}"[:300]
                          for key in keys if key not in found})
    return found


if __name__ == "__main__":
    print("RESULT " + json.dumps(versions()))

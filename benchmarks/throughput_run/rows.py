"""The table's rows: what each trainer's job reported for one model, rank count and precision
put together (``assemble_row``), printed as the benchmark's tables and written as JSON.

A trainer's report is a dict: ``samples_per_s``, ``steps``, ``host_ms``, ``peak_bytes``,
``device_name`` and fleetmpi's ``kernels`` (or ``kernels_reason``) where it trained, or
``reason`` alone where it did not (a precision it lacks, a job that failed or ran out of
time, torch not installed); a row keeps every figure, null where it is not known, and the
reasons beside them."""
import json

from . import flops
from .models import describe, spec, unit


def not_measured(reason):
    """The report of a trainer that did not train: only why."""
    return {"reason": reason}


def _ratio(mine, theirs):
    return mine / theirs if mine is not None and theirs else None


def per_device_flops(model, device, ranks, samples_per_s):
    """The FLOP/s one device (one rank) achieved at ``samples_per_s`` over all ranks."""
    rate = None if samples_per_s is None else samples_per_s / ranks
    return flops.achieved_flops(model, device, rate)


def _mfu(model, device, ranks, precision, report):
    return flops.mfu(per_device_flops(model, device, ranks, report.get("samples_per_s")),
                     flops.peak_flops(report.get("device_name"), precision))


def assemble_row(model, ranks, precision, device, steps, ours, theirs):
    """One row of the table and the JSON (module docstring) from fleetmpi's report ``ours``
    and PyTorch's ``theirs``."""
    mine, peer = ours.get("samples_per_s"), theirs.get("samples_per_s")
    return {
        "model": model, "ranks": ranks, "batch": spec(model, device).batch,
        "precision": precision, "graphs": False, "fleetmpi": mine, "pytorch": peer,
        "ratio": _ratio(mine, peer), "unit": unit(model, device), "device": device,
        "steps": steps, "shape": describe(model, device),
        "device_name": ours.get("device_name") or theirs.get("device_name"),
        "mfu_fleetmpi": _mfu(model, device, ranks, precision, ours),
        "mfu_pytorch": _mfu(model, device, ranks, precision, theirs),
        "peak_bytes_fleetmpi": ours.get("peak_bytes"),
        "peak_bytes_pytorch": theirs.get("peak_bytes"),
        "kernels_per_step": ours.get("kernels"), "kernels_reason": ours.get("kernels_reason"),
        "host_ms_per_step": ours.get("host_ms"),
        "host_ms_per_step_pytorch": theirs.get("host_ms"),
        "steps_fleetmpi": ours.get("steps"), "steps_pytorch": theirs.get("steps"),
        "fleetmpi_reason": ours.get("reason"), "pytorch_reason": theirs.get("reason"),
    }


def scaling_efficiency(rows):
    """``{id(row): (fleetmpi's, PyTorch's)}``: samples/s at N ranks over N times samples/s
    at the fewest ranks of the same model and precision (None where either is missing)."""
    first = {}
    for row in rows:
        key = (row["model"], row["precision"])
        if key not in first or row["ranks"] < first[key]["ranks"]:
            first[key] = row
    found = {}
    for row in rows:
        base = first[(row["model"], row["precision"])]
        found[id(row)] = tuple(
            row[side] / (row["ranks"] * base[side] / base["ranks"])
            if row[side] is not None and base[side] else None
            for side in ("fleetmpi", "pytorch"))
    return found


def write_json(path, rows):
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)

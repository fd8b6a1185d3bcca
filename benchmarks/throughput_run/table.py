"""The benchmark's printed tables: throughput next to PyTorch, then per step (MFU, peak memory,
kernels, host time), each figure that is missing marked with a numbered reason below."""
from . import flops
from .models import describe, spec
from .rows import per_device_flops, scaling_efficiency

MEMORY_NOTE = {
    "gpu": "peak memory: bytes in use at the high-water mark of one step after the timed ones "
           "(fleetmpi: CuPy's default pool, read at every allocation by a MemoryHook; "
           "PyTorch: torch.cuda.max_memory_allocated)",
    "cpu": "peak memory: peak resident memory during one step after the timed ones (VmHWM, "
           "reset at its start), less the process's resident memory before the model was "
           "built"}
KERNELS_NOTE = ("kernels/step: the kernel nodes of one fleetmpi step captured into a CUDA graph "
                "(not run)")
HOST_NOTE = {
    "gpu": "host ms/step: one step's wall time until its call returns, the device idle at its "
           "start (a step that waits on the device inside counts the device's work until then)",
    "cpu": "host ms/step: on the CPU the device is the host, so it is the whole step"}


def rate(samples_per_s):
    return f"{samples_per_s:,.2f}" if samples_per_s < 10 else f"{samples_per_s:,.0f}"


class Footnotes:
    """Numbered reasons: the same text gets the same number."""

    def __init__(self):
        self.texts = []

    def mark(self, text):
        if text not in self.texts:
            self.texts.append(text)
        return f"n/a [{self.texts.index(text) + 1}]"

    def lines(self):
        return [f"[{n}] {text}" for n, text in enumerate(self.texts, 1)]


def _cell(value, reason, notes, shown):
    if value is not None:
        return shown(value)
    return notes.mark(reason) if reason else "-"


def _header(rows, device):
    models = dict.fromkeys(row["model"] for row in rows)
    parts = [f"{describe(name, device)}, batch {spec(name, device).batch}" for name in models]
    where = "one GPU per rank" if device == "gpu" else "1 thread per rank"
    return (f"samples/s over all ranks (a GPT's sample is a sequence), per-rank batch; {where}; "
            f"AdamW for the GPTs, Momentum for the others: " + "; ".join(parts))


def print_throughput(rows, device, notes):
    peer = "PyTorch DDP (NCCL)" if device == "gpu" else "PyTorch DDP (gloo)"
    print(f"| model | precision | ranks | fleetmpi | {peer} | ratio | fleetmpi scaling eff. | "
          "PyTorch scaling eff. |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    efficiency = scaling_efficiency(rows)
    for row in rows:
        mine = _cell(row["fleetmpi"], row["fleetmpi_reason"], notes, rate)
        theirs = _cell(row["pytorch"], row["pytorch_reason"], notes, rate)
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        eff = " | ".join(f"{e:.2f}" if e is not None else "-" for e in efficiency[id(row)])
        print(f"| {row['model']} | {row['precision']} | {row['ranks']} | {mine} | {theirs} | "
              f"{ratio} | {eff} |")


def _mfu_cell(row, side):
    achieved = per_device_flops(row["model"], row["device"], row["ranks"], row[side])
    if achieved is None:
        return "-"
    share = row[f"mfu_{side}"]
    if share is None:
        return f"{achieved / 1e12:.3g} TFLOP/s, unknown device"
    return f"{100 * share:.1f}%"


def _mib(value):
    return f"{value / 2 ** 20:,.0f} MiB"


def _per_step_cells(row, notes):
    mine, theirs = row["peak_bytes_fleetmpi"], row["peak_bytes_pytorch"]
    memory_ratio = f"{mine / theirs:.2f}x" if mine and theirs else "-"
    if row["kernels_per_step"] is not None:
        kernels = str(row["kernels_per_step"])
    elif row["device"] == "cpu":
        kernels = "n/a on the CPU"
    else:
        kernels = _cell(None, row["kernels_reason"], notes, str)
    host = [f"{ms:,.1f}" if ms is not None else "-"
            for ms in (row["host_ms_per_step"], row["host_ms_per_step_pytorch"])]
    return [_mfu_cell(row, "fleetmpi"), _mfu_cell(row, "pytorch"),
            _mib(mine) if mine is not None else "-", _mib(theirs) if theirs is not None else "-",
            memory_ratio, kernels] + host


def print_per_step(rows, device, notes):
    print("| model | precision | ranks | MFU fleetmpi | MFU PyTorch | peak memory fleetmpi | "
          "peak memory PyTorch | memory ratio | kernels/step | host ms/step fleetmpi | "
          "host ms/step PyTorch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        cells = " | ".join(_per_step_cells(row, notes))
        print(f"| {row['model']} | {row['precision']} | {row['ranks']} | {cells} |")


def print_tables(rows, device):
    """The throughput table, the per-step table, the reasons of what is missing, and how each
    figure was taken."""
    notes = Footnotes()
    print(_header(rows, device))
    print_throughput(rows, device, notes)
    print()
    print_per_step(rows, device, notes)
    for line in notes.lines():
        print(line)
    peaks = ", ".join(f"{name} {peaks['16-bit'] / 1e12:.0f} (fp32 {peaks['fp32'] / 1e12:.0f})"
                      for name, peaks in flops.PEAK_FLOPS)
    print(f"MFU of the GPTs: {flops.FORMULA}, at the measured tokens/s per device, over the "
          f"device's dense 16-bit peak (fp32 rows: its float32 peak), TFLOP/s: {peaks}")
    print(MEMORY_NOTE[device])
    if device == "gpu":
        print(KERNELS_NOTE)
    print(HOST_NOTE[device])

"""Links (latency and bandwidth) and the named presets the planner knows.

Bandwidths are per direction, in bytes per second, as a link of that kind carries one flow
(line rate; what a real job reaches is lower, see docs/plan.md). An inter-node link is the
node's network port: flows that cross it at the same time share its bandwidth (``shared``).
``"local"`` is this machine, measured by ``fleetmpi.plan.calibrate``, not a preset.
"""
import dataclasses
import numbers


@dataclasses.dataclass(frozen=True)
class Link:
    """``alpha``: seconds per message; ``beta``: seconds per byte (1 / bandwidth)."""

    name: str
    alpha: float
    beta: float

    def __post_init__(self):
        for field in ("alpha", "beta"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise ValueError(f"link {self.name!r}: {field}={value!r} must be a number >= 0")

    @classmethod
    def from_bandwidth(cls, name, latency_s, bandwidth_bytes_per_s):
        if isinstance(bandwidth_bytes_per_s, bool) or not isinstance(
                bandwidth_bytes_per_s, numbers.Real) or bandwidth_bytes_per_s <= 0:
            raise ValueError(f"link {name!r}: bandwidth={bandwidth_bytes_per_s!r} must be a "
                             f"positive number of bytes per second")
        return cls(name, float(latency_s), 1.0 / float(bandwidth_bytes_per_s))

    @property
    def bandwidth(self):
        return float("inf") if self.beta == 0 else 1.0 / self.beta

    def shared(self, flows):
        """This link as each of ``flows`` concurrent flows through it sees it."""
        return Link(f"{self.name}/{flows}" if flows > 1 else self.name, self.alpha,
                    self.beta * flows)

    def describe(self):
        return f"{self.name} ({self.bandwidth / 1e9:.3g} GB/s, {self.alpha * 1e6:.3g} us)"


GBIT = 1e9 / 8
PRESETS = {
    # intra-node
    "nvlink": Link.from_bandwidth("nvlink", 3e-6, 100e9),   # NVLink 2, V100 DGX-1 class ring
    "pcie3": Link.from_bandwidth("pcie3", 5e-6, 12e9),      # PCIe 3.0 x16 between GPUs
    # inter-node
    "ib100": Link.from_bandwidth("ib100", 5e-6, 100 * GBIT),  # 100 Gb InfiniBand EDR
    "ib56": Link.from_bandwidth("ib56", 5e-6, 56 * GBIT),     # 56 Gb InfiniBand FDR
    "roce25": Link.from_bandwidth("roce25", 5e-6, 25 * GBIT),  # 25 Gb Ethernet with RDMA
    "eth25": Link.from_bandwidth("eth25", 30e-6, 25 * GBIT),   # 25 Gb Ethernet, TCP
    "eth10": Link.from_bandwidth("eth10", 50e-6, 10 * GBIT),   # 10 Gb Ethernet, TCP
}
LOCAL = "local"


def preset(name):
    """The preset ``name``, or an error listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"link preset {name!r} is not known; allowed: "
                         f"{', '.join(sorted(PRESETS))}, or {LOCAL!r} for this machine as "
                         f"measured")
    return PRESETS[name]

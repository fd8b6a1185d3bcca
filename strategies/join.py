"""Joining ranks whose data runs out first (``fleetmpi.Join``; Horovod's ``hvd.join()``,
PyTorch's ``Join``): the step hook that counts the ranks still training, and what cannot join.

Inside a ``Join`` block every step of a rank that still trains starts with one exchange (in
its forward stage, before anything else of the step communicates): an int32 per rank, 1 for
this rank, combined by an allreduce (max). A rank whose loop has ended answers the same
exchange with 0 and, while some rank still trains, takes the step with them with zero
gradients and no loss (``DistributedOptimizer.shadow_step``), so every collective of the step
is matched; once every rank answers 0, all leave together.

The math. At step ``t`` let ``A_t`` be the ranks that still have a batch and ``L_r`` the loss
rank ``r`` computes on its batch (the loss function's mean over it). Every rank, the joined
ones too, applies the gradient

    g_t = (1 / |A_t|) * sum over r in A_t of grad L_r(theta_t)

(``StepContext.contributors`` is ``|A_t|``: the reduction sums, then divides by it instead of
the number of ranks). With equal batch sizes within a step that is the gradient of the mean
loss over the union of the step's batches: one process training on the concatenation of the
batches of ``A_t`` at each step computes the same (to float tolerance; bit for bit while every
rank trains, the reduction being the plain mean then). The verdicts a step agrees on count
the joined ranks as finite: amp's overflow flag and the non-finite check see their zero
gradients, so an inf or NaN on a rank that trains still stops or skips the step on every rank.

``NOT_JOINABLE`` names the strategies that communicate something a rank without a batch
cannot answer with zeros, and why; ``Join`` refuses them before the first step.
"""
import numpy as np

from fleetmpi.core import backend
from fleetmpi.optimizer import StepHook

NOT_JOINABLE = {
    "sync_batch_norm": "it combines the batch statistics of every rank inside each batch-norm "
                       "layer's forward and backward, which a rank without a batch does not run",
    "gradient_merge": "a rank that joins inside a window of k_steps steps has fewer steps in "
                      "its merged gradient than the window counts",
    "localsgd": "it averages parameters, not gradients: a joined rank has no zero "
                "contribution to give, and its parameters would count in every average",
    "adaptive_localsgd": "it averages parameters, not gradients: a joined rank has no zero "
                         "contribution to give, and its parameters would count in every "
                         "average",
    "dgc": "each rank sends residual gradients kept from earlier steps, so a rank without a "
           "batch would still contribute values",
    "pipeline": "the stages pass activations to each other inside a step, which a stage "
                "without a batch cannot produce",
    "tensor_parallel": "the ranks of a model-parallel group exchange activations inside the "
                       "forward, which a rank without a batch does not run",
    "sharding": "its reduce-scatter averages over every rank of the group, and at stage 3 "
                "parameters are gathered inside the forward, which a joined rank does not run",
}
HYBRID = ("hybrid_configs split the model over model-parallel groups whose ranks exchange "
          "activations inside the forward, which a rank without a batch does not run")


def check_joinable(names, hybrid=False):
    """Raise a ValueError naming the first strategy of ``names`` (or the hybrid layout) that
    cannot run under ``Join``, and why."""
    for name in names:
        if name in NOT_JOINABLE:
            raise ValueError(f"fleet.Join cannot carry strategy {name}: {NOT_JOINABLE[name]}")
    if hybrid:
        raise ValueError(f"fleet.Join cannot carry a hybrid layout: {HYBRID}")


class JoinExchange(StepHook):
    """The first hook of every step inside a ``Join`` block: the exchange of the module
    docstring over ``communicator`` (None: a process alone, which needs none). ``last``: the
    flags of the latest exchange in which some rank trained (every rank's 1 before any)."""

    name = "join"
    capture_refusal = ("the ranks still training are counted on the host at the start of "
                       "every step inside fleet.Join, and a graph would replay the count it "
                       "captured")

    def __init__(self, communicator):
        self.communicator = communicator
        size = 1 if communicator is None else communicator.size
        self.rank = 0 if communicator is None else communicator.rank
        self._flags = backend.array_module().zeros(size, dtype=np.int32)
        self.last = np.ones(size, dtype=np.int32)

    def exchange(self, training):
        """Every rank's flag (1: it trains this step) as a host array, this rank's ``training``
        among them."""
        self._flags[...] = 0
        self._flags[self.rank] = int(training)
        if self.communicator is not None and self.communicator.size > 1:
            self.communicator.allreduce(self._flags, op="max", out=self._flags)
        flags = backend.to_numpy(self._flags).copy()
        if flags.any():
            self.last = flags
        return flags

    @property
    def last_joined(self):
        """The highest rank among those that trained in the last step any rank trained."""
        return int(np.flatnonzero(self.last)[-1])

    def forward(self, ctx, proceed):
        if ctx.contributors is None:
            ctx.contributors = int(self.exchange(True).sum())
        return proceed(ctx)

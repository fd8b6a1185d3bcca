"""``fleet.meta_parallel``, Paddle's ``paddle.distributed.fleet.meta_parallel``: the
tensor-parallel layers (``fleetmpi.nn.tensor_parallel``) and the random-state tracker that
makes dropout right under tensor parallelism (``fleetmpi.rng_tracker``), under Paddle's
names. ``PipelineLayer``, ``LayerDesc`` and ``SharedLayerDesc`` are not here yet
(docs/paddle_compat.md, "Dygraph hybrid parallel")."""
from .hybrid import model_parallel_random_seed
from .nn.tensor_parallel import (ColumnParallelLinear, ParallelCrossEntropy, RowParallelLinear,
                                 VocabParallelEmbedding)
from .rng_tracker import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_state_tracker

__all__ = ["ColumnParallelLinear", "MODEL_PARALLEL_RNG", "ParallelCrossEntropy",
           "RNGStatesTracker", "RowParallelLinear", "VocabParallelEmbedding",
           "get_rng_state_tracker", "model_parallel_random_seed"]

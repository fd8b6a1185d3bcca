"""``fleet.meta_parallel``, Paddle's ``paddle.distributed.fleet.meta_parallel``: the
tensor-parallel layers (``fleetmpi.nn.tensor_parallel``), the random-state tracker that
makes dropout right under tensor parallelism (``fleetmpi.core.rng_tracker``), and pipeline
parallelism as Paddle dygraph writes it: ``LayerDesc``, ``SharedLayerDesc`` and
``PipelineLayer`` (``fleetmpi.nn.pipeline_layer``), which ``fleet.distributed_model`` wraps
in a ``PipelineParallel`` with ``train_batch`` and ``eval_batch``
(``fleetmpi.pipeline_parallel``), all under Paddle's names (docs/paddle_compat.md, "Dygraph
hybrid parallel")."""
from .hybrid import model_parallel_random_seed
from .nn.pipeline_layer import LayerDesc, PipelineLayer, SharedLayerDesc
from .nn.tensor_parallel import (ColumnParallelLinear, ParallelCrossEntropy, RowParallelLinear,
                                 VocabParallelEmbedding)
from .pipeline_parallel import PipelineParallel
from .core.rng_tracker import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_state_tracker

__all__ = ["ColumnParallelLinear", "LayerDesc", "MODEL_PARALLEL_RNG", "ParallelCrossEntropy",
           "PipelineLayer", "PipelineParallel", "RNGStatesTracker", "RowParallelLinear",
           "SharedLayerDesc", "VocabParallelEmbedding", "get_rng_state_tracker",
           "model_parallel_random_seed"]

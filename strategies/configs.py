"""Typed, frozen views of the ``*_configs`` messages of a ``DistributedStrategy``: one dataclass
per message, named as the message is in ``distributed_strategy.proto``, whose fields are the
message's keys (Paddle's names), so code reads ``ShardingConfig.of(strategy).stage`` where it
would read a dict key.

A view is built once, by ``of(strategy)``, from the strategy's message: the values, and the
defaults of the keys left unset, come from the schema and nowhere else (the dataclasses hold no
defaults). Repeated keys become tuples, so a view is immutable and hashable. A view checks on
construction what its keys must agree on between them (``sharding_group_size`` and
``sharding_degree``, ``micro_batch`` and ``accumulate_steps``, amp's precision switches);
what a value may hold on its own the schema has checked already. Conveniences derived from the
keys are properties. ``tests/test_strategy_configs.py`` holds every view to its message: a key
added to the schema fails it until its view has the field.

Each strategy class names its view (``Strategy.config_class``) and reads ``self.config``.
"""
import dataclasses
from typing import ClassVar

from fleetmpi.config import schema_view
from fleetmpi.proto import distributed_strategy_pb2 as schema
from . import amp_precision


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """The base of the views: ``message`` names the ``DistributedStrategy`` field viewed."""

    message: ClassVar[str] = None

    @classmethod
    def of(cls, strategy):
        """The view of ``strategy``'s ``message`` (its current values)."""
        values = getattr(strategy, cls.message)
        return cls(**{field.name: _frozen(values[field.name])
                      for field in dataclasses.fields(cls)})


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def _default(message, key):
    """The schema's default of ``key`` in the proto ``message`` (a class of the schema)."""
    return schema_view.default_of(message.DESCRIPTOR.fields_by_name[key])


@dataclasses.dataclass(frozen=True)
class RecomputeConfig(StrategyConfig):
    message: ClassVar[str] = "recompute_configs"
    checkpoints: tuple
    enable_offload: bool
    checkpoint_shape: tuple


@dataclasses.dataclass(frozen=True)
class PipelineConfig(StrategyConfig):
    message: ClassVar[str] = "pipeline_configs"
    micro_batch: int
    accumulate_steps: int
    schedule_mode: str
    micro_batch_size: int

    def __post_init__(self):
        count, steps = self.micro_batch, self.accumulate_steps
        if count > 1 and steps > 1 and count != steps:
            raise ValueError(f"pipeline_configs['micro_batch']={count} and "
                             f"pipeline_configs['accumulate_steps']={steps} both set the number "
                             "of micro-batches; set one, or both to one value")

    @property
    def micro_batches(self):
        """The number of micro-batches of a step: ``micro_batch`` (the seeds', Paddle 2.0's
        name) or ``accumulate_steps`` (Paddle 2.1 on)."""
        return max(self.micro_batch, self.accumulate_steps)


@dataclasses.dataclass(frozen=True)
class GradientMergeConfig(StrategyConfig):
    message: ClassVar[str] = "gradient_merge_configs"
    k_steps: int
    avg: bool


@dataclasses.dataclass(frozen=True)
class LarsConfig(StrategyConfig):
    message: ClassVar[str] = "lars_configs"
    lars_coeff: float
    lars_weight_decay: float
    epsilon: float
    exclude_from_weight_decay: tuple


@dataclasses.dataclass(frozen=True)
class LambConfig(StrategyConfig):
    message: ClassVar[str] = "lamb_configs"
    lamb_weight_decay: float
    exclude_from_weight_decay: tuple


@dataclasses.dataclass(frozen=True)
class LocalSGDConfig(StrategyConfig):
    message: ClassVar[str] = "localsgd_configs"
    k_steps: int
    begin_step: int


@dataclasses.dataclass(frozen=True)
class AdaptiveLocalSGDConfig(StrategyConfig):
    message: ClassVar[str] = "adaptive_localsgd_configs"
    init_k_steps: int
    begin_step: int


@dataclasses.dataclass(frozen=True)
class AMPConfig(StrategyConfig):
    message: ClassVar[str] = "amp_configs"
    init_loss_scaling: float
    incr_every_n_steps: int
    decr_every_n_nan_or_inf: int
    incr_ratio: float
    decr_ratio: float
    use_dynamic_loss_scaling: bool
    custom_white_list: tuple
    custom_black_list: tuple
    use_pure_fp16: bool
    use_pure_bf16: bool
    dtype: str
    level: str

    def __post_init__(self):
        amp_precision.resolve(self)

    @property
    def precision(self):
        """The ``amp_precision.Precision`` the keys select."""
        return amp_precision.resolve(self)

    @property
    def scales_loss(self):
        """Whether amp scales the loss and checks the gradients (``amp_precision``)."""
        return amp_precision.scales_loss(self.use_dynamic_loss_scaling, self.init_loss_scaling,
                                         self.precision)


@dataclasses.dataclass(frozen=True)
class DGCConfig(StrategyConfig):
    message: ClassVar[str] = "dgc_configs"
    rampup_begin_step: int
    rampup_step: int
    sparsity: tuple


_DEFAULT_GROUP_SIZE = _default(schema.ShardingConfig, "sharding_group_size")


@dataclasses.dataclass(frozen=True)
class ShardingConfig(StrategyConfig):
    message: ClassVar[str] = "sharding_configs"
    fuse_broadcast_MB: float
    hybrid_dp: bool
    sharding_group_size: int
    sharding_degree: int
    stage: int
    prefetch_depth: int
    unit_size_MB: float

    def __post_init__(self):
        size, degree = self.sharding_group_size, self.sharding_degree
        if size != degree and _DEFAULT_GROUP_SIZE not in (size, degree):
            raise ValueError(f"sharding_configs['sharding_group_size']={size} and "
                             f"sharding_configs['sharding_degree']={degree} name the same group "
                             f"size (sharding_degree is Paddle's later name for it); set one, or "
                             f"both to one value")

    @property
    def group_size(self):
        """The ranks per sharding group with ``hybrid_dp``: ``sharding_group_size`` or Paddle's
        ``sharding_degree``, whichever is set (differs from the default)."""
        if self.sharding_group_size == _DEFAULT_GROUP_SIZE:
            return self.sharding_degree
        return self.sharding_group_size

    @property
    def partitions_gradients(self):
        """Whether each rank keeps only its shard of the gradients (stages 2 and 3)."""
        return self.stage >= 2


@dataclasses.dataclass(frozen=True)
class AsyncConfig(StrategyConfig):
    message: ClassVar[str] = "a_sync_configs"
    k_steps: int
    max_merge_var_num: int
    send_queue_size: int
    independent_recv_thread: bool
    min_send_grad_num_before_recv: int
    thread_pool_size: int
    send_wait_times: int
    runtime_split_send_recv: bool
    launch_barrier: bool
    heter_worker_device_guard: str
    lr_decay_steps: int
    use_ps_gpu: int


@dataclasses.dataclass(frozen=True)
class HybridConfig(StrategyConfig):
    message: ClassVar[str] = "hybrid_configs"
    dp_degree: int
    mp_degree: int
    pp_degree: int
    sharding_degree: int


@dataclasses.dataclass(frozen=True)
class TensorParallelConfig(StrategyConfig):
    message: ClassVar[str] = "tensor_parallel_configs"
    tensor_parallel_degree: int
    tensor_init_seed: int


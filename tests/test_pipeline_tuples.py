"""Pipeline stages that hand a tuple of tensors on, as Paddle's ``PipelineLayer`` models hand
``(hidden, mask)`` on: the first stage gets a tuple input, every stage passes two activations
that need gradients and an int64 mask that needs none, both directions over the wire. At as
many stages as ranks (2, 3 or 4, one replica) every rank's parameters and the losses equal the
same PipelineLayer trained in one process; in one process, runs recomputed
(``recompute_interval``) take and give tuples bit for bit, and eval_batch's outputs are the
plain forward's. A stage handing on something that is not a tensor is refused naming it."""
import numpy as np
import pytest

import fleetmpi as fleet
import fleetmpi.nn.functional as F
from fleetmpi import nn, optimizer, to_tensor
from fleetmpi.autograd import as_array
from fleetmpi.core import backend
from fleetmpi.meta_parallel import LayerDesc, PipelineLayer
from comm_support import close, ok, raises
from strategy_support import make_strategy

STEPS, BATCH, FEATURES, WIDTH, CLASSES = 2, 8, 5, 6, 3
MASKS_SEEN = []  # (stop_gradient, dtype) of each mask the last stage got


class Split(nn.Layer):
    """``(x, mask)`` to ``(a, b, mask)``: two activations that need gradients."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, WIDTH, dtype="float64")

    def forward(self, inputs):
        x, mask = inputs
        h = self.fc(x)
        return F.tanh(h), h * 0.5, mask


class Mix(nn.Layer):
    """Each activation through its own Linear, ``a`` masked, ``b`` mixed with ``a``."""

    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(WIDTH, WIDTH, dtype="float64")
        self.fb = nn.Linear(WIDTH, WIDTH, dtype="float64")

    def forward(self, inputs):
        a, b, mask = inputs
        keep = to_tensor(backend.asarray(as_array(mask)).astype("float64"))
        return F.tanh(self.fa(a)) * keep, F.tanh(self.fb(b)) + a, mask


class Head(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, CLASSES, dtype="float64")

    def forward(self, inputs):
        a, b, mask = inputs
        # an array on the first stage, a Tensor received from another one
        MASKS_SEEN.append((getattr(mask, "stop_gradient", True), as_array(mask).dtype))
        return self.fc(a + b)


def batch(step, size=BATCH):
    rng = np.random.default_rng(700 + step)
    x = rng.standard_normal((size, FEATURES))
    mask = rng.integers(0, 2, (size, WIDTH)).astype(np.int64)
    return [(x, mask), rng.integers(0, CLASSES, size)]


def build(stages, local, recompute_interval=0):
    backend.manual_seed(0)
    descs = [LayerDesc(Split), LayerDesc(Mix), LayerDesc(Mix), LayerDesc(Head)]
    return PipelineLayer(descs, num_stages=stages, loss_fn=nn.CrossEntropyLoss(), local=local,
                         recompute_interval=recompute_interval)


def train(stages, local, recompute_interval=0):
    strategy = make_strategy(pipeline=True,
                             pipeline_configs={"accumulate_steps": 2,
                                               "micro_batch_size": BATCH // 2})
    fleet.init(is_collective=True, strategy=strategy)
    layer = build(stages, local, recompute_interval)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(
        optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=model.parameters()),
        strategy, local=local)
    losses = [float(model.train_batch(batch(step), opt)) for step in range(STEPS)]
    return layer, losses


@pytest.mark.mpi(min_size=2)
def test_tuples_between_stages_equal_one_process():
    fleet.init(is_collective=True)
    stages = fleet.worker_num()
    if stages > 4:
        pytest.skip("four entries fill at most four stages")
    reference, reference_losses = train(stages, local=True)
    layer, losses = train(stages, local=False)
    ok(layer.stage_id == fleet.worker_index() and layer.num_stages == stages)
    expected = dict(reference.named_parameters())
    failures = []
    for name, p in layer.named_parameters():
        try:
            np.testing.assert_allclose(p.numpy(), expected[name].numpy(), rtol=1e-10,
                                       atol=1e-12, err_msg=name)
        except AssertionError as error:
            failures.append(str(error))
    ok(not failures, "\n".join(failures))
    close(losses, reference_losses, rtol=1e-10)
    ok(all(seen == (True, np.int64) for seen in MASKS_SEEN), MASKS_SEEN)


def test_recomputed_runs_take_and_give_tuples_bit_for_bit():
    plain, plain_losses = train(2, local=True)
    recomputed, losses = train(2, local=True, recompute_interval=2)
    assert losses == plain_losses
    expected = dict(plain.named_parameters())
    for name, p in recomputed.named_parameters():
        np.testing.assert_array_equal(p.numpy(), expected[name].numpy(), err_msg=name)


def test_eval_batch_runs_tuples_through_the_stages():
    fleet.init(is_collective=True, strategy=make_strategy(
        pipeline=True, pipeline_configs={"accumulate_steps": 2,
                                         "micro_batch_size": BATCH // 2}))
    model = fleet.distributed_model(build(2, local=True))
    (x, mask), _ = batch(0)
    outputs = model.eval_batch([(x, mask), None])
    plain = build(2, local=True)
    plain.eval()
    expected = plain((to_tensor(x), to_tensor(mask)))
    close(np.concatenate([o.numpy() for o in outputs]), expected.numpy(), rtol=1e-12)


class HandsOnAList(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES, dtype="float64")

    def forward(self, x):
        return [self.fc(x)]


@pytest.mark.mpi(min_size=2)
def test_a_stage_handing_on_something_else_is_refused_naming_it():
    fleet.init(is_collective=True)
    if fleet.worker_num() != 2:
        pytest.skip("two stages")
    fleet.init(is_collective=True, strategy=make_strategy(pipeline=True))
    backend.manual_seed(0)
    layer = PipelineLayer([LayerDesc(HandsOnAList),
                           LayerDesc(nn.Linear, CLASSES, CLASSES, dtype="float64")], num_stages=2,
                          loss_fn=nn.CrossEntropyLoss())
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(optimizer.SGD(learning_rate=0.1,
                                                    parameters=model.parameters()))
    x, y = batch(0)
    if layer.stage_id == 0:
        with raises(TypeError, r"a stage hands on a list; it may hand on a tensor or a tuple "
                               r"of tensors of float16, float32, float64, int32, int64, bool"):
            model.train_batch([x[0], y], opt)
    else:
        ok(True)

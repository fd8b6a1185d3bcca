"""Paddle's ``hybrid_parallel_mp_model`` check (Paddle 2.4's
``python/paddle/fluid/tests/unittests/hybrid_parallel_mp_model.py``), its model and loop as
Paddle writes them with the imports renamed: tensor-parallel layers built with
``weight_attr=ParamAttr(initializer=Assign(part))``, where each rank passes its own part of the
weight as Paddle's layers take it, train at mp_degree 2 to the losses of the serial model built
from the whole weights. Besides, the shapes an ``Assign`` may hold for a tensor-parallel
weight: the rank's part (Paddle's) or the whole weight, and nothing else."""
import random

import numpy as np
import pytest
from mpi4py import MPI

import fleetmpi as paddle
import fleetmpi as fleet
import fleetmpi.distributed as dist
from comm_support import raises

vocab_size = 6
hidden_size = 10
inner_size = 8
output_size = 2
seq_length = 2
batch_size = 4


def set_random_seed(seed, dp_id, rank_id):
    random.seed(seed)
    np.random.seed(seed + dp_id)
    paddle.seed(seed + rank_id)


class SimpleMPNet(paddle.nn.Layer):
    def __init__(self, vocab_size, hidden_size, inner_size, output_size, np_fc1, np_fc2,
                 mp_id):
        super().__init__()
        if mp_id == 0:
            init_fc1_data = np_fc1[:, :(inner_size // 2)]
            init_fc2_data = np_fc2[:(inner_size // 2), :]
        else:
            init_fc1_data = np_fc1[:, (inner_size // 2):]
            init_fc2_data = np_fc2[(inner_size // 2):, :]
        self.linear1 = fleet.meta_parallel.ColumnParallelLinear(
            hidden_size, inner_size,
            weight_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Assign(init_fc1_data)),
            gather_output=False, has_bias=True)
        self.linear2 = fleet.meta_parallel.RowParallelLinear(
            inner_size, hidden_size,
            weight_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Assign(init_fc2_data)),
            input_is_parallel=True, has_bias=True)
        self.linear3 = paddle.nn.Linear(
            hidden_size, output_size,
            weight_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Constant(0.0)),
            bias_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Constant(0.0)))
        self.embedding = fleet.meta_parallel.VocabParallelEmbedding(
            vocab_size, hidden_size, weight_attr=paddle.nn.initializer.Constant(value=0.5))

    def forward(self, x):
        x = self.embedding(x)
        x = self.linear1(x)
        x = self.linear2(x)
        x = self.linear3(x)
        return x


class SimpleDPNet(paddle.nn.Layer):
    def __init__(self, vocab_size, hidden_size, inner_size, output_size, np_fc1, np_fc2):
        super().__init__()
        self.linear1 = paddle.nn.Linear(
            hidden_size, inner_size,
            weight_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Assign(np_fc1)),
            bias_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Constant(0.0)))
        self.linear2 = paddle.nn.Linear(
            inner_size, hidden_size,
            weight_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Assign(np_fc2)),
            bias_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Constant(0.0)))
        self.linear3 = paddle.nn.Linear(
            hidden_size, output_size,
            weight_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Constant(0.0)),
            bias_attr=paddle.framework.ParamAttr(
                initializer=paddle.nn.initializer.Constant(0.0)))
        self.embedding = paddle.nn.Embedding(
            vocab_size, hidden_size, weight_attr=paddle.nn.initializer.Constant(value=0.5))

    def forward(self, x):
        x = self.embedding(x)
        x = self.linear1(x)
        x = self.linear2(x)
        x = self.linear3(x)
        return x


class TestDistMPTraning:
    """Paddle's unittest.TestCase, run by the test below at two ranks (not collected)."""

    __test__ = False

    def setUp(self):
        strategy = fleet.DistributedStrategy()
        self.model_parallel_size = 2
        self.data_parallel_size = 1
        strategy.hybrid_configs = {"dp_degree": self.data_parallel_size,
                                   "mp_degree": self.model_parallel_size, "pp_degree": 1}
        fleet.init(is_collective=True, strategy=strategy)

    def train_batch(self, batch, model, optimizer, is_mp):
        output = model(batch)
        loss = output.mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        return loss

    def build_optimizer(self, model):
        return paddle.optimizer.SGD(learning_rate=0.001, parameters=model.parameters())

    def build_model_optimizer(self):
        hcg = fleet.get_hybrid_communicate_group()
        mp_id = hcg.get_model_parallel_rank()
        dp_id = hcg.get_data_parallel_rank()
        rank_id = dist.get_rank()
        set_random_seed(1024, dp_id, rank_id)
        np_fc1 = np.random.random_sample((hidden_size, inner_size))
        np_fc2 = np.random.random_sample((inner_size, hidden_size))
        model_a = SimpleMPNet(vocab_size, hidden_size, inner_size, output_size, np_fc1,
                              np_fc2, mp_id)
        optimizer_a = self.build_optimizer(model_a)
        model_a = fleet.distributed_model(model_a)
        optimizer_a = fleet.distributed_optimizer(optimizer_a)
        model_b = SimpleDPNet(vocab_size, hidden_size, inner_size, output_size, np_fc1,
                              np_fc2)
        optimizer_b = self.build_optimizer(model_b)
        return model_a, optimizer_a, model_b, optimizer_b

    def test_mp_model(self):
        model_a, optimizer_a, model_b, optimizer_b = self.build_model_optimizer()
        for _ in range(5):
            np_data = np.random.randint(0, vocab_size, (batch_size, seq_length))
            batch = paddle.to_tensor(np_data)
            loss_a = self.train_batch(batch, model_a, optimizer_a, True)
            loss_b = self.train_batch(batch, model_b, optimizer_b, False)
            np.testing.assert_allclose(loss_a.numpy(), loss_b.numpy(), rtol=1e-5)


@pytest.mark.mpi(min_size=2)
def test_paddles_mp_model_check_passes_at_mp_degree_2():
    if MPI.COMM_WORLD.size != 2:
        pytest.skip("Paddle's check runs at two ranks")
    case = TestDistMPTraning()
    case.setUp()
    case.test_mp_model()


@pytest.mark.mpi(min_size=2)
def test_an_assign_holds_the_ranks_part_or_the_whole_weight():
    if MPI.COMM_WORLD.size != 2:
        pytest.skip("mp_degree 2 at two ranks")
    TestDistMPTraning().setUp()
    rank = fleet.get_hybrid_communicate_group().get_model_parallel_rank()
    whole = np.arange(24.0).reshape(4, 6)
    columns = slice(3 * rank, 3 * rank + 3)

    def column(value):
        return fleet.meta_parallel.ColumnParallelLinear(
            4, 6, weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.Assign(value)),
            gather_output=False)

    np.testing.assert_array_equal(column(whole[:, columns]).weight.numpy(), whole[:, columns])
    np.testing.assert_array_equal(column(whole).weight.numpy(), whole[:, columns])
    with raises(ValueError, r"Assign holds a value of shape \(4, 4\), but this rank's part of "
                            r"the parameter has shape \(4, 3\) \(of the whole \(4, 6\)\)"):
        column(np.zeros((4, 4)))

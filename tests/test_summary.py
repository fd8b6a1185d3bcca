"""``fleetmpi.summary``: Paddle's model table."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi import nn


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2D(3, 4, 3, padding=1), nn.BatchNorm2D(4),
                                      nn.ReLU())
        self.head = nn.Linear(4 * 8 * 8, 10)
        self.head.bias.stop_gradient = True  # a frozen parameter

    def forward(self, x):
        return self.head(self.features(x).reshape((x.shape[0], -1)))


def test_the_table_and_the_counts(capsys):
    net = Net()
    mean_before = net.features[1].buffer("_mean").copy()
    counts = fleet.summary(net, (-1, 3, 8, 8))
    table = capsys.readouterr().out
    total = sum(p.size for p in net.parameters())
    assert counts == {"total_params": total, "trainable_params": total - 10}
    rows = [line.split() for line in table.splitlines()
            if line.split() and line.split()[0] in ("Conv2D-1", "BatchNorm2D-1", "ReLU-1",
                                                    "Linear-1")]
    assert [r[0] for r in rows] == ["Conv2D-1", "BatchNorm2D-1", "ReLU-1", "Linear-1"]
    assert rows[0][1:] == ["[1,", "4,", "8,", "8]", "112"]  # 4*3*3*3 + 4
    assert rows[3][1:] == ["[1,", "10]", "2,570"]
    assert f"Total params: {total:,}" in table and "Non-trainable params: 10" in table
    assert net.training and net.features[1].training  # the mode is the caller's again
    np.testing.assert_array_equal(net.features[1].buffer("_mean"), mean_before)


def test_an_input_instead_of_a_size_and_bad_sizes():
    net = nn.Linear(5, 2)
    assert fleet.summary(net, input=fleet.to_tensor(np.ones((3, 5), np.float32))) == {
        "total_params": 12, "trainable_params": 12}
    with pytest.raises(ValueError, match="needs input_size"):
        fleet.summary(net)
    with pytest.raises(ValueError, match=r"input_size \(2, 0\): each entry must be"):
        fleet.summary(net, (2, 0))

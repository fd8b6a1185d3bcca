"""``fleetmpi.Model`` (Paddle's ``paddle.Model``) and its callbacks against a hand-written
loop on the same data: one process bit for bit; at 2 ranks (pytest-mpi) equal to one process
on the global batches, with the same numbers logged on every rank."""
import os
import pickle

import numpy as np
import pytest

import fleetmpi as paddle
from fleetmpi import nn
from fleetmpi.core import backend
from fleetmpi.callbacks import (Callback, EarlyStopping, LRScheduler, ModelCheckpoint,
                                ReduceLROnPlateau, VisualDL)
from fleetmpi.static import InputSpec

from comm_support import close, equal, ok

FEATURES, CLASSES = 64, 10


def digits(count, offset=0):
    """``count`` of scikit-learn's digits from ``offset``: float32 pixels in [0, 1], int64
    labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rows = slice(offset, offset + count)
    return (x[rows] / 16).astype(np.float32), y[rows].astype(np.int64)


class Pairs(paddle.io.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __getitem__(self, index):
        return self.x[index], self.y[index]

    def __len__(self):
        return len(self.x)


def network(dtype="float32"):
    backend.manual_seed(0)
    nn.set_default_dtype(dtype)
    try:
        return nn.Sequential(nn.Linear(FEATURES, 24), nn.ReLU(), nn.Linear(24, CLASSES))
    finally:
        nn.set_default_dtype("float32")


class Recorder(Callback):
    """The logs of every training step and evaluation, and the hooks called, in order."""

    def __init__(self):
        super().__init__()
        self.steps, self.evals, self.hooks = [], [], []

    def on_train_batch_end(self, step, logs=None):
        self.steps.append(dict(logs))

    def on_eval_end(self, logs=None):
        self.evals.append(dict(logs))

    def __getattribute__(self, name):
        if name.startswith("on_"):
            object.__getattribute__(self, "hooks").append(name)
        return object.__getattribute__(self, name)


def hand_loop(net, opt, x, y, batch, epochs, schedule=None):
    """Paddle dygraph's loop over ``x, y`` in order: the loss of every step."""
    loss_fn, losses = nn.CrossEntropyLoss(), []
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            loss = loss_fn(net(paddle.to_tensor(x[start:start + batch])),
                           paddle.to_tensor(y[start:start + batch]))
            loss.backward()
            opt.step()
            opt.clear_grad()
            if schedule is not None:
                schedule.step()
            losses.append(float(loss))
    return losses


def test_fit_is_the_hand_written_loop_bit_for_bit():
    x, y = digits(200)
    schedule = paddle.optimizer.lr.StepDecay(0.05, step_size=3, gamma=0.5)
    reference = network()
    opt = paddle.optimizer.Momentum(schedule, parameters=reference.parameters())
    want = hand_loop(reference, opt, x, y, 32, 2, schedule)
    net = network()
    model = paddle.Model(net)
    schedule = paddle.optimizer.lr.StepDecay(0.05, step_size=3, gamma=0.5)
    model.prepare(paddle.optimizer.Momentum(schedule, parameters=net.parameters()),
                  nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    recorder = Recorder()
    model.fit(Pairs(x, y), epochs=2, batch_size=32, shuffle=False, verbose=0,
              callbacks=[recorder])
    assert [s["loss"][0] for s in recorder.steps] == pytest.approx(want, rel=0, abs=0)
    for name, value in reference.state_dict().items():
        np.testing.assert_array_equal(net.state_dict()[name], value)
    assert schedule.last_epoch == 14  # the default LRScheduler callback steps it every step
    assert [s["batch_size"] for s in recorder.steps[:7]] == [32] * 6 + [8]
    assert recorder.hooks[:3] == ["on_train_begin", "on_epoch_begin", "on_train_batch_begin"]
    assert recorder.hooks[-1] == "on_train_end"


def test_evaluate_and_predict_are_the_network_on_the_data():
    x, y = digits(90, offset=300)
    net = network()
    model = paddle.Model(net, InputSpec([None, FEATURES], "float32", "image"),
                         InputSpec([None, 1], "int64", "label"))
    model.prepare(loss=nn.CrossEntropyLoss(), metrics=paddle.metric.Accuracy(topk=(1, 3)))
    scores = net(paddle.to_tensor(x)).numpy()
    result = model.evaluate(Pairs(x, y), batch_size=40, verbose=0)
    ranked = np.argsort(-scores, axis=1, kind="stable")
    assert result["acc_top1"] == np.mean(ranked[:, 0] == y)
    assert result["acc_top3"] == np.mean((ranked[:, :3] == y[:, None]).any(axis=1))
    last = nn.CrossEntropyLoss()(paddle.to_tensor(scores[80:]), paddle.to_tensor(y[80:]))
    assert result["loss"] == [float(last)]
    stacked = model.predict(Pairs(x, y), batch_size=40, stack_outputs=True, verbose=0)
    np.testing.assert_array_equal(stacked[0], np.vstack([
        net(paddle.to_tensor(x[s:s + 40])).numpy() for s in range(0, 90, 40)]))
    batches = model.predict(Pairs(x, y), batch_size=40, verbose=0)
    assert [b.shape for b in batches[0]] == [(40, CLASSES), (40, CLASSES), (10, CLASSES)]


def test_batch_methods_return_paddles_forms():
    x, y = digits(16)
    net = network()
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(0.1, parameters=model.parameters()),
                  nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    losses, metrics = model.train_batch([x], [y])
    assert len(losses) == 1 and losses[0].dtype == np.float32 and len(metrics) == 1
    before = net.state_dict()
    model.train_batch([x], [y], update=False)  # gradients kept, no step
    assert all(np.array_equal(before[k], v) for k, v in net.state_dict().items())
    assert model.eval_batch([x], [y])[0][0].shape == ()
    assert model.predict_batch([x])[0].shape == (16, CLASSES)
    with pytest.raises(RuntimeError, match="prepare"):
        paddle.Model(network()).train_batch([x], [y])
    with pytest.raises(TypeError, match="nn.Layer"):
        paddle.Model(lambda v: v)
    with pytest.raises(ValueError, match="inference program"):
        model.save("unused", training=False)


def test_save_writes_paddles_files_and_load_resumes_training(tmp_path):
    x, y = digits(64)

    def prepared():
        net = network()
        model = paddle.Model(net)
        model.prepare(paddle.optimizer.Adam(0.01, parameters=net.parameters()),
                      nn.CrossEntropyLoss())
        return model

    whole = prepared()
    for _ in range(4):
        whole.train_batch([x], [y])
    first = prepared()
    for _ in range(2):
        first.train_batch([x], [y])
    first.save(str(tmp_path / "ckpt" / "half"))
    with open(tmp_path / "ckpt" / "half.pdparams", "rb") as f:
        raw = pickle.load(f)  # Paddle's layout: arrays by structured name, and the name table
    assert set(raw) == set(first.network.state_dict()) | {"StructuredToParameterName@@"}
    resumed = prepared()
    resumed.load(str(tmp_path / "ckpt" / "half.pdparams"))
    for _ in range(2):
        resumed.train_batch([x], [y])
    for name, value in whole.network.state_dict().items():
        np.testing.assert_array_equal(resumed.network.state_dict()[name], value)


def test_load_reads_a_paddle_pdparams_and_skips_mismatches_on_request(tmp_path):
    net = network()
    state = {k: np.full(v.shape, 0.5, v.dtype) for k, v in net.state_dict().items()}
    written = dict(state, **{"StructuredToParameterName@@": {k: f"linear_{i}.w_0"
                                                            for i, k in enumerate(state)}})
    with open(tmp_path / "paddle.pdparams", "wb") as f:
        pickle.dump(written, f, protocol=2)
    model = paddle.Model(net)
    model.load(str(tmp_path / "paddle"))
    assert all((v == 0.5).all() for v in net.state_dict().values())
    first = next(iter(state))
    state[first] = np.zeros((2, 2), np.float32)
    with open(tmp_path / "bad.pdparams", "wb") as f:
        pickle.dump(state, f, protocol=4)
    with pytest.raises(ValueError, match=r"receives a shape \[2, 2\]"):
        model.load(str(tmp_path / "bad"))
    with pytest.warns(UserWarning, match="Skip loading for"):
        model.load(str(tmp_path / "bad"), skip_mismatch=True)


def test_summary_of_the_inputs(capsys):
    model = paddle.Model(network(), InputSpec([None, FEATURES], "float32", "x"))
    assert model.summary() == {"total_params": 64 * 24 + 24 + 24 * 10 + 10,
                               "trainable_params": 64 * 24 + 24 + 24 * 10 + 10}
    assert "Linear-2" in capsys.readouterr().out
    assert model.summary((1, FEATURES))["total_params"] == 1810


def prepared_model(lr=0.1, metrics=None):
    net = network()
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(lr, parameters=net.parameters()),
                  nn.CrossEntropyLoss(), metrics or paddle.metric.Accuracy())
    return model


def test_early_stopping_stops_and_keeps_the_best_model(tmp_path):
    x, y = digits(64)
    model = prepared_model(lr=0.0)  # nothing improves
    recorder = Recorder()
    stop = EarlyStopping("acc", patience=2, verbose=0)
    model.fit(Pairs(x, y), Pairs(x, y), epochs=10, batch_size=32, verbose=0,
              save_dir=str(tmp_path), callbacks=[stop, recorder])
    assert len(recorder.evals) == 3 and model.stop_training
    assert os.path.isfile(tmp_path / "best_model.pdparams")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"{n}.{s}" for n in ("0", "1", "2", "best_model", "final") for s in ("pdopt", "pdparams")])


def test_early_stopping_rules_follow_paddle():
    stop = EarlyStopping("loss", mode="min", patience=1, min_delta=0.1, baseline=None)
    stop.set_model(type("M", (), {"stop_training": False})())
    stop.on_train_begin()
    for loss, stops in ((1.0, False), (0.95, True)):
        stop.on_eval_end({"loss": [loss]})
        assert stop.model.stop_training is stops
    assert EarlyStopping("acc").greater and not EarlyStopping("loss").greater
    with pytest.warns(UserWarning, match="unknown"):
        assert EarlyStopping("acc", mode="sideways").greater
    baseline = EarlyStopping("acc", patience=1, baseline=0.9)
    baseline.set_model(type("M", (), {"stop_training": False})())
    baseline.on_train_begin()
    baseline.on_eval_end({"acc": 0.8})
    assert baseline.model.stop_training


def test_lr_scheduler_by_epoch_and_reduce_on_plateau():
    x, y = digits(64)
    schedule = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
    net = network()
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(schedule, parameters=net.parameters()),
                  nn.CrossEntropyLoss())
    model.fit(Pairs(x, y), epochs=3, batch_size=16, verbose=0,
              callbacks=[LRScheduler(by_step=False, by_epoch=True)])
    assert schedule.last_epoch == 3
    with pytest.raises(ValueError, match="choose one"):
        LRScheduler(by_step=True, by_epoch=True)
    model = prepared_model(lr=0.2)
    plateau = ReduceLROnPlateau("acc", factor=0.5, patience=1, verbose=0, cooldown=1)
    plateau.set_model(model)
    plateau.on_train_begin()
    rates = []
    for acc in (0.5, 0.5, 0.5, 0.6):
        plateau.on_eval_end({"acc": acc})
        rates.append(model._optimizer.get_lr())
    assert rates == pytest.approx([0.2, 0.1, 0.05, 0.05])
    with pytest.raises(ValueError, match="below 1.0"):
        ReduceLROnPlateau(factor=1.0)


def test_checkpoints_every_save_freq_epochs(tmp_path):
    x, y = digits(32)
    prepared_model().fit(Pairs(x, y), epochs=3, batch_size=16, verbose=0,
                         callbacks=[ModelCheckpoint(save_freq=2, save_dir=str(tmp_path))])
    assert sorted(os.listdir(tmp_path)) == ["0.pdopt", "0.pdparams", "2.pdopt", "2.pdparams",
                                            "final.pdopt", "final.pdparams"]


@pytest.mark.parametrize("mode", ["lines", "bar", "off"])
def test_progress_lines_bar_or_nothing(monkeypatch, capsys, mode):
    monkeypatch.setenv("FLEETMPI_PROGRESS", mode)
    x, y = digits(64)
    prepared_model().fit(Pairs(x, y), Pairs(x, y), epochs=2, batch_size=16, log_freq=2)
    out, err = capsys.readouterr()
    if mode == "off":
        assert out + err == ""
    elif mode == "lines":
        assert "Epoch 2/2" in out and "step 2/4 - loss: " in out and " - acc: " in out
        assert "Eval samples: 64" in out and "\r" not in out + err
    else:
        assert "epoch 2/2" in err and "acc " in err and "Eval samples: 64" in out + err


def test_visualdl_writes_the_scalars_through_logwriter(tmp_path):
    x, y = digits(32)
    prepared_model().fit(Pairs(x, y), Pairs(x, y), epochs=2, batch_size=16, verbose=0,
                         callbacks=[VisualDL(str(tmp_path))])
    rows = (tmp_path / "scalars.csv").read_text().splitlines()
    tags = sorted({row.split(",")[0] for row in rows[1:]})
    assert tags == ["eval/acc", "eval/loss", "train/acc", "train/loss"]
    assert sum(row.startswith("train/loss,") for row in rows) == 4


def test_amp_configs_are_checked_and_train():
    x, y = digits(32)
    model = prepared_model()
    for bad, match in (({"level": "O3"}, "level"), ({"use_pure_fp16": True}, "O2"),
                       ({"level": "O1", "growth": 2}, "not recognised")):
        with pytest.raises(ValueError, match=match):
            model.prepare(model._optimizer, nn.CrossEntropyLoss(), amp_configs=bad)
    model.prepare(model._optimizer, nn.CrossEntropyLoss(),
                  amp_configs={"level": "O1", "init_loss_scaling": 64.0})
    assert np.isfinite(model.train_batch([x], [y])[0])
    assert float(model._scaler.state_dict()["scale"][0]) == 64.0


# -- 2 ranks --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_fit_on_ranks_is_one_process_on_the_global_batches():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    size, batch = world.Get_size(), 8
    x, y = digits(16 * size * 4)
    ex, ey = digits(101, offset=1000)  # not a multiple of the ranks: the sampler pads
    reference = network("float64")
    opt = paddle.optimizer.Momentum(0.05, parameters=reference.parameters())
    want = hand_loop(reference, opt, x.astype(np.float64), y, batch * size, 2)
    ref_scores = reference(paddle.to_tensor(ex.astype(np.float64))).numpy()
    net = network("float64")
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.Momentum(0.05, parameters=net.parameters()),
                  nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    recorder = Recorder()
    model.fit(Pairs(x.astype(np.float64), y), epochs=2, batch_size=batch, shuffle=False,
              verbose=0, callbacks=[recorder])
    got = [s["loss"][0] for s in recorder.steps]
    close(got, want, rtol=1e-5)
    for name, value in reference.state_dict().items():
        close(net.state_dict()[name], value, rtol=1e-9, atol=1e-12)
    logged = [(s["loss"][0], s["acc"], s["batch_size"]) for s in recorder.steps]
    ok(all(other == logged for other in world.allgather(logged)), "ranks logged apart")
    ok(all(s["batch_size"] == batch * size for s in recorder.steps))
    result = model.evaluate(Pairs(ex.astype(np.float64), ey), batch_size=batch, verbose=0)
    ok(result["acc"] == np.mean(ref_scores.argmax(axis=1) == ey), f"{result}")
    ok(all(other == result for other in world.allgather(result)), "ranks evaluated apart")
    scores = model.predict(Pairs(ex.astype(np.float64), ey), batch_size=batch,
                           stack_outputs=True, verbose=0)[0]
    equal(scores.shape, ref_scores.shape)
    close(scores, ref_scores, rtol=1e-9, atol=1e-12)

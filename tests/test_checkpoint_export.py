"""``fleetmpi.checkpoint_export``: one safetensors file of the whole model from a checkpoint of
any number of ranks: data parallel, sharding stages 1-3, tensor parallel saved with
``hybrid_checkpoint``, and pipeline stages (each parameter from a rank that trains it); a
tensor-parallel model saved in parts is refused; damaged files are named."""
import numpy as np
import pytest

import fleetmpi as fleet
from fleetmpi.training import checkpoint, hybrid_checkpoint
from fleetmpi import checkpoint_export, nn
from comm_support import equal, ok, raises
from strategy_support import make_strategy
from test_hybrid import feature_batch, staged_mlp, tiny_gpt, token_batch, train_hybrid
from test_user_model import train_user_model

pytest.importorskip("safetensors")


def shared_directory(tmp_path_factory, name):
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp(name))
                                if MPI.COMM_WORLD.rank == 0 else None)


def exported_by_rank_0(directory):
    """Rank 0 exports the checkpoint in ``directory``; every rank gets the file's tensors."""
    from mpi4py import MPI

    path = f"{directory}/model.safetensors"
    error = None
    if MPI.COMM_WORLD.rank == 0:
        try:
            checkpoint_export.export_safetensors(directory, path)
        except ValueError as raised:
            error = str(raised)
    error = MPI.COMM_WORLD.bcast(error)
    if error is not None:
        raise ValueError(error)
    return fleet.load(path, return_numpy=True)


def flat(nested, prefix=""):
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(flat(value, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


def test_one_process_checkpoint_exports_its_model(tmp_path, capsys):
    model, opt, _ = train_user_model(local=True, skip="all")
    checkpoint.save(str(tmp_path), model, opt, step=3)
    assert checkpoint_export.main([str(tmp_path), str(tmp_path / "m.safetensors")]) == 0
    assert "m.safetensors" in capsys.readouterr().out
    exported = flat(fleet.load(str(tmp_path / "m.safetensors"), return_numpy=True))
    state = model.state_dict()
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_a_damaged_file_is_named_and_nothing_is_written(tmp_path, capsys):
    model, opt, _ = train_user_model(local=True, skip="all", steps=1)
    path = checkpoint.save(str(tmp_path), model, opt, step=1)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "m.safetensors"
    assert checkpoint_export.main([str(tmp_path), str(out)]) == 1
    assert "does not match the SHA-256" in capsys.readouterr().err
    assert not out.exists()
    assert checkpoint_export.main([str(tmp_path / "none"), str(out)]) == 1
    assert "manifest.json is missing" in capsys.readouterr().err


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [None, 1, 2, 3], ids=["dp", "stage1", "stage2", "stage3"])
def test_data_parallel_and_every_sharding_stage_export_the_whole_model(stage,
                                                                       tmp_path_factory):
    strategy = None if stage is None else make_strategy(
        sharding=True, sharding_configs={"stage": stage})
    model, opt, _ = train_user_model(strategy, skip="all", lazy=stage == 3)
    directory = shared_directory(tmp_path_factory, "sharded")
    checkpoint.save(directory, model, opt, step=3)
    exported = flat(exported_by_rank_0(directory))
    state = model.state_dict()
    ok(sorted(exported) == sorted(state), f"{sorted(exported)} != {sorted(state)}")
    for name, value in state.items():
        equal(exported[name], value, err_msg=name)


def tensor_parallel_saved(tmp_path_factory, save):
    """A GPT trained 2 steps at mp_degree 2 and its optimizer, saved by ``save``; returns the
    model and the checkpoint's folder."""
    fleet.init(is_collective=True)
    if fleet.worker_num() % 2:
        pytest.skip("mp_degree 2 needs an even world")
    model, opt, _ = train_hybrid({"mp_degree": 2}, tiny_gpt, token_batch, steps=2)
    directory = shared_directory(tmp_path_factory, "tp")
    save(directory, model, opt, step=2)
    return model, directory


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_saved_whole_exports_the_serial_model(tmp_path_factory):
    model, directory = tensor_parallel_saved(tmp_path_factory, hybrid_checkpoint.save)
    whole = hybrid_checkpoint.merged_state_dict(model)
    exported = flat(exported_by_rank_0(directory))
    ok(sorted(exported) == sorted(whole), f"{sorted(exported)} != {sorted(whole)}")
    for name, value in whole.items():
        equal(exported[name], value, err_msg=name)

    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy())
    serial = tiny_gpt()
    serial.set_state_dict(exported)
    for name, value in serial.state_dict().items():
        equal(value, whole[name], err_msg=f"loaded into the serial GPT: {name}")


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_saved_in_parts_is_refused_naming_the_entry(tmp_path_factory):
    _, directory = tensor_parallel_saved(tmp_path_factory, checkpoint.save)
    with raises(ValueError, match=r"part of the split \(tensor-parallel\) parameter '[\w.]+'.*"
                                  r"fleetmpi.training.hybrid_checkpoint"):
        exported_by_rank_0(directory)


@pytest.mark.mpi(min_size=2)
def test_pipeline_stages_export_each_parameter_from_a_rank_that_trains_it(tmp_path_factory):
    fleet.init(is_collective=True)
    if fleet.worker_num() % 2:
        pytest.skip("pp_degree 2 needs an even world")
    layout = {"pp_degree": 2, "dp_degree": fleet.worker_num() // 2}
    model, opt, _ = train_hybrid(layout, lambda: staged_mlp(False), feature_batch,
                                 loss=nn.CrossEntropyLoss, pipeline_configs={"micro_batch": 2})
    directory = shared_directory(tmp_path_factory, "pp")
    checkpoint.save(directory, model, opt, step=2)
    exported = flat(exported_by_rank_0(directory))
    stage = fleet.get_hybrid_communicate_group().get_stage_id()
    state = model.state_dict()
    mine = [name for name, p in model.named_parameters() if p.pipeline_stage == stage]
    others = [name for name, p in model.named_parameters() if p.pipeline_stage != stage]
    ok(mine and others, f"stage {stage} trains {mine}, not {others}")
    for name in mine:
        equal(exported[name], state[name], err_msg=name)
    stale = [name for name in others if np.array_equal(exported[name], state[name])]
    ok(not stale, f"the export holds this rank's untrained copy of {stale}")

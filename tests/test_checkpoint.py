"""Hub loading (single file and sharded), conversion to orbax and back, and clear errors."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import ling
import oracle
from ling import checkpoint
from ling.checkpoint import CheckpointError
from ling.config import ConfigError
from ling.convert import main as convert_main


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    hf = oracle.build(oracle.random_bailing_config(3), 3)
    return oracle.save(hf, str(tmp_path_factory.mktemp("hub") / "bailing"))


def params(model):
    return jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.split(model)[1]))


def test_conversion_round_trip_gives_identical_parameters(hub_dir, tmp_path):
    out = str(tmp_path / "orbax")
    assert convert_main(["--hf", hub_dir, "--out", out, "--dtype", "float32"]) == 0
    a, b = ling.load(hub_dir, dtype="float32", progress=False), ling.load(out, dtype="float32")
    pa, pb = params(a), params(b)
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (path, x), (_, y) in zip(pa, pb):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    assert b.cfg == a.cfg


def test_sharded_checkpoint_with_index(hub_dir, tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(hub_dir, "config.json"), sharded)
    tensors = load_file(os.path.join(hub_dir, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens = np.arange(20) % 50
    a = ling.forward(ling.load(hub_dir, dtype="float32", progress=False), tokens)
    b = ling.forward(ling.load(str(sharded), dtype="float32", progress=False), tokens)
    np.testing.assert_array_equal(a, b)


def corrupt(hub_dir, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(hub_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(bad / "model.safetensors"))
    return str(bad)


def test_missing_tensor_is_named(hub_dir, tmp_path):
    name = "model.layers.1.attention.q_proj.weight"
    bad = corrupt(hub_dir, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        ling.load(bad, progress=False)


def test_wrong_shape_names_tensor_and_both_shapes(hub_dir, tmp_path):
    name = "model.layers.2.attention.kv_b_proj.weight"

    def edit(t):
        t[name] = t[name][:, :-1].copy()

    bad = corrupt(hub_dir, tmp_path, edit)
    want = load_file(os.path.join(hub_dir, "model.safetensors"))[name].shape
    got = (want[0], want[1] - 1)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \({got[0]}, {got[1]}\), expected \({want[0]}, {want[1]}\)"):
        ling.load(bad, progress=False)


def test_unexpected_tensor_is_named(hub_dir, tmp_path):
    bad = corrupt(hub_dir, tmp_path, lambda t: t.update({"model.layers.0.attention.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.attention.extra.weight'"):
        ling.load(bad, progress=False)


def test_unknown_model_type_is_named(hub_dir, tmp_path):
    bad = tmp_path / "badtype"
    shutil.copytree(hub_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'model_type': unknown model type 'llama'"):
        ling.load(str(bad))


def test_convert_reports_a_bad_checkpoint(hub_dir, tmp_path, capsys):
    bad = corrupt(hub_dir, tmp_path, lambda t: t.pop("lm_head.weight"))
    assert convert_main(["--hf", bad, "--out", str(tmp_path / "o")]) == 2
    assert "missing tensor 'lm_head.weight'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")


def test_converted_dir_is_detected():
    assert not checkpoint.is_converted(os.path.dirname(__file__))


def test_converted_dir_of_another_layout_is_refused(hub_dir, tmp_path):
    out = tmp_path / "conv"
    assert convert_main(["--hf", hub_dir, "--out", str(out)]) == 0
    assert ling.load(str(out)) is not None
    meta = json.loads((out / checkpoint.CONFIG_FILE).read_text())
    del meta["layout"]  # as written before the projections were fused
    (out / checkpoint.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="parameter layout 1; this version reads layout 2"):
        ling.load(str(out))

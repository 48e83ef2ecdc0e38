"""Models built layer by layer in their final form (`ling.build`): the same parameters, bit for bit,
as building the full-precision model whole and quantising it; a model over the memory budget is
refused before anything is read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ling
import oracle
from ling import build, checkpoint
from ling.model import LingModel
from ling.quantize import Quantization, quantization_of, quantize_model

INT4 = Quantization(bits=4, group_size=32, lm_head=True, experts=True)


def leaves(model):
    return jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.split(model)[1]))


def assert_same(a, b):
    pa, pb = leaves(a), leaves(b)
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (path, x), (_, y) in zip(pa, pb):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hf = oracle.build(oracle.random_bailing_config(0, hidden_size=64, moe_intermediate_size=32), 0)
    return oracle.save(hf, str(tmp_path_factory.mktemp("hub") / "bailing"))


def whole_then_quantised(hub):
    cfg = ling.load_config(hub)
    model = checkpoint.load_hub(hub, cfg, dtype=jnp.float32, progress=False)
    return quantize_model(model, bits=4, group_size=32, lm_head=True, experts=True)


def test_hub_streamed_in_int4_equals_load_then_quantize(hub):
    streamed = ling.load(hub, dtype="float32", quantize="int4", group_size=32, quantize_lm_head=True,
                         quantize_experts=True, progress=False)
    assert quantization_of(streamed) == INT4
    assert_same(streamed, whole_then_quantised(hub))


def test_random_layer_by_layer_equals_the_whole_model():
    cfg = ling.preset("ling-tiny")
    whole = LingModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(5))
    assert_same(build.random(cfg, dtype=jnp.float32, seed=5, progress=False), whole)
    quantize_model(whole, bits=4, group_size=32, lm_head=True, experts=True)
    assert_same(build.random(cfg, dtype=jnp.float32, seed=5, quant=INT4, progress=False), whole)


def test_converted_int4_restores_as_stored_and_full_precision_is_quantised_at_restore(hub, tmp_path):
    ref = whole_then_quantised(hub)
    checkpoint.save_converted(ref, str(tmp_path / "q"))
    assert_same(ling.load(str(tmp_path / "q"), dtype="float32", progress=False), ref)
    full = checkpoint.load_hub(hub, ling.load_config(hub), dtype=jnp.float32, progress=False)
    checkpoint.save_converted(full, str(tmp_path / "f"))
    restored = ling.load(str(tmp_path / "f"), dtype="float32", quantize="int4", group_size=32, quantize_lm_head=True,
                         quantize_experts=True, progress=False)
    assert_same(restored, ref)


def test_over_budget_is_refused_before_anything_is_read(hub, monkeypatch):
    def no_read(self, name):
        raise AssertionError(f"read {name} before refusing")

    monkeypatch.setattr(checkpoint.SafetensorsIndex, "read", no_read)
    cfg = ling.load_config(hub)
    _, peak = build.plan(cfg, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"the weights need .* GB on a device .* but the device holds"):
        ling.load(hub, dtype="float32", memory_budget=peak // 2, progress=False)
    _, peak4 = build.plan(cfg, dtype=jnp.float32, quant=INT4)
    assert peak4 < peak  # the int4 weights plus one full-precision layer
    with pytest.raises(ValueError, match="at int4"):
        ling.load(hub, dtype="float32", quantize="int4", group_size=32, quantize_experts=True,
                  memory_budget=peak4 // 2, progress=False)
    with pytest.raises(ValueError, match="the weights need"):
        ling.load("ling-tiny", dtype="float32", memory_budget=1000, progress=False)


def test_plan_counts_the_built_bytes():
    cfg = ling.preset("ling-tiny")
    final, _ = build.plan(cfg, dtype=jnp.float32, quant=INT4)
    model = build.random(cfg, dtype=jnp.float32, quant=INT4, progress=False)
    assert build.nbytes(final) == sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))


def test_server_memory_plan_counts_the_slots_and_refuses_what_does_not_fit():
    """The slot bytes are the state `new_slots` allocates; a batch that does not fit the free memory
    is refused with the settings that would."""
    import dataclasses

    from serve.memory import check_memory, memory_plan
    from spec.step import new_slots

    model = ling.load("ling-tiny", progress=False)
    plan = memory_plan(model, max_seq_len=512, speculative_steps=3)
    slots = new_slots(model, 4, 512 + 4, 512, logprob_width=4)  # as the server allocates them
    assert 4 * (plan.slot - plan.verify) == sum(x.nbytes for x in jax.tree_util.tree_leaves(slots))
    assert plan.verify > 0 and memory_plan(model, max_seq_len=512, speculative_steps=0).verify == 0
    assert plan.weights == sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))
    check_memory(dataclasses.replace(plan, free=16 * plan.slot), 16, 512)
    with pytest.raises(ValueError, match=r"16 slots x 512 tokens need .* try --max-batch 10 or --max-seq-len \d+"):
        check_memory(dataclasses.replace(plan, free=10 * plan.slot + 5), 16, 512)
    assert "MLA cache" in plan.describe(16)
    # the prefix cache's pool: a budget in checkpoints, refused when it holds none
    from argparse import Namespace

    from serve.memory import plan_prefix_cache

    pooled = dataclasses.replace(plan, free=None, prefix_entry=10**6, prefix_interval=64)
    plan_prefix_cache(pooled, Namespace(disable_prefix_cache=False, prefix_cache_gb=0.0105, max_batch=4))
    assert pooled.prefix_entries == 10 and pooled.pool == 10**7
    with pytest.raises(ValueError, match="holds no checkpoint"):
        plan_prefix_cache(pooled, Namespace(disable_prefix_cache=False, prefix_cache_gb=0.0005, max_batch=4))


def test_large_random_weights_are_drawn_in_blocks(monkeypatch):
    """Past DRAW_CHUNK elements a random weight is drawn a block of leading-axis slices at a time:
    the right shape, dtype and spread, every slice its own draw, the same for the same key, and
    (the point) temporaries of a block's size: a routed-expert stack of Ling-3.0-flash's shape,
    compiled (not run), needs under a tenth of its own bytes beside it."""
    from moe import nn

    monkeypatch.setattr(nn, "DRAW_CHUNK", 1000)
    shape = (48, 10, 30)  # 14400 elements: blocks of 3 slices
    a = nn.normal(jax.random.key(1), shape, jnp.bfloat16, 0.5)
    assert a.shape == shape and a.dtype == jnp.bfloat16
    f = np.asarray(a, np.float32)
    assert abs(f.std() - 0.5) < 0.03 and abs(f.mean()) < 0.03
    assert len({f[i].tobytes() for i in range(shape[0])}) == shape[0]
    np.testing.assert_array_equal(f, np.asarray(nn.normal(jax.random.key(1), shape, jnp.bfloat16, 0.5), np.float32))
    assert not np.array_equal(f, np.asarray(nn.normal(jax.random.key(2), shape, jnp.bfloat16, 0.5), np.float32))

    experts = (512, 2560, 1024)  # blocks of 4 experts at the default DRAW_CHUNK
    memory = nn._normal_blocks.lower(jax.random.key(0), experts, jnp.dtype(jnp.bfloat16), 0.02, 4).compile() \
        .memory_analysis()
    assert memory.temp_size_in_bytes < memory.output_size_in_bytes / 10, memory

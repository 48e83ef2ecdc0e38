"""The model's prefill, decode and verify paths through the Pallas kernels (interpret mode on CPU)
agree with its plain-jnp path: the KDA prefill and verify kernels and the MLA decode kernel wired
in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ling
from ling.state import commit, init_state
from backends import KERNELS, assert_model_close


def run(model, kernels, prompt, steps, verify):
    ling.use_kernels(model, kernels)
    cfg = model.cfg
    state = init_state(cfg, 2, 40, jnp.float32)
    _, _, state = model(jnp.asarray(prompt), state, valid=jnp.asarray([20, 13]), form="prefill")
    out = []
    for tok in steps.T:  # one token per step; slot 1 sits out the second step (valid 0)
        valid = jnp.asarray([1, 0 if len(out) == 1 else 1])
        logits, _, state = model(jnp.asarray(tok)[:, None], state, valid=valid, form="decode")
        out.append(np.asarray(logits[:, 0]))
    logits, _, pending = model(jnp.asarray(verify), state, form="verify")
    out.append(np.asarray(logits))
    state = commit(pending, jnp.asarray([4, 1]))
    logits, _, _ = model(jnp.asarray(verify[:, :1]), state, form="decode")
    out.append(np.asarray(logits))
    return out


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", ["ling-tiny", "kimi-tiny"])
def test_kernel_path_matches_jnp_path(backend, name):
    model = ling.load(name, dtype="float32", seed=3)
    r = np.random.default_rng(0)
    prompt = r.integers(0, model.cfg.vocab_size, (2, 20))
    steps = r.integers(0, model.cfg.vocab_size, (2, 3))
    verify = r.integers(0, model.cfg.vocab_size, (2, 6))
    ref = run(model, "reference", prompt, steps, verify)
    got = run(model, backend, prompt, steps, verify)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_model_close(a, b, backend, f"output {i}")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", ["ling-tiny", "kimi-tiny"])
def test_prefill_kernel_matches_jnp_path(backend, name):
    """A ragged prefill over two KDA chunks (64 tokens each): the prefill kernel's logits and the
    state it leaves (every layer's conv and recurrent state, MLA caches) match the jnp path."""
    model = ling.load(name, dtype="float32", seed=5)
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 70)))
    valid = jnp.asarray([70, 41])
    outs = {}
    for kernels in ("reference", backend):
        ling.use_kernels(model, kernels)
        state = init_state(model.cfg, 2, 72, jnp.float32)
        outs[kernels] = model(prompt, state, valid=valid, form="prefill")
    (ref_logits, _, ref_state), (got_logits, _, got_state) = outs["reference"], outs[backend]
    for b, n in enumerate(np.asarray(valid)):
        assert_model_close(got_logits[b, :n], ref_logits[b, :n], backend, f"logits of slot {b}")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got_state), jax.tree.leaves(ref_state))):
        assert_model_close(a, b, backend, f"state leaf {i}")


def test_the_backend_is_fixed_when_the_model_is_built(monkeypatch):
    """A model runs the backend it was built with whatever LING_KERNELS says when it is traced;
    the variable only picks the default at build time, and `use_kernels` switches a built model."""
    def pallas_calls(model):
        state = init_state(model.cfg, 1, 8, jnp.float32)
        jaxpr = jax.make_jaxpr(lambda t: model(t, state, form="decode")[0])(jnp.zeros((1, 1), jnp.int32))
        return str(jaxpr).count("pallas_call")

    monkeypatch.setenv("LING_KERNELS", "interpret")
    built_interpret = ling.load("ling-tiny", dtype="float32")
    built_reference = ling.load("ling-tiny", dtype="float32", kernels="reference")
    monkeypatch.setenv("LING_KERNELS", "reference")
    assert built_interpret.kernels == "interpret" and pallas_calls(built_interpret) > 0
    assert built_reference.kernels == "reference" and pallas_calls(built_reference) == 0
    assert pallas_calls(ling.use_kernels(built_reference, "interpret")) > 0


def test_serve_run_builds_the_model_with_its_kernels_flag():
    from serve.run import _load_model, parse_args

    model = _load_model(parse_args(["--model", "ling-tiny", "--dtype", "float32", "--kernels", "interpret"]))
    assert {m.kernels for _, m in nnx.iter_graph(model) if hasattr(m, "kernels")} == {"interpret"}


def test_the_mixed_launch_is_set_on_every_moe_and_checked():
    from moe.block import MoE, use_mixed_launch
    from serve.run import parse_args

    model = ling.load("ling-tiny", dtype="float32", seed=4)
    moes = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
    assert moes and {m.mixed_launch for m in moes} == {"grouped"}  # the default
    assert {m.mixed_launch for m in moes if use_mixed_launch(model, "tiles")} == {"tiles"}
    with pytest.raises(ValueError, match="mixed launch must be one of"):
        use_mixed_launch(model, "tile")
    assert parse_args(["--mixed-moe", "grouped"]).mixed_moe == "grouped" and parse_args([]).mixed_moe == "grouped"
    with pytest.raises(SystemExit):
        parse_args(["--mixed-moe", "union"])


@pytest.mark.parametrize("launch", ["tiles", "grouped"])
@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_a_grouped_forward_equals_separate_calls(backend, launch, monkeypatch):
    """`LingModel.forward` over a verify batch and a prefill batch (the mixed iteration: attention
    per batch between projections run once over both batches' rows, one MoE call over both, through the tile-scheduled kernel with the verify tokens
    first, or with `use_mixed_launch(model, "grouped")` as any other tokens) equals the two calls
    made apart on the reference path: logits, hidden states and every layer's new state."""
    import moe.block
    import moe.nn
    from ling.model import Batch

    model = ling.load("ling-tiny", dtype="float32", seed=4)
    cfg, r = model.cfg, np.random.default_rng(2)
    ling.use_kernels(model, "reference")
    decoding = init_state(cfg, 2, 48, jnp.float32)
    _, _, decoding = model(jnp.asarray(r.integers(0, cfg.vocab_size, (2, 12))), decoding,
                           valid=jnp.asarray([12, 7]), form="prefill")
    verify = jnp.asarray(r.integers(0, cfg.vocab_size, (2, 4)))
    prompt, valid = jnp.asarray(r.integers(0, cfg.vocab_size, (1, 24))), jnp.asarray([17])
    fresh = init_state(cfg, 1, 48, jnp.float32)
    apart = (model(verify, decoding, form="verify"), model(prompt, fresh, valid=valid, form="prefill"))

    tiles, rows = [], []
    real, linear = moe.block.tile_moe, moe.nn.Linear.__call__
    monkeypatch.setattr(moe.block, "tile_moe", lambda *a, **kw: tiles.append(kw["n_decode"]) or real(*a, **kw))
    monkeypatch.setattr(moe.nn.Linear, "__call__", lambda self, x: rows.append(x.size // x.shape[-1]) or linear(self, x))
    ling.use_kernels(model, backend)
    moe.block.use_mixed_launch(model, launch)
    together = model.forward([Batch(verify, decoding, None, "verify"), Batch(prompt, fresh, valid, "prefill")])
    moe_layers = sum(t == "moe" for t in cfg.mlp_types)
    assert tiles == ([] if backend == "reference" or launch == "grouped" else [2 * 4] * moe_layers)
    assert rows == [2 * 4 + 24] * 2 * cfg.num_hidden_layers  # each attention projection once over both batches
    for (want_logits, want_hidden, want_state), (logits, hidden, state) in zip(apart, together):
        assert_model_close(logits, want_logits, "interpret" if backend == "reference" else backend, "logits")
        assert_model_close(hidden, want_hidden, "interpret" if backend == "reference" else backend, "hidden")
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 24])  # the fused kernels' sizes (a skipped pair borrows), the grouped GEMM's
@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_a_chunks_padding_rows_take_no_routed_expert(backend, rows, monkeypatch):
    """`MoE(x, live=mask)`: the real rows' output is the unmasked block's, the others' the shared
    expert's alone, and the routed experts receive the others' pairs as skipped (id E, weight 0);
    `real_rows` marks a prefill batch's rows past its valid tokens, and no other batch's."""
    import moe.block
    from ling.model import real_rows
    from moe.block import MoE

    model = ling.load("ling-tiny", dtype="float32", seed=6)
    ling.use_kernels(model, backend)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    e = block.w13.shape[0]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, rows // 2 + 1, model.cfg.hidden_size)), jnp.float32)
    b, t, _ = x.shape
    live = real_rows([(1, 2), (b, t)], [jnp.asarray([2]), jnp.asarray([t, 1])], ["verify", "prefill"])
    assert real_rows([(b, t)], [jnp.asarray([t, 1])], ["decode"]) is None
    np.testing.assert_array_equal(np.asarray(live), [True, True] + [True] * t + [True] + [False] * (t - 1))
    live = live[2:]
    seen, real = [], moe.block.routed_experts
    monkeypatch.setattr(moe.block, "routed_experts", lambda *a, **kw: seen.append((a[1], a[2], kw)) or real(*a, **kw))
    want, got = block(x), block(x, live=live)
    ids, weights, kw = [call for call in seen if "skips" in call[2]][-1]  # not the shared expert's own call
    assert kw["skips"] and kw["shared"] is None
    assert np.all(np.asarray(ids)[~np.asarray(live)] == e) and np.all(np.asarray(ids)[np.asarray(live)] < e)
    flat_want, flat_got = np.asarray(want).reshape(b * t, -1), np.asarray(got).reshape(b * t, -1)
    np.testing.assert_allclose(flat_got[np.asarray(live)], flat_want[np.asarray(live)], rtol=1e-5, atol=1e-6)
    shared = np.asarray(block.shared_experts(x.reshape(b * t, -1)))
    np.testing.assert_allclose(flat_got[~np.asarray(live)], shared[~np.asarray(live)], rtol=1e-5, atol=1e-6)

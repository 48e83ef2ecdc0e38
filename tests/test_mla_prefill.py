"""MLA prefill attention (pallas_kernels/mla_prefill.py) and its place in the model.

Kernel level: the blockwise path (what the "interpret" backend runs; cuDNN shares its split and
merge and is checked on the GPU by bench/prefill.py) against `reference` on fresh random fp32
inputs (seed in the failure message): ragged lengths including an empty prefix, chunk lengths not
a multiple of the block, several prefix blocks, cache rows at or past each length poisoned with
NaN. `reference` itself against attention written out per head in float64. No intermediate of
the blockwise path has a [T, T] or [T, L] pair of dimensions.
Model level: the MLA layer's kernel path against its plain-jnp path over two chunks (the second
with a cached prefix), and a chunked prefill followed by decode steps against one full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ling
import ling.model
import oracle
from ling.mla import MLAttention
from ling.state import init_state
from pallas_kernels import mla_prefill as mp
from backends import KERNELS, assert_model_close

H, N, P, V, R = 2, 16, 8, 16, 32  # heads, nope, rope, value, latent dims (Ling: 32, 128, 64, 128, 512)


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


def make_inputs(rng, b, t, l_max, lengths):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    cache_latent, cache_rope = f(b, l_max, R), f(b, l_max, P)
    lengths = np.asarray(lengths, np.int32)
    dead = np.arange(l_max)[None, :] >= lengths[:, None]  # rows no prefill has written
    cache_latent[dead] = np.nan
    cache_rope[dead] = np.nan
    arrays = (f(b, t, H, N), f(b, t, H, P), f(b, t, R), f(b, t, P), cache_latent, cache_rope,
              f(R, H, N) / np.sqrt(R), f(R, H, V) / np.sqrt(R))
    return tuple(jnp.asarray(a) for a in arrays) + (jnp.asarray(lengths),)


def test_reference_matches_attention_per_head():
    seed = _seed()
    rng = np.random.default_rng(seed)
    b, t, l_max, scale = 2, 5, 12, 0.3
    args = make_inputs(rng, b, t, l_max, [0, 7])
    got = np.asarray(mp.reference(*args, scale=scale), np.float64)
    qn, qr, lat, kr, cl, cr, w_uk, w_uv, lengths = (np.asarray(a, np.float64) for a in args)
    want = np.zeros((b, t, H, V))
    for bi in range(b):
        n = int(lengths[bi])
        c = np.concatenate([cl[bi, :n], lat[bi]])  # [n + T, R]: the prefix, then the chunk
        k_r = np.concatenate([cr[bi, :n], kr[bi]])
        for hi in range(H):
            k_nope, v = c @ w_uk[:, hi], c @ w_uv[:, hi]
            for ti in range(t):
                vis = n + ti + 1  # the prefix and the chunk up to this query
                s = (k_nope[:vis] @ qn[bi, ti, hi] + k_r[:vis] @ qr[bi, ti, hi]) * scale
                p = np.exp(s - s.max())
                want[bi, ti, hi] = (p / p.sum()) @ v[:vis]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


CASES = [  # t, l_max, block, lengths (B = 3)
    (45, 80, 16, [0, 5, 35]),  # T and the prefixes not multiples of the block; one empty prefix
    (7, 64, 4, [0, 0, 0]),  # a first chunk everywhere: every prefix block is empty
    (16, 100, 32, [84, 1, 50]),  # a prefix filling the cache up to the chunk; L not a block multiple
    (33, 40, 512, [7, 0, 3]),  # block beyond T and L: one step each
    (9, 200, 192, [191, 64, 0]),  # L just past a block: two balanced blocks of 128
]


@pytest.mark.parametrize("t,l_max,block,lengths", CASES)
@pytest.mark.parametrize("jit", [False, True])
def test_blockwise_matches_reference(t, l_max, block, lengths, jit):
    seed = _seed()
    rng = np.random.default_rng(seed)
    args = make_inputs(rng, 3, t, l_max, lengths)
    scale = (N + P) ** -0.5
    run = lambda *a: mp.prefill_attention(*a, scale=scale, backend="interpret", block=block)  # noqa: E731
    got = np.asarray((jax.jit(run) if jit else run)(*args))
    want = np.asarray(mp.prefill_attention(*args, scale=scale, backend="reference"))
    msg = f"T={t} L={l_max} block={block} lengths={lengths} seed {seed}"
    assert got.shape == (3, t, H, V)
    assert np.all(np.isfinite(got)), "non-finite output: " + msg
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=msg)


def _stand_in_cudnn(monkeypatch, mla_dims: bool):
    """Replaces jax's cuDNN fused attention (GPU only) by jnp with its contract: layout BTNH,
    causal mask aligned top-left or a padding mask from kv_seqlen, (o, lse [B, N, T] fp32);
    without mla_dims it refuses qk and v head dims that differ, as cuDNN < 9.10 does. A zero kv
    length (undefined there) gives NaN here, so the output shows any that reaches it."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def fake(q, k, v, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, *, scale, mask_type, qkv_layout,
             return_residual):
        assert qkv_layout == "BTNH" and return_residual and bias is None and mask is None
        if not mla_dims and q.shape[-1] != v.shape[-1]:
            raise NotImplementedError("mla requires cudnn version >= 9.10 and at least hopper arch.")
        t, s = q.shape[1], k.shape[1]
        logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
        if mask_type == fa.MaskType.CAUSAL:
            vis = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None, None]
        else:
            assert mask_type == fa.MaskType.PADDING and q_seqlen.shape == kv_seqlen.shape == (q.shape[0],)
            vis = (jnp.arange(s)[None, :] < kv_seqlen[:, None])[:, None, None, :]
            vis = vis & (jnp.arange(t)[:, None] < q_seqlen[:, None, None])[:, None]
        logits = jnp.where(vis, logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)  # [B, N, T]
        o = jnp.einsum("bnts,bsnh->btnh", jnp.exp(logits - lse[..., None]), v.astype(jnp.float32))
        if kv_seqlen is not None:  # what a zero kv length gives is not specified: NaN everywhere
            empty = (kv_seqlen == 0)[:, None, None]
            lse = jnp.where(empty, jnp.nan, lse)
            o = jnp.where(empty[..., None], jnp.nan, o)
        return o.astype(q.dtype), lse

    monkeypatch.setattr(fa, "dot_product_attention", fake)


@pytest.mark.parametrize("mla_dims", [True, False])
def test_cudnn_path_with_a_stand_in(monkeypatch, mla_dims):
    """The cuDNN path's plumbing (q/k concatenation, rope broadcast, lse layout, the padded-v
    fallback, prefix blocks with per-sequence kv lengths, empty blocks) on CPU; the real custom
    call is checked against `reference` by bench/prefill.py on the GPU."""
    _stand_in_cudnn(monkeypatch, mla_dims)
    seed = _seed()
    args = make_inputs(np.random.default_rng(seed), 3, 21, 70, [0, 9, 45])
    scale = (N + P) ** -0.5
    got = np.asarray(mp.prefill_attention(*args, scale=scale, impl="cudnn", block=16))
    want = np.asarray(mp.prefill_attention(*args, scale=scale, backend="reference"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


def _shapes(jaxpr):
    """Every intermediate shape of a jaxpr, its loop bodies and branches included."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _shapes(inner)


def test_no_square_scores():
    """With T = 96, L = 128 and blocks of 16, no intermediate has two of {T, L} among its dims."""
    t, l_max = 96, 128
    args = make_inputs(np.random.default_rng(0), 2, t, l_max, [40, 3])
    jaxpr = jax.make_jaxpr(lambda *a: mp.prefill_attention(*a, scale=0.2, backend="interpret", block=16))(*args)
    big = [s for s in _shapes(jaxpr.jaxpr) if sum(d in (t, l_max) for d in s) >= 2]
    assert not big, f"[T, T] / [T, L] intermediates: {big}"


def test_bad_impl():
    args = make_inputs(np.random.default_rng(0), 1, 4, 8, [2])
    with pytest.raises(ValueError, match="impl"):
        mp.prefill_attention(*args, scale=1.0, backend="interpret", impl="flash")


# ---------------------------------------------------------------------------------- model level


@pytest.mark.parametrize("backend", KERNELS)
def test_layer_kernel_path_matches_plain(backend):
    """MLAttention form "plain", three chunks of two slots (the second slot keeps 4 of its first
    11 tokens and sits out the third chunk, valid 0): the interpret path's outputs (of the slots
    with tokens) and caches equal the plain-jnp path's."""
    cfg = ling.preset("ling-tiny")
    layer = MLAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(7))
    r = np.random.default_rng(_seed())
    xs = [jnp.asarray(r.standard_normal((2, t, cfg.hidden_size)), jnp.float32) for t in (11, 9, 6)]
    chunks = [(xs[0], [0, 0], None), (xs[1], [11, 4], None), (xs[2], [20, 13], [4, 0])]

    def run(kernels):
        ling.use_kernels(layer, kernels)
        lat = jnp.zeros((2, 40, cfg.kv_lora_rank), jnp.float32)
        rope = jnp.zeros((2, 40, cfg.qk_rope_head_dim), jnp.float32)
        outs = []
        for x, lengths, valid in chunks:
            lengths = jnp.asarray(lengths, jnp.int32)
            positions = lengths[:, None] + jnp.arange(x.shape[1])
            valid = None if valid is None else jnp.asarray(valid, jnp.int32)
            y, lat, rope = layer(x, positions, lat, rope, lengths, form="plain", valid=valid)
            outs.append(np.asarray(y) if valid is None else np.asarray(y)[np.asarray(valid) > 0])
        return outs + [np.asarray(lat), np.asarray(rope)]

    want = run("reference")
    got = run(backend)
    for a, b in zip(got, want):
        assert oracle.rel_err(a, b) < 1e-5


@pytest.mark.parametrize("absorbed_max_t", [0, 32])
@pytest.mark.parametrize("backend", KERNELS)
def test_chunked_prefill_then_decode_equals_full_forward(backend, absorbed_max_t, monkeypatch):
    """Kernel path (interpret): prompts of 29 and 17 tokens prefilled in chunks of 16 (the second
    chunk attends to a cached prefix; 13 and 1 real tokens in it), then 3 decode steps; the
    logits at the last prompt position and at every decoded position equal those of one prefill
    of the whole sequences through the plain-jnp path. MLA runs the chunks in the plain form
    (absorbed_max_t 0) and in the absorbed one (`ling.model.ABSORBED_CHUNK_MAX_T`)."""
    monkeypatch.setattr(ling.model, "ABSORBED_CHUNK_MAX_T", absorbed_max_t)
    model = ling.load("ling-tiny", dtype="float32", seed=5)
    cfg = model.cfg
    r = np.random.default_rng(_seed())
    plen, n_dec, chunk = np.array([29, 17]), 3, 16
    seqs = [r.integers(2, cfg.vocab_size, n + n_dec) for n in plen]

    ling.use_kernels(model, backend)
    state = init_state(cfg, 2, 48, jnp.float32)
    toks = np.zeros((2, 2 * chunk), np.int32)
    for i, n in enumerate(plen):
        toks[i, :n] = seqs[i][:n]
    got = []
    for c in range(2):
        valid = np.clip(plen - c * chunk, 0, chunk)
        logits, _, state = model(jnp.asarray(toks[:, c * chunk:(c + 1) * chunk]), state, valid=jnp.asarray(valid),
                                 form="prefill")
    got.append(np.asarray(logits)[np.arange(2), plen - chunk - 1])  # the last prompt position
    for j in range(n_dec):
        tok = np.array([s[n + j] for s, n in zip(seqs, plen)], np.int32)[:, None]
        logits, _, state = model(jnp.asarray(tok), state, form="decode")
        got.append(np.asarray(logits)[:, 0])

    ling.use_kernels(model, "reference")
    full = np.zeros((2, int(plen.max()) + n_dec), np.int32)
    for i, s in enumerate(seqs):
        full[i, : len(s)] = s
    logits, _, _ = model(jnp.asarray(full), init_state(cfg, 2, 48, jnp.float32), valid=jnp.asarray(plen + n_dec),
                         form="prefill")
    logits = np.asarray(logits)
    for j, g in enumerate(got):
        want = logits[np.arange(2), plen - 1 + j]
        assert_model_close(g, want, backend, f"position {j} after the prompt")

"""The prefill grouped GEMM (interpret mode) against `experts.reference` and float64
experts, and the MoE block / model wired to it above GATHER_MAX_PAIRS pairs.

Small shapes (D 256, I 128, E 13: not a power of two) keep Pallas' interpreter fast; every case
draws fresh random inputs and starts the kernels' outputs as NaN, so a row left unwritten shows.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.experts import GATHER_MAX_PAIRS
from pallas_kernels.experts import reference as experts_reference
from pallas_kernels import experts, moe_align
from pallas_kernels import grouped_gemm as gg

from moe_inputs import D, E, I, dense32 as _dense32, swiglu64 as _swiglu64
from backends import KERNELS, assert_model_close

EMPTY = (4, 9)  # experts no token picks
T = gg.Tile


def _weights(rng, kind):
    """kind: "bf16", "f32", "int4" (symmetric), "int4a" or "int8a" (asymmetric: zero points)."""
    w13 = rng.standard_normal((E, D, 2 * I)) * 0.06
    w2 = rng.standard_normal((E, I, D)) * 0.09
    if kind == "f32":
        return jnp.asarray(w13, jnp.float32), jnp.asarray(w2, jnp.float32)
    w13, w2 = jnp.asarray(w13, jnp.bfloat16), jnp.asarray(w2, jnp.bfloat16)
    if kind == "bf16":
        return w13, w2
    bits = 4 if kind == "int4" else 8
    q = experts.quantize_experts(w13, w2, bits=bits, group_size=128, symmetric=not kind.endswith("a"), block_n=64)
    return q.w13, q.w2


def _routing(rng, m, k):
    """Ragged: expert 0 in every token (one expert with many rows, several blocks), experts
    EMPTY never, the others skewed (a few popular ones)."""
    others = np.array([e for e in range(1, E) if e not in EMPTY])
    p = np.where(others < 4, 6.0, 1.0)
    p /= p.sum()
    ids = np.stack([np.r_[0, rng.choice(others, k - 1, replace=False, p=p)] for _ in range(m)])
    ids = np.stack([rng.permutation(row) for row in ids])  # expert 0 in any slot
    w = rng.random((m, k)).astype(np.float32) + 0.1
    return jnp.asarray(ids, jnp.int32), jnp.asarray(w)


def _half_routing(rng, m, k, bm):
    """Ragged around BM/2 (the half path's switch): expert 0 in every token (the most rows, several
    blocks), experts EMPTY never, the others blocks of 1, BM/2, BM/2 + 1 and BM valid rows (as
    their only or their second block); the last four share the rest. Distinct experts per token."""
    half = bm // 2
    counts = np.zeros(E, int)
    counts[[0, 1, 2, 3, 5, 6, 7]] = m, half, half + 1, bm + half, bm + half + 1, 1, bm
    rest = m * k - counts.sum()
    counts[[8, 10, 11, 12]] = rest // 4 + (np.arange(4) < rest % 4)
    assert rest >= 0 and counts.max() <= m
    # Expert-major runs of at most M pairs, laid out slot-major: each run wraps at most once, so
    # it covers distinct tokens.
    ids = np.repeat(np.arange(E), counts).reshape(k, m).T
    ids = np.stack([rng.permutation(row) for row in ids[rng.permutation(m)]])
    w = rng.random((m, k)).astype(np.float32) + 0.1
    return jnp.asarray(ids, jnp.int32), jnp.asarray(w)


def _exact64(x, ids, w, w13, w2, limit):
    """(exact y, S = sum_k |w| (|h| @ |W2|)) in float64, per expert."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    a, b = np.asarray(_dense32(w13), np.float64), np.asarray(_dense32(w2), np.float64)
    ids, w = np.asarray(ids), np.asarray(w, np.float64)
    y, s = np.zeros((x.shape[0], D)), np.zeros((x.shape[0], D))
    for e in range(E):
        tok, slot = np.nonzero(ids == e)
        if tok.size:
            hh = x64[tok] @ a[e]
            h = _swiglu64(hh[:, 0::2], hh[:, 1::2], limit)
            np.add.at(y, tok, w[tok, slot, None] * (h @ b[e]))
            np.add.at(s, tok, w[tok, slot, None] * (np.abs(h) @ np.abs(b[e])))
    return y, s


def _assert_close(y, want, s, rel, name):
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    assert y.shape == want.shape and np.isfinite(y).all(), name
    bound = rel * np.abs(want) + 2 * rel * s
    assert np.all(np.abs(y - want) <= bound), (name, float(np.max(np.abs(y - want) / bound)))


# (M, k, weights, limit, plan)
CASES = [
    (40, 8, "bf16", None, gg.Plan(16, T(64, 64, 4, 2), T(128, 64, 4, 2))),  # 320 pairs, block 16
    (100, 1, "bf16", 0.5, gg.Plan(32, T(64, 128, 4, 2), T(64, 128, 4, 2), swap=True)),  # k = 1
    (33, 3, "f32", 1.0, gg.Plan(64, T(128, 64, 4, 2), T(64, 256, 4, 2), combine="atomic")),
    (57, 5, "int4", None, gg.Plan(16, T(0, 0, 4, 2), T(0, 0, 4, 2))),
    (57, 5, "int4", None, gg.Plan(16, T(0, 0, 4, 2), T(0, 0, 4, 2), unpack="f32")),  # the float32 unpack
    (23, 4, "int4a", 3.0, gg.Plan(16, T(0, 0, 4, 2), T(0, 0, 4, 2))),  # bf16 pairs with zero points
    (29, 6, "int4", 2.0, gg.Plan(64, T(0, 0, 4, 2), T(0, 0, 4, 2), swap=True, combine="atomic")),
    (21, 4, "int8a", None, gg.Plan(128, T(0, 0, 8, 2), T(0, 0, 8, 2), swap=True)),  # zero points
    (70, 2, "bf16", 7.0, None),  # plan_for's choice
    (45, 8, "bf16", None, gg.Plan(32, T(64, 64, 4, 2), T(64, 128, 4, 2), combine="sum16")),  # bf16 pair rows
    (26, 4, "int4", 1.0, gg.Plan(16, T(0, 0, 4, 2), T(0, 0, 4, 2), swap=True, combine="sum16")),
    # half blocks, on _half_routing
    (60, 4, "bf16", None, gg.Plan(32, T(64, 64, 4, 2), T(64, 128, 4, 2), combine="sum16", half=True)),
    (110, 4, "bf16", 0.5, gg.Plan(64, T(64, 128, 4, 2), T(128, 64, 4, 2), swap=True, combine="atomic", half=True)),
    (200, 5, "bf16", None, gg.Plan(128, T(64, 128, 8, 2), T(64, 128, 8, 2), half=True)),
    (110, 4, "int4", 2.0, gg.Plan(64, T(0, 0, 4, 2), T(0, 0, 4, 2), swap=True, half=True)),
    (200, 5, "int8a", None, gg.Plan(128, T(0, 0, 8, 2), T(0, 0, 8, 2), combine="atomic", half=True)),
    (60, 4, "int4", None, gg.Plan(32, T(0, 0, 4, 2), T(0, 0, 4, 2), swap=True, combine="sum16", half=True)),
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,k,kind,limit,plan", CASES)
def test_grouped_moe_matches_experts_reference(backend, m, k, kind, limit, plan):
    rng = np.random.default_rng([m, k, len(kind)])
    w13, w2 = _weights(rng, kind)
    act = jnp.float32 if kind == "f32" else jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((m, D)), act)
    ids, w = _half_routing(rng, m, k, plan.block_m) if plan and plan.half else _routing(rng, m, k)
    assert m * k > GATHER_MAX_PAIRS  # the sizes the MoE block sends here
    y, h, out = gg._run(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, plan=plan, poison=True)
    assert y.dtype == x.dtype

    # Every pair written once, padding nowhere; h: the pairs' rows only (padding slots and unused
    # blocks stay NaN; y stays finite and close).
    plan = plan or gg.plan_for(m * k, E, kind.startswith("int"))
    p = m * k
    out = np.asarray(out.astype(jnp.float32))
    if plan.combine != "atomic":  # pair rows
        assert np.isfinite(out[:p]).all() and np.isnan(out[p]).all()
    sorted_pairs, block_expert = (np.asarray(a) for a in moe_align.moe_align(ids, E, plan.block_m, backend="reference"))
    used = int(np.sum(block_expert >= 0))
    bm = plan.block_m
    h = np.asarray(h.astype(jnp.float32)).reshape(-1, bm, I)
    pad = sorted_pairs[: h.shape[0] * bm].reshape(-1, bm)[:used] == p  # [used, BM]
    if plan.half:
        small = pad[:, bm // 2]  # the blocks run at BM/2 rows
        assert small.any() and not small.all()  # both sizes ran
    hu = h[:used]
    assert pad.any() and np.isfinite(hu[~pad]).all() and np.isnan(hu[pad]).all()
    assert np.isnan(h[used:]).all()
    assert not set(EMPTY) & set(block_expert[:used].tolist())

    # Against the block's own reference (dense, fp32 for quantised weights: the kernel's exact
    # dequantisation) and against float64 experts; the bound covers h's and y's roundings.
    exact, s = _exact64(x, ids, w, w13, w2, limit)
    if kind == "f32":
        ref = experts_reference(x, ids, w, w13, w2, swiglu_limit=limit)
        _assert_close(y, ref, s, 1e-5, "vs experts_reference")
        _assert_close(y, exact, s, 1e-5, "vs float64")
        return
    if kind == "bf16":
        ref = experts_reference(x, ids, w, w13, w2, swiglu_limit=limit)  # h and y rounded to bf16 too
    else:
        ref = experts_reference(x.astype(jnp.float32), ids, w, _dense32(w13), _dense32(w2), swiglu_limit=limit)
    _assert_close(y, ref, s, 2.0**-7, "vs experts_reference")
    _assert_close(y, exact, s, 2.0**-8, "vs float64")


def test_public_entry_reference_and_errors():
    rng = np.random.default_rng(11)
    w13, w2 = _weights(rng, "bf16")
    x = jnp.asarray(rng.standard_normal((12, D)), jnp.float32)  # y keeps x's dtype
    ids, w = _routing(rng, 12, 8)
    y = gg.grouped_moe(x, ids, w, w13, w2, swiglu_limit=1.5, backend="interpret")
    r = gg.grouped_moe(x, ids, w, w13, w2, swiglu_limit=1.5, backend="reference")
    assert y.dtype == r.dtype == jnp.float32
    exact, s = _exact64(x.astype(jnp.bfloat16), ids, w, w13, w2, 1.5)
    _assert_close(r, exact, s, 2.0**-8, "reference vs float64")
    _assert_close(y, exact, s, 2.0**-8, "kernel vs float64")
    with pytest.raises(ValueError, match="x must be"):
        gg.grouped_moe(x[:, :100], ids, w, w13, w2, backend="interpret")
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        gg.grouped_moe(x, ids, w[:, :1], w13, w2, backend="interpret")
    with pytest.raises(ValueError, match="block_m"):
        gg.grouped_moe(x, ids, w, w13, w2, backend="interpret", plan=gg.Plan(48))
    with pytest.raises(ValueError, match="half"):
        gg.grouped_moe(x, ids, w, w13, w2, backend="interpret", plan=gg.Plan(16, half=True))
    with pytest.raises(ValueError, match="block_n"):
        gg.grouped_moe(x, ids, w, w13, w2, backend="interpret", plan=gg.Plan(16, T(64, 96)))


# ------------------------------------------------------------------------------ dense entry
DENSE_CASES = [  # (M, N, bits, symmetric, plan): ragged M and N (N not a multiple of B_N)
    (37, 200, 4, True, None),  # two row blocks of 32 rows (the last ragged), two column tiles
    (5, 128, 4, False, None),  # zero points; one block of 16, mostly padding
    (130, 72, 8, True, None),  # int8; two blocks of 128, the second two rows
    (24, 256, 4, True, gg.Plan(16, T(0, 0, 4, 2), T(0, 0, 4, 2), swap=True)),
    (40, 128, 4, True, gg.Plan(32, T(0, 0, 4, 2), T(0, 0, 4, 2), half=True, unpack="f32")),
    (70, 300, 4, False, gg.Plan(128, T(0, 32, 4, 2), T(0, 32, 4, 2), swap=True)),  # sub-tiles of 32 columns
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,n,bits,symmetric,plan", DENSE_CASES)
def test_dense_matches_the_dequantised_product(backend, m, n, bits, symmetric, plan):
    """y = x @ W̃ᵀ of the dequantised weight, rounded once to bf16: every row and column written
    (a miss would be whatever the output buffer held), within a bf16 rounding of float64."""
    from pallas_kernels.quant import dequantize, quantize

    rng = np.random.default_rng(m * n + bits)
    w = quantize(jnp.asarray(rng.standard_normal((n, 2 * D)), jnp.float32), bits=bits, group_size=128,
                 symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((m, 2 * D)), jnp.bfloat16)
    y = gg.dense(x, w, plan=plan, backend=backend)
    exact = np.asarray(x, np.float64) @ np.asarray(dequantize(w), np.float64).T
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    _assert_close(y, exact, np.abs(exact).max(), 2.0**-8, "dense vs float64")
    r = gg.dense(x, w, backend="reference")
    _assert_close(r, exact, np.abs(exact).max(), 2.0**-8, "reference vs float64")


def test_dense_refuses_what_it_cannot_run():
    from pallas_kernels.quant import quantize

    w = jnp.ones((64, 256), jnp.float32)
    x = jnp.ones((20, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="groups of 32"):
        gg.dense(x, quantize(w, bits=4, group_size=32), backend="interpret")
    with pytest.raises(ValueError, match="layout 'rows'"):
        gg.dense(x, quantize(w, bits=4, group_size=128, layout="rows"), backend="interpret")
    with pytest.raises(ValueError, match="x has 128 columns"):
        gg.dense(x[:, :128], quantize(w, bits=4, group_size=128), backend="interpret")
    with pytest.raises(ValueError, match="block_n must be 0"):
        gg.dense(x, quantize(w, bits=4, group_size=128), plan=gg.Plan(32, T(0, 48), T(0, 48)), backend="interpret")
    assert gg.dense_plan(16).block_m == 16 and gg.dense_plan(17).block_m == gg.dense_plan(96).block_m == 32


# ------------------------------------------------------------------------------------- wiring
def _count_calls(monkeypatch):
    import moe.block

    calls = []
    real = moe.block.grouped_moe

    def counted(*a, **kw):
        calls.append(a[1].shape)
        return real(*a, **kw)

    monkeypatch.setattr(moe.block, "grouped_moe", counted)
    return calls


@pytest.mark.parametrize("backend", KERNELS)
def test_model_prefill_through_the_kernel(backend, monkeypatch):
    """ling-tiny (fp32) prefill of 2 x 24 tokens (96 pairs per MoE layer) through the grouped GEMM
    equals the reference path."""
    import ling
    from ling.state import init_state

    model = ling.load("ling-tiny", dtype="float32", seed=5)
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, model.cfg.vocab_size, (2, 24)))
    assert prompt.size * model.cfg.num_experts_per_tok > GATHER_MAX_PAIRS

    def prefill(kernels):
        ling.use_kernels(model, kernels)
        state = init_state(model.cfg, 2, 32, jnp.float32)
        logits, _, _ = model(prompt, state, valid=jnp.asarray([24, 17]), form="prefill")
        return np.asarray(logits)

    want = prefill("reference")
    calls = _count_calls(monkeypatch)
    got = prefill(backend)
    assert len(calls) == sum(t == "moe" for t in model.cfg.mlp_types) and calls[0] == (48, 2)
    assert_model_close(got, want, backend, "logits")


@pytest.mark.parametrize("m,k,plan", [(40, 4, gg.Plan(16, T(64, 64, 4, 2), T(64, 64, 4, 2))),
                                      (30, 3, gg.Plan(32, T(64, 64, 4, 2), T(64, 64, 4, 2), combine="atomic"))])
@pytest.mark.parametrize("backend", KERNELS)
def test_skipped_pairs_add_nothing(backend, m, k, plan):
    """A pair whose id is E (expert parallelism: another rank's pair) is in no block and adds
    nothing, in the kernel (both combines, output poisoned), its reference, both align paths and
    moe.block.routed_experts on either side of GATHER_MAX_PAIRS; the same as those pairs' weights
    set to 0 with any real expert."""
    from moe.block import routed_experts

    rng = np.random.default_rng([m, k, 7])
    w13, w2 = _weights(rng, "bf16")
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _routing(rng, m, k)
    skip = jnp.asarray(rng.random((m, k)) < 0.4)
    ids_skip = jnp.where(skip, E, ids)
    want = experts_reference(x, ids, jnp.where(skip, 0.0, w), w13, w2)
    y = gg._run(x, ids_skip, w, w13, w2, swiglu_limit=None, backend=backend, plan=plan, poison=True)[0]
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2)
    ref = experts_reference(x, ids_skip, w, w13, w2)
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2)
    flat = np.asarray(ids_skip).reshape(-1)
    for align in (backend, "reference"):  # the align kernel (<= 64 pairs) and the argsort path
        for n in (8, flat.size):
            sp, be = (np.asarray(a) for a in moe_align.moe_align(jnp.asarray(flat[:n]), E, 16, backend=align))
            placed = sp[sp < n]
            assert sorted(placed.tolist()) == [p for p in range(n) if flat[p] < E], (align, n)
    for mm in (m, 5):  # grouped GEMM beyond GATHER_MAX_PAIRS, fused kernel (borrowing) below
        got = routed_experts(x[:mm], ids_skip[:mm], w[:mm], w13, w2, backend=backend, skips=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want[:mm], np.float32),
                                   rtol=3e-2, atol=3e-2)
        got = routed_experts(x[:mm], ids_skip[:mm], w[:mm], w13, w2, backend="reference", skips=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want[:mm], np.float32),
                                   rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("combine", ["sum16", "atomic"])
def test_any_order_within_an_expert_gives_the_same_y(backend, combine):
    """On the GPU the blocked align orders an expert's pairs by when their blocks of pairs ran;
    the GEMMs must not care. Each expert's pairs shuffled among its valid slots (padding stays
    last, so the half flag is unchanged): the same h rows per pair and the same y, bit for bit."""
    rng = np.random.default_rng(21)
    m, k = 60, 4
    plan = gg.Plan(32, T(64, 64, 4, 2), T(64, 128, 4, 2), combine=combine, half=True)
    w13, w2 = _weights(rng, "bf16")
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _half_routing(rng, m, k, plan.block_m)
    p, nb = m * k, moe_align.align_sizes(m * k, E, plan.block_m).nb
    sp, be = moe_align.moe_align(ids.reshape(-1), E, plan.block_m, backend=backend)
    sp_np, be_np = np.asarray(sp).copy(), np.asarray(be)
    used = int(np.sum(be_np >= 0))
    rows = sp_np[: used * plan.block_m].reshape(used, plan.block_m)
    for e in np.unique(be_np[:used]):
        run = rows[be_np[:used] == e].reshape(-1)  # a copy: the expert's slots, pairs first
        n = int(np.sum(run < p))
        run[:n] = rng.permutation(run[:n])
        rows[be_np[:used] == e] = run.reshape(-1, plan.block_m)
    shuffled = sp_np.copy()
    shuffled[: used * plan.block_m] = rows.reshape(-1)
    assert not np.array_equal(shuffled, np.asarray(sp))

    def run_gemms(sorted_pairs):
        h = gg.gate_up(x, sorted_pairs, be, w13, k=k, n_blocks=nb, plan=plan, backend=backend)
        out = gg.down(h, sorted_pairs, be, w, w2, n_blocks=nb, plan=plan, backend=backend)
        slot_of = np.full(p, -1)
        live = np.asarray(sorted_pairs)[: nb * plan.block_m]
        slot_of[live[live < p]] = np.flatnonzero(live < p)
        h_pairs = np.asarray(h.astype(jnp.float32))[slot_of]  # [P, I] by pair
        y = out[:m] if combine == "atomic" else jnp.sum(out[:p].astype(jnp.float32).reshape(m, k, D), axis=1)
        return h_pairs, np.asarray(y)

    h0, y0 = run_gemms(sp)
    h1, y1 = run_gemms(jnp.asarray(shuffled))
    np.testing.assert_array_equal(h1, h0)
    if combine == "atomic":  # fp32 atomics: the adds' order follows the slots (the last bits may differ)
        np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(y1, y0)

"""The fused MoE kernels (interpret mode) against float64 experts, and the align's contract.

Small shapes (D 256, I 128, E 13: not a power of two) keep Pallas' interpreter fast; every case
draws fresh random inputs and starts the kernels' outputs as NaN, so a row left unwritten shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import experts, moe_align
from pallas_kernels import fused_moe as fm
from pallas_kernels.quant import quantize

from backends import KERNELS
from moe_inputs import (D, E, I,
                        dense64 as _dense64,
                        expert_weights as _weights,
                        routing as _routing,
                        swiglu64 as _swiglu64,
                        )

DOT = None  # plan_for's choice: block 16 ("dot"), block 64 beyond 512 pairs
FMA = fm.Plan("fma", 1, fm.GemmPlan(64, 64, 1, 2), fm.GemmPlan(32, 128, 2, 2))
DOT32 = fm.Plan("dot", 16, fm.GemmPlan(64, 32, 4, 2), fm.GemmPlan(128, 64, 4, 2))
QDOT = fm.Plan("dot", 16, fm.GemmPlan(0, 0, 4, 2), fm.GemmPlan(0, 0, 4, 2))  # quantised: the dot path


def _check(y, x, ids, w, w13, w2, limit, shared=None):
    """|y - exact| <= 2^-8 |exact| + 2^-7 S: y's bf16 rounding, and h's (one bf16 ulp of each
    h element may differ with the fp32 summation order), S = sum_k |w| (|h| @ |W2|).
    shared: an `experts.SharedExpert`, one more pair a token (weight 1, its own limit)."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    a, b = _dense64(w13), _dense64(w2)
    ids, w = np.asarray(ids), np.asarray(w, np.float64)
    pairs = [(a, b, ids, w, limit)]
    if shared is not None:
        ones = np.ones((x.shape[0], 1))
        pairs.append((_dense64(shared.w13), _dense64(shared.w2), 0 * ones.astype(int), ones, shared.swiglu_limit))
    exact = np.zeros((x.shape[0], D))
    s = np.zeros_like(exact)
    for a, b, ids, w, limit in pairs:
        for m in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                hh = x64[m] @ a[ids[m, j]]
                h = _swiglu64(hh[0::2], hh[1::2], limit)
                exact[m] += w[m, j] * (h @ b[ids[m, j]])
                s[m] += w[m, j] * (np.abs(h) @ np.abs(b[ids[m, j]]))
    y = np.asarray(y.astype(jnp.float32), np.float64)
    assert y.shape == exact.shape and np.isfinite(y).all()
    err = np.abs(y - exact)
    bound = 2.0**-8 * np.abs(exact) + 2.0**-7 * s
    assert np.all(err <= bound), float(np.max(err / bound))


# (M, k, weights bits or None for bf16, routing, limit, plan)
CASES = [
    (1, 8, None, "random", None, DOT),  # direct: no align launch
    (1, 2, 4, "random", 0.5, FMA),
    (1, 1, 4, "random", None, QDOT),
    (3, 4, None, "skewed", 0.5, DOT32),
    (6, 8, 4, "skewed", None, QDOT),  # 48 pairs: the align kernel
    (6, 8, None, "random", 2.0, FMA),
    (16, 4, 4, "skewed", 1.0, DOT),  # 64 pairs: the align kernel's limit
    (16, 1, None, "one", None, DOT),  # every token on one expert: one full block
    (16, 3, 8, "random", None, QDOT),  # int8, asymmetric (zero points) on both paths
    (2, 3, 8, "skewed", 1.0, FMA),
    (64, 8, None, "skewed", 1.0, DOT),  # 512 pairs: argsort align, block 16
    (64, 2, 4, "one", None, FMA),
    (24, 8, 4, "random", 2.0, DOT),  # 192 pairs, quantised: plan_for's dot path, argsort align
    (80, 8, None, "random", None, DOT),  # 640 pairs: the grouped path, block 64
    (72, 8, 4, "skewed", None, DOT),
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,k,bits,kind,limit,plan", CASES)
def test_fused_moe_matches_float64_experts(backend, m, k, bits, kind, limit, plan):
    rng = np.random.default_rng([m, k, bits or 16])
    w13, w2 = _weights(rng, bits, symmetric=bits != 8)
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _routing(rng, m, k, kind)
    y, h, out = fm._run(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, plan=plan,
                        poison=True)
    assert y.dtype == jnp.bfloat16
    out = np.asarray(out)  # [S, P + 1, D]
    assert np.isfinite(out[:, : m * k]).all() and np.isnan(out[:, m * k]).all()  # each pair, no padding
    _check(y, x, ids, w, w13, w2, limit)


# Quantised GEMMs with K split among programs (fp32 partials): group 64 gives the up GEMM 4 groups
# and the down GEMM 2 (D 256, I 128). (M, k, bits, routing, limit, plan)
SPLIT_CASES = [
    (1, 8, 4, "random", 0.5, None),  # plan_for's M = 1 plan: 2 groups an up program, 1 a down program
    (1, 8, 4, "random", None, fm.Plan("fma", 1, fm.GemmPlan(0, 0, 2, 1, split=4), fm.GemmPlan(0, 0, 2, 1, split=2))),
    (6, 8, 4, "skewed", 0.5, fm.Plan("fma", 1, fm.GemmPlan(0, 0, 2, 1, split=2), fm.GemmPlan(0, 0, 2, 1))),
    (3, 4, 8, "random", 1.0, fm.Plan("fma", 1, fm.GemmPlan(0, 0, 2, 1), fm.GemmPlan(0, 0, 2, 1, split=2))),
    (5, 8, 8, "one", None, fm.Plan("dot", 16, fm.GemmPlan(0, 0, 4, 2, split=2), fm.GemmPlan(0, 0, 4, 2, split=2))),
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,k,bits,kind,limit,plan", SPLIT_CASES)
def test_split_k_partials_match_float64_experts(backend, m, k, bits, kind, limit, plan):
    rng = np.random.default_rng([m, k, bits, 64])
    w13, w2 = _weights(rng, bits, symmetric=bits != 8, group_size=64)
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _routing(rng, m, k, kind)
    if plan is None:  # 4 up groups in 2 programs, 2 down groups in 2
        plan = fm.plan_for(m, k, True, experts.k_groups(w13, w2))
        assert (plan.up.split, plan.down.split) == (2, 2)
    y, h, out = fm._run(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, plan=plan, poison=True)
    out = np.asarray(out)
    assert out.shape[0] == plan.down.split and np.isfinite(out[:, : m * k]).all()
    if plan.up.split > 1 and plan.path == "fma":  # every pair's row of every partial written
        assert h.shape[0] == plan.up.split and np.isfinite(np.asarray(h)[:, : m * k]).all()
    _check(y, x, ids, w, w13, w2, limit)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,k", [(1, 1), (5, 1), (1, 2)])
def test_bf16_split_k_on_small_grids(backend, m, k):
    """One expert (the dense MLP, the shared expert) or few pairs: the default bf16 plan splits K
    so that the grid fills the GPU (`_fill`); fp32 partials, summed before SwiGLU and combine."""
    rng = np.random.default_rng([m, k, 16])
    w13, w2 = _weights(rng, None)
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _routing(rng, m, k, "random")
    y, h, out = fm._run(x, ids, w, w13, w2, swiglu_limit=None, backend=backend, plan=None, poison=True)
    assert out.shape[0] > 1 and h.ndim == 3 and h.shape[0] > 1  # both GEMMs were split
    assert np.isfinite(np.asarray(out)[:, : m * k]).all()
    _check(y, x, ids, w, w13, w2, None)


# The shared expert in the routed experts' launches (pair k of each token, expert id E).
# (M, k, weights bits or None, routing, routed limit, shared limit, plan)
SHARED_CASES = [
    (1, 8, 4, "random", None, 0.5, None),  # M = 1: direct, K split, per-row limits after the partials' sum
    (1, 3, None, "random", 0.5, None, None),  # bf16 direct: `_fill` splits both GEMMs
    (3, 4, 4, "skewed", 1.0, 0.5, None),  # the align over E + 1 experts, fma, limits in the epilogue
    (6, 8, None, "random", None, None, DOT32),  # 54 pairs, block 16
    (5, 3, 8, "one", 2.0, 1.0, QDOT),  # int8 asymmetric, the dot path
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,k,bits,kind,limit,shared_limit,plan", SHARED_CASES)
def test_shared_expert_in_the_routed_launches(backend, m, k, bits, kind, limit, shared_limit, plan):
    rng = np.random.default_rng([m, k, bits or 16, 7])
    group = 64 if bits else 128
    w13, w2 = _weights(rng, bits, symmetric=bits != 8, group_size=group)
    one = lambda w: jax.tree.map(lambda a: a[:1], w)  # noqa: E731  (expert 0 of another draw)
    shared = experts.SharedExpert(*map(one, _weights(rng, bits, symmetric=bits != 8, group_size=group)), shared_limit)
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _routing(rng, m, k, kind)
    y, h, out = fm._run(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, plan=plan, poison=True,
                        shared=shared)
    out = np.asarray(out)  # [S, M (k + 1) + 1, D]
    assert out.shape[1] == m * (k + 1) + 1 and np.isfinite(out[:, : m * (k + 1)]).all()
    _check(y, x, ids, w, w13, w2, limit, shared)
    # The public entry, and the reference with the shared expert, give the same sums.
    want = experts.reference(x, ids, w, w13, w2, swiglu_limit=limit, shared=shared)
    got = fm.fused_moe(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, plan=plan, shared=shared)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    _check(want, x, ids, w, w13, w2, limit, shared)


def test_shared_expert_must_match_the_routed_format():
    rng = np.random.default_rng(8)
    w13, w2 = _weights(rng, 4)
    b13, b2 = _weights(rng, None)
    x = jnp.zeros((1, D), jnp.bfloat16)
    ids, w = _routing(rng, 1, 2, "random")
    for shared in (experts.SharedExpert(b13[:1], b2[:1]), experts.SharedExpert(w13, w2)):  # bf16; 13 experts
        with pytest.raises(ValueError, match="shared: one expert"):
            fm.fused_moe(x, ids, w, w13, w2, backend="interpret", shared=shared)


def test_split_must_divide_k():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    ids, w = _routing(rng, 1, 2, "random")
    dense = _weights(rng, None)  # D 256: 4 steps of 64
    plan = fm.Plan("dot", 16, fm.GemmPlan(64, 64, 4, 2, split=3), fm.GemmPlan(64, 64, 4, 2))
    with pytest.raises(ValueError, match="split=3"):
        fm.fused_moe(x, ids, w, *dense, plan=plan, backend="interpret")
    quant = _weights(rng, 4)  # group 128: the up GEMM has 2 groups of K
    plan = fm.Plan("fma", 1, fm.GemmPlan(0, 0, 2, 1, split=3), fm.GemmPlan(0, 0, 2, 1))
    with pytest.raises(ValueError, match="split=3"):
        fm.fused_moe(x, ids, w, *quant, plan=plan, backend="interpret")


@pytest.mark.parametrize("backend", KERNELS)
def test_public_entry_and_reference_agree(backend):
    rng = np.random.default_rng(7)
    w13, w2 = _weights(rng, None)
    x = jnp.asarray(rng.standard_normal((5, D)), jnp.float32)  # y keeps x's dtype
    ids, w = _routing(rng, 5, 6, "skewed")
    y = fm.fused_moe(x, ids, w, w13, w2, swiglu_limit=1.5, backend=backend)
    r = fm.fused_moe(x, ids, w, w13, w2, swiglu_limit=1.5, backend="reference")
    assert y.dtype == r.dtype == jnp.float32
    _check(r, x.astype(jnp.bfloat16), ids, w, w13, w2, 1.5)
    _check(y, x.astype(jnp.bfloat16), ids, w, w13, w2, 1.5)


# ------------------------------------------------------------------------------------- align
def _check_align(sorted_pairs, block_expert, ids, bm):
    """Pairs grouped by expert in ascending order, stable, each run padded to bm with P; pairs
    with id >= E (skipped) in no block."""
    ids = np.asarray(ids).reshape(-1)
    p = ids.size
    sp, be = np.asarray(sorted_pairs), np.asarray(block_expert)
    s = moe_align.align_sizes(p, E, bm)
    assert sp.shape == (s.n_slots,) and be.shape == (s.nbp,)
    counts = np.bincount(ids[ids < E], minlength=E)
    used = int(np.sum(-(-counts // bm)))
    assert used <= s.nb
    assert np.all(be[:used] >= 0) and np.all(be[used:] == -1)
    assert np.all(np.diff(be[:used]) >= 0)  # experts ascending
    assert np.all(sp[used * bm:] == p)  # nothing past the used blocks
    got = sp[: used * bm].reshape(used, bm)
    for e in range(E):  # expert e's run: its pairs in pair order, then padding
        rows = got[be[:used] == e].reshape(-1)
        want = np.flatnonzero(ids == e)
        np.testing.assert_array_equal(rows[: want.size], want)
        assert np.all(rows[want.size:] == p) and rows.size == -(-want.size // bm) * bm


@pytest.mark.parametrize("m,k,bm,kind", [(1, 8, 16, "random"), (3, 5, 16, "skewed"),
                                         (6, 8, 16, "skewed"), (16, 4, 16, "random"),
                                         (8, 8, 1, "skewed"), (64, 1, 16, "one"), (7, 3, 4, "random")])
@pytest.mark.parametrize("backend", KERNELS)
def test_align_kernel(backend, m, k, bm, kind):
    ids, _ = _routing(np.random.default_rng([m, k, bm]), m, k, kind)
    got = moe_align.moe_align(ids, E, bm, backend=backend)
    _check_align(*got, ids, bm)
    want = moe_align.moe_align(ids, E, bm, backend="reference")  # the argsort path
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("m,k,bm,kind", [(9, 8, 16, "skewed"), (64, 8, 16, "skewed"), (100, 6, 64, "skewed"),
                                         (1100, 8, 16, "random"), (1100, 8, 64, "one"),
                                         (20, 4, 256, "random")])  # S not a multiple of BM
def test_align_beyond_the_kernel(m, k, bm, kind):
    """The blocked align (rank + place launches over blocks of 64 pairs): the layout, and equal to
    the argsort path (interpret mode runs the blocks in order), with skipped pairs (id E) among
    them."""
    ids, _ = _routing(np.random.default_rng([m, k]), m, k, kind)
    ids = ids.at[m // 2, 0].set(E)
    assert m * k > moe_align.MAX_ALIGN_PAIRS
    got = moe_align.moe_align(ids, E, bm, backend="interpret")
    _check_align(*got, ids, bm)
    want = moe_align.moe_align(ids, E, bm, backend="reference")  # the argsort path
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_blocked_align_with_a_power_of_two_of_experts():
    """E = 16 = E_pow: the rank launch's spare counter is the extra entry past the experts'."""
    e = 16
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(e, 6, replace=False, p=np.r_[[5.0] * 4, [1.0] * 12] / 32) for _ in range(50)])
    ids[7, 2] = e  # a skipped pair
    ids = jnp.asarray(ids, jnp.int32)
    for bm in (16, 64):
        got = moe_align.moe_align(ids, e, bm, backend="interpret")
        want = moe_align.moe_align(ids, e, bm, backend="reference")
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------- format
def test_quantize_experts_stacks_per_expert_quantisation():
    rng = np.random.default_rng(3)
    w13, w2 = _weights(rng, None)
    q = experts.quantize_experts(w13, w2, bits=4, group_size=128, block_n=64)
    assert q.w13.words.shape == (E, 2 * I // 64, D * 4 // 32, 64) and q.w13.shape == (2 * I, D)
    assert q.w2.scales.shape == (E, D // 64, I // 128, 64) and q.w2.shape == (D, I)
    for e in (0, E - 1):
        one = quantize(w13[e].T, bits=4, group_size=128, block_n=64)
        np.testing.assert_array_equal(np.asarray(q.w13.words[e]), np.asarray(one.words))
        np.testing.assert_array_equal(np.asarray(q.w13.scales[e]), np.asarray(one.scales))


def test_errors_name_the_argument():
    rng = np.random.default_rng(4)
    w13, w2 = _weights(rng, None)
    x = jnp.zeros((2, D), jnp.bfloat16)
    ids, w = _routing(rng, 2, 2, "random")
    with pytest.raises(ValueError, match="x must be"):
        fm.fused_moe(x[:, :100], ids, w, w13, w2, backend="interpret")
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fm.fused_moe(x, ids, w[:, :1], w13, w2, backend="interpret")
    with pytest.raises(ValueError, match="disagree"):
        fm.fused_moe(x, ids, w, w13, w2[:, :64], backend="interpret")
    with pytest.raises(ValueError, match="block_n"):
        experts.quantize_experts(w13, w2, block_n=96)


# ------------------------------------------------------------------------------------- wiring
@pytest.mark.parametrize("backend", KERNELS)
def test_moe_block_uses_the_kernel(backend):
    """The MoE block's kernel path (decode / verify sizes) equals its plain-jnp path."""
    from flax import nnx

    from ling.model import use_kernels
    from moe.block import MoE

    moe = MoE(D, num_experts=E, top_k=4, inter=I, num_shared=1, n_group=1, topk_group=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=None,
              shared_swiglu_limit=None, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels="reference")
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, D)), jnp.bfloat16)
    want = np.asarray(moe(x).astype(jnp.float32))
    got = np.asarray(use_kernels(moe, backend)(x).astype(jnp.float32))
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)  # bf16 roundings differ


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("k,bits,limit,shared_limit", [(8, 4, None, 0.5), (3, 8, 0.5, None), (2, 4, 0.5, 1.0)])
def test_one_token_sums_by_tickets_in_the_launches(backend, k, bits, limit, shared_limit):
    """Inside a tickets scope a token's MoE is two launches: the up GEMM's split shares summed and
    SwiGLU'd by tickets, the down GEMM's shares and the combine likewise; y agrees with float64
    experts and with the two-fusion path, and the counters are zero after."""
    from pallas_kernels import tickets

    rng = np.random.default_rng([k, bits, 11])
    w13, w2 = _weights(rng, bits, symmetric=bits != 8, group_size=64)
    one = lambda w: jax.tree.map(lambda a: a[:1], w)  # noqa: E731
    shared = experts.SharedExpert(*map(one, _weights(rng, bits, symmetric=bits != 8, group_size=64)), shared_limit)
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    ids, w = _routing(rng, 1, k, "random")
    plan = fm.plan_for(1, k + 1, True, experts.k_groups(w13, w2))
    assert plan.up.split > 1 and plan.down.split > 1  # both GEMMs' shares cross programs

    def call(x, counters):
        with tickets.scope(counters) as scope:
            y = fm.fused_moe(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, shared=shared)
        return y, scope.buffer

    y, counters = jax.jit(call)(x, tickets.zeros())
    _check(y, x, ids, w, w13, w2, limit, shared)
    plain = fm.fused_moe(x, ids, w, w13, w2, swiglu_limit=limit, backend=backend, shared=shared)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(plain, np.float32), rtol=2**-7, atol=1e-6)
    assert not np.asarray(counters).any()
    ops = [e.primitive.name for e in jax.make_jaxpr(call)(x, tickets.zeros()).jaxpr.eqns]
    assert ops.count("pallas_call") == 2 and "reduce_sum" not in ops and "add" not in ops

"""The tile-scheduled MoE kernel (interpret mode) against fused_moe's reference on the union of the
decode and prefill tokens, and its claim record.

Small shapes (D 256, I 128, E 13) keep the interpreter fast; h starts as NaN, so a row read before
it is written shows. Interpret mode runs the persistent programs one after another, so program 0
claims every tile: the trace checks the queue's order, and the spin-waits run (already satisfied).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import expert_tiles as et
from pallas_kernels import experts
from pallas_kernels import fused_moe as fm
from pallas_kernels.quant import QuantizedWeight

from moe_inputs import (D, E, dense64 as _dense64,
                        expert_weights as _weights,
                        routing as _routing,
                        swiglu64,
                        )

# 4 up and 2 down tiles a block; align tiles of 16 pairs (several a class)
BM16 = et.Plan(16, et.Tile(64, 64), et.Tile(64, 128), programs=3, align_pairs=16)
BM32 = et.Plan(32, et.Tile(128, 128), et.Tile(32, 64), programs=2, align_pairs=64)
BM32_HOT16 = et.Plan(32, et.Tile(64, 64), et.Tile(64, 128), programs=3, align_pairs=16, block_m_hot=16)


def _magnitude(x, ids, w, w13, w2, limit):
    """S [M, D] = sum_k |w| (|h| @ |W2|): the scale of the cancellation in each output element."""
    a, b = _dense64(w13), _dense64(w2)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ids, w = np.asarray(ids), np.abs(np.asarray(w, np.float64))
    hh = np.einsum("md,mkdn->mkn", x64, a[ids])
    h = swiglu64(hh[..., 0::2], hh[..., 1::2], limit)
    return np.einsum("mk,mki,mkid->md", w, np.abs(h), np.abs(b[ids]))


def _assert_close(y, ref, scale):
    """|y - ref| <= 2^-7 (|ref| + S): bf16 roundings of y and of h (an h element may round the
    other way when the fp32 sum order differs)."""
    y = np.asarray(y.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    assert y.shape == ref.shape and np.isfinite(y).all()
    bound = 2.0**-7 * (np.abs(ref) + scale)
    assert np.all(np.abs(y - ref) <= bound), float(np.max(np.abs(y - ref) / bound))


def _run(md, mp, k, bits, kind, limit, plan, symmetric=True, seed=0):
    rng = np.random.default_rng([md, mp, k, bits or 16, seed])
    w13, w2 = _weights(rng, bits, symmetric)
    m = md + mp
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    ids, w = _routing(rng, m, k, kind)
    run = et.run_tiles(x, ids, w, w13, w2, n_decode=md, swiglu_limit=limit, backend="interpret", plan=plan,
                  trace=True, poison=True)
    ref = experts.reference(x, ids, w, w13, w2, swiglu_limit=limit)
    _assert_close(run.y, ref, _magnitude(x, ids, w, w13, w2, limit))
    return run, (x, ids, w, w13, w2)


def _runs(ids, md, bm, bmh):
    """Each expert's hot blocks (holding its decode pairs, filled up with its prefill pairs when
    BM_h = BM) and cold blocks (its pairs past them), from the routing."""
    dec = np.bincount(np.asarray(ids[:md]).reshape(-1), minlength=E)
    n = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
    hot = -(-dec // bmh)
    return hot, -(-np.maximum(n - (dec if bmh < bm else hot * bmh), 0) // bm)


def _align_tiles(ids, md, pb):
    """Count tiles (and as many place tiles): pb pairs each, never mixing the classes."""
    pairs = np.asarray(ids).shape[1]
    return -(-md * pairs // pb) + -(-(len(ids) - md) * pairs // pb)


def _expected_tiles(ids, md, bm, bmh, pb, tu, td):
    """{(kind, j, n_tile)} the queue must hand out once each, from the routing: the align's tiles
    (kind 5: counts, the offsets tile, places), one zero tile (kind 4) per ZR rows of y32 (M + 1
    rows), and each block's up and down tiles (hot blocks first: kinds 0, 1; then cold: 2, 3)."""
    out = {(5, j, 0) for j in range(2 * _align_tiles(ids, md, pb) + 1 + (bmh < bm))}
    out |= {(4, z, 0) for z in range(-(-(len(ids) + 1) // et.ZERO_ROWS))}
    hot, cold = (int(v.sum()) for v in _runs(ids, md, bm, bmh))
    for kind, blocks in ((0, range(hot)), (2, range(hot, hot + cold))):
        for j in blocks:
            out |= {(kind, j, t) for t in range(tu)} | {(kind + 1, j, t) for t in range(td)}
    return out


def _n_tiles(w, block_n):
    """N-blocks of one GEMM: the quantised layout's tiles, else N / block_n."""
    return w.words.shape[1] if isinstance(w, QuantizedWeight) else w.shape[2] // block_n


def _check_trace(run, ids, md, plan, w13, w2):
    tu, td = _n_tiles(w13, plan.up.block_n), _n_tiles(w2, plan.down.block_n)
    bm, bmh = plan.block_m, plan.block_m_hot or plan.block_m
    split = bmh < bm  # the align in two phases: phase 0 the decode pairs, phase 1 the prefill pairs
    nbk = _align_tiles(ids, md, plan.align_pairs)
    n1 = _align_tiles(ids[:md], md, plan.align_pairs) if split else nbk  # phase 0's count tiles
    chunks = -(-(len(ids) + 1) // et.ZERO_ROWS)
    z1 = -(-md // et.ZERO_ROWS) if split else chunks
    n_hot, n_cold = (int(v.sum()) for v in _runs(ids, md, bm, bmh))
    trace = np.asarray(run.trace)
    claimed = trace[trace[:, 0] >= 0]
    n = len(claimed)
    assert np.all(trace[n:] == -1)  # claims are a prefix of the record
    kinds = claimed[:, 0]
    # phase 0's count, offsets and place tiles and zero tiles, hot up, hot down, then phase 1's
    # align and zero tiles (when apart), cold up, cold down
    a1, a2 = 2 * n1 + 1, 2 * (nbk - n1) + split
    order = [5] * a1 + [4] * z1 + [0] * (n_hot * tu) + [1] * (n_hot * td) + [5] * a2 + [4] * (chunks - z1)
    order += [2] * (n_cold * tu) + [3] * (n_cold * td)
    assert list(kinds) == order
    assert list(claimed[kinds == 5, 1]) == list(range(a1 + a2)) and list(claimed[kinds == 4, 1]) == list(range(chunks))
    tiles = [tuple(r) for r in claimed[:, :3]]
    assert len(set(tiles)) == n and set(tiles) == _expected_tiles(ids, md, bm, bmh, plan.align_pairs, tu, td)
    assert sorted(claimed[:, 4]) == list(range(n))  # each finished once
    sync = np.asarray(run.sync)
    assert sync[et.SYNC_CLAIM] == n + (plan.programs or 4)  # every program's last claim found nothing
    assert sync[et.SYNC_TICKET] == n
    for phase, (counts, zeros, offsets) in enumerate(((n1, z1, 1), (nbk - n1, chunks - z1, int(split)))):
        assert sync[et.sync_index(phase, et.COUNTED)] == sync[et.sync_index(phase, et.PLACED)] == counts
        assert sync[et.sync_index(phase, et.ZEROED)] == zeros and sync[et.sync_index(phase, et.OFFSETS)] == offsets
    assert (sync[et.SYNC_HOT], sync[et.SYNC_NB]) == (n_hot, n_hot + n_cold)
    rounds = sync[et.SYNC_ROUND:et.SYNC_ROUND + td]  # hot blocks landed per down tile
    assert np.all(rounds == (n_hot if md else 0))
    e_pad = max(32, 1 << (E - 1).bit_length())
    counts = sync[et.SYNC_ROUND + td:et.SYNC_ROUND + td + 2 * e_pad]  # pairs per expert: decode's, prefill's
    assert np.array_equal(counts[:e_pad], np.bincount(np.asarray(ids[:md]).reshape(-1), minlength=e_pad))
    assert np.array_equal(counts[e_pad:], np.bincount(np.asarray(ids[md:]).reshape(-1), minlength=e_pad))
    ups = sync[et.SYNC_ROUND + td + 2 * e_pad:]
    assert np.all(ups[:n_hot + n_cold] == tu) and np.all(ups[n_hot + n_cold:] == 0)  # each block's up tiles done


# (decode tokens, prefill tokens, k, bits, routing, limit, plan)
CASES = [
    (3, 20, 4, None, "random", 1.0, BM16),  # mixed classes, bf16
    (2, 13, 4, 4, "random", None, BM16),  # int4
    (0, 11, 3, None, "random", None, BM16),  # no decode class
    (6, 0, 4, 4, "random", 2.0, BM16),  # no prefill class
    (4, 40, 1, None, "one", None, BM16),  # one expert takes every token: a hot block (4 decode rows, 12 prefill), 2 cold
    (20, 30, 1, None, "one", None, BM16),  # 20 decode pairs on one expert: 2 hot blocks, 2 cold
    (40, 10, 4, None, "random", None, BM16),  # 160 decode pairs: two count tiles of decode pairs
    # hot blocks of 16 rows holding decode pairs only (two align phases), cold of 32
    (3, 40, 4, None, "random", None, BM32_HOT16),
    (4, 40, 1, 4, "one", 1.0, BM32_HOT16),  # one expert: a hot block (4 decode rows), 2 cold (32 + 8)
    (20, 30, 1, None, "one", None, BM32_HOT16),  # 20 decode pairs on one expert: 2 hot blocks, 1 cold
    (0, 11, 3, None, "random", None, BM32_HOT16),  # no decode class: phase 0 lays out nothing
    (6, 0, 4, 4, "random", None, BM32_HOT16),  # no prefill class: phase 1 lays out nothing
    (5, 30, 3, 8, "one", 0.5, BM32),  # every token on the same 3 experts, int8 with zero points
    (2, 90, 3, None, "one", None, BM16),  # 270 prefill pairs: 17 align tiles count into the same experts
    (3, 70, 4, 4, "random", None, BM32),  # 280 prefill pairs, int4
]


@pytest.mark.parametrize("md,mp,k,bits,kind,limit,plan", CASES)
def test_tiles_match_reference_and_claim_decode_first(md, mp, k, bits, kind, limit, plan):
    run, (_, ids, _, w13, w2) = _run(md, mp, k, bits, kind, limit, plan, symmetric=bits != 8)
    assert run.y.dtype == jnp.bfloat16
    _check_trace(run, ids, md, plan, w13, w2)


def test_equals_fused_moe_on_the_union():
    run, (x, ids, w, w13, w2) = _run(4, 12, 4, None, "random", None, BM16, seed=3)
    fused = fm.fused_moe(x, ids, w, w13, w2, backend="interpret")
    _assert_close(run.y, fused, _magnitude(x, ids, w, w13, w2, None))


def test_public_entry_default_plan_and_dtype():
    rng = np.random.default_rng(11)
    w13, w2 = _weights(rng, None)
    x = jnp.asarray(rng.standard_normal((7, D)), jnp.float32)  # y keeps x's dtype
    ids, w = _routing(rng, 7, 2, "random")
    y, trace = et.tile_moe(x, ids, w, w13, w2, n_decode=2, backend="interpret", trace=True)
    assert y.dtype == jnp.float32 and trace.shape[1] == len(et.TRACE_FIELDS)
    r = et.tile_moe(x, ids, w, w13, w2, n_decode=2, backend="reference")
    _assert_close(y, r, _magnitude(x.astype(jnp.bfloat16), ids, w, w13, w2, None))
    empty = et.tile_moe(x[:0], ids[:0], w[:0], w13, w2, n_decode=0, backend="interpret")
    assert empty.shape == (0, D)


def test_bad_arguments_are_named():
    rng = np.random.default_rng(1)
    w13, w2 = _weights(rng, None)
    x = jnp.zeros((3, D), jnp.bfloat16)
    ids, w = _routing(rng, 3, 2, "random")
    with pytest.raises(ValueError, match="n_decode"):
        et.tile_moe(x, ids, w, w13, w2, n_decode=4, backend="interpret")
    with pytest.raises(ValueError, match="block_m"):
        et.tile_moe(x, ids, w, w13, w2, n_decode=1, backend="interpret", plan=et.Plan(8))
    with pytest.raises(ValueError, match="block_m_hot"):
        et.tile_moe(x, ids, w, w13, w2, n_decode=1, backend="interpret", plan=et.Plan(16, block_m_hot=32))
    with pytest.raises(ValueError, match="globaltimer"):
        et.run_tiles(x, ids, w, w13, w2, n_decode=1, swiglu_limit=None, backend="interpret", plan=BM16, stamps=True)


@pytest.mark.parametrize("bits,hot", [(None, None), (4, None), (None, 16)])
def test_lowers_to_triton_ir(bits, hot, monkeypatch):
    """The GPU path lowers (to Triton IR, on CPU): ordered atomics for the claims and the hand-off
    counters, a relaxed fp32 add for the combine, barriers around each hand-off, and the clock.
    With hot blocks shorter than cold ones the up and down tiles are there twice (one a height)."""
    from jax._src.pallas.triton import lowering as tlow

    modules, real = [], tlow.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        r = real(*a, **kw)
        modules.append(str(r.module))
        return r

    monkeypatch.setattr(tlow, "lower_jaxpr_to_triton_module", capture)
    w13, w2 = _weights(np.random.default_rng(0), bits)
    sds = jax.ShapeDtypeStruct
    plan = et.plan_for(20 * 4, E, bits is not None)
    if hot:
        plan = dataclasses.replace(plan, block_m=2 * hot, block_m_hot=hot)

    def f(x, ids, w, w13, w2):
        run = et.run_tiles(x, ids, w, w13, w2, n_decode=3, swiglu_limit=None, backend="pallas", plan=plan, trace=True,
                      stamps=True)
        return run.y, run.trace, run.stamps

    jax.jit(f).trace(sds((20, D), jnp.bfloat16), sds((20, 4), jnp.int32), sds((20, 4), jnp.float32),
                     w13, w2).lower(lowering_platforms=("cuda",))
    [ir] = [m for m in modules if "expert_tiles" in m]
    g = 2 if hot else 1  # copies of the GEMM tiles
    phases = 2 if hot else 1  # align phases (hot blocks shorter than cold ones hold decode pairs only)
    # ordered: releases (zero; count, offsets, place in each phase; up and hot arrival in each copy)
    # and the acquires' reads, 2 a spin: spins (counts, offsets in each phase; up tiles and zero
    # tiles in each copy; here every zero tile is phase 0's), and the wait for each phase's align
    # at 2 call sites (a spin and its block counts: both in one phase, else one each)
    releases, spins = 1 + 3 * phases + 2 * g, 2 * phases + 2 * g
    waits = 2 * (4 if phases == 1 else 3 + 3)
    assert ir.count("tt.atomic_rmw add, acq_rel, gpu") == releases + 2 * spins + waits
    # relaxed: the claims (2 call sites), the ticket, the counts (a site a phase), the two block counts
    assert ir.count("tt.atomic_rmw add, relaxed, gpu") == 5 + phases
    assert ir.count("tt.atomic_rmw fadd, relaxed, gpu") == g  # the combine
    # a barrier before each release and after each spin (the align waits': 2 sites a phase), and
    # before the decode rounding
    assert ir.count("gpu.barrier") == releases + spins + 2 * phases + g and ir.count("%globaltimer_lo") == 2
    assert "isVolatile = true" in ir  # the rounding reads y32 from L2

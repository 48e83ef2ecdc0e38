"""MLA decode / verify attention over the latent cache, absorbed form, split along the cache.

T query tokens of each of B sequences attend to that sequence's latent cache. W_UK is already
folded into the query (q_lat = q_nope · W_UK, per head) and W_UV is applied after, so a cache row
is one latent c_l [R] (shared by all heads, MQA-like) plus one rope key k_rope_l [P]:
  s[t, h, l] = scale · (q_lat[t, h] · c_l + q_rope[t, h] · k_rope_l)
  out[t, h]  = Σ_l softmax_l(s[t, h, l]) c_l            over l ≤ lengths[b] - T + t
Query token t of sequence b sits at position lengths[b] - T + t (the T tokens are already in
the cache), so it attends causally to its own position and everything before it. Requires
T ≤ lengths[b]; lengths[b] may exceed L (a prefill chunk's padding queries past a nearly full
cache), and no position ≥ L is read: a query sees the positions < L up to its own. Softmax
statistics and accumulation in fp32.

Layouts: q_lat [B, T, H, R], q_rope [B, T, H, P], c [B, L, R], k_rope [B, L, P], lengths [B]
int32; output [B, T, H, R] in q_lat's dtype. Ling: H 32, R 512, P 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import slot_rows
from pallas_kernels.backend import resolve

NUM_SMS = 132  # H200; only used to size the default split count
_NEG = -1e30  # finite "minus infinity": a split that sees no valid position keeps l = 0, no NaN


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def default_num_splits(batch: int, row_blocks: int, max_len: int, block_l: int) -> int:
    """Splits per sequence: about one program per SM (one fits at BL 64), each with at least one
    cache block, at most 128 (the partials grow with the split count). Power of two (the
    combine loads all splits at once). On the H200 (bench/attention.py, 8k, T = 1) a program
    costs ~4 µs a 64-position block whatever the split count: 4 blocks a program 24.6 µs, 2 16.4,
    1 14.7; at T = 6 (6 row blocks) 16 splits beat 4, 8, 32, 64 and 128."""
    by_sms = NUM_SMS // max(1, batch * row_blocks)
    by_len = max_len // block_l
    return _pow2_floor(max(1, min(by_sms, by_len, 128)))


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp): the specification.


def reference(q_lat, q_rope, c, k_rope, lengths, *, scale: float):
    """Absorbed MLA attention in plain jnp, fp32 softmax; cache rows at or past lengths[b] are
    never read (they may hold anything, NaN included)."""
    b, t, h, r = q_lat.shape
    l_max = c.shape[1]
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    pos = jnp.arange(l_max)
    live = pos[None, :] < lengths[:, None]  # [B, L]
    c = jnp.where(live[:, :, None], c, 0)
    k_rope = jnp.where(live[:, :, None], k_rope, 0)
    s = (jnp.einsum("bthr,blr->bthl", q_lat, c, precision=hi, preferred_element_type=f32)
         + jnp.einsum("bthp,blp->bthl", q_rope, k_rope, precision=hi, preferred_element_type=f32))
    s = s * scale
    limit = lengths[:, None] - t + jnp.arange(t)[None, :]  # [B, T] last visible position
    mask = pos[None, None, None, :] <= limit[:, :, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bthl,blr->bthr", p, c.astype(f32), precision=hi)
    return out.astype(q_lat.dtype)


# ----------------------------------------------------------------------------------------------
# Pallas (Triton lowering): a split kernel and a combine kernel.


def _split_kernel(len_ref, ql_ref, qr_ref, c_ref, kr_ref, *refs,
                  t_len: int, heads: int, block_l: int, num_splits: int, scale: float, slotted: bool):
    """Program (row block r, split s, sequence b): rows = BM (token, head) pairs against the
    s-th chunk of sequence b's cache. Chunks are sized at run time from lengths[b], so all
    splits of a sequence get equal work whatever the cache capacity.

    Transposed form: the cache block is the dots' M side (scores sᵀ = c·qᵀ [BL, BM], then
    accᵀ += cᵀ·pᵀ [R, BM]), so at BL 64 both dots compile to Hopper's wgmma with the cache tile
    read from shared memory (M = BM = 32 rows at T = 1 gave mma.sync). Measured, this did not
    cut the ~4 µs a block costs a program (at BL 32 it was no faster than the untransposed
    kernel); what gained was fewer, larger blocks, more splits and smaller partials."""
    f32 = jnp.float32
    rows_ref, acc_ref, lse_ref = refs if slotted else (None, *refs)
    bm = ql_ref.shape[0]
    l_max = c_ref.shape[-2]  # the cache's capacity L
    r, s = pl.program_id(0), pl.program_id(1)
    if slotted:  # the whole caches [B, L, ·], read at the row's slot (one indexer a load)
        sl = slot_rows.slot(rows_ref[()], c_ref.shape[0])
        at = lambda pos0: (sl, pl.ds(pos0, block_l), slice(None))  # noqa: E731
    else:
        at = lambda pos0: (pl.ds(pos0, block_l), slice(None))  # noqa: E731
    length = len_ref[()]  # the queries' positions follow from it; the positions read stop at L
    readable = jnp.minimum(length, l_max)
    chunk = pl.cdiv(pl.cdiv(readable, num_splits), block_l) * block_l
    start = s * chunk
    n_blocks = pl.cdiv(jnp.maximum(jnp.minimum(start + chunk, readable) - start, 0), block_l)

    row = r * bm + jnp.arange(bm)
    limit = length - t_len + row // heads  # [BM] last position each row may see
    q = ql_ref[...]  # [BM, R]
    qp = qr_ref[...]  # [BM, P]
    nt = (((1,), (1,)), ((), ()))  # a · bᵀ: contract the feature dims
    tn = (((0,), (0,)), ((), ()))  # aᵀ · b: contract the position dims

    def body(i, carry):
        acc, m, l = carry  # acc [R, BM]; m, l [BM]
        pos0 = start + i * block_l
        pos = pos0 + jnp.arange(block_l)
        live = pos < readable  # rows past the length may hold anything, past L none exist
        cb = pltriton.load(c_ref.at[at(pos0)],
                           mask=jnp.broadcast_to(live[:, None], (block_l, c_ref.shape[-1])), other=0)
        kb = pltriton.load(kr_ref.at[at(pos0)],
                           mask=jnp.broadcast_to(live[:, None], (block_l, kr_ref.shape[-1])), other=0)
        sc = (lax.dot_general(cb, q, nt, preferred_element_type=f32)
              + lax.dot_general(kb, qp, nt, preferred_element_type=f32)) * scale  # [BL, BM]
        vis = (pos[:, None] <= limit[None, :]) & live[:, None]  # a query's limit may pass L
        sc = jnp.where(vis, sc, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=0))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(sc - m_new[None, :]), 0.0)  # [BL, BM]
        l = l * alpha + jnp.sum(p, axis=0)
        acc = acc * alpha[None, :] + lax.dot_general(cb, p.astype(cb.dtype), tn, preferred_element_type=f32)
        return acc, m_new, l

    init = (jnp.zeros((c_ref.shape[-1], bm), f32), jnp.full((bm,), _NEG, f32), jnp.zeros((bm,), f32))
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    # Stored normalised (acc / l) in the partials' dtype — the activations' (bf16: half the
    # bytes the combine reads back; it was 8 MB at 8k with 128 splits) — with the split's
    # log-sum-exp m + ln l in fp32 (-inf for a split that saw nothing: its weight is 0).
    acc_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[None, :]).astype(acc_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _combine_kernel(acc_ref, lse_ref, o_ref, *, split_block: int):
    """Program (sequence b, BMc rows, BR latent columns): out = Σ_s e^{lse_s - M} accn_s /
    Σ_s e^{lse_s - M}, M = max_s lse_s, accn_s = acc_s / l_s the normalised partials. The S
    splits go in blocks of SB (registers: SB·BR·BMc ≤ 4096 fp32); lse [S, BMc] is read once for
    M and once a block (it is small next to the BR columns of partials a program reads)."""
    f32 = jnp.float32
    ns, br, bmc = acc_ref.shape
    m_max = jnp.max(lse_ref[...], axis=0)  # [BMc]; finite: every row sees position 0

    def body(i, carry):
        num, den = carry
        blk = pl.ds(i * split_block, split_block)
        wgt = jnp.exp(lse_ref[blk, :] - m_max[None, :])  # [SB, BMc]; 0 for splits that saw nothing
        num = num + jnp.sum(wgt[:, None, :] * acc_ref[blk, :, :].astype(f32), axis=0)  # [BR, BMc]
        return num, den + jnp.sum(wgt, axis=0)

    num, den = lax.fori_loop(0, ns // split_block, body, (jnp.zeros((br, bmc), f32), jnp.zeros((bmc,), f32)))
    o_ref[...] = (num / den[None, :]).T.astype(o_ref.dtype)


def split_pass(q_lat, q_rope, c, k_rope, lengths, *, scale, block_rows, block_l, num_splits, num_warps,
               num_stages, interpret, rows=None):
    """The split kernel's launch: partials accᵀ / l [B, S, R, rows_pad] and lse [B, S, rows_pad];
    rows [B] (`slot_rows`): the caches hold every slot, sequence b reads slot rows[b]."""
    b, t, h, r = q_lat.shape
    p = q_rope.shape[-1]
    l_max = c.shape[1]
    q_rows = t * h
    nr = pl.cdiv(q_rows, block_rows)
    rows_pad = nr * block_rows
    ql = q_lat.reshape(b, q_rows, r)  # free: (t, h) rows, contiguous
    qr = q_rope.reshape(b, q_rows, p)
    if rows_pad != q_rows:  # only when BM does not divide T*H (padded rows are discarded)
        ql = jnp.pad(ql, ((0, 0), (0, rows_pad - q_rows), (0, 0)))
        qr = jnp.pad(qr, ((0, 0), (0, rows_pad - q_rows), (0, 0)))
    ns, bm = num_splits, block_rows

    kernel = functools.partial(_split_kernel, t_len=t, heads=h, block_l=block_l, num_splits=ns,
                               scale=scale, slotted=rows is not None)
    if rows is None:
        caches = [pl.BlockSpec((None, l_max, r), lambda i, j, k: (k, 0, 0)),  # latent cache (sliced inside)
                  pl.BlockSpec((None, l_max, p), lambda i, j, k: (k, 0, 0))]  # rope-key cache
        extra, extra_specs = [], []
    else:  # the whole caches; the row's slot is picked inside
        caches = [pl.BlockSpec(x.shape, lambda i, j, k: (0, 0, 0)) for x in (c, k_rope)]
        extra, extra_specs = [rows.astype(jnp.int32)], [pl.BlockSpec((None,), lambda i, j, k: (k,))]
    # Grid (row block, split, sequence): row blocks of one chunk are adjacent in launch order,
    # so a chunk read by several row blocks is served from L2 after the first.
    acc, lse = pl.pallas_call(
        kernel,
        grid=(nr, ns, b),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j, k: (k,)),  # lengths
            pl.BlockSpec((None, bm, r), lambda i, j, k: (k, i, 0)),  # q_lat rows
            pl.BlockSpec((None, bm, p), lambda i, j, k: (k, i, 0)),  # q_rope rows
            *caches,
            *extra_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, r, bm), lambda i, j, k: (k, j, 0, i)),  # accᵀ / l
            pl.BlockSpec((None, None, bm), lambda i, j, k: (k, j, i)),  # lse
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, ns, r, rows_pad), q_lat.dtype),
            jax.ShapeDtypeStruct((b, ns, rows_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_decode_split",
    )(lengths.astype(jnp.int32), ql, qr, c, k_rope, *extra)
    return acc, lse


@functools.partial(jax.jit, static_argnames=("scale", "block_rows", "block_l", "num_splits",
                                             "num_warps", "num_stages", "interpret"))
def _mla_pallas(q_lat, q_rope, c, k_rope, lengths, rows, *, scale, block_rows, block_l, num_splits,
                num_warps, num_stages, interpret):
    b, t, h, r = q_lat.shape
    acc, lse = split_pass(q_lat, q_rope, c, k_rope, lengths, scale=scale, block_rows=block_rows, block_l=block_l,
                          num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                          rows=rows)
    ns, rows_pad, bm = acc.shape[1], acc.shape[3], block_rows
    # Tiles: BMc = 16 rows (the partials' minor dim: 32 contiguous bytes, one sector, per split
    # and column), BR columns for at least two programs an SM (8k, T = 1: BR 2, 512 programs),
    # splits in blocks of SB.
    bmc = min(bm, 16)
    tiles = b * (rows_pad // bmc)
    br = _pow2_floor(max(1, min(r, r * tiles // (2 * NUM_SMS))))
    sb = _pow2_floor(max(1, min(ns, 4096 // (br * bmc))))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, split_block=sb),
        grid=(b, rows_pad // bmc, r // br),
        in_specs=[
            pl.BlockSpec((None, ns, br, bmc), lambda i, j, k: (i, 0, k, j)),
            pl.BlockSpec((None, ns, bmc), lambda i, j, k: (i, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, bmc, br), lambda i, j, k: (i, j, k)),
        out_shape=jax.ShapeDtypeStruct((b, rows_pad, r), q_lat.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_decode_combine",
    )(acc, lse)
    return out[:, :t * h].reshape(b, t, h, r)


def mla_decode(q_lat, q_rope, c, k_rope, lengths, *, scale: float, block_rows: int | None = None,
               block_l: int = 64, num_splits: int | None = None, num_warps: int = 4,
               num_stages: int = 2, rows=None, backend: str = "auto"):
    """Absorbed MLA attention of T query tokens over the latent cache; see the module docstring.
    rows [B] int32 (`slot_rows`): the caches hold every slot (any number) and sequence b reads
    slot rows[b]'s, in place.

    Pallas: (1) split kernel, grid (T·H/BM, S, B): each program takes BM (token, head) rows and
    one of S chunks of its sequence's cache (chunk = lengths[b]/S rounded up to BL; blocks of BL
    positions in a loop, scores by two tensor-core dots with the cache block on the M side,
    online softmax), and writes partials: accᵀ / l [R, BM] in the activation dtype and the
    log-sum-exp m + ln l in fp32. (2) combine kernel, grid (B, T·H/BMc, R/BR) with BMc = 16 and
    BR for at least two programs an SM, looping over the splits in blocks (an XLA fusion for it was
    slower on the H200: 18.9 against 14.1 µs at 8k, T = 1).
    BL = 64 and 2 stages fit one program per SM (188 KB of shared memory). 4 warps (255
    registers, 620 B spilled: triton 3.6, sm_90a) beat 8 (252, no spills) on the H200 at T = 1 and
    6 (bench/history/mla_decode.md).
    Bytes that must move: lengths[b]·(R + P)·e (the cache, read once from HBM; further row
    blocks hit L2) + T·H·(R + P + R)·e (queries in, output out), e = element bytes; the
    partials, B·S·T·H·(R·e + 4), are written and read back (ncu at 8k, S = 128, fp32 partials:
    the combine read them from HBM at ~1 TB/s, 8.4 µs). At T = 6 the dots (2·T·H·L·(2R + P)
    flops) also approach the tensor-core floor.
    """
    b, t, h, r = q_lat.shape
    n, l_max = c.shape[:2]
    assert (n == b if rows is None else rows.shape == (b,))
    assert q_rope.shape[:3] == (b, t, h) and c.shape == (n, l_max, r)
    assert k_rope.shape == (n, l_max, q_rope.shape[3]) and lengths.shape == (b,)
    backend = resolve(backend)
    if backend == "reference":
        if rows is not None:
            c, k_rope = slot_rows.take((c, k_rope), rows)
        return reference(q_lat, q_rope, c, k_rope, lengths, scale=scale)
    q_rows = t * h
    if block_rows is None:  # 32 rows keep the fp32 accumulator [BM, 512] at 64 registers a thread
        block_rows = min(32, max(16, 1 << (q_rows - 1).bit_length()))
    if num_splits is None:
        num_splits = default_num_splits(b, pl.cdiv(q_rows, block_rows), l_max, block_l)
    for name, val in (("block_rows", block_rows), ("block_l", block_l), ("num_splits", num_splits)):
        if val & (val - 1):
            raise ValueError(f"{name} must be a power of two, got {val}")
    return _mla_pallas(q_lat, q_rope, c, k_rope, lengths, rows, scale=float(scale), block_rows=block_rows,
                       block_l=block_l, num_splits=num_splits, num_warps=num_warps,
                       num_stages=num_stages, interpret=backend == "interpret")

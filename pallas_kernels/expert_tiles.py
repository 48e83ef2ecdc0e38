"""Tile-scheduled MoE: decode and prefill tokens of one layer in one persistent launch, decode first.

    y [M, D] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])   (fused_moe's maths)
    tokens [0, M_d) are the decode class, [M_d, M) the prefill class (M_d = n_decode).

Why. Two launches (decode, then prefill) make decode wait for nothing but leave the GPU half idle
at the seam; one grouped launch over the union makes decode outputs wait for the whole prefill.
Here one launch runs both, and decode work never queues behind prefill work: every decode tile
is claimed before any prefill tile (seed 002, ExpertPlex's adaptive persistent kernel, §4.2).

Layout. Each class is aligned alone: pairs grouped by expert, each expert's run padded to BM
rows, one expert per block. The decode class before the launch (`fused_moe.moe_align`: one small
launch at decode sizes): sorted_d [S_d] (the pair p = m*k + slot at each slot, P_d = padding),
blk_d [NBP_d] (expert of each block, -1 unused; n_d blocks in use). The prefill class inside the
launch, by its align tiles (below): sorted_p (pairs numbered in the union, P = padding), blk_p,
n_p blocks. h holds both classes' block rows, decode blocks first (NB_d = the decode align's
bound).
Weights: fused_moe's formats, w13 [E, D, 2I] (gate/up interleaved by column) and w2 [E, I, D] in
bf16, or both fields of `fused_moe.quantize_experts` (grouped low-bit, dequantised in registers
on the tensor-core "dot" path of fused_moe; its helpers `weight_operands`, `expert_tile`,
`swiglu_columns` are shared, not copied).

Tiles and the queue. A tile is one block's BM rows times one N-block of one GEMM:
  up   (b, t): rows x[pair // k] @ W13_e[:, t*BN_u : (t+1)*BN_u] -> SwiGLU -> h[b rows, t cols]
  down (b, t): rows h[b rows] @ W2_e[:, t*BN_d : (t+1)*BN_d] * topk weight -> y32[token, cols]
with T_u = 2I/BN_u and T_d = D/BN_d tiles per block. Besides the GEMM tiles, zero tiles (ZR rows
of the fp32 accumulator y32 <- 0: it starts uninitialised, so no memset sits before the launch)
and the prefill class's align tiles. The queue is the claim index c = 0, 1, ... read against
seven segments, in this order:
  [zero: the chunks holding decode rows | decode up: n_d*T_u | decode down: n_d*T_d |
   align: count x NBk, offsets, place x NBk | prefill up: n_p*T_u | zero: the other chunks |
   prefill down: n_p*T_d]
(block-major, N-block fastest: consecutive claims share a block's rows in L2, sibling blocks of
one expert its weights). The prefill class's zeroing comes after its up tiles, off the decode
class's tail. No tile list is materialised: a program maps c to its tile from the block counts,
so the queue costs no memory and no launch.

The prefill align (NBk = ceil(P_p / PB) tiles of PB = ALIGN_PAIRS pairs). A count tile takes its
pairs' histogram over the experts and adds it to the expert counts with atomics, keeping the old
counts: its first rank within each expert. The offsets tile (after every count) gives each
expert its first slot (the padded runs' prefix sum), blk_p and n_p, and writes P to each run's
padding slots. A place tile (after the
offsets) writes each pair to its expert's first slot + its tile's first rank + its rank among
the tile's earlier pairs of that expert. Pairs of an expert so land in the order their tiles
counted, not in p order (fused_moe's align is stable): any order serves, rows being independent
and the combine a sum. A claim past the align waits, once per program, for the last place tile,
then reads n_p and so the queue's length.
Grid and claims. A persistent grid of G programs (`Plan.programs`, default PROGRAMS_PER_SM = 2 a
SM: 264 on the H200; where two do not fit an SM the second waits and finds the queue empty).
Each program loops: c = atomic_add(sync[0], 1); stop once c >= the tile count; run tile c.
Claims are handed out in queue order, so no prefill tile is claimed before the last decode tile
(the debug trace makes that testable), and a decode tile waits behind no prefill tile at all
(the bound of one tile per program would apply to decode work arriving mid-launch; within one
launch the decode tiles simply come first). What decode does wait for is the work before the
launch: the decode class's align (one launch), the counters' zeroing; the decode rows are rounded
in the launch (below), the prefill rows after it.
Claims are relaxed atomics (they order nothing; an ordered one would first wait for the last
tile's atomic adds); each hand-off below is a release (barrier, ordered atomic increment) and an
acquire (ordered atomic reads, barrier).

The down tile's dependency. Down tile (b, t) needs all T_u up tiles of block b. An up tile
stores its h tile, then (barrier, so every thread's stores precede it) atomically increments
its block's counter; a down tile spins on atomic reads of it until it reads T_u, then reads h.
It also waits for the zero tiles of its class's rows. A per-block counter (not per class) lets
a block's down tiles start as soon as its own up tiles are done. Deadlock-free without assuming
that every program is resident: a down tile waits only for up tiles, which were claimed earlier
(queue order) by programs that are already running, and up tiles wait for nothing (nor do zero and count tiles; the offsets tile and the
place tiles wait for tiles of the align claimed before them).

Combine: atomic adds into y32 [R, D] fp32 (R >= M + 1 rows, whole zero tiles; row M: the padding
rows' sink in interpret mode, adding 0), relaxed (pallas_kernels/relaxed_atomic.py: Pallas' own
atomics fence before each one). Chosen over a per-pair output and a sum because a decode row is
then final inside the launch the moment its last down tile lands: a counter per down N-block
counts the decode blocks landed, and the last one rounds that N-block of the decode rows into y
(volatile loads, from L2 where the atomics summed). The prefill rows are rounded after the
launch, in place. The price is that the fp32 sum order (and so, rarely, the last bit after the
rounding) varies run to run. y is rounded once to x's dtype.

Debug outputs (off by default): trace [C_max, 5] int32 per claim index c: (kind, block in its
class (zero tiles: the chunk; align tiles: the index in the align), N-block, program, finish
ticket); kinds as KINDS (0 decode up, 1 decode down, 2 prefill up, 3 prefill down, 4 zero,
5 align); the ticket is the order in which tiles finished (a second atomic counter).
Rows past the last claim stay -1. stamps (GPU only: the inline PTX has no CPU rule): int32
[G + C_max], the low word of the %globaltimer nanosecond clock when each program starts (first
G) and when each claimed tile has finished; the benchmark reads decode completion from them.

Rounding: h is rounded to the activation dtype between the GEMMs (as fused_moe); y once.
Bytes: each block reads its expert's weights once (a block re-reads them when its expert has more
than BM rows in its class; an expert used by both classes is read once per class), plus x and y,
h written and read once (padding rows are masked, never moved), and P*D*4 of fp32 atomics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve
from pallas_kernels.fused_moe import (_dims, _pow2, align_sizes, check_args, expert_tile, moe_align,
                                      pop_weight_refs, reference, swiglu_columns, weight_operands)
from pallas_kernels.quant import QuantizedWeight
from pallas_kernels.relaxed_atomic import relaxed_atomic_add

H200_SMS = 132
# Persistent programs per SM by default. H200, 8 decode + 512 / 2048 prefill tokens (BM 16 / 64 of
# 4 warps): the mixed launch 2018 -> 1586 / 2228 -> 1751 µs from 1 to 2 a SM, 3 no better; at
# BM 128 of 8 warps (8192 prefill tokens) 1, 2 and 3 tie (bench/RESULTS.md, 2026-12-01).
PROGRAMS_PER_SM = 2
KINDS = ("decode up", "decode down", "prefill up", "prefill down", "zero", "align")
ZERO_ROWS = 64  # y32 rows per zero tile (ZR)
ALIGN_PAIRS = 128  # prefill pairs per align tile (PB)
ALIGN_EXPERTS = 32  # experts per step of an align tile's histogram ([PB, EB] comparisons)
ALIGN_RANK = 32  # pairs per step of a place tile's ranking ([PB, CB] comparisons)
# sync int32 counters (zeros before the launch): the next claim; finish tickets; zero tiles done
# (decode's, prefill's); prefill align tiles done (count, offsets, place); the prefill class's
# blocks; then T_d counters (decode blocks whose down tile t has landed), E_pad per-expert prefill
# pair counts, and one counter per block (its up tiles done; decode blocks, then prefill).
(SYNC_CLAIM, SYNC_TICKET, SYNC_ZERO_D, SYNC_ZERO_P, SYNC_COUNTED, SYNC_OFFSETS, SYNC_PLACED, SYNC_NP,
 SYNC_ROUND) = range(9)
TRACE_FIELDS = ("kind", "block", "n_tile", "program", "ticket")


# ---------------------------------------------------------------------------------- plans
@dataclasses.dataclass(frozen=True)
class Tile:
    """One GEMM's tile: block_k (K per loop step) and block_n (output columns; up: interleaved, so
    h gets block_n / 2) for bf16 weights; quantised weights step one group and take their B_N."""

    block_k: int = 64
    block_n: int = 128


@dataclasses.dataclass(frozen=True)
class Plan:
    block_m: int = 64  # rows per block, both classes (a power of two >= 16: tensor-core dots)
    up: Tile = Tile()
    down: Tile = Tile()
    num_warps: int = 4
    num_stages: int = 3
    programs: int | None = None  # persistent programs; None: PROGRAMS_PER_SM a SM (4 in interpret mode)


def plan_for(p_prefill: int, e: int, quantized: bool) -> Plan:
    """Launch heuristics, by the prefill rows an expert: BM 16 up to 24, 64 up to 96, else 128, all
    of 4 warps (two programs an SM; BM 128 spills ~0.4 KB in its epilogue). H200, 8 decode + 8192
    prefill tokens (128 rows an expert): BM 128 2797 µs total, decode done 218 µs; BM 64 3245 and
    190; BM 128 of 8 warps (one program an SM) was 3385 before the relaxed claims
    (bench/RESULTS.md, 2026-12-01)."""
    r = p_prefill / e
    bm = 16 if r <= 24 else 64 if r <= 96 else 128
    warps = 4
    if quantized:
        return Plan(bm, Tile(0, 0), Tile(0, 0), warps, 3)
    return Plan(bm, Tile(64, 128), Tile(64, 128), warps, 3)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the kernel needs to know at trace time (no arrays)."""

    k: int
    e: int
    p: int  # pairs of the union
    p_d: int  # decode pairs: [0, p_d); prefill pairs [p_d, p)
    m: int  # tokens of the union (y32's sink row)
    md: int  # decode tokens (rows [0, md) of y are rounded in the kernel)
    rb: int  # rows per step of that rounding: a power of two dividing md
    bm: int
    nb_d: int  # decode blocks (the decode align's bound): prefill block j is h's block nb_d + j
    nbk: int  # prefill count (and place) tiles, ALIGN_PAIRS pairs each
    n_align: int  # the align's tiles: count tiles, the offsets tile, place tiles (0: no prefill pairs)
    e_pad: int  # experts padded to a power of two >= ALIGN_EXPERTS
    zr: int  # y32 rows per zero tile
    zd: int  # zero tiles before the decode class (chunks holding decode rows)
    zp: int  # zero tiles after the prefill up tiles (the other chunks)
    up: object  # fused_moe.WeightOperands of w13, without its arrays
    down: object
    limit: float | None
    trace: bool
    stamps: bool
    interpret: bool
    n_init: int

    @property
    def sync_count(self) -> int:  # the per-expert prefill counts
        return SYNC_ROUND + self.down.n_tiles

    @property
    def sync_up(self) -> int:  # the per-block up-tile counters
        return self.sync_count + self.e_pad


# ---------------------------------------------------------------------------------- kernel
def _kernel(*refs, s: _Static):
    refs = list(refs)
    x_ref = refs.pop(0)  # [M, D] activation dtype
    ids_ref = refs.pop(0)  # [P] int32 expert of each pair (the prefill class's are aligned here)
    sorted_d_ref = refs.pop(0)  # [S_d] int32: the decode align's pairs (padding: p_d)
    blk_d_ref = refs.pop(0)  # [NBP_d] int32: the decode align's block experts (-1: unused)
    tw_ref = refs.pop(0)  # [P] f32 routed weight per pair
    w13 = pop_weight_refs(refs, s.up.qm)
    w2 = pop_weight_refs(refs, s.down.qm)
    del refs[:s.n_init]  # aliased initial outputs: only the output refs are used
    h_ref = refs.pop(0)  # [(NB_d + NB_p)*BM, I] slot rows, decode blocks first
    y_ref = refs.pop(0)  # [M, D]: the kernel writes the decode rows
    y32_ref = refs.pop(0)  # [R, D] f32, R = ZR chunks covering M + 1 rows; uninitialised: zero tiles
    sorted_p_ref = refs.pop(0)  # [S_p] int32: the prefill class's pairs by slot (padding: P)
    blk_p_ref = refs.pop(0)  # [NB_p + 1] int32: expert of each prefill block (+ a sink)
    base_ref = refs.pop(0)  # [NBk, E_pad] int32: each align tile's first rank within each expert
    offs_ref = refs.pop(0)  # [E_pad] int32: each expert's first prefill slot
    sync_ref = refs.pop(0)  # int32 counters, see SYNC_*
    trace_ref = refs.pop(0) if s.trace else None  # [C_max, 5] int32
    stamp_ref = refs.pop(0) if s.stamps else None  # [G + C_max] int32

    bm, k, p, p_d, zr, e_pad = s.bm, s.k, s.p, s.p_d, s.zr, s.e_pad
    tu, td = s.up.n_tiles, s.down.n_tiles
    hb = s.up.bn // 2  # h columns per up tile
    bn_d = s.down.bn
    pb = ALIGN_PAIRS
    prog = pl.program_id(0)
    # Traced, not literal: constants created inside a loop body become consts of the body's jaxpr,
    # which the interpreter's discharge of nested loops rejects.
    zero = prog * 0
    one = zero + 1
    n_d = jnp.sum((blk_d_ref[...] >= 0).astype(jnp.int32))  # decode blocks in use
    seg_d = n_d * (tu + td)  # the decode class's GEMM tiles
    n_align = s.n_align
    prefix = s.zd + seg_d + n_align  # claims before the prefill class's GEMM tiles

    def barrier():  # the GPU's threads of one program; the interpreter runs a program as one
        if not s.interpret:
            pltriton.debug_barrier()

    def read(idx):
        """sync[idx], ordered (an acquire): an atomic add of 0."""
        return pltriton.atomic_add(sync_ref, zero + idx, zero)

    def spin(idx, target):
        """Wait until sync[idx] >= target (an acquire: atomic reads), then let every thread on."""
        lax.while_loop(lambda done: done < target, lambda _: read(idx), read(idx))
        barrier()

    def release(idx):
        """sync[idx] += 1 after every thread's stores (barrier, then one ordered atomic); returns
        the old count."""
        barrier()
        return pltriton.atomic_add(sync_ref, zero + idx, one)

    def claim():
        """The next claim index. Relaxed: a claim orders nothing (the hand-offs have their own
        counters), and an ordered atomic fences first, waiting for the last tile's atomic adds."""
        return relaxed_atomic_add(sync_ref, zero + SYNC_CLAIM, one)

    # ------------------------------------------------------------ the prefill class's align
    # Unlike fused_moe's align (stable in p, for every caller), pairs of one expert land in the
    # order their align tiles reserved their ranks: any order serves the tiles (rows are
    # independent, and the combine sums by atomics anyway).
    def prefill_ids(b):
        q = b * pb + jnp.arange(pb, dtype=jnp.int32)  # [PB] prefill pair index
        # padding: id E_pad, which no histogram column counts (expert ids E..E_pad-1 are not real either)
        ids = pltriton.load(ids_ref.at[pl.ds(p_d + b * pb, pb)], mask=q < p - p_d, other=e_pad)
        return q, ids

    def count_tile(b):
        """Align tile b's pairs per expert, added to the expert counts; the old counts are b's
        first ranks (stored)."""
        _, ids = prefill_ids(b)

        def experts(i, carry):  # loops, not unrolled: the kernel's code size
            e0 = pl.multiple_of(i * ALIGN_EXPERTS, ALIGN_EXPERTS)
            ex = e0 + jnp.arange(ALIGN_EXPERTS, dtype=jnp.int32)
            hist = jnp.sum((ids[:, None] == ex[None, :]).astype(jnp.int32), axis=0)  # [EB]
            base_ref[b, pl.ds(e0, ALIGN_EXPERTS)] = relaxed_atomic_add(sync_ref, s.sync_count + ex, hist)
            return carry

        lax.fori_loop(0, e_pad // ALIGN_EXPERTS, experts, zero)
        release(SYNC_COUNTED)

    def offsets_tile():
        """Once every count is in: each expert's first slot (its run padded to BM), the prefill
        blocks' experts and their number, and P in each run's padding slots."""
        spin(SYNC_COUNTED, s.nbk)
        counts = pltriton.load(sync_ref.at[pl.ds(s.sync_count, e_pad)], volatile=True)  # [E_pad]
        nblk = (counts + bm - 1) // bm
        bstart = jnp.cumsum(nblk) - nblk
        offs_ref[...] = bstart * bm
        ex = jnp.arange(e_pad, dtype=jnp.int32)
        sink = blk_p_ref.shape[0] - 1

        def fill_blocks(i, carry):  # the i-th block of every expert with more than i blocks
            has = i < nblk
            pltriton.store(blk_p_ref.at[jnp.where(has, bstart + i, sink)], ex, mask=has)
            return carry

        lax.fori_loop(0, jnp.max(nblk), fill_blocks, zero)
        pad_end = bstart * bm + nblk * bm
        slot_sink = sorted_p_ref.shape[0] - 1

        def fill_padding(i, carry):  # each run's slots past its pairs <- P (padding)
            slot = bstart * bm + counts + i
            pad = slot < pad_end
            pltriton.store(sorted_p_ref.at[jnp.where(pad, slot, slot_sink)], jnp.full((e_pad,), p, jnp.int32),
                           mask=pad)
            return carry

        lax.fori_loop(0, bm - 1, fill_padding, zero)
        relaxed_atomic_add(sync_ref, zero + SYNC_NP, jnp.sum(nblk))
        release(SYNC_OFFSETS)

    def place_tile(b):
        """Align tile b's pairs to their slots: the expert's first slot + b's first rank + the rank
        among b's earlier pairs of the expert ([PB, CB] comparisons a step)."""
        spin(SYNC_OFFSETS, 1)
        q, ids = prefill_ids(b)
        valid = ids < s.e

        def rank(i, within):
            c0 = pl.multiple_of(i * ALIGN_RANK, ALIGN_RANK)
            qc = b * pb + c0 + jnp.arange(ALIGN_RANK, dtype=jnp.int32)
            ic = pltriton.load(ids_ref.at[pl.ds(p_d + b * pb + c0, ALIGN_RANK)], mask=qc < p - p_d, other=e_pad)
            hit = (ic[None, :] == ids[:, None]) & (qc[None, :] < q[:, None])
            return within + jnp.sum(hit.astype(jnp.int32), axis=1)

        within = lax.fori_loop(0, pb // ALIGN_RANK, rank, jnp.zeros((pb,), jnp.int32))
        e = jnp.where(valid, ids, 0)
        first = pltriton.load(offs_ref.at[e], volatile=True) + pltriton.load(base_ref.at[b, e], volatile=True)
        # Masked-off lanes point at the last slot, never a pair's (interpret mode may write them back)
        slot = jnp.where(valid, first + within, sorted_p_ref.shape[0] - 1)
        pltriton.store(sorted_p_ref.at[slot], p_d + q, mask=valid)
        release(SYNC_PLACED)

    def align_tile(j):
        pl.when(j < s.nbk)(lambda: count_tile(j))
        pl.when(j == s.nbk)(offsets_tile)
        pl.when(j > s.nbk)(lambda: place_tile(j - s.nbk - 1))

    # ------------------------------------------------------------ the GEMM tiles
    def block(j, pre):
        """Block j of its class (pre: 0 decode, 1 prefill) -> (expert, pairs [BM], valid [BM],
        the block's index among h's blocks and the up counters). One code path for both classes:
        each class's arrays are loaded under a mask, the other's lanes are off and read nothing.
        The prefill arrays were written in this launch by other SMs: a masked-off load never
        brings their lines into this SM's L1 before the align's acquire, so plain loads see the
        written values (volatile ones cost ~40% of the decode launch at BM 64: H200, 2026-12-01)."""
        dec = jnp.full((bm,), pre == 0)
        pair_d = pltriton.load(sorted_d_ref.at[pl.ds(j * bm, bm)], mask=dec, other=0)
        pair_p = pltriton.load(sorted_p_ref.at[pl.ds(j * bm, bm)], mask=jnp.logical_not(dec), other=0)
        pair = pair_d + pair_p
        valid = pair < p_d + (p - p_d) * pre  # padding: p_d (the decode align's) or P
        one_d = jnp.full((1,), pre == 0)
        e_d = pltriton.load(blk_d_ref.at[pl.ds(j, 1)], mask=one_d, other=0)
        e_p = pltriton.load(blk_p_ref.at[pl.ds(j, 1)], mask=jnp.logical_not(one_d), other=0)
        return jnp.sum(e_d + e_p), pair, valid, j + s.nb_d * pre

    def zero_tile(z):
        """y32 rows [z*ZR, (z+1)*ZR) <- 0, in D / BN_d column blocks."""
        def cols(ci, carry):
            y32_ref[pl.ds(z * zr, zr), pl.ds(pl.multiple_of(ci * bn_d, bn_d), bn_d)] = jnp.zeros((zr, bn_d),
                                                                                                  jnp.float32)
            return carry

        lax.fori_loop(0, td, cols, zero)
        release(SYNC_ZERO_D + (z >= s.zd).astype(jnp.int32))

    def up_tile(j, t, pre):
        e, pair, valid, b = block(j, pre)
        tok = jnp.where(valid, lax.div(pair, k), 0)[:, None]  # [BM, 1]

        def a_load(k0, size):  # x rows gathered by token; padding rows read nothing (0)
            cols = (k0 + jnp.arange(size, dtype=jnp.int32))[None, :]
            return pltriton.load(x_ref.at[tok, cols], mask=valid[:, None], other=0.0)

        acc = expert_tile(w13, s.up.qm, e, t, a_load, n_k=s.up.n_k, bk=s.up.bk, bn=s.up.bn, bm=bm, fma=False)
        h = swiglu_columns(acc, s.limit).astype(h_ref.dtype)  # [BM, BN_u / 2]
        mask = jnp.broadcast_to(valid[:, None], h.shape)
        pltriton.store(h_ref.at[pl.ds(b * bm, bm), pl.ds(t * hb, hb)], h, mask=mask)
        release(s.sync_up + b)

    def round_decode(t):
        """y[decode rows, tile t] <- y32 rounded: every decode block's down tile t has landed.
        Chunks of RB rows, RB dividing M_d (no masks). Volatile loads, served by L2, where other
        SMs' atomics made the sums (cache_modifier ".cg" does not lower in jax 0.10)."""

        def chunk(i, carry):
            rows = pl.ds(pl.multiple_of(i * s.rb, s.rb), s.rb)
            cols = pl.ds(pl.multiple_of(t * bn_d, bn_d), bn_d)
            v = pltriton.load(y32_ref.at[rows, cols], volatile=True)
            y_ref[rows, cols] = v.astype(y_ref.dtype)
            return carry

        lax.fori_loop(0, s.md // s.rb, chunk, zero)

    def down_tile(j, t, pre):
        e, pair, valid, b = block(j, pre)
        # Acquire block b's h (its T_u up tiles were claimed before this tile and wait for nothing)
        # and y32's zeroed rows (the zero tiles were claimed before it too).
        spin(s.sync_up + b, tu)
        if s.zd:
            spin(SYNC_ZERO_D, s.zd)
        pl.when(pre == 1)(lambda: spin(SYNC_ZERO_P, s.zp))

        def a_load(k0, size):  # the block's own h rows; padding rows were never written
            mask = jnp.broadcast_to(valid[:, None], (bm, size))
            return pltriton.load(h_ref.at[pl.ds(b * bm, bm), pl.ds(k0, size)], mask=mask, other=0.0)

        acc = expert_tile(w2, s.down.qm, e, t, a_load, n_k=s.down.n_k, bk=s.down.bk, bn=bn_d, bm=bm, fma=False)
        w = pltriton.load(tw_ref.at[jnp.where(valid, pair, 0)], mask=valid, other=0.0)  # [BM]
        val = acc * w[:, None]  # padding rows: 0
        tok = jnp.where(valid, lax.div(pair, k), s.m)[:, None]  # padding adds 0 to the sink row M
        cols = (t * bn_d + jnp.arange(bn_d, dtype=jnp.int32))[None, :]
        # The interpreter has no masked atomics; unmasked, padding adds 0 to row M. Relaxed: a sum
        # needs no ordering (the finish ticket / the kernel's end orders it).
        mask = None if s.interpret else jnp.broadcast_to(valid[:, None], val.shape)
        relaxed_atomic_add(y32_ref, (tok, cols), val, mask=mask)
        if s.md:  # the last decode block to land its tile t rounds the decode rows' tile t
            @pl.when(pre == 0)
            def _():
                @pl.when(release(SYNC_ROUND + t) == n_d - 1)
                def _():
                    barrier()
                    round_decode(t)

    # ------------------------------------------------------------ the queue
    def tile_of(c, n_p):
        """Claim index -> (kind, index j in its segment, N-block t) over the segments
        [zero (decode rows) | decode up | decode down | align | prefill up | zero (the rest) |
        prefill down]; j of a zero tile is its chunk. n_p: the prefill blocks (read once the
        align is done, -1 before: claims before the align's end do not depend on it)."""
        n_p = jnp.maximum(n_p, 0)  # -1 would shift the later segments back over the earlier ones
        segments = ((4, s.zd, 1, 0), (0, n_d * tu, tu, 0), (1, n_d * td, td, 0), (5, n_align, 1, 0),
                    (2, n_p * tu, tu, 0), (4, s.zp, 1, s.zd), (3, n_p * td, td, 0))
        kind = j = t = zero
        start = zero
        for kd, length, width, j0 in segments:
            inside = ((c >= start) & (c < start + length)).astype(jnp.int32)
            local = (c - start) * inside
            kind, j, t = kind + kd * inside, j + (j0 + lax.div(local, width)) * inside, t + lax.rem(local, width)
            start = start + length
        return kind, j, t

    def prefill_blocks(c, n_p):
        """n_p, read (once) when a claim passes the align: wait for every place tile, all claimed
        earlier (so the wait ends even without every program resident)."""
        if not s.nbk:
            return n_p

        def wait():
            spin(SYNC_PLACED, s.nbk)
            return read(SYNC_NP)

        return lax.cond((c >= prefix) & (n_p < 0), wait, lambda: n_p)

    def clock(dep):
        """[1] int32: %globaltimer's low word (ns). The asm is pure: dep, a value that exists only
        once the event happened, keeps it from being hoisted or merged. A [1] block, not a scalar:
        the asm lowers to a tensor type."""
        [now] = pltriton.elementwise_inline_asm(
            "mov.u32 $0, %globaltimer_lo;", args=[jnp.broadcast_to(dep, (1,))], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
        return now

    def body(carry):
        c, n_p = carry
        kind, j, t = tile_of(c, n_p)
        pl.when(kind == 4)(lambda: zero_tile(j))
        pl.when(kind == 5)(lambda: align_tile(j))
        pl.when((kind == 0) | (kind == 2))(lambda: up_tile(j, t, kind // 2))
        pl.when((kind == 1) | (kind == 3))(lambda: down_tile(j, t, kind // 2))
        if s.trace or s.stamps:
            ticket = relaxed_atomic_add(sync_ref, zero + SYNC_TICKET, one)
        if s.trace:
            for field, v in enumerate((kind, j, t, prog, ticket)):
                trace_ref[c, field] = v
        if s.stamps:
            stamp_ref[pl.ds(pl.num_programs(0) + c, 1)] = clock(ticket)
        c = claim()
        return c, prefill_blocks(c, n_p)

    def more(carry):
        c, n_p = carry
        return c < prefix + s.zp + jnp.maximum(n_p, 0) * (tu + td)

    if s.stamps:
        stamp_ref[pl.ds(prog, 1)] = clock(prog)
    c = claim()
    lax.while_loop(more, body, (c, prefill_blocks(c, zero - 1 if s.nbk else zero)))


# ---------------------------------------------------------------------------------- wrapper
@dataclasses.dataclass(frozen=True)
class TileRun:
    """Outputs of one launch: y [M, D], h, y32, sync, and the debug trace / stamps (or None)."""

    y: jax.Array
    h: jax.Array
    y32: jax.Array
    sync: jax.Array
    trace: jax.Array | None
    stamps: jax.Array | None


def _strip(ops):
    """WeightOperands without arrays: the kernel's static facts, hashable."""
    return dataclasses.replace(ops, inputs=())


def _programs(plan: Plan, interpret: bool) -> int:
    if plan.programs is not None:
        if plan.programs < 1:
            raise ValueError(f"plan.programs must be positive, got {plan.programs}")
        return plan.programs
    if interpret:
        return 4
    return PROGRAMS_PER_SM * (getattr(jax.devices()[0], "core_count", None) or H200_SMS)


def _run(x, topk_ids, topk_weights, w13, w2, *, n_decode: int, swiglu_limit, backend, plan: Plan | None,
         trace=False, stamps=False, poison=False) -> TileRun:
    m, k = topk_ids.shape
    if not 0 <= n_decode <= m:
        raise ValueError(f"n_decode must be in [0, M={m}], got {n_decode}")
    e, d, i = _dims(w13, w2)
    quant = isinstance(w13, QuantizedWeight)
    act = jnp.bfloat16 if quant else w13.dtype
    plan = plan or plan_for((m - n_decode) * k, e, quant)
    bm = plan.block_m
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"plan.block_m must be a power of two >= 16 (tensor-core dots), got {bm}")
    interpret = backend == "interpret"
    if stamps and interpret:
        raise ValueError("stamps read the GPU's %globaltimer: not available in interpret mode")
    if m == 0:  # no tokens: nothing to launch
        y = jnp.zeros((0, d), x.dtype)
        return TileRun(y, None, None, None, None, None)
    p, p_d = m * k, n_decode * k
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    # The decode class is aligned before the launch (fused_moe's align: one small launch at decode
    # sizes); the prefill class inside it, after the decode tiles (see the module docstring).
    if p_d:
        sorted_d, blk_d = moe_align(ids[:p_d], e, bm, backend=backend)
        nb_d = align_sizes(p_d, e, bm).nb
    else:
        sorted_d, blk_d, nb_d = jnp.full((bm,), 0, jnp.int32), jnp.full((1,), -1, jnp.int32), 0

    up = weight_operands(w13, plan.up.block_k, plan.up.block_n, dot=True, stage="up")
    down = weight_operands(w2, plan.down.block_k, plan.down.block_n, dot=True, stage="down")
    if up.bn % 2 or up.bn < 32:
        raise ValueError(f"the up tile needs an even block_n >= 32 (gate/up pairs), got {up.bn}")
    g = _programs(plan, interpret)

    nbk = -(-(p - p_d) // ALIGN_PAIRS)  # prefill align tiles
    nb_p = align_sizes(p - p_d, e, bm).nb if nbk else 0
    e_pad = max(ALIGN_EXPERTS, _pow2(e))
    zr = ZERO_ROWS
    chunks = -(-(m + 1) // zr)  # y32 rows: whole zero tiles covering M + 1
    zd = -(-n_decode // zr)
    n_align = 2 * nbk + 1 if nbk else 0  # count tiles, the offsets tile, place tiles
    c_max = (nb_d + nb_p) * (up.n_tiles + down.n_tiles) + n_align + chunks  # every claim's trace row
    i32 = jnp.int32
    inits = [jnp.zeros((SYNC_ROUND + down.n_tiles + e_pad + nb_d + nb_p,), i32)]  # sync
    out_shape = [jax.ShapeDtypeStruct(((nb_d + nb_p) * bm, i), act),  # h
                 jax.ShapeDtypeStruct((m, d), x.dtype),  # y
                 jax.ShapeDtypeStruct((chunks * zr, d), jnp.float32),  # y32
                 jax.ShapeDtypeStruct((max(nb_p * bm + 1, bm),), i32),  # sorted_p (+ a sink slot)
                 jax.ShapeDtypeStruct((nb_p + 1,), i32),  # blk_p
                 jax.ShapeDtypeStruct((max(nbk, 1), e_pad), i32),  # base
                 jax.ShapeDtypeStruct((e_pad,), i32),  # offsets
                 jax.ShapeDtypeStruct(inits[0].shape, i32)]  # sync
    n_out = len(out_shape)
    if poison:  # h starts as NaN: a row read before it is written shows in y
        inits.insert(0, jnp.full(out_shape[0].shape, jnp.nan, act))
    if trace:
        inits.append(jnp.full((c_max, len(TRACE_FIELDS)), -1, i32))
        out_shape.append(jax.ShapeDtypeStruct(inits[-1].shape, i32))
    if stamps:
        inits.append(jnp.zeros((g + c_max,), i32))
        out_shape.append(jax.ShapeDtypeStruct(inits[-1].shape, i32))
    inputs = [x.astype(act), ids, sorted_d, blk_d, topk_weights.reshape(-1).astype(jnp.float32)]
    inputs += up.inputs + down.inputs
    # The aliased outputs: (h,) sync, (trace), (stamps); the rest start uninitialised (y32: the
    # zero tiles; the align's arrays: the align tiles)
    alias_out = ([0] if poison else []) + list(range(n_out - 1, n_out + trace + stamps))
    aliases = {len(inputs) + n: o for n, o in enumerate(alias_out)}
    rb = min(32, n_decode & -n_decode) if n_decode else 1  # a power of two dividing n_decode
    s = _Static(k=k, e=e, p=p, p_d=p_d, m=m, md=n_decode, rb=rb, bm=bm, nb_d=nb_d, nbk=nbk, n_align=n_align,
                e_pad=e_pad, zr=zr, zd=zd, zp=chunks - zd, up=_strip(up), down=_strip(down), limit=swiglu_limit,
                trace=trace, stamps=stamps, interpret=interpret, n_init=len(inits))
    name = "expert_tiles" + ("" if up.qm is None else f"_int{up.qm.bits}") + f"_m{bm}"
    outs = pl.pallas_call(
        functools.partial(_kernel, s=s),
        out_shape=out_shape,
        grid=(g,),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        name=name,
    )(*inputs, *inits)
    h, y, y32 = outs[:3]
    sync = outs[n_out - 1]
    rest = list(outs[n_out:])
    tr = rest.pop(0) if trace else None
    st = rest.pop(0) if stamps else None
    # The prefill rows, rounded after the launch (in place into the kernel's y: a dynamic update slice)
    y = lax.dynamic_update_slice_in_dim(y, y32[n_decode:m].astype(x.dtype), n_decode, axis=0)
    return TileRun(y, h, y32, sync, tr, st)


def tile_moe(x, topk_ids, topk_weights, w13, w2, *, n_decode: int, swiglu_limit=None, backend="auto",
             plan: Plan | None = None, trace: bool = False):
    """y [M, D] = sum_k topk_weights * expert_{topk_ids}(x) over decode and prefill tokens at once.

    x [M, D]: the decode tokens first (rows [0, n_decode)), then the prefill tokens; topk_ids,
    topk_weights [M, k]; w13, w2: `fused_moe.fused_moe`'s weights (bf16 arrays or the fields of
    `quantize_experts`). Equal to `fused_moe.fused_moe` on the same tokens up to the fp32 order of
    the combine. backend: "pallas" | "interpret" | "reference" | "auto". plan overrides
    `plan_for`. trace=True returns (y, trace [C_max, 5] int32) with the claim record (see the
    module docstring; the reference backend has none and returns None).
    """
    backend = resolve(backend)
    check_args(x, topk_ids, topk_weights, w13, w2)
    if backend == "reference":
        y = reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit)
        return (y, None) if trace else y
    run = _run(x, topk_ids, topk_weights, w13, w2, n_decode=n_decode, swiglu_limit=swiglu_limit,
               backend=backend, plan=plan, trace=trace)
    return (run.y, run.trace) if trace else run.y

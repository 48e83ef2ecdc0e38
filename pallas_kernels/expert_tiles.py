"""Tile-scheduled MoE: decode and prefill tokens of one layer in one persistent launch, decode first.

The server's mixed iteration runs it (`moe.block.routed_experts` with n_decode: a decode step
and a prefill chunk in one program); `bench/mixed_moe.py` measures it alone.

    y [M, D] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])   (fused_moe's maths)
    tokens [0, M_d) are the decode class, [M_d, M) the prefill class (M_d = n_decode).

Why. Two launches (decode, then prefill) make decode wait for nothing but read every expert that
both classes use twice; one grouped launch over the union reads each expert once but makes the
decode outputs wait for the whole prefill. Here one launch aligns the union, and the blocks that
hold decode pairs run first: every one of their tiles is claimed before any other GEMM tile
(ExpertPlex's adaptive persistent kernel, §4.2).

Layout. The union's pairs (p = m*k + slot) grouped by expert, one expert per block. An expert's
run is split in two: its hot run, ceil(d_e / BM_h) blocks of BM_h rows holding its d_e decode
pairs, and its cold run, blocks of BM rows (BM_h <= BM, `Plan.block_m_hot`) of its prefill pairs.
With BM_h = BM the hot run is filled up with as many prefill pairs as fit (the cold run holds the
rest), so a decode expert's weights are read once, but the hot blocks wait for the whole union's
align. A shorter BM_h keeps long prefill blocks off the decode path at the price of reading those
experts again; then the hot blocks hold decode pairs only, and the align runs in two phases:
phase 0 the decode pairs (the hot runs), phase 1 the prefill pairs (the cold runs), behind the
hot tiles. Hot blocks come first: blocks [0, n_hot) are hot, [n_hot, n_blocks) cold, and h's hot
rows precede its cold rows. All of it is built inside the launch, by the align tiles
(below): sorted (the pair at each slot), blk (each block's expert), rows (each block's pairs, its
first rows; the rest are padding, masked, never written). h holds the blocks' rows.
Weights: fused_moe's formats, w13 [E, D, 2I] (gate/up interleaved by column) and w2 [E, I, D] in
bf16, or both fields of `experts.quantize_experts` (grouped low-bit, dequantised in registers
on the tensor-core "dot" path of fused_moe; its helpers `weight_operands`, `expert_tile`,
`swiglu_columns` are shared, not copied).

Tiles and the queue. A GEMM tile is one block's BM rows times one N-block of one GEMM:
  up   (b, t): rows x[pair // k] @ W13_e[:, t*BN_u : (t+1)*BN_u] -> SwiGLU -> h[b rows, t cols]
  down (b, t): rows h[b rows] @ W2_e[:, t*BN_d : (t+1)*BN_d] * topk weight -> y32[token, cols]
with T_u = 2I/BN_u and T_d = D/BN_d tiles per block. Besides them, the align tiles and zero tiles
(ZR rows of the fp32 accumulator y32 <- 0: it starts uninitialised, so no memset sits before the
launch). The queue is the claim index c = 0, 1, ... read against these segments, in order:
  [align 0: count x N_0, offsets, place x N_0 | zero 0 x Z_0 | hot up: n_hot*T_u |
   hot down: n_hot*T_d | align 1 | zero 1 | cold up: n_cold*T_u | cold down: n_cold*T_d]
One phase: align 0 takes all NBk count and place tiles and zero 0 all R/ZR zero tiles (align 1 and
zero 1 are empty). Two: align 0 the decode pairs' and zero 0 the tiles covering the decode rows,
align 1 and zero 1 the rest.
(block-major, N-block fastest: consecutive claims share a block's rows in L2, sibling blocks of
one expert its weights). No tile list is materialised: a program maps c to its tile from the
block counts, so the queue costs no memory and no launch.

The align (NBk tiles of PB = `Plan.align_pairs` pairs; a tile holds decode pairs or prefill
pairs, never both). A count tile adds 1 to its class's counter of each pair's expert, one atomic
a pair; the old count is the pair's rank among its class's pairs of that expert. A phase's
offsets tile (after its counts) lays out its runs: each expert's first hot (phase 0) and first
cold slot, blk, rows, n_hot (phase 0) and n_blocks. A place tile (after its phase's offsets)
writes each pair to its slot: rank r in the expert's run (in one phase, a prefill pair's rank
after the expert's d_e decode pairs), in the hot run if r < ceil(d_e / BM_h)*BM_h (two phases:
decode pairs only), else in the cold run. Pairs of an expert land in the order their atomics
ran, not in p order (as in fused_moe's blocked align on the GPU): any order serves, rows being
independent and the combine a sum. A claim past a phase's align and zero tiles waits, once per
program, for the phase's last place tile, then reads n_hot (phase 0) and n_blocks (the last
phase), and so where the next segments start and the queue's length.

Grid and claims. A persistent grid of G programs (`Plan.programs`, default PROGRAMS_PER_SM = 2 a
SM: 264 on the H200; where two do not fit an SM the second waits and finds the queue empty).
Each program loops: c = atomic_add(sync[0], 1); stop once c >= the tile count; run tile c.
Claims are handed out in queue order, so no cold tile is claimed before the last hot tile (the
debug trace makes that testable), and a hot tile waits behind no cold tile at all (the bound of
one tile per program would apply to decode work arriving mid-launch; within one launch the hot
tiles simply come first). What decode does wait for is its align (in one phase, the union's:
13-34 µs on the H200 at 8 decode + 512..8192 prefill tokens) and, in one phase, its own experts'
prefill rows in the hot blocks; the decode rows are rounded in the launch (below), the prefill
rows after it.
Claims are relaxed atomics (they order nothing; an ordered one would first wait for the last
tile's atomic adds); each hand-off below is a release (barrier, ordered atomic increment) and an
acquire (ordered atomic reads, barrier).

Dependencies. Down tile (b, t) needs all T_u up tiles of block b. An up tile stores its h tile,
then (barrier, so every thread's stores precede it) atomically increments its block's counter; a
down tile spins on atomic reads of it until it reads T_u, then reads h. It also waits for every
zero tile (a hot block holds prefill rows too). Deadlock-free without assuming that every program
is resident: every wait targets tiles claimed earlier (queue order) by programs already running:
the offsets tile waits for the count tiles, place tiles for the offsets tile, GEMM claims for the
place tiles, down tiles for zero tiles and their block's up tiles; count, zero and up tiles wait
for nothing. Phase 1's offsets tile reads n_hot, which its program read (waiting for phase 0)
when it claimed past phase 0.

Combine: atomic adds into y32 [R, D] fp32 (R >= M + 1 rows, whole zero tiles; row M: the padding
rows' sink in interpret mode, adding 0), relaxed (pallas_kernels/relaxed_atomic.py: Pallas' own
atomics fence before each one). Chosen over a per-pair output and a sum because a decode row is
then final inside the launch the moment its last down tile lands: a counter per down N-block
counts the hot blocks landed, and the last one rounds that N-block of the decode rows into y
(volatile loads, from L2 where the atomics summed). The prefill rows are rounded after the
launch, in place. The price is that the fp32 sum order (and so, rarely, the last bit after the
rounding) varies run to run. y is rounded once to x's dtype.

Debug outputs (off by default): trace [C_max, 5] int32 per claim index c: (kind, j, N-block,
program, finish ticket), j being a GEMM tile's block (cold blocks after the hot ones), a zero
tile's chunk or an align tile's index in the align; kinds as KINDS (0 hot up, 1 hot down, 2 cold
up, 3 cold down, 4 zero, 5 align); the ticket is the order in which tiles finished (a second
atomic counter). Rows past the last claim stay -1. stamps (GPU only: the inline PTX has no CPU
rule): int32 [G + C_max], the low word of the %globaltimer nanosecond clock when each program
starts (first G) and when each claimed tile has finished; the benchmark reads decode completion
from them.

Rounding: h is rounded to the activation dtype between the GEMMs (as fused_moe); y once.
Bytes: each block reads its expert's weights once (an expert re-reads them once per block past
its first), plus x and y, h written and read once (padding rows are masked, never moved), and
P*D*4 of fp32 atomics.
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
from pallas_kernels.experts import check_args, expert_dims, reference, rows_layout
from pallas_kernels.fused_moe import expert_tile, pop_weight_refs, swiglu_columns, weight_operands
from pallas_kernels.moe_align import align_sizes, next_pow2
from pallas_kernels.quant import QuantizedWeight
from pallas_kernels.relaxed_atomic import relaxed_atomic_add

H200_SMS = 132
# Persistent programs per SM: 2 beat 1 on the H200, 3 no better (bench/history/expert_tiles.md).
PROGRAMS_PER_SM = 2
KINDS = ("hot up", "hot down", "cold up", "cold down", "zero", "align")  # hot: blocks holding decode pairs
ZERO_ROWS = 64  # y32 rows per zero tile (ZR)
# sync int32 counters (zeros before the launch): the next claim; finish tickets; the blocks (hot,
# all); then each align phase's four (see `_sync`); then T_d counters (hot blocks whose down tile t
# has landed), 2 x E_pad per-expert pair counts (decode's, then prefill's), and one counter per
# block (its up tiles done).
SYNC_CLAIM, SYNC_TICKET, SYNC_HOT, SYNC_NB = range(4)
COUNTED, OFFSETS, PLACED, ZEROED = range(4)  # a phase's count, offsets, place and zero tiles done
SYNC_ROUND = 12


def sync_index(phase: int, counter: int) -> int:
    """Where align phase `phase` (0: the hot blocks' pairs, 1: the cold blocks' when apart) keeps
    `counter` (COUNTED, OFFSETS, PLACED or ZEROED)."""
    return 4 + 4 * phase + counter


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
    block_m: int = 64  # rows per block (a power of two >= 16: tensor-core dots)
    up: Tile = Tile()
    down: Tile = Tile()
    num_warps: int = 4
    num_stages: int = 3
    programs: int | None = None  # persistent programs; None: PROGRAMS_PER_SM a SM (4 in interpret mode)
    align_pairs: int = 512  # pairs per align tile (PB; a power of two)
    block_m_hot: int | None = None  # rows per hot block (BM_h, at most block_m); None: block_m


def plan_for(pairs: int, e: int, quantized: bool) -> Plan:
    """Launch heuristics, by the union's rows an expert: BM 16 up to 24, 64 up to 96, else 128 with
    hot blocks of 16, all of 4 warps (two programs an SM; BM 128 spills ~0.4 KB in its epilogue).
    At 128 rows an expert hot blocks of 16 (decode pairs only, two align phases) keep the decode
    span near the decode-only launch's; at fewer rows BM 64 keeps its hot blocks as tall as the
    cold ones (the decode experts then read once). H200 figures: bench/history/expert_tiles.md."""
    r = pairs / e
    bm = 16 if r <= 24 else 64 if r <= 96 else 128
    hot = 16 if bm == 128 else None
    warps = 4
    if quantized:
        return Plan(bm, Tile(0, 0), Tile(0, 0), warps, 3, block_m_hot=hot)
    return Plan(bm, Tile(64, 128), Tile(64, 128), warps, 3, block_m_hot=hot)


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
    bm: int  # rows per cold block
    bmh: int  # rows per hot block
    h0: int  # the hot region's rows (of h and of the slots): its bound of hot blocks times BM_h
    pb: int  # pairs per align tile
    nbk_d: int  # count (and place) tiles of the decode pairs, PB pairs each
    nbk: int  # ... of all pairs (the decode pairs' first)
    e_pad: int  # experts padded to a power of two (>= 32)
    zr: int  # y32 rows per zero tile
    chunks: int  # zero tiles
    z1: int  # ... of phase 0 (all, or those covering the decode rows when the phases are apart)
    split: bool  # the align in two phases: hot blocks hold decode pairs only (BM_h < BM)
    up: object  # fused_moe.WeightOperands of w13, without its arrays
    down: object
    limit: float | None
    trace: bool
    stamps: bool
    interpret: bool
    n_init: int

    @property
    def n1(self) -> int:  # count (and place) tiles of phase 0: the decode pairs', or all
        return self.nbk_d if self.split else self.nbk

    @property
    def a1(self) -> int:  # phase 0's align tiles: counts, the offsets tile, places
        return 2 * self.n1 + 1

    @property
    def a2(self) -> int:  # ... phase 1's (none when the phases are one)
        return 2 * (self.nbk - self.n1) + 1 if self.split else 0

    @property
    def sync_count(self) -> int:  # the per-expert pair counts, decode's then prefill's
        return SYNC_ROUND + self.down.n_tiles

    @property
    def sync_up(self) -> int:  # the per-block up-tile counters
        return self.sync_count + 2 * self.e_pad


# ---------------------------------------------------------------------------------- kernel
def _kernel(*refs, s: _Static):
    refs = list(refs)
    x_ref = refs.pop(0)  # [M, D] activation dtype
    ids_ref = refs.pop(0)  # [P] int32 expert of each pair (aligned here, by the align tiles)
    tw_ref = refs.pop(0)  # [P] f32 routed weight per pair
    w13 = pop_weight_refs(refs, s.up.qm)
    w2 = pop_weight_refs(refs, s.down.qm)
    del refs[:s.n_init]  # aliased initial outputs: only the output refs are used
    h_ref = refs.pop(0)  # [NB*BM, I] slot rows, hot blocks first
    y_ref = refs.pop(0)  # [M, D]: the kernel writes the decode rows
    y32_ref = refs.pop(0)  # [R, D] f32, R = ZR chunks covering M + 1 rows; uninitialised: zero tiles
    sorted_ref = refs.pop(0)  # [NB*BM + 1] int32: the pair at each slot (+ a sink slot); padding unwritten
    blk_ref = refs.pop(0)  # [NB + 1] int32: expert of each block (+ a sink)
    rows_ref = refs.pop(0)  # [NB + 1] int32: pairs in each block (its first rows; + a sink)
    rank_ref = refs.pop(0)  # [P] int32: each pair's rank among its class's pairs of its expert
    offs_ref = refs.pop(0)  # [3, E_pad] int32: each expert's first hot slot, first cold slot, decode pairs
    sync_ref = refs.pop(0)  # int32 counters, see SYNC_*
    trace_ref = refs.pop(0) if s.trace else None  # [C_max, 5] int32
    stamp_ref = refs.pop(0) if s.stamps else None  # [G + C_max] int32

    bm, bmh, k, p, p_d, zr, e_pad = s.bm, s.bmh, s.k, s.p, s.p_d, s.zr, s.e_pad
    tu, td = s.up.n_tiles, s.down.n_tiles
    hb = s.up.bn // 2  # h columns per up tile
    bn_d = s.down.bn
    pb = s.pb
    prog = pl.program_id(0)
    # Traced, not literal: constants created inside a loop body become consts of the body's jaxpr,
    # which the interpreter's discharge of nested loops rejects.
    zero = prog * 0
    one = zero + 1
    n2 = s.nbk - s.n1  # phase 1's count (and place) tiles
    z2 = s.chunks - s.z1  # ... and zero tiles
    prefix = s.a1 + s.z1  # claims before the hot GEMM tiles: phase 0's align and zero tiles

    def at(phase, counter):
        return sync_index(phase, counter)

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

    def placed(phase):
        """Wait for every place tile of the phase (or its offsets tile, where it has no pairs)."""
        n = s.n1 if phase == 0 else n2
        spin(at(phase, PLACED), n) if n else spin(at(phase, OFFSETS), 1)

    # ------------------------------------------------------------ the align
    def align_pairs(b):
        """Align tile b's pairs: (decode tile?, its first pair, its end (the class's), pair indices
        q [PB], their experts [PB]: E_pad past the end, which no histogram column counts). Tiles
        [0, NBk_d) cover the decode pairs, the others the prefill pairs: a tile never mixes them."""
        dec = b < s.nbk_d
        start = jnp.where(dec, b * pb, p_d + (b - s.nbk_d) * pb)
        end = jnp.where(dec, zero + p_d, zero + p)  # traced operands: a select of literals mis-lowers
        q = start + jnp.arange(pb, dtype=jnp.int32)
        ids = pltriton.load(ids_ref.at[pl.ds(start, pb)], mask=q < end, other=e_pad)
        return dec, start, end, q, ids

    def count_tile(b, phase):
        """Tile b's pairs counted into their class's expert counters, one atomic increment a pair: its
        old count is the pair's rank (stored). The interpreter's atomics gather, add and scatter, so
        repeated indices in one op would collide: there one pair at a time."""
        dec, start, end, q, ids = align_pairs(b)
        counts = jnp.where(dec, zero, zero + e_pad) + s.sync_count
        if s.interpret:
            def one_pair(i, carry):
                pair = start + i
                e = ids_ref[jnp.minimum(pair, p - 1)]
                real = (pair < end) & (e < s.e)
                rank = relaxed_atomic_add(sync_ref, jnp.where(real, counts + e, counts), real.astype(jnp.int32))

                @pl.when(real)
                def _():
                    rank_ref[pair] = rank

                return carry

            lax.fori_loop(0, pb, one_pair, zero)
        else:
            real = ids < s.e  # and q < end (past it, ids are E_pad)
            rank = relaxed_atomic_add(sync_ref, counts + jnp.where(real, ids, 0), real.astype(jnp.int32), mask=real)
            pltriton.store(rank_ref.at[pl.ds(start, pb)], rank, mask=real)
        release(at(phase, COUNTED))

    def offsets_tile(phase, n_hot):
        """Once the phase's counts are in, its runs: phase 0 lays out the hot runs (and the cold
        ones, when the phases are one), phase 1 the cold runs (after the n_hot hot blocks); each
        with its blocks' experts and rows, and the hot / total block count."""
        spin(at(phase, COUNTED), s.n1 if phase == 0 else n2)
        ex = jnp.arange(e_pad, dtype=jnp.int32)
        real = ex < s.e  # ids in [E, E_pad) are skipped pairs, in no block

        def pairs(cls):  # [E_pad] the class's pairs of each expert (0: decode, 1: prefill)
            return jnp.where(real, pltriton.load(sync_ref.at[pl.ds(s.sync_count + cls * e_pad, e_pad)],
                                                 volatile=True), 0)

        nd = pairs(0)
        none = ex * 0
        hot = hot0 = cold = cold0 = rest = none
        if phase == 0:  # the hot runs
            hot = (nd + bmh - 1) // bmh  # [E_pad] blocks holding the expert's decode pairs
            n_hot = jnp.sum(hot)
            hot0 = jnp.cumsum(hot) - hot  # first block of each expert's hot run
            offs_ref[0, :] = hot0 * bmh
            offs_ref[2, :] = nd
        hot_pairs = nd if s.split else nd + pairs(1)  # a union's hot runs take prefill pairs too
        lay_cold = phase == 1 or not s.split
        if lay_cold:  # the cold runs: each expert's pairs past its hot run
            rest = pairs(1) if s.split else jnp.maximum(hot_pairs - hot * bmh, 0)
            cold = (rest + bm - 1) // bm
            cold0 = n_hot + jnp.cumsum(cold) - cold  # first block of each expert's cold run
            offs_ref[1, :] = s.h0 + (cold0 - n_hot) * bm
        sink = blk_ref.shape[0] - 1

        def fill_blocks(i, carry):  # the i-th block of every expert with more than i blocks
            is_hot = i < hot
            ic = i - hot
            used = is_hot | (ic < cold)
            b = jnp.where(is_hot, hot0 + i, jnp.where(used, cold0 + ic, sink))
            rows = jnp.where(is_hot, jnp.minimum(hot_pairs - i * bmh, bmh), jnp.minimum(rest - ic * bm, bm))
            pltriton.store(blk_ref.at[b], ex, mask=used)
            pltriton.store(rows_ref.at[b], rows, mask=used)
            return carry

        lax.fori_loop(0, jnp.max(hot + cold), fill_blocks, zero)
        if phase == 0:
            relaxed_atomic_add(sync_ref, zero + SYNC_HOT, n_hot)
        if lay_cold:
            relaxed_atomic_add(sync_ref, zero + SYNC_NB, n_hot + jnp.sum(cold))
        release(at(phase, OFFSETS))

    def place_tile(b, phase):
        """Tile b's pairs to their slots. A pair's rank in its expert's run: its rank in its class,
        after the expert's decode pairs if it is a prefill pair of a union. Ranks below the hot run's
        capacity go to the hot run, the others to the cold run."""
        spin(at(phase, OFFSETS), 1)
        dec, start, end, q, ids = align_pairs(b)
        valid = ids < s.e
        e = jnp.where(valid, ids, 0)

        def offs(row):
            return pltriton.load(offs_ref.at[row, e], volatile=True)

        nd = offs(2)
        r = pltriton.load(rank_ref.at[pl.ds(start, pb)], mask=valid, other=0, volatile=True)
        if s.split:  # decode pairs fill the hot runs, prefill pairs the cold runs
            cap = jnp.where(dec, (nd + bmh - 1) // bmh * bmh, 0)
        else:
            r = r + jnp.where(dec, zero, nd)
            cap = (nd + bmh - 1) // bmh * bmh
        first = jnp.where(r < cap, offs(0), offs(1) - cap)
        # Masked-off lanes point at the last slot, never a pair's (interpret mode may write them back)
        slot = jnp.where(valid, first + r, sorted_ref.shape[0] - 1)
        pltriton.store(sorted_ref.at[slot], q, mask=valid)
        release(at(phase, PLACED))

    def align_tile(j, n_hot):
        """Align tile j: phase 0's [count x n1, offsets, place x n1], then phase 1's."""
        for phase, base, b0, n in ((0, 0, 0, s.n1), (1, s.a1, s.n1, n2)):
            if phase and not s.split:
                break
            i = j - base
            pl.when((i >= 0) & (i < n))(lambda: count_tile(b0 + i, phase))
            pl.when(i == n)(lambda: offsets_tile(phase, n_hot))
            pl.when((i > n) & (i <= 2 * n))(lambda: place_tile(b0 + i - n - 1, phase))

    # ------------------------------------------------------------ the GEMM tiles
    def block(j, n_hot, rows):
        """Block j of `rows` rows (BM_h hot, BM cold) -> (expert, pairs [rows], valid [rows], its
        first row in h and the slots). Its arrays were written in this launch by other SMs; plain
        loads see them, as no SM reads their lines before the align's acquire (volatile loads here
        cost ~40% of a decode launch at BM 64 on the H200)."""
        row0 = jnp.where(j < n_hot, j * bmh, s.h0 + (j - n_hot) * bm)
        valid = jnp.arange(rows, dtype=jnp.int32) < rows_ref[j]
        pair = pltriton.load(sorted_ref.at[pl.ds(row0, rows)], mask=valid, other=0)
        return blk_ref[j], pair, valid, row0

    def zero_tile(z):
        """y32 rows [z*ZR, (z+1)*ZR) <- 0, in D / BN_d column blocks; chunks [0, Z1) are phase 0's."""
        def cols(ci, carry):
            y32_ref[pl.ds(z * zr, zr), pl.ds(pl.multiple_of(ci * bn_d, bn_d), bn_d)] = jnp.zeros((zr, bn_d),
                                                                                                  jnp.float32)
            return carry

        lax.fori_loop(0, td, cols, zero)
        release(jnp.where(z < s.z1, zero + at(0, ZEROED), zero + at(1, ZEROED)))

    def up_tile(j, t, n_hot, rows):
        e, pair, valid, row0 = block(j, n_hot, rows)
        tok = jnp.where(valid, lax.div(pair, k), 0)[:, None]  # [BM, 1]

        def a_load(k0, size):  # x rows gathered by token; padding rows read nothing (0)
            cols = (k0 + jnp.arange(size, dtype=jnp.int32))[None, :]
            return pltriton.load(x_ref.at[tok, cols], mask=valid[:, None], other=0.0)

        acc = expert_tile(w13, s.up.qm, e, t, a_load, n_k=s.up.n_k, bk=s.up.bk, bn=s.up.bn, bm=rows, fma=False)
        h = swiglu_columns(acc, s.limit).astype(h_ref.dtype)  # [BM, BN_u / 2]
        mask = jnp.broadcast_to(valid[:, None], h.shape)
        pltriton.store(h_ref.at[pl.ds(row0, rows), pl.ds(t * hb, hb)], h, mask=mask)
        release(s.sync_up + j)

    def round_decode(t):
        """y[decode rows, tile t] <- y32 rounded: every hot block's down tile t has landed.
        Chunks of RB rows, RB dividing M_d (no masks). Volatile loads, served by L2, where other
        SMs' atomics made the sums (cache_modifier ".cg" does not lower in jax 0.10)."""

        def chunk(i, carry):
            rows = pl.ds(pl.multiple_of(i * s.rb, s.rb), s.rb)
            cols = pl.ds(pl.multiple_of(t * bn_d, bn_d), bn_d)
            v = pltriton.load(y32_ref.at[rows, cols], volatile=True)
            y_ref[rows, cols] = v.astype(y_ref.dtype)
            return carry

        lax.fori_loop(0, s.md // s.rb, chunk, zero)

    def down_tile(j, t, n_hot, rows, cold):
        e, pair, valid, row0 = block(j, n_hot, rows)
        # Acquire block j's h (its T_u up tiles were claimed before this tile and wait for nothing)
        # and y32's zeroed rows (the zero tiles were claimed before it too): the hot blocks' rows
        # are phase 0's, a cold block's may be any.
        spin(s.sync_up + j, tu)
        spin(at(0, ZEROED), s.z1)
        if cold and z2:
            spin(at(1, ZEROED), z2)

        def a_load(k0, size):  # the block's own h rows; padding rows were never written
            mask = jnp.broadcast_to(valid[:, None], (rows, size))
            return pltriton.load(h_ref.at[pl.ds(row0, rows), pl.ds(k0, size)], mask=mask, other=0.0)

        acc = expert_tile(w2, s.down.qm, e, t, a_load, n_k=s.down.n_k, bk=s.down.bk, bn=bn_d, bm=rows, fma=False)
        w = pltriton.load(tw_ref.at[jnp.where(valid, pair, 0)], mask=valid, other=0.0)  # [BM]
        val = acc * w[:, None]  # padding rows: 0
        tok = jnp.where(valid, lax.div(pair, k), s.m)[:, None]  # padding adds 0 to the sink row M
        cols = (t * bn_d + jnp.arange(bn_d, dtype=jnp.int32))[None, :]
        # The interpreter has no masked atomics; unmasked, padding adds 0 to row M. Relaxed: a sum
        # needs no ordering (the finish ticket / the kernel's end orders it).
        mask = None if s.interpret else jnp.broadcast_to(valid[:, None], val.shape)
        relaxed_atomic_add(y32_ref, (tok, cols), val, mask=mask)
        if s.md:  # the last hot block to land its tile t rounds the decode rows' tile t
            @pl.when(j < n_hot)
            def _():
                @pl.when(release(SYNC_ROUND + t) == n_hot - 1)
                def _():
                    barrier()
                    round_decode(t)

    # ------------------------------------------------------------ the queue
    def tile_of(c, n_hot, n_blocks):
        """Claim index -> (kind, index j in its segment, N-block t) over the segments
        [align 0 | zero 0 | hot up | hot down | align 1 | zero 1 | cold up | cold down]; j of a zero
        tile is its chunk, of an align tile its index in the align (phase 1's after phase 0's), of
        a GEMM tile its block (cold blocks follow the hot ones). n_hot, n_blocks: -1 until read
        after their phase's align (the claims before those segments do not depend on them)."""
        n_hot, n_cold = jnp.maximum(n_hot, 0), jnp.maximum(n_blocks - n_hot, 0)
        segments = ((5, s.a1, 1, 0), (4, s.z1, 1, 0), (0, n_hot * tu, tu, 0), (1, n_hot * td, td, 0),
                    (5, s.a2, 1, s.a1), (4, z2, 1, s.z1), (2, n_cold * tu, tu, n_hot), (3, n_cold * td, td, n_hot))
        kind = j = t = zero
        start = zero
        for kd, length, width, j0 in segments:
            if isinstance(length, int) and not length:
                continue
            inside = ((c >= start) & (c < start + length)).astype(jnp.int32)
            local = (c - start) * inside
            kind, j, t = kind + kd * inside, j + (j0 + lax.div(local, width)) * inside, t + lax.rem(local, width)
            start = start + length
        return kind, j, t

    def blocks(c, counts):
        """(n_hot, n_blocks), each read once, when a claim passes its phase's align: wait for every
        place tile of the phase, all claimed earlier (so the wait ends even without every program
        resident). One phase: both at once."""
        n_hot, n_blocks = counts

        def wait0():
            placed(0)
            return read(SYNC_HOT), (n_blocks if s.split else read(SYNC_NB))

        n_hot, n_blocks = lax.cond((c >= prefix) & (n_hot < 0), wait0, lambda: (n_hot, n_blocks))
        if s.split:
            def wait1():
                placed(1)
                return read(SYNC_NB)

            past = (n_hot >= 0) & (c >= prefix + n_hot * (tu + td) + s.a2 + z2)
            n_blocks = lax.cond(past & (n_blocks < 0), wait1, lambda: n_blocks)
        return n_hot, n_blocks

    def clock(dep):
        """[1] int32: %globaltimer's low word (ns). The asm is pure: dep, a value that exists only
        once the event happened, keeps it from being hoisted or merged. A [1] block, not a scalar:
        the asm lowers to a tensor type."""
        [now] = pltriton.elementwise_inline_asm(
            "mov.u32 $0, %globaltimer_lo;", args=[jnp.broadcast_to(dep, (1,))], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
        return now

    def body(carry):
        c, counts = carry
        n_hot = counts[0]
        kind, j, t = tile_of(c, *counts)
        pl.when(kind == 4)(lambda: zero_tile(j))
        pl.when(kind == 5)(lambda: align_tile(j, n_hot))
        if bmh == bm:  # one code path for both (one phase: every zero tile is phase 0's)
            pl.when((kind == 0) | (kind == 2))(lambda: up_tile(j, t, n_hot, bm))
            pl.when((kind == 1) | (kind == 3))(lambda: down_tile(j, t, n_hot, bm, cold=False))
        else:
            pl.when(kind == 0)(lambda: up_tile(j, t, n_hot, bmh))
            pl.when(kind == 1)(lambda: down_tile(j, t, n_hot, bmh, cold=False))
            pl.when(kind == 2)(lambda: up_tile(j, t, n_hot, bm))
            pl.when(kind == 3)(lambda: down_tile(j, t, n_hot, bm, cold=True))
        if s.trace or s.stamps:
            ticket = relaxed_atomic_add(sync_ref, zero + SYNC_TICKET, one)
        if s.trace:
            for field, v in enumerate((kind, j, t, prog, ticket)):
                trace_ref[c, field] = v
        if s.stamps:
            stamp_ref[pl.ds(pl.num_programs(0) + c, 1)] = clock(ticket)
        c = claim()
        return c, blocks(c, counts)

    def more(carry):  # n_blocks unknown: c is before the cold tiles
        c, (_, n_blocks) = carry
        return (n_blocks < 0) | (c < prefix + s.a2 + z2 + n_blocks * (tu + td))

    if s.stamps:
        stamp_ref[pl.ds(prog, 1)] = clock(prog)
    c = claim()
    lax.while_loop(more, body, (c, blocks(c, (zero - 1, zero - 1))))


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


def run_tiles(x, topk_ids, topk_weights, w13, w2, *, n_decode: int, swiglu_limit, backend, plan: Plan | None,
         trace=False, stamps=False, poison=False) -> TileRun:
    m, k = topk_ids.shape
    if not 0 <= n_decode <= m:
        raise ValueError(f"n_decode must be in [0, M={m}], got {n_decode}")
    e, d, i = expert_dims(w13, w2)
    quant = isinstance(w13, QuantizedWeight)
    act = jnp.bfloat16 if quant else w13.dtype
    plan = plan or plan_for(m * k, e, quant)
    bm = plan.block_m
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"plan.block_m must be a power of two >= 16 (tensor-core dots), got {bm}")
    bmh = plan.block_m_hot or bm
    if bmh < 16 or bmh & (bmh - 1) or bmh > bm:
        raise ValueError(f"plan.block_m_hot must be a power of two in [16, block_m={bm}], got {bmh}")
    interpret = backend == "interpret"
    if stamps and interpret:
        raise ValueError("stamps read the GPU's %globaltimer: not available in interpret mode")
    if m == 0:  # no tokens: nothing to launch
        y = jnp.zeros((0, d), x.dtype)
        return TileRun(y, None, None, None, None, None)
    p, p_d = m * k, n_decode * k
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    up = weight_operands(w13, plan.up.block_k, plan.up.block_n, dot=True, stage="up")
    down = weight_operands(w2, plan.down.block_k, plan.down.block_n, dot=True, stage="down")
    if up.bn % 2 or up.bn < 32:
        raise ValueError(f"the up tile needs an even block_n >= 32 (gate/up pairs), got {up.bn}")
    g = _programs(plan, interpret)

    pb = plan.align_pairs
    if pb < 16 or pb & (pb - 1):
        raise ValueError(f"plan.align_pairs must be a power of two >= 16, got {pb}")
    nbk_d = -(-p_d // pb)
    nbk = nbk_d + -(-(p - p_d) // pb)  # count tiles (and place tiles): decode pairs', prefill pairs'
    # Blocks: an expert's hot run holds its decode pairs, its cold run the pairs past the hot run's
    # last block, so its blocks are at most each class's alone: sum_e ceil(d_e/BM_h) + ceil(p_e/BM).
    nbh = align_sizes(p_d, e, bmh).nb if p_d else 0
    nbc = align_sizes(p - p_d, e, bm).nb if p > p_d else 0
    nb, rows = nbh + nbc, nbh * bmh + nbc * bm  # blocks and h's rows (hot region first)
    e_pad = max(32, next_pow2(e))
    zr = ZERO_ROWS
    chunks = -(-(m + 1) // zr)  # y32 rows: whole zero tiles covering M + 1
    split = bmh < bm  # hot blocks hold decode pairs only: two align phases
    z1 = -(-n_decode // zr) if split else chunks  # phase 0's zero tiles: the decode rows', or all
    c_max = nb * (up.n_tiles + down.n_tiles) + 2 * nbk + 1 + split + chunks  # every claim's trace row
    i32 = jnp.int32
    inits = [jnp.zeros((SYNC_ROUND + down.n_tiles + 2 * e_pad + nb,), i32)]  # sync
    out_shape = [jax.ShapeDtypeStruct((rows, i), act),  # h
                 jax.ShapeDtypeStruct((m, d), x.dtype),  # y
                 jax.ShapeDtypeStruct((chunks * zr, d), jnp.float32),  # y32
                 jax.ShapeDtypeStruct((rows + 1,), i32),  # sorted (+ a sink slot)
                 jax.ShapeDtypeStruct((nb + 1,), i32),  # blk (+ a sink)
                 jax.ShapeDtypeStruct((nb + 1,), i32),  # rows (+ a sink)
                 jax.ShapeDtypeStruct((p,), i32),  # rank
                 jax.ShapeDtypeStruct((3, e_pad), i32),  # offs
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
    inputs = [x.astype(act), ids, topk_weights.reshape(-1).astype(jnp.float32)]
    inputs += up.inputs + down.inputs
    # The aliased outputs: (h,) sync, (trace), (stamps); the rest start uninitialised (y32: the
    # zero tiles; the align's arrays: the align tiles)
    alias_out = ([0] if poison else []) + list(range(n_out - 1, n_out + trace + stamps))
    aliases = {len(inputs) + n: o for n, o in enumerate(alias_out)}
    rb = min(32, n_decode & -n_decode) if n_decode else 1  # a power of two dividing n_decode
    s = _Static(k=k, e=e, p=p, p_d=p_d, m=m, md=n_decode, rb=rb, bm=bm, bmh=bmh, h0=nbh * bmh, pb=pb, nbk_d=nbk_d,
                nbk=nbk, e_pad=e_pad, zr=zr, chunks=chunks, z1=z1, split=split, up=_strip(up), down=_strip(down), limit=swiglu_limit,
                trace=trace, stamps=stamps, interpret=interpret, n_init=len(inits))
    name = "expert_tiles" + ("" if up.qm is None else f"_int{up.qm.bits}") + f"_m{bm}" + (
        f"_h{bmh}" if bmh != bm else "")
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


def supports(w13, w2) -> bool:
    """Whether the launch takes these weights: low-bit ones need the dot path's >= 16 words a
    group, and the up tile an even block_n >= 32 (callers run fused_moe / grouped_gemm otherwise);
    not the row layout."""
    if rows_layout(w13) or rows_layout(w2):
        return False
    try:
        up = weight_operands(w13, Tile().block_k, Tile().block_n, dot=True, stage="up")
        weight_operands(w2, Tile().block_k, Tile().block_n, dot=True, stage="down")
    except ValueError:
        return False
    return up.bn % 2 == 0 and up.bn >= 32


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
    run = run_tiles(x, topk_ids, topk_weights, w13, w2, n_decode=n_decode, swiglu_limit=swiglu_limit,
               backend=backend, plan=plan, trace=trace)
    return (run.y, run.trace) if trace else run.y

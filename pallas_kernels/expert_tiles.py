"""Tile-scheduled MoE: decode and prefill tokens of one layer in one persistent launch, decode first.

    y [M, D] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])   (fused_moe's maths)
    tokens [0, M_d) are the decode class, [M_d, M) the prefill class (M_d = n_decode).

Why. Two launches (decode, then prefill) make decode wait for nothing but leave the GPU half idle
at the seam; one grouped launch over the union makes decode outputs wait for the whole prefill.
Here one launch runs both, and decode work never queues behind prefill work: every decode tile
is claimed before any prefill tile (seed 002, ExpertPlex's adaptive persistent kernel, §4.2).

Layout. Each class is aligned alone (`fused_moe.moe_align`: pairs sorted by expert, each expert's
run padded to BM rows, one expert per block), then the two are concatenated, decode first:
  sorted_pairs [S] int32  pair p = m*k + slot of the union at each slot, P = padding;
  block_expert [NB] int32 expert of block b = slots [b*BM, (b+1)*BM); NB = NB_d + NB_p, the
                          align bound of each class (`align_sizes(...).nb`);
  used [2] int32          blocks the routing uses per class: a prefix of each class's blocks.
Weights: fused_moe's formats, w13 [E, D, 2I] (gate/up interleaved by column) and w2 [E, I, D] in
bf16, or both fields of `fused_moe.quantize_experts` (grouped low-bit, dequantised in registers
on the tensor-core "dot" path of fused_moe; its helpers `weight_operands`, `expert_tile`,
`swiglu_columns` are shared, not copied).

Tiles and the queue. A tile is one block's BM rows times one N-block of one GEMM:
  up   (b, t): rows x[pair // k] @ W13_e[:, t*BN_u : (t+1)*BN_u] -> SwiGLU -> h[b rows, t cols]
  down (b, t): rows h[b rows] @ W2_e[:, t*BN_d : (t+1)*BN_d] * topk weight -> y32[token, cols]
with T_u = 2I/BN_u and T_d = D/BN_d tiles per block. The queue is the claim index c = 0, 1, ...
read against four segments, in this order:
  [decode up: n_d*T_u | decode down: n_d*T_d | prefill up: n_p*T_u | prefill down: n_p*T_d]
(block-major, N-block fastest: consecutive claims share a block's rows in L2, sibling blocks of
one expert its weights). No tile list is materialised: a program maps c to its tile from the
two used-block counts, so the queue costs no memory and no launch.

Grid and claims. A persistent grid of G programs (`Plan.programs`, default PROGRAMS_PER_SM = 2 a
SM: 264 on the H200; where two do not fit an SM the second waits and finds the queue empty).
Each program loops: c = atomic_add(sync[0], 1); stop once c >= the tile count; run tile c.
Claims are handed out in queue order, so no prefill tile is claimed before the last decode tile
(the debug trace makes that testable), and a decode tile waits behind no prefill tile at all
(the bound of one tile per program would apply to decode work arriving mid-launch; within one
launch the decode tiles simply come first). What decode does wait for is the work before the
launch: both classes' aligns (the prefill class's is the blocked align beyond 64 pairs, 25-33
µs on the H200), the fp32 accumulator's zeroing, and after it y's rounding over all rows; the
benchmark counts them as decode latency.

The down tile's dependency. Down tile (b, t) needs all T_u up tiles of block b. An up tile
stores its h tile, then (barrier, so every thread's stores precede it) atomically increments
sync[2 + b]; a down tile spins on an atomic read of sync[2 + b] until it reads T_u, then reads
h. A per-block counter (not per class) lets a block's down tiles start as soon as its own up
tiles are done. Deadlock-free without assuming that every program is resident: a down tile
waits only for up tiles, which were claimed earlier (queue order) by programs that are already
running, and up tiles wait for nothing.

Combine: atomic adds into y32 [M + 1, D] fp32 (row M: the padding rows' sink, adding 0), relaxed
(pallas_kernels/relaxed_atomic.py: Pallas' own atomics fence before each one). Chosen over a
per-pair output and a sum because a decode row is then final inside the launch the moment its
last down tile lands -- the decode class completes mid-launch -- and no second launch reads
P*D*4 bytes back; the price is that the fp32 sum order (and so, rarely, the last bit after the
bf16 rounding) varies run to run. y is rounded once to x's dtype.

Debug outputs (off by default): trace [C_max, 5] int32 per claim index c: (kind, block in its
class, N-block, program, finish ticket); kind 0 decode up, 1 decode down, 2 prefill up,
3 prefill down; the ticket is the order in which tiles finished (a second atomic counter).
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
from pallas_kernels.fused_moe import (_dims, align_sizes, check_args, expert_tile, moe_align, pop_weight_refs,
                                      reference, swiglu_columns, weight_operands)
from pallas_kernels.quant import QuantizedWeight
from pallas_kernels.relaxed_atomic import relaxed_atomic_add

H200_SMS = 132
# Persistent programs per SM by default. H200, 8 decode + 512 / 2048 prefill tokens (BM 16 / 64 of
# 4 warps): the mixed launch 2018 -> 1586 / 2228 -> 1751 µs from 1 to 2 a SM, 3 no better; at
# BM 128 of 8 warps (8192 prefill tokens) 1, 2 and 3 tie (bench/RESULTS.md, 2026-12-01).
PROGRAMS_PER_SM = 2
KINDS = ("decode up", "decode down", "prefill up", "prefill down", "zero")
ZERO_ROWS = 64  # y32 rows per zero tile (ZR)
# sync [SYNC_ROUND + T_d + NB] int32: the next claim; finish tickets; zero tiles done (decode's,
# prefill's); decode blocks whose down tile t has landed (T_d counters); up tiles done per block.
SYNC_CLAIM, SYNC_TICKET, SYNC_ZERO_D, SYNC_ZERO_P, SYNC_ROUND = range(5)
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
    """Launch heuristics: BM 16 up to 24 prefill rows an expert, else 64 of 4 warps. Not 128 at
    larger chunks (as grouped_gemm.plan_for) although an expert then takes two blocks: H200, 8
    decode + 8192 prefill tokens (128 rows an expert), BM 64 took 3039 µs and its decode tiles
    157 µs alone, BM 128 of 8 warps 3385 and 226 (bench/RESULTS.md, 2026-12-01)."""
    r = p_prefill / e
    bm = 16 if r <= 24 else 64
    warps = 4
    if quantized:
        return Plan(bm, Tile(0, 0), Tile(0, 0), warps, 3)
    return Plan(bm, Tile(64, 128), Tile(64, 128), warps, 3)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the kernel needs to know at trace time (no arrays)."""

    k: int
    p: int  # pairs of the union
    m: int  # tokens of the union (y32's sink row)
    md: int  # decode tokens (rows [0, md) of y are rounded in the kernel)
    rb: int  # rows per step of that rounding: a power of two dividing md
    bm: int
    zr: int  # y32 rows per zero tile
    zd: int  # zero tiles before the decode class (chunks holding decode rows)
    zp: int  # zero tiles before the prefill class (the other chunks)
    up: object  # fused_moe.WeightOperands of w13, without its arrays
    down: object
    limit: float | None
    trace: bool
    stamps: bool
    interpret: bool
    n_init: int


# ---------------------------------------------------------------------------------- kernel
def _kernel(*refs, s: _Static):
    refs = list(refs)
    x_ref = refs.pop(0)  # [M, D] activation dtype
    sorted_ref = refs.pop(0)  # [S] int32
    blk_ref = refs.pop(0)  # [NB] int32
    used_ref = refs.pop(0)  # [2] int32
    tw_ref = refs.pop(0)  # [P] f32 routed weight per pair
    w13 = pop_weight_refs(refs, s.up.qm)
    w2 = pop_weight_refs(refs, s.down.qm)
    del refs[:s.n_init]  # aliased initial outputs: only the output refs are used
    h_ref = refs.pop(0)  # [NB*BM, I] slot rows
    y_ref = refs.pop(0)  # [M, D] activation dtype: the kernel writes the decode rows
    y32_ref = refs.pop(0)  # [R, D] f32, R = ZR chunks covering M + 1 rows; uninitialised: zero tiles
    sync_ref = refs.pop(0)  # [SYNC_UP + NB] int32, see SYNC_*
    trace_ref = refs.pop(0) if s.trace else None  # [C_max, 5] int32
    stamp_ref = refs.pop(0) if s.stamps else None  # [G + C_max] int32

    bm, k, p, zr = s.bm, s.k, s.p, s.zr
    tu, td = s.up.n_tiles, s.down.n_tiles
    hb = s.up.bn // 2  # h columns per up tile
    bn_d = s.down.bn
    prog = pl.program_id(0)
    # Traced, not literal: constants created inside a loop body become consts of the body's jaxpr,
    # which the interpreter's discharge of nested loops rejects.
    zero = prog * 0
    one = zero + 1
    sync_up = SYNC_ROUND + td  # up tiles done, per block
    n_d, n_p = used_ref[0], used_ref[1]
    seg_d = n_d * (tu + td)  # the decode class's GEMM tiles
    seg_p = n_p * (tu + td)
    total = s.zd + seg_d + s.zp + seg_p

    def barrier():  # the GPU's threads of one program; the interpreter runs a program as one
        if not s.interpret:
            pltriton.debug_barrier()

    def spin(idx, target):
        """Wait until sync[idx] >= target (an acquire: atomic reads), then let every thread on."""
        idx = zero + idx
        lax.while_loop(lambda done: done < target, lambda _: pltriton.atomic_add(sync_ref, idx, zero),
                       pltriton.atomic_add(sync_ref, idx, zero))
        barrier()

    def release(idx):
        """sync[idx] += 1 after every thread's stores (barrier, then one ordered atomic); returns
        the old count."""
        barrier()
        idx = zero + idx
        return pltriton.atomic_add(sync_ref, idx, one)

    def claim():
        """The next claim index. Relaxed: a claim orders nothing (the hand-offs have their own
        counters), and an ordered atomic fences first, waiting for the last tile's atomic adds."""
        return relaxed_atomic_add(sync_ref, zero + SYNC_CLAIM, one)

    def block_rows(b):
        pair = sorted_ref[pl.ds(b * bm, bm)]  # [BM], P = padding
        return pair, pair < p

    def zero_tile(z):
        """y32 rows [z*ZR, (z+1)*ZR) <- 0, in D / BN_d column blocks."""
        def cols(ci, carry):
            y32_ref[pl.ds(z * zr, zr), pl.ds(pl.multiple_of(ci * bn_d, bn_d), bn_d)] = jnp.zeros((zr, bn_d),
                                                                                                  jnp.float32)
            return carry

        lax.fori_loop(0, td, cols, zero)

    def up_tile(b, t):
        e = blk_ref[b]
        pair, valid = block_rows(b)
        tok = jnp.where(valid, lax.div(pair, k), 0)[:, None]  # [BM, 1]

        def a_load(k0, size):  # x rows gathered by token; padding rows read nothing (0)
            cols = (k0 + jnp.arange(size, dtype=jnp.int32))[None, :]
            return pltriton.load(x_ref.at[tok, cols], mask=valid[:, None], other=0.0)

        acc = expert_tile(w13, s.up.qm, e, t, a_load, n_k=s.up.n_k, bk=s.up.bk, bn=s.up.bn, bm=bm, fma=False)
        h = swiglu_columns(acc, s.limit).astype(h_ref.dtype)  # [BM, BN_u / 2]
        mask = jnp.broadcast_to(valid[:, None], h.shape)
        pltriton.store(h_ref.at[pl.ds(b * bm, bm), pl.ds(t * hb, hb)], h, mask=mask)
        release(sync_up + b)

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

    def down_tile(b, t, decode):
        # Acquire block b's h (its T_u up tiles were claimed before this tile and wait for nothing)
        # and y32's zeroed rows (the zero tiles were claimed before it too).
        spin(sync_up + b, tu)
        if s.zd:
            spin(SYNC_ZERO_D, s.zd)
        pl.when(jnp.logical_not(decode))(lambda: spin(SYNC_ZERO_P, s.zp))
        e = blk_ref[b]
        pair, valid = block_rows(b)

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
            @pl.when(decode)
            def _():
                @pl.when(release(SYNC_ROUND + t) == n_d - 1)
                def _():
                    barrier()
                    round_decode(t)

    def tile_of(c):
        """Claim index -> (kind, block b in the union or zero chunk, block in its class or zero chunk,
        N-block t, prefill flag). Segments: [zero (decode rows) | decode up | decode down | prefill
        up | zero (the other rows) | prefill down]."""
        # Arithmetic on 0/1 flags, not jnp.where between two literals (no Triton lowering).
        zd, zp = s.zd, s.zp
        flag = lambda v: v.astype(jnp.int32)  # noqa: E731
        is_zd = flag(c < zd)
        c1 = c - zd
        pre = flag(c1 >= seg_d)  # past the decode class's tiles
        c2 = c1 - seg_d * pre
        n_cls = n_d + (n_p - n_d) * pre
        ups = n_cls * tu  # the class's up tiles
        is_zp = pre * flag(c2 >= ups) * flag(c2 < ups + zp)
        is_zero = is_zd + is_zp
        local = (c2 - zp * pre * flag(c2 >= ups + zp)) * (1 - is_zero)  # within the class's GEMM tiles
        up = flag(local < ups)
        local = local - ups * (1 - up)
        width = td + (tu - td) * up
        j, t = lax.div(local, width), lax.rem(local, width)  # non-negative: C division is floor
        kind = (2 * pre + 1 - up) * (1 - is_zero) + 4 * is_zero
        z = c * is_zd + (zd + c2 - ups) * is_zp  # the zero chunk
        return kind, (j + n_d * pre) * (1 - is_zero) + z * is_zero, j * (1 - is_zero) + z * is_zero, t, pre

    def clock(dep):
        """[1] int32: %globaltimer's low word (ns). The asm is pure: dep, a value that exists only
        once the event happened, keeps it from being hoisted or merged. A [1] block, not a scalar:
        the asm lowers to a tensor type."""
        [now] = pltriton.elementwise_inline_asm(
            "mov.u32 $0, %globaltimer_lo;", args=[jnp.broadcast_to(dep, (1,))], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
        return now

    def body(c):
        kind, b, j, t, pre = tile_of(c)
        is_zero = kind == 4
        up = (kind == 0) | (kind == 2)

        @pl.when(is_zero)
        def _():
            zero_tile(b)
            release(SYNC_ZERO_D + pre)

        pl.when(up)(lambda: up_tile(b, t))
        pl.when((kind == 1) | (kind == 3))(lambda: down_tile(b, t, kind == 1))
        if s.trace or s.stamps:
            ticket = relaxed_atomic_add(sync_ref, zero + SYNC_TICKET, one)
        if s.trace:
            for field, v in enumerate((kind, j, t, prog, ticket)):
                trace_ref[c, field] = v
        if s.stamps:
            stamp_ref[pl.ds(pl.num_programs(0) + c, 1)] = clock(ticket)
        return claim()

    if s.stamps:
        stamp_ref[pl.ds(prog, 1)] = clock(prog)
    lax.while_loop(lambda c: c < total, body, claim())


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


def _align(ids, n_decode_pairs: int, e: int, bm: int, backend: str):
    """Both classes in one align: prefill pairs take expert ids e + E, so the decode class's blocks
    (experts 0..E-1) come first, then the prefill class's, each expert's run padded to BM within
    its class. Returns (sorted_pairs [S], block_expert [NB] in 0..E-1 (-1 unused), used [2]
    int32 blocks per class, NB)."""
    p = ids.shape[0]
    cls = jnp.arange(p, dtype=jnp.int32) >= n_decode_pairs
    sorted_pairs, block2 = moe_align(ids + e * cls, 2 * e, bm, backend=backend)
    nb = align_sizes(p, 2 * e, bm).nb
    block2 = block2[:nb]
    used = jnp.stack([jnp.sum((block2 >= 0) & (block2 < e)), jnp.sum(block2 >= e)]).astype(jnp.int32)
    return sorted_pairs, jnp.where(block2 >= e, block2 - e, block2), used, nb


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
    p = m * k
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    sorted_pairs, block_expert, used, nb = _align(ids, n_decode * k, e, bm, backend)

    up = weight_operands(w13, plan.up.block_k, plan.up.block_n, dot=True, stage="up")
    down = weight_operands(w2, plan.down.block_k, plan.down.block_n, dot=True, stage="down")
    if up.bn % 2 or up.bn < 32:
        raise ValueError(f"the up tile needs an even block_n >= 32 (gate/up pairs), got {up.bn}")
    g = _programs(plan, interpret)

    zr = ZERO_ROWS
    chunks = -(-(m + 1) // zr)  # y32 rows: whole zero tiles covering M + 1
    zd = -(-n_decode // zr)
    c_max = nb * (up.n_tiles + down.n_tiles) + chunks
    h_shape = jax.ShapeDtypeStruct((nb * bm, i), act)
    inits = [jnp.zeros((SYNC_ROUND + down.n_tiles + nb,), jnp.int32)]
    out_shape = [h_shape, jax.ShapeDtypeStruct((m, d), x.dtype),
                 jax.ShapeDtypeStruct((chunks * zr, d), jnp.float32), jax.ShapeDtypeStruct(inits[0].shape, jnp.int32)]
    if poison:  # h starts as NaN: a row read before it is written shows in y
        inits.insert(0, jnp.full(h_shape.shape, jnp.nan, act))
    if trace:
        inits.append(jnp.full((c_max, len(TRACE_FIELDS)), -1, jnp.int32))
        out_shape.append(jax.ShapeDtypeStruct(inits[-1].shape, jnp.int32))
    if stamps:
        inits.append(jnp.zeros((g + c_max,), jnp.int32))
        out_shape.append(jax.ShapeDtypeStruct(inits[-1].shape, jnp.int32))
    inputs = [x.astype(act), sorted_pairs, block_expert, used, topk_weights.reshape(-1).astype(jnp.float32)]
    inputs += up.inputs + down.inputs
    # The aliased outputs: (h,) sync, (trace), (stamps); y and y32 are not (y32: the zero tiles)
    alias_out = ([0] if poison else []) + [3] + list(range(4, 4 + trace + stamps))
    aliases = {len(inputs) + n: o for n, o in enumerate(alias_out)}
    rb = min(32, n_decode & -n_decode) if n_decode else 1  # a power of two dividing n_decode
    s = _Static(k=k, p=p, m=m, md=n_decode, rb=rb, bm=bm, zr=zr, zd=zd, zp=chunks - zd, up=_strip(up), down=_strip(down), limit=swiglu_limit, trace=trace, stamps=stamps,
                interpret=interpret, n_init=len(inits))
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
    h, y, y32, sync = outs[:4]
    rest = list(outs[4:])
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

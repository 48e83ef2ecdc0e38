"""Grouped GEMM for the MoE at prefill sizes: gate/up GEMM + SwiGLU, down GEMM + routed-weight combine.

    y [M, D] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])
    expert_e(x) = swiglu(x @ W13_e) @ W2_e   (pallas_kernels/fused_moe.py: the same maths)

The decode-size kernels (fused_moe) stream each routed expert once for a handful of rows; here
every expert has tens to hundreds of rows (Ling, 4096 tokens x top-8 over 512 experts: 64 on
average), so the work is a grouped GEMM: one [rows_e, K] @ [K, N] product per expert on the
tensor cores. XLA's `lax.ragged_dot` computes every expert against every row (298 ms a layer
at 4096 tokens on the H200); this reads each expert's weights once per row block.

Layout. Pairs p = m*k + slot. `moe_align.moe_align` (blocked path beyond 64 pairs) sorts them by
expert (within an expert, in any order: rows are independent), each expert's run padded to BM
rows, one expert per block:
  sorted_pairs [S] int32 (P = padding), block_expert [NBP] int32 (-1: unused block);
  NB = n + (P - n) // BM, n = min(P, E), bounds the blocks of any routing.
Weights as in fused_moe: w13 [E, D, 2I] with gate/up INTERLEAVED by column (2j gate, 2j+1 up:
an output tile holds both halves of its SwiGLU), w2 [E, I, D]; or the grouped low-bit format of
`experts.quantize_experts` (per expert torch orientation, words [E, T, K*b/32, B_N], bf16
scales [E, T, K/G, B_N]; the tile B_N is the layout's).

Kernels (Triton lowering; `jnp.dot` -> tt.dot: wgmma on sm_90 for BM >= 64 or plan.swap, mma.sync
for BM 16 / 32 unswapped):
  up    grid (2I/BN, NB), tile t fastest: program (t, j) gathers block j's BM rows of x (masked:
        padding rows are 0), multiplies them by expert e_j's [D, BN] column tile in BK steps
        (cp.async pipelined), pairs gate/up columns in registers, SwiGLU (optional limit),
        rounds to the activation dtype -> h [NB*BM, I] in slot order, pair rows only (a masked
        store: padding rows are neither written here nor read by down; ~24 MB each way at Ling's
        4096 tokens, where ncu counted the down GEMM's reads at 2.07 GB).
  down  grid (D/BN, NB): block j's h rows (contiguous, masked) @ W2_e[:, tile]; the epilogue scales each
        row by its pair's routed weight (fp32) and
          combine "sum"    stores it to out [P + 1, D] fp32 at the pair's row (row P: padding,
                           masked), then one XLA fusion sums the k rows of each token;
          combine "sum16"  the same with out in the activation dtype: each weighted pair row is
                           rounded to it (bf16: as SGLang's and vLLM's fused_moe store theirs)
                           before the fp32 sum, for half the bytes written and read back;
          combine "atomic" adds it into y32 [M + 1, D] fp32 with atomics (row M: padding; the
                           sum order, and so the last bits, vary run to run).
        y is rounded once to x's dtype.
  Tile t fastest: the N/BN programs of one row block run together, so its A rows come from L2
  after the first tile; sibling blocks of one expert are adjacent, so their second read of a
  weight tile is an L2 hit. Unused blocks (e < 0) exit before any weight load. A program asks
  for its expert, its slots, its half flag and (down) its routed weights at once, before the K
  loop: none of those addresses waits on another load (down: 541 -> 533 µs at 4096 tokens).
  plan.half: blocks with at most BM/2 valid rows run at BM/2 rows: the whole program (A loads, K
  loop, epilogue, stores) at a static row count of BM/2 instead of BM, chosen per block by one
  scalar load (a block's valid rows are a prefix, so it has at most BM/2 iff slot BM/2 is
  padding). Half the tensor-core work of such a block. Both sizes are compiled into one kernel,
  each its own pipelined K loop.
  Quantised weights: per K step of one group G, the [G*b/32, B_N] words are unpacked in
  registers to the exact integers u - z in bf16. int4 (plan.unpack "pairs"): two codes an
  instruction (`int4_pairs`), lane i's [WPG, B_N] rows (rows i*WPG.. of the group: lane i of word
  w is row w + i*WPG) against a's [BM, WPG] columns of the lane, 32/b dots a group in two
  accumulator chains. int8, or "f32": shift, and-or into the float 2^23, subtract, cast to bf16,
  reshaped to the natural [G, B_N] row order, one dot [BM, G] @ [G, B_N] a group. The group's
  scale multiplies the fp32 partial once per column. plan.swap computes (W^T A^T)^T instead: the
  dequantised tile is the dot's first operand (wgmma can take it from registers) and the rows its N.
Rounding: h is rounded to the activation dtype between the GEMMs (as in moe.block); y once.

Dense entry (`dense`): y = x @ Wᵀ for one quantised weight of `pallas_kernels.quant`'s tile layout
(the projections at GEMM sizes), the down kernel's K loop over a one-expert stack with no routing
arrays: block j is rows [j*BM, (j+1)*BM) of x (rows >= M masked), the epilogue stores the fp32
accumulator rounded once; grid (NB, N_pad / B_N), row blocks fastest, so the blocks of one column
tile run together and its words come from HBM once.

FLOPs (useful) 6*P*D*I: up 2*P*D*2I, down 2*P*I*D; the padding adds (NB_used*BM - P)/P of it
(plan.half: a block of at most BM/2 valid rows counts BM/2).
Bytes: the U distinct experts' weights once, U*3*D*I*2 (bf16) or U*3*D*I*(b + 16/G)/8, x and y
(M*D*2 each); by design also h (P*I*2, the pairs' rows, written and read) and, combine "sum", out
(P*D*4, written and read; "sum16" P*D*2).
Ling (E 512, top-8, D 2560, I 768) at M = 4096 tokens, P = 32768, U = 512 (every expert):
  386.5 GFLOP useful (0.39 ms at the H200's 989 TFLOP/s dense bf16);
  bf16 weights 6.04 GB -> 1.40 ms at 4.3 TB/s: the floor (x + y add 0.04 GB); h 0.10 GB and the
  "sum" combine's out 0.67 GB ("sum16": 0.34) more -> ~1.6 ms as designed; 250 TFLOP/s would be
  1.55 ms. Measured and compared with cuBLAS and a Mosaic GPU kernel: bench/history/grouped_gemm.md.
  int4 G128 weights 1.56 GB -> 0.36 ms: the compute floor 0.39 ms binds.
`plan_for`'s bf16 plans are the H200 sweeps' winners (bench/history/grouped_gemm.md); its quantised
plans are not measured (bench/grouped_gemm.py sweeps them). Every plan compiles for sm_90a without
spills, within 144 KB of shared memory.
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
from pallas_kernels.experts import check_args, expert_dims, reference, swiglu
from pallas_kernels.fused_moe import QMeta
from pallas_kernels.int4_pairs import dot_acc, int4_pairs, subtrahend
from pallas_kernels.moe_align import align_sizes, moe_align
from pallas_kernels.quant import QuantizedWeight, dequantize
from pallas_kernels.relaxed_atomic import relaxed_atomic_add

COMBINES = ("sum", "sum16", "atomic")
UNPACKS = ("pairs", "f32")


# ---------------------------------------------------------------------------------- plans
@dataclasses.dataclass(frozen=True)
class Tile:
    """One GEMM's launch. block_k: K per loop step and block_n: output columns per program (up:
    interleaved, h gets block_n / 2), both for bf16 weights; quantised weights step one group
    and take their layout's B_N (dense: block_n, a divisor of B_N, when not 0)."""

    block_k: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    block_m: int = 64  # rows per block: a power of two >= 16 (64 and 128: wgmma on sm_90)
    up: Tile = Tile()
    down: Tile = Tile()
    combine: str = "sum"  # "sum" | "sum16" | "atomic", see the module docstring ("atomic" in interpret
    # mode: a block's rows must be distinct tokens, as top-k ids are: the interpreter's atomics
    # are a gather-add-scatter)
    swap: bool = False  # acc^T = W^T A^T: wgmma's M is the tile's N, its N the rows (BM 16 and
    # 32 then run on wgmma too); quantised weights: the dequantised tile stays in registers
    half: bool = False  # blocks with at most BM/2 valid rows run at BM/2 rows (block_m >= 32):
    # an expert's last block is often mostly padding (Ling, 4096 tokens, BM 128: ~64 rows of 128)
    unpack: str = "pairs"  # int4: "pairs" (bf16x2, `int4_pairs`) or "f32" (the float32 magic
    # number, one code an instruction; int8 always)


def plan_for(p: int, e: int, quantized: bool) -> Plan:
    """Launch heuristics: BM near the mean rows per expert P/E, so an expert takes ~one block
    (its weights read once) without mostly padding: BM 128 from 48 rows an expert; bf16 weights
    take bf16 pair rows ("sum16") and half blocks at BM 128; the down GEMM K steps of 32 at 6
    stages. The H200 timings behind each choice: bench/history/grouped_gemm.md."""
    r = p / e
    if quantized:
        if r <= 24:
            return Plan(16, Tile(0, 0, 4, 3), Tile(0, 0, 4, 3))
        if r <= 96:
            return Plan(64, Tile(0, 0, 4, 3), Tile(0, 0, 4, 3))
        return Plan(128, Tile(0, 0, 8, 3), Tile(0, 0, 8, 3))
    if r <= 24:
        return Plan(16, Tile(64, 128, 4, 5), Tile(64, 128, 4, 5), combine="sum16")
    if r <= 48:
        return Plan(32, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4), combine="sum16")
    return Plan(128, Tile(64, 128, 8, 3), Tile(32, 128, 8, 6), combine="sum16", half=True)


# ---------------------------------------------------------------------------------- kernels
def _unpack(words, qm: QMeta, magic, zero, dtype):
    """words uint32 [WPG, B_N] -> (u - z) [G, B_N] in dtype, rows in natural K order; exact.

    Lane i (bits [i*b, (i+1)*b)) of word w is row w + i*WPG: the lanes stacked on a leading axis
    and reshaped are the group's rows in order. Or-ing a code into the mantissa of 2^23 gives
    2^23 + u exactly; subtracting 2^23 + z gives u - z (a small integer: exact in bf16)."""
    lanes = 32 // qm.bits
    shifts = (lax.broadcasted_iota(jnp.int32, (lanes, 1, 1), 0) * qm.bits).astype(jnp.uint32)
    codes = (words[None, :, :] >> shifts) & jnp.uint32(2**qm.bits - 1)  # [L, WPG, B_N]
    f = lax.bitcast_convert_type(codes | magic, jnp.float32)  # 2^23 + u
    f = f.reshape(qm.group_size, qm.block_n)  # [G, B_N]
    return (f - (2.0**23 + zero)).astype(dtype)


def _kernel(*refs, stage, k, p, bm, bk, bn, n_k, qm, limit, combine, swap, half, unpack, interpret, n_init):
    """Program (t, j): block j's rows times expert e_j's column tile t; see the module doc."""
    refs = list(refs)
    a_ref = refs.pop(0)  # up: x [M, D]; down: h [NB*BM, I]; dense: x [M, K]
    blk_ref = refs.pop(0) if stage != "dense" else None  # block_expert [NBP]
    sorted_ref = refs.pop(0) if stage != "dense" else None  # sorted_pairs [S]
    tw_ref = refs.pop(0) if stage == "down" else None  # topk weights [P] f32
    if qm is None:
        w_ref = refs.pop(0)  # [E, K, N]
    else:  # magic [1], words [E, T, K*b/32, B_N], scales (zeros) [E, T, K/G, B_N]
        magic_ref, words_ref, scales_ref = refs.pop(0), refs.pop(0), refs.pop(0)
        zeros_ref = None if qm.symmetric else refs.pop(0)
    del refs[:n_init]  # aliased initial outputs (tests poison them): only the output ref is used
    out_ref = refs.pop(0)  # up: h; down: out [P + 1, D] ("sum") or y32 [M + 1, D] ("atomic"); dense: y [M + 1, N_pad]

    if stage == "dense":  # one weight and no routing: block j is rows [j*BM, (j+1)*BM), blocks fastest
        j, t = pl.program_id(0), pl.program_id(1)
        e = 0
        small = (j * bm + bm // 2 >= p) if half else None  # rows >= M (= p) are padding
    else:
        t, j = pl.program_id(0), pl.program_id(1)
        # A program's first loads, issued together: no address below depends on another load, so
        # their latencies overlap instead of adding up before the first weight tile is asked for.
        e = blk_ref[j]
        pairs_bm = sorted_ref[pl.ds(j * bm, bm)]  # [BM], P = padding
        small = (sorted_ref[j * bm + bm // 2] >= p) if half else None  # see plan.half below

    def block(rows):
        """The block's first `rows` slots (static: BM, or BM/2 for plan.half): K loop, epilogue, stores."""
        # [rows]; at BM/2 a reload of the lines just loaded
        if stage == "dense":
            pair = j * bm + lax.broadcasted_iota(jnp.int32, (rows,), 0)
        else:
            pair = pairs_bm if rows == bm else sorted_ref[pl.ds(j * bm, rows)]
        valid = pair < p
        if stage == "down":  # the routed weights: asked for now, used after the K loop
            tw = pltriton.load(tw_ref.at[jnp.where(valid, pair, 0)], mask=valid, other=0.0)  # [rows]

        if stage != "down":  # x's rows gathered by token (dense: k = 1, a pair is its row)
            tok = jnp.where(valid, pair // k, 0)[:, None]  # [rows, 1]

            def a_load(k0, size):
                cols = (k0 + jnp.arange(size, dtype=jnp.int32))[None, :]
                return pltriton.load(a_ref.at[tok, cols], mask=valid[:, None], other=0.0)
        else:  # the block's own h rows; padding rows were never written, and are not read
            def a_load(k0, size):
                return pltriton.load(a_ref.at[pl.ds(j * bm, rows), pl.ds(k0, size)], mask=valid[:, None],
                                     other=0.0)

        shape = (bn, rows) if swap else (rows, bn)  # swap: acc^T
        if qm is None:
            def body(i, acc):
                k0 = pl.multiple_of(i * bk, bk)
                w = w_ref[e, pl.ds(k0, bk), pl.ds(t * bn, bn)]  # [BK, BN]
                a = a_load(k0, bk)  # [rows, BK]
                if swap:
                    return acc + jnp.dot(w.T, a.T, preferred_element_type=jnp.float32)
                return acc + jnp.dot(a, w, preferred_element_type=jnp.float32)

            acc = lax.fori_loop(0, n_k, body, jnp.zeros(shape, jnp.float32))
        else:
            wpg, g_size = qm.group_size * qm.bits // 32, qm.group_size
            magic = magic_ref[0]  # 2^23 as a register operand: the and-or fuses into one LOP3
            # Column tile t of BN columns is sub-tile t % subs of the layout's tile t // subs.
            lt, cols = (t, slice(None)) if qm.subs == 1 else (t // qm.subs, pl.ds((t % qm.subs) * bn, bn))

            def body_pairs(g, acc):
                words = words_ref[e, lt, pl.ds(g * wpg, wpg), cols]  # [WPG, BN]
                zero = 2.0 ** (qm.bits - 1) if zeros_ref is None else zeros_ref[e, lt, g, cols].astype(jnp.float32)[None, :]
                c = subtrahend(zero, words.shape)
                part = [jnp.zeros(shape, jnp.float32)] * 2  # two chains: shorter dependency
                for i, v in enumerate(int4_pairs(words, c)):  # v: [WPG, B_N] bf16 = u - z of lane i
                    a = a_load(pl.multiple_of(g * g_size + i * wpg, wpg), wpg)  # [rows, WPG]
                    part[i % 2] = dot_acc(v.T, a.T, part[i % 2]) if swap else dot_acc(a, v, part[i % 2])
                scale = scales_ref[e, lt, g, cols].astype(jnp.float32)  # [BN]
                return acc + (part[0] + part[1]) * (scale[:, None] if swap else scale[None, :])

            def body(g, acc):
                words = words_ref[e, lt, pl.ds(g * wpg, wpg), cols]  # [WPG, BN]
                zero = (2.0 ** (qm.bits - 1) if zeros_ref is None
                        else zeros_ref[e, lt, g, cols].astype(jnp.float32)[None, :])
                a = a_load(pl.multiple_of(g * g_size, g_size), g_size)  # [rows, G]
                v = _unpack(words, qm, magic, zero, a.dtype)  # [G, B_N]
                scale = scales_ref[e, lt, g, cols].astype(jnp.float32)  # [BN]
                if swap:
                    part = jnp.dot(v.T, a.T, preferred_element_type=jnp.float32)
                    return acc + part * scale[:, None]
                return acc + jnp.dot(a, v, preferred_element_type=jnp.float32) * scale[None, :]

            use_pairs = unpack == "pairs" and qm.bits == 4
            acc = lax.fori_loop(0, qm.n_groups, body_pairs if use_pairs else body, jnp.zeros(shape, jnp.float32))
        if swap:
            acc = acc.T

        if stage == "up":  # interleaved columns: (gate, up) side by side
            pairs = acc.reshape(rows, bn // 2, 2)
            gate = jnp.arange(2, dtype=jnp.int32) == 0  # select + sum: lowers everywhere, exact
            g = jnp.sum(jnp.where(gate, pairs, 0.0), axis=-1)
            u = jnp.sum(jnp.where(gate, 0.0, pairs), axis=-1)
            h = swiglu(g, u, limit).astype(out_ref.dtype)
            # Pair rows only: an expert's last block is ~half padding at Ling's 64 rows an expert.
            pltriton.store(out_ref.at[pl.ds(j * bm, rows), pl.ds(t * (bn // 2), bn // 2)], h,
                           mask=valid[:, None])
        else:
            val = acc if stage == "dense" else acc * tw[:, None]  # padding rows: h read as 0, tw = 0 -> 0
            cols = (t * bn + jnp.arange(bn, dtype=jnp.int32))[None, :]
            if stage == "dense" or combine != "atomic":  # "sum", "sum16", dense: the pair's own row, in out's dtype
                dst = jnp.where(valid, pair, p)[:, None]  # padding goes nowhere (masked, row P)
                pltriton.store(out_ref.at[dst, cols], val.astype(out_ref.dtype), mask=valid[:, None])
            else:
                n_tok = out_ref.shape[0] - 1
                dst = jnp.where(valid, pair // k, n_tok)[:, None]  # padding: row M (adds 0)
                # The interpreter has no masked atomics; unmasked, padding adds 0 to row M. Relaxed:
                # a sum needs atomicity, not order (Pallas' own atomics fence before each one).
                mask = None if interpret else jnp.broadcast_to(valid[:, None], val.shape)
                relaxed_atomic_add(out_ref, (dst, cols), val, mask=mask)

    def run():
        if half:  # valid rows are a prefix: at most BM/2 of them iff slot BM/2 is padding
            lax.cond(small, lambda: block(bm // 2), lambda: block(bm))
        else:
            block(bm)

    if stage == "dense":
        run()
    else:
        pl.when(e >= 0)(run)  # an unused block reads its slots only, and writes nothing


def _gemm(stage, a, block_expert, sorted_pairs, w, *, tw=None, n_blocks, k, p, plan: Plan,
          out_shape, limit, interpret, init=None):
    """One grouped-GEMM pallas_call: stage "up" or "down", grid (N / BN, n_blocks); "dense" (w one
    expert, no routing arrays), grid (n_blocks, N / BN).
    init: an initial output to alias (tests poison it; the atomic combine starts from zeros)."""
    tile = plan.up if stage == "up" else plan.down
    qm = None
    if isinstance(w, QuantizedWeight):
        (_, n_tiles, _, bn), (_, k_in) = w.words.shape, w.shape
        subs = 1
        if stage == "dense" and tile.block_n and tile.block_n != bn:  # programs of sub-tiles
            if bn % tile.block_n or tile.block_n < 16:
                raise ValueError(f"dense's block_n must be 0 (the layout's B_N={bn}) or a divisor >= 16 of it, "
                                 f"got {tile.block_n}")
            subs, bn = bn // tile.block_n, tile.block_n
            n_tiles *= subs
        qm = QMeta(w.bits, w.group_size, w.symmetric, bn, k_in // w.group_size, subs)
        bk = n_k = None
        magic = jnp.array([0x4B000000], jnp.uint32)
        w_inputs = [magic, w.words, w.scales] + ([] if w.symmetric else [w.zeros])
    else:
        _, k_in, n_out = w.shape
        bn, bk = min(tile.block_n, n_out), min(tile.block_k, k_in)
        if n_out % bn or k_in % bk or bn < 16 or bk < 16:
            raise ValueError(f"block_n={bn} and block_k={bk} must be >= 16 and divide the {stage} "
                             f"GEMM's N={n_out} and K={k_in}")
        n_tiles, n_k = n_out // bn, k_in // bk
        w_inputs = [w]
    routing = [] if stage == "dense" else [block_expert, sorted_pairs]
    inputs = [a] + routing + ([tw] if stage == "down" else []) + w_inputs
    inits = [] if init is None else [init]
    kernel = functools.partial(
        _kernel, stage=stage, k=k, p=p, bm=plan.block_m, bk=bk, bn=bn, n_k=n_k, qm=qm, limit=limit,
        combine=plan.combine, swap=plan.swap, half=plan.half, unpack=plan.unpack, interpret=interpret,
        n_init=len(inits))
    name = (stage if stage == "dense" else f"grouped_{stage}") + ("" if qm is None else f"_int{qm.bits}")
    name += f"_m{plan.block_m}_n{bn}"
    if qm is not None and qm.bits == 4 and plan.unpack == "f32":
        name += "_f32"
    if plan.swap:
        name += "_swap"
    if plan.half:
        name += "_half"
    if stage == "down" and plan.combine == "atomic":
        name += "_atomic"
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_blocks, n_tiles) if stage == "dense" else (n_tiles, n_blocks),
        input_output_aliases={len(inputs) + i: i for i in range(len(inits))},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
        name=name,
    )(*inputs, *inits)


def _check_plan(plan: Plan):
    bm = plan.block_m
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"plan.block_m must be a power of two >= 16, got {bm}")
    if plan.half and bm < 32:
        raise ValueError(f"plan.half needs block_m >= 32 (BM/2 >= 16, a dot's smallest side), got {bm}")
    if plan.unpack not in UNPACKS:
        raise ValueError(f"plan.unpack must be one of {UNPACKS}, got {plan.unpack!r}")
    if plan.combine not in COMBINES:
        raise ValueError(f"plan.combine must be one of {COMBINES}, got {plan.combine!r}")


def gate_up(x, sorted_pairs, block_expert, w13, *, k: int, n_blocks: int, plan: Plan,
            swiglu_limit=None, backend="pallas", init=None):
    """Stage 1. h [n_blocks*BM, I] (x's dtype) = swiglu(x[pair // k] @ W13_e), one row per slot
    of the align's layout (`moe_align(ids, E, plan.block_m)`; n_blocks = align_sizes(...).nb);
    only the rows of pairs are written (padding slots and unused blocks keep init's values, or
    are left unset without init; down does not read them). x [M, D] in the activation dtype
    (bf16 for quantised weights)."""
    _check_plan(plan)
    i = (w13.shape[0] if isinstance(w13, QuantizedWeight) else w13.shape[2]) // 2
    out_shape = jax.ShapeDtypeStruct((n_blocks * plan.block_m, i), x.dtype)
    return _gemm("up", x, block_expert, sorted_pairs, w13, n_blocks=n_blocks, k=k, p=x.shape[0] * k,
                 plan=plan, out_shape=out_shape, limit=swiglu_limit, interpret=backend == "interpret",
                 init=init)


def down(h, sorted_pairs, block_expert, topk_weights, w2, *, n_blocks: int, plan: Plan,
         backend="pallas", init=None):
    """Stage 2. The down GEMM of gate_up's h with each row scaled by its routed weight, combined
    per token: "sum" returns out [P + 1, D] fp32 (pair rows; row P untouched), "sum16" the same
    in h's dtype, "atomic" y32 [M + 1, D] fp32 (token rows, added into init or zeros; row M
    collects padding zeros)."""
    _check_plan(plan)
    m, k = topk_weights.shape
    d = w2.shape[0] if isinstance(w2, QuantizedWeight) else w2.shape[2]
    tw = topk_weights.reshape(-1).astype(jnp.float32)
    if plan.combine == "atomic":
        out_shape = jax.ShapeDtypeStruct((m + 1, d), jnp.float32)
        init = jnp.zeros(out_shape.shape, jnp.float32) if init is None else init
    else:
        out_shape = jax.ShapeDtypeStruct((m * k + 1, d), h.dtype if plan.combine == "sum16" else jnp.float32)
    return _gemm("down", h, block_expert, sorted_pairs, w2, tw=tw, n_blocks=n_blocks, k=k, p=m * k,
                 plan=plan, out_shape=out_shape, limit=None, interpret=backend == "interpret",
                 init=init)


DENSE_BITS = (4, 8)  # the quantised widths the K loop is tested at


def dense_plan(m: int) -> Plan:
    """BM 16 up to 16 rows, else BM 32 unswapped on 4 warps: the fastest of `bench.qgemm`'s plans
    at 96 rows of a 20512 x 2560 projection on the H200. The kernel is latency-bound at such
    sizes: N / B_N column tiles make few programs for a K loop over every group, and a larger BM
    has fewer still."""
    tile = Tile(0, 0, 4, 3)
    return Plan(16 if m <= 16 else 32, tile, tile)


def dense_applies(w) -> bool:
    """Whether `dense` takes w: one int4 or int8 weight in the tile layout whose group gives the
    tensor cores a K of at least 16 (int4: G >= 128, a lane's words; int8: G >= 16)."""
    return (isinstance(w, QuantizedWeight) and w.layout == "tiles" and w.bits in DENSE_BITS
            and w.words.ndim == 3 and (w.group_size * w.bits // 32 if w.bits == 4 else w.group_size) >= 16)


def dense(x, w: QuantizedWeight, *, plan: Plan | None = None, backend="auto"):
    """y [M, N] = x [M, K] @ Wᵀ for one quantised weight W [N, K] (`pallas_kernels.quant`'s tile
    layout, int4 or int8): the down kernel's K loop over one expert and no routing, float32
    accumulation, rounded once to x's dtype (bf16). Grid (ceil(M / BM), N_pad / B_N), row blocks
    fastest: the blocks of one column tile run together and read its words from HBM once. Bytes:
    w.nbytes, x once a tile (L2), y. For projections of a few dozen rows (verify passes of several
    slots), where the matvec would read the weight once every 16 rows; with hundreds of rows the
    K loop's latency over too few programs makes it slower than a dequantised weight's GEMM."""
    backend = resolve(backend)
    m, k = x.shape
    if not dense_applies(w):
        raise ValueError(f"dense takes one int4 (groups >= 128) or int8 (>= 16) weight in the tile layout, got "
                         f"{w.bits} bits, groups of {w.group_size}, layout {w.layout!r}, words of rank {w.words.ndim}")
    if k != w.shape[1]:
        raise ValueError(f"x has {k} columns, the weight's K is {w.shape[1]}")
    n = w.shape[0]
    if backend == "reference":
        return jnp.dot(x, dequantize(w).T.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    plan = plan or dense_plan(m)
    _check_plan(plan)
    stack = dataclasses.replace(w, words=w.words[None], scales=w.scales[None],
                                zeros=None if w.zeros is None else w.zeros[None])
    n_blocks = -(-m // plan.block_m)
    out_shape = jax.ShapeDtypeStruct((m + 1, w.n_tiles * w.block_n), x.dtype)  # row M: padding, masked
    y = _gemm("dense", x, None, None, stack, n_blocks=n_blocks, k=1, p=m, plan=plan, out_shape=out_shape,
              limit=None, interpret=backend == "interpret")
    return y[:m, :n]


def _run(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit, backend, plan, poison=False):
    """The kernel path; returns (y, h, out). poison: h and ("sum", "sum16") out start as NaN (tests)."""
    m, k = topk_ids.shape
    p = m * k
    e, _, _ = expert_dims(w13, w2)
    act = jnp.bfloat16 if isinstance(w13, QuantizedWeight) else w13.dtype
    plan = plan or plan_for(p, e, isinstance(w13, QuantizedWeight))
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    sorted_pairs, block_expert = moe_align(ids, e, plan.block_m, backend=backend)
    nb = align_sizes(p, e, plan.block_m).nb
    nan = (lambda shape, dt: jnp.full(shape, jnp.nan, dt)) if poison else (lambda shape, dt: None)
    i = (w13.shape[0] if isinstance(w13, QuantizedWeight) else w13.shape[2]) // 2
    d = x.shape[1]
    h = gate_up(x.astype(act), sorted_pairs, block_expert, w13, k=k, n_blocks=nb, plan=plan,
                swiglu_limit=swiglu_limit, backend=backend, init=nan((nb * plan.block_m, i), act))
    init = None if plan.combine == "atomic" else nan((p + 1, d), act if plan.combine == "sum16" else jnp.float32)
    out = down(h, sorted_pairs, block_expert, topk_weights, w2, n_blocks=nb, plan=plan,
               backend=backend, init=init)
    if plan.combine == "atomic":
        y = out[:m]
    else:  # a skipped pair's row was never written
        rows = jnp.where((ids < e)[:, None], out[:p].astype(jnp.float32), 0.0)
        y = jnp.sum(rows.reshape(m, k, d), axis=1)  # one XLA fusion, fp32
    return y.astype(x.dtype), h, out


def grouped_moe(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit=None, backend="auto",
                plan: Plan | None = None):
    """y [M, D] = sum_k topk_weights * expert_{topk_ids}(x), fp32 accumulation, rounded once.

    The prefill-size counterpart of `fused_moe.fused_moe`, with its arguments: x [M, D];
    topk_ids [M, k] int in [0, E], E marking a skipped pair (no expert: it adds nothing and
    costs nothing; expert parallelism's pairs of other ranks); topk_weights [M, k];
    w13 [E, D, 2I] (gate/up interleaved by column), w2 [E, I, D] in bf16 (or any float dtype:
    x is cast to it), or both fields of `experts.quantize_experts` (x in bf16).
    swiglu_limit: None or L. backend: "pallas" | "interpret" | "reference" | "auto"
    (pallas_kernels.backend.resolve). plan overrides `plan_for`. Any M works; it pays off once
    every expert has rows (prefill chunks).
    """
    backend = resolve(backend)
    check_args(x, topk_ids, topk_weights, w13, w2)
    if backend == "reference":
        return reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit)
    return _run(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, backend=backend,
                plan=plan)[0]

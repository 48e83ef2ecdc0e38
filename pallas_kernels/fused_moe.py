"""Fused MoE experts: pair-axis align, gate/up GEMM with a SwiGLU epilogue, down GEMM, combine.

    y [M, D] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])
    expert_e(x) = swiglu(x @ W13_e) @ W2_e,  swiglu(g, u) = silu(g) * u
                  (with a limit L: min(silu(g), L) * clamp(u, -L, L))

Layouts (x @ W orientation, every stacked weight passed whole, never sliced in front of a call):
  x [M, D] (cast to the weights' dtype, bf16 for quantised weights); topk_ids, topk_weights [M, k].
  w13 [E, D, 2I] gate and up INTERLEAVED by column (column 2j = gate j, 2j+1 = up j): one output
      tile holds both halves of its SwiGLU, so the epilogue pairs them in registers.
  w2  [E, I, D].
  Or grouped low-bit: `experts.quantize_experts` (pallas_kernels/experts.py holds the formats and
  the reference, `experts.reference`).
Pairs p = m*k + slot (P = M*k) are grouped by expert (`moe_align.moe_align`) into blocks of BM
rows, block_expert [NBP] naming each block's expert; at M = 1 ("direct") there is no align:
block j is pair j (a token's top-k experts are distinct).

GEMMs (`_gemm_kernel`, Triton lowering), grid (NB, N / BN, S): program (j, t, s) reads block j's
rows and streams the s-th of S shares of expert e_j's [K, BN] weight tile t once (unused blocks
exit before any load). S = 1 unless the plan splits K (`GemmPlan.split`: quantised weights at
M = 1; bf16 where the grid is smaller than the GPU): then each program writes an fp32 partial ([S, rows, 2I] of raw gate/up
sums; [S, P + 1, D]) and the XLA fusions after the GEMM (SwiGLU and h's rounding; the combine)
sum them in a fixed order; at one token inside a `pallas_kernels.tickets` scope the last program
of each output sums them in the launch instead (`_run_tickets`: two launches a MoE layer).
  up:   rows x[pair // k] (gathered) @ W13_e[:, tile]  -> swiglu -> h [NB*BM, I] (bf16, slot rows)
  down: rows h[slot] @ W2_e[:, tile]                   -> out [S, P + 1, D] float32 (pair rows;
        row P is the masked padding's address)
  path "dot": BM rows (>= 16), tensor-core dot, fp32 accumulator [BM, BN] (quantised: qmatvec's
        `lanes` unpack to bf16 in registers); Triton pipelines the weight tiles (cp.async).
  path "fma": BM = 1 (one pair per block, never padded), CUDA-core multiply-adds into a [BK, BN]
        fp32 tile summed once (quantised: codes or-ed into magic floats, see `_acc_quant`).
Combine (one XLA fusion): y = sum_k w * out[m*k + slot] in fp32, rounded once to x's dtype.
Shared expert (`shared=`): each token's pair k (P = M (k + 1)), expert id E (the align has E + 1
experts), weight 1; its blocks read the shared weights (inputs after the routed experts', one
expert in their format, `pl.when` on the block's expert) and its SwiGLU limit. Its bytes join
the routed experts' stream; its own launches, split-K sums, combine and add are gone.
Shared with the tile-scheduled kernel (expert_tiles.py): `weight_operands` (either weight format as
pallas_call inputs), `pop_weight_refs`, `expert_tile` (one block's rows times one weight tile) and
`swiglu_columns` (the interleaved gate/up epilogue).
Rounding: h is rounded to the activation dtype between the GEMMs (as in `experts.reference`); nothing else
(the quantised "fma" path sums terms up to ~(256 + 2^b) / 2^b times larger in fp32: ~1e-6).

Bytes moved per layer: the distinct experts' weights once each, U * (3*D*I*2) bytes in bf16
(U = distinct experts; Ling M = 1: 8 * 3 * 2560 * 768 * 2 = 94.4 MB, 22 us at 4.3 TB/s) or
U * 3*D*I * (b + 16/G) / 8 quantised (int4 G=128: 24.3 MB); activations are noise: x (M*D*2),
h (2 * NB*BM*I*2), out (2 * P*D*4), y (M*D*2). A block re-reads its expert only when the expert
has more than BM pairs ("dot") or more than one pair ("fma").

Timings on the H200 against SGLang's Triton kernel: bench/RESULTS.md; the sweeps behind
`plan_for`: bench/history/fused_moe.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tickets
from pallas_kernels.backend import resolve
from pallas_kernels.int4_pairs import dot_acc, int4_pairs, subtrahend
from pallas_kernels.experts import (GATHER_MAX_PAIRS, SharedExpert, check_args, check_shared, expert_dims, k_groups,
                                    reference, rows_layout, swiglu)
from pallas_kernels.moe_align import align_sizes, moe_align
from pallas_kernels.qmatvec import H200_SMS, MMA_ROWS, lane_magics, lanes, offset_lanes, rows_launch
from pallas_kernels.quant import QuantizedWeight

EVICT = "evict_first"  # weights stream once: keep L2 for activations


# ---------------------------------------------------------------------------------- GEMMs
@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """One GEMM's launch. block_k: K per loop step (bf16; quantised weights step one group).
    block_n: output columns per program (w13: interleaved, so h gets block_n / 2); quantised
    weights fix it to their tile B_N. split: K's groups (quantised) or steps of block_k (bf16)
    shared among this many programs, each writing its own fp32 partial (summed by the next XLA
    fusion, in a fixed order: no atomics). More programs in flight per SM where the grid is small
    (M = 1; bf16: `_fill` sets it where the grid is smaller than the GPU)."""

    block_k: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 4
    split: int = 1


@dataclasses.dataclass(frozen=True)
class Plan:
    path: str  # "dot" | "fma"
    block_m: int  # rows per block: >= 16 for "dot", 1 for "fma"
    up: GemmPlan
    down: GemmPlan


def split_groups(n_groups: int, per_program: int) -> int:
    """Programs sharing K's n_groups: n_groups / per_program, or the largest divisor below it."""
    return max(d for d in range(1, max(1, n_groups // per_program) + 1) if n_groups % d == 0)


def _fill(gp: GemmPlan, w, n_blocks: int, programs: int = 2 * H200_SMS) -> GemmPlan:
    """gp with K split (bf16) so that a grid of n_blocks x N/BN programs, if under half the GPU's
    SMs, grows to about `programs`: the largest divisor of K's steps up to programs / grid.
    One-expert MLPs at decode sizes have 12-40 tiles (Ling's shared expert at M = 1 on the H200:
    up + down 19 -> 8.3 us); the routed experts at M = 1 (96 up tiles) measured no better split
    in two. A split of S costs an fp32 partial of S x rows x N and its sum."""
    ops = weight_operands(w, gp.block_k, gp.block_n, dot=True, stage="split")
    grid = n_blocks * ops.n_tiles
    if 2 * grid >= H200_SMS:
        return gp
    split = max(d for d in range(1, min(ops.n_k, max(1, programs // grid)) + 1) if ops.n_k % d == 0)
    return dataclasses.replace(gp, split=split)


def plan_for(m: int, k: int, quantized: bool, k_groups: tuple[int, int] = (1, 1)) -> Plan:
    """Launch heuristics: the H200 sweep's winners (bench/fused_moe.py; the figures in
    bench/history/fused_moe.md). k_groups: quantised weights' groups of K in the up and down GEMMs
    (D/G, I/G).

    bf16: block 16, tensor-core dot, weight tiles pipelined by cp.async; [64, 128] tiles, 6 / 5
    stages at M = 1 to 16, [128, 64] x 4 at 64.
    Quantised: "fma" waits on its loads at M = 1 (few programs), so K is split among programs
    (2 groups each in the up GEMM, 1 in the down GEMM); M = 6 and 16: 4 warps; M = 64: the dot path.
    Beyond 512 pairs (prefill): block 64, not tuned on the GPU.
    """
    if quantized:
        if m == 1:
            up, down = (GemmPlan(0, 0, 4, 1, split=split_groups(n, per)) for n, per in zip(k_groups, (2, 1)))
            return Plan("fma", 1, up, down)
        if m * k <= 128:
            return Plan("fma", 1, GemmPlan(0, 0, 4, 1), GemmPlan(0, 0, 4, 1))
        if m * k <= 512:
            return Plan("dot", 16, GemmPlan(0, 0, 4, 4), GemmPlan(0, 0, 4, 4))
        return Plan("dot", 64, GemmPlan(0, 0, 8, 3), GemmPlan(0, 0, 8, 3))
    if m * k <= 128:
        return Plan("dot", 16, GemmPlan(64, 128, 4, 6), GemmPlan(64, 128, 4, 5))
    if m * k <= 512:
        return Plan("dot", 16, GemmPlan(128, 64, 4, 4), GemmPlan(128, 64, 4, 4))
    return Plan("dot", 64, GemmPlan(64, 128, 4, 3), GemmPlan(64, 128, 4, 3))


def _acc_dense(w_ref, e, n0, a_load, *, n_k, bk, bn, bm, fma, steps=None):
    """sum over K of a @ W_e[:, n0:n0+BN]: fp32 [BM, BN] ("dot") or [BN] ("fma"). steps: (first,
    count) of K's n_k steps of BK (split K), else all of them."""
    first, n_k = (0, n_k) if steps is None else steps

    def body(i, acc):
        k0 = pl.multiple_of((first + i) * bk, bk)
        w = pltriton.load(w_ref.at[e, pl.ds(k0, bk), pl.ds(n0, bn)], eviction_policy=EVICT)  # [BK, BN]
        a = a_load(k0, bk)
        if fma:
            return acc + w.astype(jnp.float32) * a[:, None]
        return acc + jnp.dot(a, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_k, body, jnp.zeros((bk, bn) if fma else (bm, bn), jnp.float32))
    return jnp.sum(acc, axis=0) if fma else acc


@dataclasses.dataclass(frozen=True)
class QMeta:
    """Static description of quantised weights (the kernel never closes over arrays)."""

    bits: int
    group_size: int
    symmetric: bool
    block_n: int
    n_groups: int  # groups of K
    subs: int = 1  # programs a layout tile is split into along N (block_n = the layout's B_N / subs)


def _acc_quant(qrefs, qm: QMeta, e, t, a_load, *, bm, fma, groups=None):
    """The same for quantised weights, one group of G input rows per loop step; groups = (first,
    count) of K's groups to sum (default: all).

    "dot": the exact u - z in bf16 (int4: two codes an instruction by `int4_pairs`; int8:
    qmatvec's `lanes` float unpack, cast), tensor-core dot with lane i's [BM, WPG] slice of a; the
    group's scale once per column.
    "fma": no per-weight dequantisation. Each byte of a word is shifted once (not each code) so that
    its codes sit at mantissa offsets off = 15, 15 + b, ..; or-ing the masked bits into the float
    2^c (c = 23 - off, a magic per offset) gives f = 2^c + u exactly, so one and-or and one fma
    per weight accumulate P[j, n] = sum_lanes (2^c + u) x. Per group, P minus sum_lanes (2^c + z)
    x[j] (per row j: cheap) is sum_lanes (u - z) x up to the fp32 rounding of terms at most
    (256 + 2^b) / 2^b times the signal's; it is scaled once per element and summed over the WPG
    rows once, after the last group.
    """
    magic_ref, words_ref, scales_ref, zeros_ref = qrefs
    bits, g_size, bn = qm.bits, qm.group_size, qm.block_n
    wpg = g_size * bits // 32
    per_byte = 8 // bits
    magic = magic_ref[0]  # 2^23: `lanes`
    lane_magic = [magic_ref[1 + i] for i in range(per_byte)]  # 2^(23 - off_i), off_i = 15 + i b

    def zero_point(g):  # z: a constant, or [1, B_N] per column
        if zeros_ref is None:
            return 2.0 ** (bits - 1)
        return zeros_ref[e, t, g, :].astype(jnp.float32)[None, :]

    def body_dot(g, acc):
        words = pltriton.load(words_ref.at[e, t, pl.ds(g * wpg, wpg), :], eviction_policy=EVICT)
        scale = scales_ref[e, t, g, :].astype(jnp.float32)  # [B_N]
        part = [jnp.zeros((bm, bn), jnp.float32)] * 2  # two chains: shorter dependency
        if bits == 4:  # two codes an instruction, bf16 (exact)
            c = subtrahend(zero_point(g), words.shape)
            unpacked = enumerate(int4_pairs(words, c))
        else:
            unpacked = lanes(words, bits, zero_point(g), magic)
        for i, v in unpacked:  # v: [WPG, B_N] = u - z (f32; bf16 from int4_pairs)
            a = a_load(g * g_size + i * wpg, wpg)  # [BM, WPG] bf16
            part[i % 2] = dot_acc(a, v.astype(jnp.bfloat16), part[i % 2])
        return acc + (part[0] + part[1]) * scale[None, :]

    def body_fma(g, acc):  # acc [WPG, B_N]
        words = pltriton.load(words_ref.at[e, t, pl.ds(g * wpg, wpg), :], eviction_policy=EVICT)
        z = zero_point(g)
        p_acc = jnp.zeros((wpg, bn), jnp.float32)
        corr = jnp.zeros((wpg,), jnp.float32)  # sum_lanes (2^c + z) x[j]  (symmetric z)
        sum_x = jnp.zeros((wpg,), jnp.float32)  # sum_lanes x[j]            (asymmetric)
        for lane, base, f in offset_lanes(words, bits, lane_magic):  # f: [WPG, B_N] = 2^c + u
            x = a_load(g * g_size + lane * wpg, wpg)  # [WPG] f32, lane's slice of a
            p_acc = p_acc + f * x[:, None]
            if zeros_ref is None:
                corr = corr + (base + z) * x
            else:
                corr = corr + base * x
                sum_x = sum_x + x
        corr = corr[:, None] if zeros_ref is None else corr[:, None] + z * sum_x[:, None]
        scale = scales_ref[e, t, g, :].astype(jnp.float32)[None, :]
        return acc + (p_acc - corr) * scale

    g0, n_g = (0, qm.n_groups) if groups is None else groups
    if fma:
        acc = lax.fori_loop(g0, g0 + n_g, body_fma, jnp.zeros((wpg, bn), jnp.float32))
        return jnp.sum(acc, axis=0)
    return lax.fori_loop(g0, g0 + n_g, body_dot, jnp.zeros((bm, bn), jnp.float32))


@dataclasses.dataclass(frozen=True)
class WeightOperands:
    """One expert GEMM's weights as pallas_call inputs, with the static facts its kernel needs.

    inputs: [w] (dense [E, K, N]) or [magic, words, scales(, zeros)] (quantised; `pop_weight_refs`
    takes their refs back in this order). bn: output columns per tile (quantised: the layout's
    B_N); bk, n_k: K per step and steps (dense; None when quantised: one group per step);
    n_tiles: N / bn; qm: the quantised layout (None: dense)."""

    inputs: list
    qm: QMeta | None
    bk: int | None
    bn: int
    n_k: int | None
    n_tiles: int


def weight_operands(w, block_k: int, block_n: int, *, dot: bool, stage: str) -> WeightOperands:
    """The operands of `expert_tile` for stacked experts w (dense [E, K, N] or a grouped
    `QuantizedWeight`); block_k / block_n apply to dense weights. stage names the GEMM in errors."""
    if isinstance(w, QuantizedWeight):
        (_, n_tiles, _, bn), (_, k_in) = w.words.shape, w.shape
        if dot and w.group_size * w.bits // 32 < 16:
            raise ValueError("the dot path needs >= 16 words per group (group_size * bits >= 512)")
        qm = QMeta(w.bits, w.group_size, w.symmetric, bn, k_in // w.group_size)
        # Magic floats as register operands (the and-or fuses into one LOP3, qmatvec): 2^23, then
        # 2^(23 - off) for the "fma" path's code offsets off = 15 + i * bits.
        magic = jnp.array([0x4B000000] + lane_magics(w.bits), jnp.uint32)
        inputs = [magic, w.words, w.scales] + ([] if w.symmetric else [w.zeros])
        return WeightOperands(inputs, qm, None, bn, None, n_tiles)
    _, k_in, n_out = w.shape
    # The largest power-of-two tile up to the plan's that divides the dimension (16 at least).
    bn, bk = (next((b for b in (1 << i for i in range(blk.bit_length() - 1, 3, -1)) if dim % b == 0), blk)
              for blk, dim in ((min(block_n, n_out), n_out), (min(block_k, k_in), k_in)))
    if n_out % bn or k_in % bk:
        raise ValueError(f"block_n={bn} and block_k={bk} must divide the {stage} GEMM's "
                         f"N={n_out} and K={k_in}")
    return WeightOperands([w], None, bk, bn, k_in // bk, n_out // bn)


def pop_weight_refs(refs: list, qm: QMeta | None):
    """Pops one GEMM's weight refs off the front of refs (the order of `weight_operands`):
    w [E, K, N], or (magic [1], words [E, T, K*b/32, B_N], scales [E, T, K/G, B_N], zeros or None)."""
    if qm is None:
        return refs.pop(0)
    return refs.pop(0), refs.pop(0), refs.pop(0), None if qm.symmetric else refs.pop(0)


def expert_tile(wrefs, qm: QMeta | None, e, t, a_load, *, n_k, bk, bn, bm, fma, groups=None):
    """a @ W_e[:, tile t] in fp32 for either weight format: [BM, BN] ("dot") or [BN] ("fma").
    a_load(k0, size) gives the rows' columns [k0, k0 + size): [BM, size] in the activation dtype
    ("dot") or [size] fp32 ("fma"). groups: (first, count) of K's groups (quantised weights) or of
    its n_k steps of BK (bf16)."""
    if qm is None:
        return _acc_dense(wrefs, e, t * bn, a_load, n_k=n_k, bk=bk, bn=bn, bm=bm, fma=fma, steps=groups)
    return _acc_quant(wrefs, qm, e, t, a_load, bm=bm, fma=fma, groups=groups)


def swiglu_columns(acc, limit):
    """acc [..., BN] fp32 with (gate, up) interleaved by column -> swiglu [..., BN/2] fp32.

    The pairs are split by a select and a sum over the pair axis (exact, and it lowers everywhere:
    Triton has no strided column slice)."""
    pairs = acc.reshape(*acc.shape[:-1], acc.shape[-1] // 2, 2)  # [..., BN/2, (gate, up)]
    gate = jnp.arange(2, dtype=jnp.int32) == 0
    g = jnp.sum(jnp.where(gate, pairs, 0.0), axis=-1)
    u = jnp.sum(jnp.where(gate, 0.0, pairs), axis=-1)
    return swiglu(g, u, limit)


def _gemm_kernel(*refs, stage, direct, k, p, bm, fma, n_k, bk, bn, qm, split, limit, n_init, shared,
                 ticket_sums=False, n_tiles=1, interpret=False):
    """Program (j, t, s): block j's rows times expert e_j's weight tile t, over the s-th of split
    shares of K; see the module doc. shared: None, or (E, its SwiGLU limit): expert id E names
    the shared expert, whose weights follow the routed experts' refs. ticket_sums ("fma" only): the
    last program to finish a share of an output (`pallas_kernels.tickets`) sums the shares in
    split order: up, the (j, t) tile's S shares -> SwiGLU -> h; down, column tile t of every
    pair's S shares -> y [M, D] = sum_k w * out (the combine), each in the launch."""
    refs = list(refs)
    a_ref = refs.pop(0)  # up: x [M, D]; down: h [NB*BM, I]
    route_ref = refs.pop(0)  # direct: topk ids [P] (the routed P - 1 with a shared expert); else block_expert [NBP]
    sorted_ref = None if direct else refs.pop(0)  # [S]
    wrefs = pop_weight_refs(refs, qm)
    shared_wrefs = None if shared is None else pop_weight_refs(refs, qm)
    pair_w_ref = refs.pop(0) if ticket_sums and stage == "down" else None  # [P] fp32: each pair's combine weight
    del refs[:n_init + ticket_sums]  # aliased initial outputs (tests poison them; the counters): output refs used
    # up: h [NB*BM, I], or (split, no tickets) partials [S, NB*BM, 2I] f32; down: out [S, P + 1, D] f32,
    # or with tickets y [M, D], the partials and the counters after it.
    out_ref = refs.pop(0)
    part_ref, counters_ref = (refs.pop(0), refs.pop(0)) if ticket_sums else (out_ref, None)

    j, t, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if direct and shared is not None:  # the last pair is the shared expert's: route holds the p - 1 routed
        e = jnp.where(j < p - 1, route_ref[jnp.minimum(j, p - 2)], shared[0])
    else:
        e = route_ref[j]
    r = jnp.arange(bm, dtype=jnp.int32)
    if fma:  # one pair per block: never padding
        pair = j if direct else sorted_ref[j]
    elif direct:
        pair = jnp.where(r == 0, j, p)  # [BM] only row 0 holds a pair
    else:
        pair = sorted_ref[pl.ds(j * bm, bm)]  # [BM] P = padding
    valid = pair < p

    if stage == "up":  # rows of x gathered by token
        if fma:
            def a_load(k0, size):
                return a_ref[pair // k, pl.ds(k0, size)].astype(jnp.float32)
        else:
            tok = jnp.where(valid, pair // k, 0)[:, None]  # [BM, 1]

            def a_load(k0, size):
                cols = (k0 + jnp.arange(size, dtype=jnp.int32))[None, :]
                return pltriton.load(a_ref.at[tok, cols], mask=valid[:, None], other=0.0)
    else:  # rows of h: the block's own slots
        if fma:
            def a_load(k0, size):
                return a_ref[j, pl.ds(k0, size)].astype(jnp.float32)
        else:
            def a_load(k0, size):
                return a_ref[pl.ds(j * bm, bm), pl.ds(k0, size)]

    def block(wrefs, e, limit):  # an unused block (e < 0) reads and writes nothing
        per = (n_k if qm is None else qm.n_groups) // split
        share = None if split == 1 else (s * per, per)
        acc = expert_tile(wrefs, qm, e, t, a_load, n_k=n_k, bk=bk, bn=bn, bm=bm, fma=fma, groups=share)
        if stage == "up" and split > 1:  # raw (gate, up) partial sums: SwiGLU after their sum
            if fma:
                part_ref[s, j, pl.ds(t * bn, bn)] = acc
            else:
                part_ref[s, pl.ds(j * bm, bm), pl.ds(t * bn, bn)] = acc
        elif stage == "up":
            h = swiglu_columns(acc, limit).astype(out_ref.dtype)  # padding rows: x = 0 -> h = 0
            if fma:
                out_ref[j, pl.ds(t * (bn // 2), bn // 2)] = h
            else:
                out_ref[pl.ds(j * bm, bm), pl.ds(t * (bn // 2), bn // 2)] = h
        elif fma:
            part_ref[s, pair, pl.ds(t * bn, bn)] = acc
        else:
            rows = jnp.where(valid, pair, p)[:, None]  # padding goes nowhere (masked, row P)
            cols = (t * bn + jnp.arange(bn, dtype=jnp.int32))[None, :]
            pltriton.store(part_ref.at[s, rows, cols], acc, mask=valid[:, None])

    if shared is None:
        pl.when(e >= 0)(lambda: block(wrefs, e, limit))
    else:
        n_experts, shared_limit = shared
        pl.when((e >= 0) & (e < n_experts))(lambda: block(wrefs, e, limit))
        pl.when(e == n_experts)(lambda: block(shared_wrefs, jnp.zeros((), jnp.int32), shared_limit))
    if not ticket_sums:
        return

    # Every program takes a ticket (unused blocks too); the last of its output finishes the sum.
    def barrier():  # the program's threads; the interpreter runs a program as one
        if not interpret:
            pltriton.debug_barrier()

    counter = j * n_tiles + t if stage == "up" else t
    barrier()  # every thread's share stored before the ticket (an acquire-release atomic)
    ticket = pltriton.atomic_add(counters_ref, counter, jnp.int32(1))
    barrier()
    arrivals = split if stage == "up" else pl.num_programs(0) * split

    @pl.when(ticket == arrivals - 1)
    def _():
        if stage == "up":
            total = part_ref[0, j, pl.ds(t * bn, bn)]
            for s_ in range(1, split):
                total = total + part_ref[s_, j, pl.ds(t * bn, bn)]
            lim = limit
            if shared is not None and (limit is not None or shared[1] is not None):
                # strongly typed: Triton's select of two weak literals types them as its predicate
                limits = [jnp.float32(float("inf") if v is None else v) for v in (shared[1], limit)]
                lim = jnp.where(e == shared[0], *limits)
            out_ref[j, pl.ds(t * (bn // 2), bn // 2)] = swiglu_columns(total, lim).astype(out_ref.dtype)
        else:
            for m in range(out_ref.shape[0]):  # tokens: y[m] = sum over its k pairs of w * (sum of shares)
                y = None
                for i in range(k):
                    pr = m * k + i
                    share = part_ref[0, pr, pl.ds(t * bn, bn)]
                    for s_ in range(1, split):
                        share = share + part_ref[s_, pr, pl.ds(t * bn, bn)]
                    term = share * pair_w_ref[pr]
                    y = term if y is None else y + term
                out_ref[m, pl.ds(t * bn, bn)] = y.astype(out_ref.dtype)
        counters_ref[counter] = jnp.int32(0)  # zero again for the next ticket kernel


def _gemm(stage, a, route, sorted_pairs, w, *, n_blocks, k, p, plan: Plan, gp: GemmPlan, out_shape,
          limit, interpret, init=None, shared=None, counters=None, pair_weights=None, partials=None):
    """One expert-GEMM pallas_call (stage "up" or "down"), grid (n_blocks, N / BN, split).

    route: topk ids [P] when sorted_pairs is None (direct), else block_expert [NBP].
    init: an initial output to alias (tests poison it). shared: None, or (the shared expert's
    weights for this GEMM, its SwiGLU limit): blocks of expert E = w's E read them.
    counters ("fma", split K): the shares summed in the launch by tickets (`pallas_kernels.tickets`):
    out_shape is then h (up) or y [M, D] (down), partials the shares' scratch, pair_weights [P]
    fp32 (down) the combine's weights; returns (out, partials, counters)."""
    dot = plan.path == "dot"
    ops = weight_operands(w, gp.block_k, gp.block_n, dot=dot, stage=stage)
    qm, bk, bn, n_k, n_tiles, w_inputs = ops.qm, ops.bk, ops.bn, ops.n_k, ops.n_tiles, ops.inputs
    if shared is not None:
        w_inputs = w_inputs + weight_operands(shared[0], gp.block_k, gp.block_n, dot=dot, stage=stage).inputs
        shared = (w.words.shape[0] if qm else w.shape[0], shared[1])
    if (qm.n_groups if qm else n_k) % gp.split:
        raise ValueError(f"plan: split={gp.split} must divide the {stage} GEMM's "
                         + (f"groups of K ({qm.n_groups})" if qm else f"steps of K ({n_k} of {bk})"))
    direct = sorted_pairs is None
    ticket_sums = counters is not None
    if ticket_sums and (plan.path != "fma" or gp.split == 1 or init is not None):
        raise ValueError("tickets sum the split shares of the 'fma' path (no poisoned init)")
    inputs = [a, route] + ([] if direct else [sorted_pairs]) + w_inputs
    if ticket_sums and stage == "down":
        inputs.append(pair_weights)
    inits = [] if init is None else [init]
    aliases = {len(inputs) + i: i for i in range(len(inits))}
    if ticket_sums:  # out, the shares' scratch, the counters (aliased)
        out_shape = (out_shape, partials, jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[len(inputs)] = 2
        inits.append(counters)
    kernel = functools.partial(
        _gemm_kernel, stage=stage, direct=direct, k=k, p=p, bm=plan.block_m,
        fma=plan.path == "fma", n_k=n_k, bk=bk, bn=bn, qm=qm, split=gp.split, limit=limit,
        n_init=len(inits) - ticket_sums, shared=shared, ticket_sums=ticket_sums, n_tiles=n_tiles,
        interpret=interpret)
    bits = "" if qm is None else f"_int{qm.bits}"
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_blocks, n_tiles, gp.split),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=gp.num_warps, num_stages=gp.num_stages),
        name=f"fused_moe_{stage}_{plan.path}{bits}",
    )(*inputs, *inits)


# ---------------------------------------------------------------------------------- public
def _run(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit, backend, plan, poison=False,
         shared: SharedExpert | None = None):
    """The kernel path; returns (y, h, out). poison: start h and out as NaN (tests).
    h: [NB*BM, I], or the up GEMM's fp32 partials [S, NB*BM, 2I] when it is split; out: the down
    GEMM's [S, P + 1, D] (S = 1 unless split). shared: each token takes the shared expert as
    pair k (expert id E, weight 1), so P = M (k + 1); at M = 1 the kernels know the shared pair
    (the last) without reading its id, so the routed ids reach them as the router wrote them."""
    e, d, i = expert_dims(w13, w2)
    routed = topk_ids.reshape(-1).astype(jnp.int32)
    if shared is not None:
        check_shared(w13, w2, shared)
        column = jnp.full((topk_ids.shape[0], 1), e, jnp.int32)
        topk_ids = jnp.concatenate([topk_ids.astype(jnp.int32), column], axis=1)
        topk_weights = jnp.concatenate([topk_weights.astype(jnp.float32), jnp.ones(column.shape, jnp.float32)], 1)
    m, k = topk_ids.shape
    p = m * k
    buckets = e + (shared is not None)  # the align's experts: the shared expert is expert E
    quant = isinstance(w13, QuantizedWeight)
    act = jnp.bfloat16 if quant else w13.dtype
    default_plan = plan is None
    plan = plan or plan_for(m, k, quant, k_groups(w13, w2) if quant else (1, 1))
    if (plan.path == "fma") != (plan.block_m == 1) or plan.path not in ("dot", "fma"):
        raise ValueError(f"plan: path 'fma' goes with block_m 1, 'dot' with block_m >= 16, got {plan}")
    interpret = backend == "interpret"
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    if m == 1:  # direct: block j is pair j; the shared pair (the last) is known to the kernel, not read
        route, sorted_pairs, nb = routed, None, p
    else:
        sorted_pairs, route = moe_align(ids, buckets, plan.block_m, backend=backend)
        nb = align_sizes(p, buckets, plan.block_m).nb
    if not quant and default_plan:  # bf16: split K where the grid would leave SMs idle
        plan = dataclasses.replace(plan, up=_fill(plan.up, w13, nb), down=_fill(plan.down, w2, nb))
    rows, su, sd = nb * plan.block_m, plan.up.split, plan.down.split
    h_shape = jax.ShapeDtypeStruct((su, rows, 2 * i) if su > 1 else (rows, i), jnp.float32 if su > 1 else act)
    out_shape = jax.ShapeDtypeStruct((sd, p + 1, d), jnp.float32)

    def nan(s):
        return jnp.full(s.shape, jnp.nan, s.dtype) if poison else None

    common = dict(n_blocks=nb, k=k, p=p, plan=plan, limit=swiglu_limit, interpret=interpret)
    up_shared, down_shared = (None, None) if shared is None else ((shared.w13, shared.swiglu_limit), (shared.w2, None))
    scope = tickets.current()
    if scope is not None and m == 1 and plan.path == "fma" and not poison:  # the sums in the launches
        n_counters = _ticket_counters(w13, w2, plan, nb)
        if n_counters <= tickets.CAPACITY:
            return _run_tickets(x, topk_weights, w13, w2, route, act, plan, su, sd, rows, scope.take(n_counters),
                                scope, up_shared, down_shared, common)
    h = _gemm("up", x.astype(act), route, sorted_pairs, w13, gp=plan.up, out_shape=h_shape,
              init=nan(h_shape), shared=up_shared, **common)
    # A split up GEMM's partials: summed in a fixed order (an unrolled chain of adds, so that XLA
    # fuses the sum, the strided gate/up split, SwiGLU and the rounding into one elementwise
    # launch; a reduce over S would be a launch of its own), SwiGLU, rounded.
    if su > 1:
        limit = swiglu_limit if shared is None else _row_limits(ids if m == 1 else route[:nb], plan.block_m, e,
                                                                 swiglu_limit, shared.swiglu_limit)
        total = h[0]
        for s in range(1, su):
            total = total + h[s]
        h_in = swiglu(total[:, 0::2], total[:, 1::2], limit).astype(act)
    else:
        h_in = h
    out = _gemm("down", h_in, route, sorted_pairs, w2, gp=plan.down, out_shape=out_shape,
                init=nan(out_shape), shared=down_shared, **common)
    y = _combine(out, topk_weights, p)
    return y.astype(x.dtype), h, out


def _combine(out, topk_weights, p: int):
    """y [M, D] fp32 = sum_k w * (the down GEMM's shares [S, P + 1, D] summed): one XLA fusion."""
    w = topk_weights.astype(jnp.float32)[..., None]  # [M, k, 1]
    return jnp.sum(jnp.sum(out[:, :p], axis=0).reshape(*topk_weights.shape, out.shape[-1]) * w, axis=1)


def _ticket_counters(w13, w2, plan: Plan, n_blocks: int) -> int:
    """The counters the ticket sums of a one-token call use: a (block, tile) each in the up GEMM,
    a column tile each in the down GEMM (one after the other, so the larger)."""
    up = weight_operands(w13, plan.up.block_k, plan.up.block_n, dot=False, stage="up").n_tiles
    down = weight_operands(w2, plan.down.block_k, plan.down.block_n, dot=False, stage="down").n_tiles
    return max(n_blocks * up, down)


def _run_tickets(x, topk_weights, w13, w2, route, act, plan, su, sd, rows, counters, scope, up_shared, down_shared,
                 common):
    """`_run` at one token inside a tickets scope: h from the up GEMM's launch (its split shares
    summed and SwiGLU'd by tickets) and y from the down GEMM's (the combine by tickets).
    counters: the scope's buffer, taken for `_ticket_counters` of them."""
    e, d, i = expert_dims(w13, w2)
    p = common["p"]
    h_shape = jax.ShapeDtypeStruct((rows, i), act)
    if su > 1:
        h, _, counters = _gemm("up", x.astype(act), route, None, w13, gp=plan.up, out_shape=h_shape,
                               shared=up_shared, counters=counters,
                               partials=jax.ShapeDtypeStruct((su, rows, 2 * i), jnp.float32), **common)
        scope.give(counters)
    else:
        h = _gemm("up", x.astype(act), route, None, w13, gp=plan.up, out_shape=h_shape, shared=up_shared, **common)
    y_shape = jax.ShapeDtypeStruct((x.shape[0], d), x.dtype)
    out_shape = jax.ShapeDtypeStruct((sd, p + 1, d), jnp.float32)
    if sd == 1:  # nothing to sum across programs: the combine stays XLA's
        out = _gemm("down", h, route, None, w2, gp=plan.down, out_shape=out_shape, shared=down_shared, **common)
        return _combine(out, topk_weights, p).astype(x.dtype), h, out
    y, out, counters = _gemm("down", h, route, None, w2, gp=plan.down, out_shape=y_shape, shared=down_shared,
                             counters=counters,
                             pair_weights=topk_weights.astype(jnp.float32).reshape(-1),
                             partials=out_shape, **common)
    scope.give(counters)
    return y, h, out


def _row_limits(route, block_m: int, e: int, limit, shared_limit):
    """The SwiGLU limit of each of the up GEMM's rows [NB*BM, 1] (the shared expert's rows, in
    blocks of expert E, take shared_limit; no limit is +inf), or None where neither has one."""
    if limit is None and shared_limit is None:
        return None
    inf = float("inf")
    rows_expert = jnp.repeat(route, block_m)[:, None]
    return jnp.where(rows_expert == e, inf if shared_limit is None else shared_limit, inf if limit is None else limit)


ROWS_PREFILL_BLOCK = 64  # pairs a block of the row layout's kernel past GATHER_MAX_PAIRS pairs


@dataclasses.dataclass(frozen=True)
class RowsRoute:
    """Where the row layout's kernel finds a routing's pairs: blocks of block_m pairs of one
    expert (MMA_ROWS up to GATHER_MAX_PAIRS pairs, ROWS_PREFILL_BLOCK beyond: a prefill's experts
    read once a block). direct (M = 1): block j is pair j, expert = the flat top-k ids; else the
    align's sorted pairs [S] and block_expert. slot [P]: each pair's row in the down GEMM's output."""

    direct: bool
    expert: jax.Array
    pairs: jax.Array | None
    n_blocks: int
    slot: jax.Array
    block_m: int


def rows_route(topk_ids, n_experts: int, *, backend="auto") -> RowsRoute:
    m, k = topk_ids.shape
    p = m * k
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    if m == 1:
        return RowsRoute(True, ids, None, p, jnp.arange(p, dtype=jnp.int32) * MMA_ROWS, MMA_ROWS)
    bm = MMA_ROWS if p <= GATHER_MAX_PAIRS else ROWS_PREFILL_BLOCK
    pairs, expert = moe_align(ids, n_experts, bm, backend=backend)
    slot = jnp.zeros((p,), jnp.int32).at[pairs].set(jnp.arange(pairs.shape[0], dtype=jnp.int32), mode="drop")
    return RowsRoute(False, expert, pairs, align_sizes(p, n_experts, bm).nb, slot, bm)


def rows_combine(out, route: RowsRoute, topk_ids, topk_weights, n_experts: int):
    """y [M, D] float32 = sum_k w * out[slot] over the live pairs (a skipped pair's rows are never
    written: masked, not multiplied). One XLA fusion."""
    m, k = topk_ids.shape
    live = (topk_ids.reshape(-1) < n_experts)[:, None]
    terms = jnp.where(live, out[route.slot] * topk_weights.reshape(-1, 1).astype(jnp.float32), 0.0)  # [P, D]
    return jnp.sum(terms.reshape(m, k, -1), axis=1)


def _run_rows(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit, backend, plan=None):
    """Experts in the row layout: the tensor-core kernel's up and down GEMMs (two launches, each
    with its split-K sum) over blocks of (token, slot) pairs of one expert (`rows_route`), then
    the combine. plan: (up, down) `rows_plan.RowsPlan`s. Returns (y, h, out)."""
    from pallas_kernels.rows_plan import moe_rows_plans

    m, k = topk_ids.shape
    e, d, i = expert_dims(w13, w2)
    route = rows_route(topk_ids, e, backend=backend)
    up, down = plan or moe_rows_plans(route.n_blocks, i, d, route.block_m)
    rows = route.n_blocks * route.block_m
    common = dict(m=m, expert=route.expert, n_blocks=route.n_blocks, topk=k, direct=route.direct,
                  block_m=route.block_m)
    h = rows_launch("up", x.astype(jnp.bfloat16), w13, out=jax.ShapeDtypeStruct((rows, i), jnp.bfloat16),
                    plan=up, pairs=route.pairs, limit=swiglu_limit, **common)
    out = rows_launch("down", h, w2, out=jax.ShapeDtypeStruct((rows, d), jnp.float32), plan=down, **common)
    y = rows_combine(out, route, topk_ids, topk_weights, e)
    return y.astype(x.dtype), h, out


def fused_moe(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit=None, backend="auto",
              plan: Plan | None = None, shared: SharedExpert | None = None):
    """y [M, D] = sum_k topk_weights * expert_{topk_ids}(x), fp32 accumulation, rounded once.

    x [M, D]; topk_ids [M, k] int (in [0, E)); topk_weights [M, k] (fp32 in the combine).
    w13 [E, D, 2I] (gate/up interleaved by column), w2 [E, I, D], bf16 (or any float dtype: x
    is cast to it); or both the `QuantizedExperts` fields of `quantize_experts` (x in bf16).
    swiglu_limit: None, or L for min(silu(g), L) * clamp(u, -L, L).
    backend: "pallas" | "interpret" | "reference" | "auto" (pallas_kernels.backend.resolve).
    M <= 64 runs block 16 (bf16) or one pair per block (quantised, M <= 16); M = 1 without an
    align launch; larger M the same kernels with block 64 (a grouped GEMM) and the blocked
    align. Experts in the row layout (int4, int8) run the tensor-core Triton kernel instead,
    any M, in blocks of 16 pairs of one expert (64 past GATHER_MAX_PAIRS pairs; `_run_rows`).
    plan overrides the launch heuristics (`plan_for`; for the row layout a pair of
    `rows_plan.RowsPlan`s).
    shared: an `experts.SharedExpert` added to y inside the same launches (each token's pair k,
    weight 1, its own SwiGLU limit; the plan is chosen for k + 1 pairs a token): its weights
    stream beside the routed experts' and its split-K sum, combine and add cost nothing extra.
    Tile layout and bf16 only.
    """
    backend = resolve(backend)
    check_args(x, topk_ids, topk_weights, w13, w2)
    if backend == "reference":
        return reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, shared=shared)
    if shared is not None and rows_layout(w13):
        raise ValueError("shared: experts in the row layout run the shared expert in its own launches")
    if rows_layout(w13):
        if backend == "interpret":
            raise ValueError("experts in the row layout run Triton's tensor-core kernel, which Pallas' interpret "
                             "mode cannot run: use backend='reference' on CPU, or tests/triton_interpret.py")
        return _run_rows(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, backend=backend,
                         plan=plan)[0]
    return _run(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, backend=backend,
                plan=plan, shared=shared)[0]

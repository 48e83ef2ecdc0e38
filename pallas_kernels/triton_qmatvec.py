"""The row layout's dequantising kernels on the tensor cores, in Triton: the matvec  y = x @ W^T
and the two GEMMs of a MoE's experts at decode and verify sizes, one kernel (`rows_kernel`).

W: int4 or int8 in `pallas_kernels.quant`'s row layout (groups of 128 columns): words uint32
[N, K*b/32], scales (and zeros) bf16 [N, K/128] (stacked experts: a leading E axis). x: bf16
[M, K], M = 1..16 for the matvec. `qmatvec` and `fused_moe` call it (through jax_triton) for weights in the row
layout; this module imports only triton, so Triton's interpreter can run it on a CPU
(tests/triton_interpret.py).

Dequantisation, per 32-bit word of 8 codes (inline PTX, 7 integer instructions): lanes j and j + 4
sit in bits [4j, 4j + 4) and [16 + 4j, 20 + 4j), so `lop3((w >> 4j) & 0x000F000F | 0x43004300)`
is the bf16x2 pair (128 + u_j, 128 + u_{j+4}) exactly (0x4300 is bf16 128.0; the code fills the
low mantissa bits). One bf16x2 subtraction of 128 + z makes the exact integers u - z (|u - z| < 16).
int8 takes a byte's two nibbles from the same unpack and combines them, 16 (hi - c_hi) +
(lo - c_lo), exact too (|u - z| < 256; `_bytes`).

Tensor cores at M <= 16 ("swap AB"): the dequantised tile is wgmma's A operand [BN, 128] straight
from registers, x^T its B operand [128, MP] (MP = 16: M padded by repeating row M - 1; a MoE's
prefill takes blocks of MP = 64 pairs), one group's product D [BN, MP] float32; the group's
scale multiplies D's rows into the float32 accumulator (one FMA per element), so the weights
reach the tensor core as exact integers and the only rounding of a product is fp32's.

No shuffles: the row layout's ROW_ORDERS put in words 4t..4t+3 of a row (one 128-bit load; int8
also words 16 + 4t..) the columns {16b + 8h + 2t + p} that thread t of a quad holds in wgmma's A
fragment, with the lane pairs (j, j + 4) as the (p = 0, 1) halves of one register. Rows are relabelled (`_rowperm`)
between Triton's coalesced load layout (row +8 across warps) and wgmma's (row +8 in registers);
scales, zeros and the stored rows take the same relabelling.

Grid (NBLK, n_tiles, S) (n_tiles = ceil(N / BN)): program (b, t, s) multiplies block b's MP
rows of the activations (the matvec: x's M rows; a MoE: one expert's pairs, `rows_kernel`) by
tile t's weight rows [t*BN, t*BN + BN) (rows past N re-read row N - 1 and are not stored) over K
split s: groups [s*NB/S, (s+1)*NB/S) of the NB = K/128, GPI groups an iteration with their loads
issued together. S = 1 stores the result. S > 1: the program stores its float32 partial to
part [S, R, N], then takes a ticket from its (block, tile)'s counter (int32, zeroed before the
launch); the program that draws ticket S - 1 sums the S partials in split order (the same sum
every run) and stores the result (through the SwiGLU for a MoE's up GEMM: gate and up rows are
read into one thread), so one GEMM is one launch.

Bytes moved: the words and scales once a block (K*b/8 + K/64 bytes a row), x (M*K*2, from L2
after the first programs), the output, and with S > 1 the partials (S*R*N*4, twice).
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP = 128  # columns a group: 16 words of 8 int4 codes, 32 of 4 int8 codes
_GROUP = tl.constexpr(GROUP)  # the same, as the kernels read it

# $0..$7: bf16 (128 + u) of lanes 0, 4, 1, 5, 2, 6, 3, 7 of the word $8.
UNPACK_PTX = tl.constexpr("""{
.reg .b32 t, s;
lop3.b32 t, $8, 0x000F000F, 0x43004300, 0xea;
mov.b32 {$0, $1}, t;
shr.u32 s, $8, 4;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xea;
mov.b32 {$2, $3}, t;
shr.u32 s, $8, 8;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xea;
mov.b32 {$4, $5}, t;
shr.u32 s, $8, 12;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xea;
mov.b32 {$6, $7}, t;
}""")


@triton.jit
def _halves(r):
    """A uint32 holding a bf16 pair -> (low half, high half) as bf16 (the PTX's mov {lo, hi})."""
    lo = (r & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _unpack(q, COMPILED: tl.constexpr):
    """q uint32 [BN, 16] -> the 8 bf16 (128 + u) tensors of lanes 0, 4, 1, 5, 2, 6, 3, 7.

    COMPILED: the inline PTX; otherwise the same bits through Triton's integer ops (what
    Triton's interpreter can run; compiled, they cost twice the instructions)."""
    if COMPILED:
        return tl.inline_asm_elementwise(UNPACK_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r", [q],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        o0, o1 = _halves((q & 0x000F000F) | 0x43004300)
        o2, o3 = _halves(((q >> 4) & 0x000F000F) | 0x43004300)
        o4, o5 = _halves(((q >> 8) & 0x000F000F) | 0x43004300)
        o6, o7 = _halves(((q >> 12) & 0x000F000F) | 0x43004300)
        return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _fragment(q, c, COMPILED: tl.constexpr):
    """One group of a tile: words q uint32 [BN, 16] -> u - z [BN, 128] in column order (bf16;
    float32 when not COMPILED).

    c: 128 + z, bf16 [BN, 1, 1, 1, 1] ([1, 1, 1, 1, 1] of 136 when symmetric). Word m = 4t + 2e + h
    (t: the thread of a quad, e, h: the word within its 128-bit load), lane j = j' + 4p: the
    column is 16(2j' + e) + 8h + 2t + p (quant.ROW_ORDERS[4])."""
    BN: tl.constexpr = q.shape[0]
    o0, o1, o2, o3, o4, o5, o6, o7 = _unpack(q, COMPILED)
    v = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)),
                tl.join(tl.join(o4, o5), tl.join(o6, o7)))  # [n, m, p, j'0, j'1]
    if COMPILED:
        v = v - c  # bf16x2 subtractions, exact
    else:  # the interpreter's bf16 arithmetic is wrong (137 - 136 = 0): float32, also exact
        v = v.to(tl.float32) - c.to(tl.float32)
    v = v.reshape(BN, 4, 2, 2, 2, 2, 2)  # [n, t, e, h, p, j'0, j'1]
    v = tl.permute(v, (0, 6, 5, 2, 3, 1, 4))  # [n, j'1, j'0, e, h, t, p]
    return v.reshape(BN, _GROUP)


@triton.jit
def _bytes(q, c_lo, c_hi, COMPILED: tl.constexpr):
    """Half a group of int8 codes: words q uint32 [BN, 16] -> u - z [BN, 16, 2 (p), 2 (h)], byte
    j = 2p + h of each word (bf16; float32 when not COMPILED). A byte's nibbles come from the
    int4 unpack (shifts 0, 4: bytes 0, 2; shifts 8, 12: bytes 1, 3) and combine exactly as
    16 (hi - c_hi) + (lo - c_lo), c_hi = 128 + z // 16, c_lo = 128 + z % 16 (each below 256, so
    exact in bf16, as every partial result is)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = _unpack(q, COMPILED)
    lo = tl.join(tl.join(o0, o1), tl.join(o4, o5))  # [n, m, p, h]
    hi = tl.join(tl.join(o2, o3), tl.join(o6, o7))
    if COMPILED:
        return (hi - c_hi) * 16.0 + (lo - c_lo)
    else:  # the interpreter's bf16 arithmetic is wrong: float32, also exact
        return (hi.to(tl.float32) - c_hi.to(tl.float32)) * 16.0 + (lo.to(tl.float32) - c_lo.to(tl.float32))


@triton.jit
def _fragment8(q0, q1, c_lo, c_hi, COMPILED: tl.constexpr):
    """One group of int8 codes: words q0, q1 uint32 [BN, 16] (the group's words 0..15, 16..31) ->
    u - z [BN, 128] in column order; c_lo, c_hi bf16 [BN or 1, 1, 1, 1] (`_bytes`). Word
    m = 16 half + 4t + e, byte j = 2p + h: the column is 16(4 half + e) + 8h + 2t + p
    (quant.ROW_ORDERS[8])."""
    BN: tl.constexpr = q0.shape[0]
    v = tl.join(_bytes(q0, c_lo, c_hi, COMPILED), _bytes(q1, c_lo, c_hi, COMPILED))  # [n, m, p, h, half]
    v = v.reshape(BN, 4, 4, 2, 2, 2)  # [n, t, e, p, h, half]
    v = tl.permute(v, (0, 5, 2, 4, 1, 3))  # [n, half, e, h, t, p]
    return v.reshape(BN, _GROUP)


@triton.jit
def _to_bf16(v, COMPILED: tl.constexpr):
    """float32 -> bf16, rounding to nearest even (the interpreter's own conversion truncates)."""
    if COMPILED:
        return v.to(tl.bfloat16)
    else:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _rowperm(v, LW: tl.constexpr):
    """Relabel the rows of v [BN, C]: load row i (bits: 0-2 lane, 3..3+LW warp, 3+LW register)
    -> wgmma row (bits: 0-2 lane, 3 register, 4..4+LW warp); higher bits are kept."""
    BN: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    W: tl.constexpr = 1 << LW
    v = v.reshape(BN // (16 * W), 2, W, 8, C)
    v = tl.permute(v, (0, 2, 1, 3, 4))
    return v.reshape(BN, C)


@triton.jit
def _column(a, i: tl.constexpr, n: tl.constexpr):
    """Column i (static) of a [BN, n] as [BN, 1], by halving splits (no data movement)."""
    if n == 1:
        return a.reshape(a.shape[0], 1)
    else:
        lo, hi = a.reshape(a.shape[0], 2, n // 2).permute(0, 2, 1).split()
        if i < n // 2:
            return _column(lo, i, n // 2)
        else:
            return _column(hi, i - n // 2, n // 2)


@triton.jit
def _paired(i, LW: tl.constexpr):
    """Load row i -> the tile row it reads when rows 2j, 2j + 1 (an expert's gate j and up j)
    must land in one thread: the bit that `_rowperm` makes the register bit 3 becomes bit 0."""
    b = (i >> (3 + LW)) & 1
    rest = (i & ((1 << (3 + LW)) - 1)) | ((i >> (4 + LW)) << (3 + LW))
    return 2 * rest + b


@triton.jit
def _swiglu(acc, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr):
    """acc [BN, MP] in wgmma row order whose rows r and r + 8 (bit 3) are gate j and up j ->
    silu(gate) * up [BN/2, MP] (with the limit: min(silu(g), L) * clamp(u, -L, L)), float32."""
    BN: tl.constexpr = acc.shape[0]
    C: tl.constexpr = acc.shape[1]
    g, u = acc.reshape(BN // 16, 2, 8, C).permute(0, 2, 3, 1).split()
    g = g * tl.sigmoid(g)
    if HAS_LIMIT:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return (g * u).reshape(BN // 2, C)


@triton.jit
def _gate_rows(rows):
    """The gate rows' entries of rows [BN, 1] (bit 3 = 0), as `_swiglu` keeps them: [BN/2, 1]."""
    BN: tl.constexpr = rows.shape[0]
    g, _ = rows.reshape(BN // 16, 2, 8, 1).permute(0, 2, 3, 1).split()
    return g.reshape(BN // 2, 1)


@triton.jit
def _store(out_ptr, acc, orow, rows_out, N: tl.constexpr, R: tl.constexpr, STAGE: tl.constexpr,
           HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, COMPILED: tl.constexpr):
    """A tile's finished sums acc [BN, MP] to the output (see `rows_kernel`)."""
    cols = orow[None, :]  # [1, MP] output rows
    ok = cols < R
    if STAGE == 1:  # up: SwiGLU, h [R, N/2] bf16
        h = _swiglu(acc, HAS_LIMIT, LIMIT)
        j = _gate_rows(rows_out) // 2  # [BN/2, 1]
        tl.store(out_ptr + cols * (N // 2) + j, _to_bf16(h, COMPILED), mask=ok & (j < N // 2))
    elif STAGE == 2:  # down: float32 rows of the pairs
        tl.store(out_ptr + cols * N + rows_out, acc, mask=ok & (rows_out < N))
    else:
        tl.store(out_ptr + cols * N + rows_out, _to_bf16(acc, COMPILED), mask=ok & (rows_out < N))


@triton.jit
def rows_kernel(a_ptr, w_ptr, s_ptr, z_ptr, expert_ptr, pair_ptr, out_ptr, part_ptr, ticket_ptr,
                M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
                TOPK: tl.constexpr, STAGE: tl.constexpr, DIRECT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                LIMIT: tl.constexpr, BN: tl.constexpr, S: tl.constexpr, GPI: tl.constexpr, LW: tl.constexpr,
                SYMMETRIC: tl.constexpr, BITS: tl.constexpr, MP: tl.constexpr, COMPILED: tl.constexpr):
    """One launch; grid (NBLK, ceil(N / BN), S): program (b, t, s) multiplies block b's MP rows of
    a by tile t's weight rows over K split s (module docstring). STAGE:
      0  matvec: a = x [M, K]; NBLK = 1; W [N, K*BITS/32]; out = y [M, N] bf16.
      1  a MoE's up GEMM: a = x [M, K]; block b's expert from expert_ptr (DIRECT: the flat top-k
         ids [P], block b = pair b, M = 1; else the align's block_expert [NBLK], -1 past the
         used blocks) and its rows' tokens pair // TOPK (DIRECT: b // TOPK; else pair_ptr, the
         align's sorted pairs [NBLK * MP], P marking padding); W [E, N = 2I, ..] with rows 2j and
         2j + 1 gate j and up j; out = h [NBLK * MP, I] bf16 after the SwiGLU (LIMIT where
         HAS_LIMIT).
      2  a MoE's down GEMM: a = h; block b's rows are h's rows b*MP .. b*MP + MP - 1; W [E, N = D,
         ..]; out [NBLK * MP, D] float32.
    R: the output's rows (M; NBLK * MP for the MoE stages). A block whose expert is outside
    [0, E) does nothing. z_ptr is read only when not SYMMETRIC, pair_ptr only by STAGE 1 not
    DIRECT, part_ptr and ticket_ptr only when S > 1 (partials [S, R, N], tickets
    [NBLK * tiles]). LW = log2(num_warps); BN a multiple of 16 << LW. BITS: 4 or 8. MP: rows a
    block, the B operand's N (16 at decode and verify sizes, 64 for a prefill's MoE). COMPILED:
    False under Triton's interpreter (no inline PTX there)."""
    NB: tl.constexpr = K // _GROUP
    WPG: tl.constexpr = 4 * BITS  # words a group
    WPR: tl.constexpr = K * BITS // 32  # words a row
    NBP: tl.constexpr = NB // S
    blk = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, MP)
    if STAGE == 0:
        expert = 0
        arow = tl.minimum(m, M - 1)  # x's rows, the padding repeating row M - 1
    else:
        expert = tl.load(expert_ptr + blk)
        if STAGE == 2:
            arow = blk * MP + m  # h's rows of this block
        elif DIRECT:
            arow = tl.zeros((MP,), tl.int32) + blk // TOPK  # pair blk's token, in every row
        else:
            pair = tl.load(pair_ptr + blk * MP + m)  # P marks padding: it reads the last token
            arow = tl.minimum(pair, M * TOPK - 1) // TOPK
    if (expert >= 0) & (expert < E):
        w_ptr += expert.to(tl.int64) * (N * WPR)
        s_ptr += expert.to(tl.int64) * (N * NB)
        z_ptr += expert.to(tl.int64) * (N * NB)
        i = tl.arange(0, BN)
        rows = tile * BN + (_paired(i, LW) if STAGE == 1 else i)  # the tile rows each load row reads
        rows_in = tl.minimum(rows, N - 1)[:, None]  # [BN, 1]: rows past N re-read row N - 1
        acc = tl.zeros((BN, MP), tl.float32)
        for b0 in range(split * NBP, split * NBP + NBP, GPI):
            groups = b0 + tl.arange(0, GPI)[None, :]
            scales = _rowperm(tl.load(s_ptr + rows_in * NB + groups), LW).to(tl.float32)  # [BN, GPI]
            if not SYMMETRIC:  # c = 128 + z (int4); int8: 128 + z % 16 and 128 + z // 16
                z = _rowperm(tl.load(z_ptr + rows_in * NB + groups), LW).to(tl.float32)
                if BITS == 4:
                    cz = (z + 128.0).to(tl.bfloat16)  # [BN, GPI], exact
                else:
                    z_hi = tl.floor(z * 0.0625)
                    cz = (z - 16.0 * z_hi + 128.0).to(tl.bfloat16)
                    cz_hi = (z_hi + 128.0).to(tl.bfloat16)
            for g in tl.static_range(GPI):
                b = b0 + g
                words = w_ptr + rows_in * WPR + b * WPG + tl.arange(0, 16)[None, :]
                q = _rowperm(tl.load(words, eviction_policy="evict_first"), LW)
                if BITS == 4:
                    if SYMMETRIC:  # z = 8
                        c = tl.full((1, 1, 1, 1, 1), 136.0, tl.float32).to(tl.bfloat16)
                    else:
                        c = _column(cz, g, GPI)[:, :, None, None, None]
                    wa = _fragment(q, c, COMPILED)
                else:
                    if SYMMETRIC:  # z = 128: 16 * 8 + 0
                        c_lo = tl.full((1, 1, 1, 1), 128.0, tl.float32).to(tl.bfloat16)
                        c_hi = tl.full((1, 1, 1, 1), 136.0, tl.float32).to(tl.bfloat16)
                    else:
                        c_lo = _column(cz, g, GPI)[:, :, None, None]
                        c_hi = _column(cz_hi, g, GPI)[:, :, None, None]
                    q1 = _rowperm(tl.load(words + 16, eviction_policy="evict_first"), LW)
                    wa = _fragment8(q, q1, c_lo, c_hi, COMPILED)
                xt = tl.load(a_ptr + arow[None, :] * K + b * _GROUP + tl.arange(0, _GROUP)[:, None])  # [128, MP]
                if COMPILED:
                    d = tl.dot(wa, xt)
                else:  # the interpreter's dot reads bf16 operands as their bits
                    d = tl.dot(wa, xt.to(tl.float32))
                acc += d * _column(scales, g, GPI)
        rows_out = _rowperm(rows[:, None], LW)  # [BN, 1]: the tile row of each accumulator row
        orow = (0 if STAGE == 0 else blk * MP) + m  # [MP]: the output row of each column
        if S == 1:
            _store(out_ptr, acc, orow, rows_out, N, R, STAGE, HAS_LIMIT, LIMIT, COMPILED)
        else:
            offs = orow[None, :] * N + rows_out  # [BN, MP] into the partials' [R, N]
            live = (orow[None, :] < R) & (rows_out < N)
            tl.store(part_ptr + split * R * N + offs, acc, mask=live)
            tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
            counter = ticket_ptr + blk * tl.num_programs(1) + tile
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == S - 1:  # the tile's last program: sum the partials in split order
                total = tl.zeros((BN, MP), tl.float32)
                for sp in range(S):
                    total += tl.load(part_ptr + sp * R * N + offs, mask=live, other=0.0,
                                     cache_modifier=".cg")
                _store(out_ptr, total, orow, rows_out, N, R, STAGE, HAS_LIMIT, LIMIT, COMPILED)

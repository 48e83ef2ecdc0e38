"""The row layout's dequantising matvec on the tensor cores, in Triton:  y = x @ W^T.

W: int4 in `pallas_kernels.quant`'s row layout (groups of 128 columns): words uint32 [N, K/8],
scales (and zeros) bf16 [N, K/128]. x: bf16 [M, K], M = 1..16. y: bf16 [M, N]. `qmatvec` calls
this kernel (through jax_triton) for weights in the row layout; this module imports only triton,
so Triton's interpreter can run it on a CPU (tests/triton_interpret.py).

Dequantisation, per 32-bit word of 8 codes (inline PTX, 7 integer instructions): lanes j and j + 4
sit in bits [4j, 4j + 4) and [16 + 4j, 20 + 4j), so `lop3((w >> 4j) & 0x000F000F | 0x43004300)`
is the bf16x2 pair (128 + u_j, 128 + u_{j+4}) exactly (0x4300 is bf16 128.0; the code fills the
low mantissa bits). One bf16x2 subtraction of 128 + z makes the exact integers u - z (|u - z| < 16).

Tensor cores at M <= 16 ("swap AB"): the dequantised tile is wgmma's A operand [BN, 128] straight
from registers, x^T its B operand [128, MP] (M padded to MP = 16 by repeating row M - 1), one
group's product D [BN, MP] float32; the group's scale multiplies D's rows into the float32
accumulator (one FMA per element), so the weights reach the tensor core as exact integers and the
only rounding of a product is fp32's.

No shuffles: the row layout's ROW_ORDER puts in words 4t..4t+3 of a row (one 128-bit load) the
columns {16b + 8h + 2t + p} that thread t of a quad holds in wgmma's A fragment, with the lane
pairs (j, j + 4) as the (p = 0, 1) halves of one register. Rows are relabelled (`_rowperm`)
between Triton's coalesced load layout (row +8 across warps) and wgmma's (row +8 in registers);
scales, zeros and the stored rows take the same relabelling.

Grid: 1-D, n_tiles * S programs (n_tiles = ceil(N / BN)). Program p owns tile p // S (rows
[t*BN, t*BN + BN); the last tile's rows past N re-read row N - 1 and are not stored) and K split
p % S: groups [s*NB/S, (s+1)*NB/S) of the NB = K/128, GPI groups an iteration with their loads
issued together. S = 1 stores y. S > 1: the program stores its float32 partial [M, BN] to
part [S, M, N], then takes a ticket from its tile's counter (int32, zeroed before the launch); the
program that draws ticket S - 1 sums the S partials in split order (the same sum every run) and
stores y, so one matvec is one launch.

Bytes moved: the words and scales once (K/2 + K/64 bytes a row), x (M*K*2, from L2 after the
first programs), y (M*N*2), and with S > 1 the partials (S*M*N*4, twice).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

GROUP = 128  # columns a group: 16 words of 8 codes
MP = 16  # x rows a tensor-core tile holds (tl.dot needs N >= 16)
_GROUP, _MP = tl.constexpr(GROUP), tl.constexpr(MP)  # the same, as the kernels read them

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
    column is 16(2j' + e) + 8h + 2t + p (quant.ROW_ORDER)."""
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
def qmatvec_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, part_ptr, ticket_ptr,
                        M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                        S: tl.constexpr, GPI: tl.constexpr, LW: tl.constexpr,
                        SYMMETRIC: tl.constexpr, COMPILED: tl.constexpr):
    """See the module docstring. z_ptr is not read when SYMMETRIC; part_ptr and ticket_ptr only
    when S > 1. LW = log2(num_warps); BN a multiple of 16 << LW. COMPILED: False under Triton's
    interpreter (no inline PTX there)."""
    NB: tl.constexpr = K // _GROUP
    NBP: tl.constexpr = NB // S
    pid = tl.program_id(0)
    tile = pid // S
    split = pid % S
    rows = tile * BN + tl.arange(0, BN)
    rows_in = tl.minimum(rows, N - 1)[:, None]  # [BN, 1]
    xrows = tl.minimum(tl.arange(0, _MP), M - 1)[None, :]  # [1, MP]
    acc = tl.zeros((BN, _MP), tl.float32)
    for b0 in range(split * NBP, split * NBP + NBP, GPI):
        groups = b0 + tl.arange(0, GPI)[None, :]
        scales = _rowperm(tl.load(s_ptr + rows_in * NB + groups), LW).to(tl.float32)  # [BN, GPI]
        if not SYMMETRIC:
            z = _rowperm(tl.load(z_ptr + rows_in * NB + groups), LW).to(tl.float32)
            cz = (z + 128.0).to(tl.bfloat16)  # [BN, GPI], exact
        for i in tl.static_range(GPI):
            b = b0 + i
            q = tl.load(w_ptr + rows_in * (K // 8) + b * 16 + tl.arange(0, 16)[None, :],
                        eviction_policy="evict_first")
            q = _rowperm(q, LW)
            if SYMMETRIC:
                a = _fragment(q, tl.full((1, 1, 1, 1, 1), 136.0, tl.float32).to(tl.bfloat16), COMPILED)
            else:
                a = _fragment(q, _column(cz, i, GPI)[:, :, None, None, None], COMPILED)
            xt = tl.load(x_ptr + xrows * K + b * _GROUP + tl.arange(0, _GROUP)[:, None])  # [128, MP]
            if COMPILED:
                d = tl.dot(a, xt)
            else:  # the interpreter's dot reads bf16 operands as their bits
                d = tl.dot(a, xt.to(tl.float32))
            acc += d * _column(scales, i, GPI)
    rows_out = _rowperm(rows[:, None], LW)  # [BN, 1]: the memory row of each accumulator row
    cols = tl.arange(0, _MP)[None, :]
    mask = (rows_out < N) & (cols < M)
    offs = cols * N + rows_out  # [BN, MP] into [M, N]
    if S == 1:
        tl.store(y_ptr + offs, _to_bf16(acc, COMPILED), mask=mask)
    else:
        tl.store(part_ptr + split * M * N + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == S - 1:  # the tile's last program: sum the partials in split order
            total = tl.zeros((BN, _MP), tl.float32)
            for sp in range(S):
                total += tl.load(part_ptr + sp * M * N + offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + offs, _to_bf16(total, COMPILED), mask=mask)


@dataclasses.dataclass(frozen=True)
class RowsPlan:
    """How one call is launched (static); `rows_plan_for` picks it."""

    block_n: int  # BN: rows a program (64, 128 or 256 at 4 warps)
    split: int  # S: programs a tile along K (divides K / 128)
    groups_per_iter: int  # GPI: groups whose loads an iteration issues together (divides K/128/S)
    num_warps: int = 4


def rows_plan_for(m: int, n: int, k: int, sms: int = 132) -> RowsPlan:
    """Launch heuristics: at least two programs an SM, as few splits as give them, and whole
    iterations of 4 groups where a split allows (the loads of 4 groups in flight at once).

    BN 128 unless its tiles need a split that leaves a program fewer than 4 groups; then 64."""
    del m  # one tile of x rows (MP = 16) serves every M
    nb = k // GROUP
    divisors = [s for s in range(1, nb + 1) if nb % s == 0]
    for bn in (128, 64):
        tiles = -(-n // bn)
        fits = [s for s in divisors if tiles * s >= 2 * sms] or [nb]
        split = next((s for g in (4, 2, 1) for s in fits if (nb // s) % g == 0), fits[0])
        if nb // split >= 4:
            break
    gpi = next(g for g in (4, 2, 1) if (nb // split) % g == 0)
    return RowsPlan(bn, split, gpi)

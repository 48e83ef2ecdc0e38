"""Launch plans of the row layout's tensor-core kernel (pallas_kernels/triton_qmatvec.py): plain
Python, so that the JAX side, the benchmarks and the tests pick them without triton."""

from __future__ import annotations

import dataclasses

MP = 16  # rows of the activations a block holds (the kernel's B operand: tl.dot needs N >= 16)


@dataclasses.dataclass(frozen=True)
class RowsPlan:
    """How one call is launched (static); `rows_plan_for` picks it."""

    block_n: int  # BN: rows a program (64, 128 or 256 at 4 warps)
    split: int  # S: programs a tile along K (divides K / 128)
    groups_per_iter: int  # GPI: groups whose loads an iteration issues together (divides K/128/S)
    num_warps: int = 4


def rows_plan_for(m: int, n: int, k: int, sms: int = 132, blocks: int = 1, max_gpi: int = 4) -> RowsPlan:
    """Launch heuristics for `blocks` blocks of rows times an [n, k] weight: at least two programs
    an SM, as few splits as give them, and whole iterations of up to max_gpi groups where a split
    allows (the loads of that many groups in flight at once).

    BN 128 unless its tiles need a split that leaves a program fewer than 4 groups; then 64."""
    del m  # one tile of x rows (MP = 16) serves every M
    nb = k // 128  # groups
    divisors = [s for s in range(1, nb + 1) if nb % s == 0]
    for bn in (128, 64):
        tiles = -(-n // bn) * blocks
        fits = [s for s in divisors if tiles * s >= 2 * sms] or [nb]
        gpis = [g for g in (4, 2, 1) if g <= max_gpi]
        split = next((s for g in gpis for s in fits if (nb // s) % g == 0), fits[0])
        if nb // split >= 4:
            break
    gpi = next(g for g in gpis if (nb // split) % g == 0)
    return RowsPlan(bn, split, gpi)


def moe_rows_plans(blocks: int, inter: int, d: int, block_m: int = MP) -> tuple[RowsPlan, RowsPlan]:
    """(up, down) plans of a MoE's two GEMMs over `blocks` blocks of block_m rows: up [2I, D],
    down [D, I]. Blocks of 64 rows hold a [BN, 64] accumulator: 2 groups an iteration at most
    (4 spill at BN 128, compiled offline for sm_90a)."""
    gpi = 4 if block_m <= MP else 2
    return (rows_plan_for(block_m, 2 * inter, d, blocks=blocks, max_gpi=gpi),
            rows_plan_for(block_m, d, inter, blocks=blocks, max_gpi=gpi))

"""bench.fused_moe --align-only: the align alone (pallas_kernels/moe_align.py; the kernel up to
MAX_ALIGN_PAIRS pairs, the blocked path beyond) at the bf16 default plan's block, M > 1 and any M
(prefill sizes too): N aligns of shifted routings a dispatch, queued dispatches, the difference of
two counts divided out. Also a task of the full run: how much of the layer the align is.
"""

from __future__ import annotations

from bench.common import queued_us


def align_task(routing, rows, fmts, ek, backend, smoke, log):
    """The task align(_, m): times the align for M tokens, its µs in each format's row; ek: (E, K)."""
    import jax

    from pallas_kernels import fused_moe as fm
    from pallas_kernels import moe_align

    E, K = ek

    def align(_, m):
        """The align alone (M > 1; the kernel up to 64 pairs, the blocked path beyond), as the bf16
        default plan runs it: how much of the layer it is. N aligns of shifted routings a dispatch
        (one alone is shorter than the host's dispatch: the queue would time the host)."""
        x, ids, ws, _ = routing(m)
        bm, n = fm.plan_for(m, K, False).block_m, 32
        f = jax.jit(lambda ids: [moe_align.moe_align((i + j) % E, E, bm, backend=backend) for i in ids for j in range(n)])
        jax.block_until_ready(f(ids))
        us = 0.0 if smoke else queued_us(f, ids, hi=12, lo=3) / (n * len(ids))
        for fmt in fmts:
            rows[(fmt, m)]["align"] = us
        log(f"align M={m} ({m * K} pairs, block {bm}, {'kernel' if m * K <= moe_align.MAX_ALIGN_PAIRS else 'blocked'}): "
            f"{us:.1f} µs")

    return align

"""bench.fused_moe --ab: the default plan and the sweep's plans for each (format, M), each checked
against `experts.reference`, then timed once a round in turn (queued dispatches, the difference of
two counts divided out), best of the rounds: plan comparisons within one run, which
machine-to-machine spread does not blur.
"""

from __future__ import annotations

from bench.common import queued_us


def ab_task(routing, sweep, ours, check, wts, dims, smoke, results, log):
    """The task interleaved(fmt, m, rounds=3); dims: (K, D, I, G) of the run."""
    import jax

    from pallas_kernels import fused_moe as fm

    K, D, I, G = dims

    def interleaved(fmt, m, rounds=3):
        """--ab: the default plan and the sweep's, each timed once a round in turn (machines of one
        kind differ by up to 25% at M = 1: compare plans within a run); best of the rounds."""
        x, ids, ws, _ = routing(m)
        plans = [None] + sweep.get((fmt, m), [])
        fns = []
        for plan in plans:
            f = jax.jit(lambda w, x, ids, ws, plan=plan: [ours(plan)(x, i, s, w) for i, s in zip(ids, ws)])
            check(fmt, m, wts[fmt], x, ids, ws, jax.block_until_ready(f(wts[fmt], x, ids, ws)), "ab")
            fns.append(f)
        times = [[] for _ in plans]
        for _ in range(0 if smoke else rounds):
            for f, t in zip(fns, times):
                t.append(queued_us(f, wts[fmt], x, ids, ws, hi=10, lo=2) / len(ids))
        for plan, t in zip(plans, times):
            results["sweep"].append(dict(fmt=fmt, m=m, us=min(t, default=0.0), rounds=t, plan=str(plan or "default")))
            log(f"ab {fmt} M={m}: {' '.join(f'{u:6.1f}' for u in t)}  best {min(t, default=0.0):6.1f} µs  "
                f"{'default ' + str(fm.plan_for(m, K, fmt == 'int4', (D // G, I // G))) if plan is None else plan}")

    return interleaved

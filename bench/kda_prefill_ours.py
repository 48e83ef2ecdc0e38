"""bench.kda_prefill_check's runs of ours: kda_prefill's layer at the default plan, at --plan's, at its
other state-dot form and intra warp counts (or --state-stages), the default once more for the spread;
with --trace the layer's device span from the profiler; then the kernels alone (the conv pass, the
gated norm as XLA's fusion and as the norm pass, intra, state + norm) and their sweep, the best
combination and the layer in chunks of 64. Timed with kda_prefill_common.time_loop; each row's TB/s
and share of the floor over the bytes that must move (or a part's own bytes).
"""

from __future__ import annotations

import dataclasses
import os
import time


from bench import kda_prefill_common as kc
from bench.common import time_loop
from bench.kda_prefill_common import T0, log, make_inputs, parse_plan, plan_name, record
from bench.trace import device_trace


def bench_ours(gate, ceiling, backend, args):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels import kda_prefill as kp

    B, T, H, KD = kc.B, kc.T, kc.H, kc.KD  # (--smoke sets them)
    x, w, s, valid = make_inputs(T, jax.random.PRNGKey(0), jnp.bfloat16)
    base = kp.default_plan(KD, jnp.bfloat16)
    zeros_o = jnp.zeros((B, T, H, KD), jnp.bfloat16)
    interp = backend == "interpret"
    prec = lambda name: lax.Precision.HIGHEST if interp and name != "bf16" else kp.PRECISIONS[name]  # noqa: E731
    inv_prec = prec(kp.INV_PRECISION)

    chunk = args.chunk or kp.CHUNK

    def full(plan, size=chunk):
        def step(a, c):
            x, w, valid = a
            o, st = kp.kda_prefill(x, w, c[1], valid, gate=gate, plan=plan, chunk=size, backend=backend)
            return o, st
        return time_loop(step, (x, w, valid), (zeros_o, s))

    us = full(base)
    record(gate, f"ours, default plan {plan_name(base)}", us, T, base.bv, ceiling, chunk=chunk)
    extra_plans = [dataclasses.replace(base, **parse_plan(spec)) for spec in args.plan]  # --plan
    if args.trace:  # device spans from the profiler, the default and each --plan twice, interleaved
        def layer_of(plan):
            f = jax.jit(lambda x, w, s, v: kp.kda_prefill(x, w, s, v, gate=gate, plan=plan, chunk=chunk,
                                                          backend=backend))
            return lambda: f(x, w, s, valid)
        for again in ("", " (again)"):
            for plan in [base] + extra_plans:
                if time.time() - T0 < args.budget:
                    tr = device_trace(layer_of(plan), 10, os.environ.get("OUT", "bench_out"), log,
                                      label=plan_name(plan) + again)
                    if tr["span_us"]:
                        record(gate, f"ours, device span (profiler), {plan_name(plan)}{again}", tr["span_us"], T,
                               plan.bv, ceiling, chunk=chunk, kernels=tr["kernels"])
    for plan in extra_plans:  # the layer at the --plan plans on the loop timer, each twice
        for again in ("", " (again)"):
            if time.time() - T0 < args.budget:
                record(gate, f"ours, {plan_name(plan)}{again}", full(plan), T, plan.bv, ceiling, chunk=chunk)
    if not (args.state_stages or args.quick):
        other = dataclasses.replace(base, state_hi_lo=not base.state_hi_lo)  # the state's other dot form
        record(gate, f"ours, {plan_name(other)}", full(other), T, other.bv, ceiling, chunk=chunk)
    # The layer at the intra kernel's other warp counts (or at other state-kernel stages).
    variants = ([dataclasses.replace(base, state_stages=st) for st in args.state_stages] if args.state_stages else
                [] if args.quick else [dataclasses.replace(base, intra_warps=warps) for warps in (2, 4)])
    for plan in variants:
        if plan != base and time.time() - T0 < args.budget:
            record(gate, f"ours, {plan_name(plan)}", full(plan), T, plan.bv, ceiling, chunk=chunk)
    if time.time() - T0 < args.budget:  # the default once more: the spread between two timings of one thing
        record(gate, f"ours, default plan {plan_name(base)} (again)", full(base), T, base.bv, ceiling, chunk=chunk)
    if args.no_sweep:
        return

    def conv_pass(block_t, warps):
        def step(a, c):
            x, w = a
            xc, _, conv = kp.conv_pass(x, w, c, valid, interpret=interp, block_t=block_t, num_warps=warps)
            return c._replace(conv_q=conv[0] + (xc.v[0, 0, 0] * 0).astype(c.conv_q.dtype))
        return time_loop(step, (x, w), s)

    for block_t, warps in ((kp.CONV_ROWS, 4), (16, 2), (8, 2), (32, 8), (16, 4)):
        if time.time() - T0 < args.budget:
            record(gate, f"conv pass alone (q, k, v and the norm factors), {block_t} rows, {warps} warps",
                   conv_pass(block_t, warps), T, None, ceiling, nbytes=2 * 3 * B * T * H * KD * 2)  # x read, y written
    if time.time() - T0 < args.budget:  # the gated norm after the state kernel (BV < V), alone
        o = jax.random.normal(jax.random.PRNGKey(3), (B, T, H, KD), jnp.bfloat16)
        from pallas_kernels.kda_reference import gated_norm as _gated_norm

        def norm_step(a, c):
            x, w = a
            y = _gated_norm(c.astype(jnp.float32), x.gate_in.reshape(B, T, H, KD), w.o_norm, 1e-6)
            return y.astype(c.dtype)
        norm_bytes = 3 * B * T * H * KD * 2  # o and gate read, y written
        record(gate, "the gated norm alone (XLA)", time_loop(norm_step, (x, w), o), T, None, ceiling, nbytes=norm_bytes)
        for rows, steps, warps in ((kp.NORM_ROWS, kp.NORM_STEPS, 4), (64, 1, 4), (32, 2, 4), (32, 8, 4),
                                   (32, 4, 8), (64, 4, 8), (16, 8, 2), (32, 4, 4)):
            def pass_step(a, c, rows=rows, steps=steps, warps=warps):
                x, w = a
                return kp.norm_pass(c, x.gate_in, w.o_norm, eps=1e-6, interpret=interp, block_t=rows, n_steps=steps,
                                     num_warps=warps)
            if time.time() - T0 < args.budget:
                record(gate, f"the gated norm alone (norm pass, {steps} x {rows} rows, {warps} warps)",
                       time_loop(pass_step, (x, w), o), T, None, ceiling, nbytes=norm_bytes)

    # The two kernels alone (kda_prefill's internals, with the same precisions it uses), on the
    # conv pass's outputs.
    xc, rn, _ = kp.conv_pass(x, w, s, valid, interpret=interp)

    def intra(warps, precision):
        def step(a, c):
            x, w, rn, valid = a
            inter, tick = c
            inter = kp.intra_pass(x._replace(q=x.q + tick), w, rn, valid, chunk=chunk, gate=gate, lower_bound=-5.0,
                              precision=prec(precision), inv_precision=inv_prec, num_warps=warps, interpret=interp)
            return inter, (inter[5][0, 0, 0, 0] * 0).astype(x.q.dtype)  # the next call depends on this one
        inter0 = jax.eval_shape(lambda: kp.intra_pass(xc, w, rn, valid, chunk=chunk, gate=gate, lower_bound=-5.0,
                                                  precision=prec(precision), inv_precision=inv_prec,
                                                  num_warps=warps, interpret=interp))
        inter0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), inter0)
        return time_loop(step, (xc, w, rn, valid), (inter0, jnp.zeros((), xc.q.dtype)))

    inter = kp.intra_pass(xc, w, rn, valid, chunk=chunk, gate=gate, lower_bound=-5.0, precision=prec(base.precision),
                      inv_precision=inv_prec, num_warps=base.intra_warps, interpret=interp)

    def state(bv, warps, stages, precision, hi_lo):
        def step(a, c):
            inter, x, w = a
            return kp.state_pass(inter, x, w, c[1], chunk=chunk, eps=1e-6, bv=bv, precision=prec(precision),
                             num_warps=warps, num_stages=stages, interpret=interp, hi_lo=hi_lo)
        return time_loop(step, (inter, x, w), (zeros_o, s.recurrent))

    best_intra, best_state = None, None
    others = [(wp, base.precision) for wp in (2, 4, 8) if wp != base.intra_warps]
    alt = "tf32" if base.precision == "bf16" else "bf16"  # the intra dots' other operand precision
    intras = [(base.intra_warps, base.precision)] + others + [(base.intra_warps, alt), (base.intra_warps, "bf16x3")]
    for warps, precision in intras[:1] if args.quick else intras:
        if time.time() - T0 > args.budget:
            log("  budget spent: intra sweep cut short")
            break
        try:
            us = intra(warps, precision)
            record(gate, f"intra kernel alone, {warps} warps, {precision}", us, T, None, ceiling)
            if best_intra is None or us < best_intra[0]:
                best_intra = (us, warps, precision)
        except Exception as e:  # noqa: BLE001
            log(f"  intra {warps} warps {precision} FAILED: {type(e).__name__}: {str(e)[:400]}")
    hl = base.state_hi_lo
    states = ((base.bv, base.state_warps, base.state_stages, hl),
              (base.bv, base.state_warps, base.state_stages, not hl), (16, 4, 3, hl), (16, 4, 3, not hl),
              (64, 4, 2, hl), (64, 8, 2, hl), (32, 4, 2, hl), (32, 8, 2, hl), (128, 8, 2, hl), (128, 4, 1, hl))
    for bv, warps, stages, hi_lo in states[:1] if args.quick else states:
        if bv > KD:  # (--smoke: V is 32)
            continue
        if time.time() - T0 > args.budget:
            log("  budget spent: state sweep cut short")
            break
        dots = "hi+lo" if hi_lo else "rounded"
        try:
            us = state(bv, warps, stages, base.precision, hi_lo)
            record(gate, f"state kernel (+ norm) alone, BV {bv}, {warps} warps, {stages} stages, {dots}", us, T,
                   None, ceiling)
            if hi_lo == hl and (best_state is None or us < best_state[0]):
                best_state = (us, bv, warps, stages)
        except Exception as e:  # noqa: BLE001
            log(f"  state BV {bv} {warps} warps {stages} stages {dots} FAILED: {type(e).__name__}: {str(e)[:400]}")
    if args.quick:
        return
    if best_intra and best_state and time.time() - T0 < args.budget:
        plan = kp.Plan(bv=best_state[1], intra_warps=best_intra[1], state_warps=best_state[2],
                       state_stages=best_state[3], precision=best_intra[2], state_hi_lo=hl)
        if plan != base:
            record(gate, f"ours, best plan {plan_name(plan)}", full(plan), T, plan.bv, ceiling, chunk=chunk)
    if chunk != 64 and time.time() - T0 < args.budget:  # the earlier default chunk, kept as a row to compare
        plan = dataclasses.replace(base, intra_warps=8)
        record(gate, f"ours, chunks of 64 {plan_name(plan)}", full(plan, 64), T, plan.bv, ceiling, chunk=64)


"""KDA prefill kernels (pallas_kernels/kda_prefill.py) on the GPU at Ling shapes: check, time, sweep.

    python -m bench.kda_prefill_check [--chunk C]  (GPU; log and JSON under $OUT, else ./bench_out)
    python -m bench.kda_prefill_check --smoke      (CPU, interpret mode, tiny shapes: the script runs)
    python -m bench.kda_prefill_check --lower DIR  (CPU: each plan's Triton IR into DIR and, where
                                                     triton imports, its sm_90a compile: registers,
                                                     spills, shared memory, SASS mix)

One KDA layer between the projections and o_proj: B 1, T 8192, H 32, K = V = 128, bf16
activations, fp32 conv weights (as Ling), fp32 state, random nonzero initial recurrent and conv
state; gate "safe" (Ling, lower_bound -5) and "softplus" (Kimi).
Correctness first, on the GPU: kda_prefill (default plan) against the jnp reference (the model's
chunked form at HIGHEST precision) at T 1024 and at T 8192, o and final state.
Timing: device side. A fori_loop of n calls in one dispatch, the state (recurrent and conv: both
kernels depend on it, so nothing is hoisted out of the loop) and o carried from call to call, run
for 2 and 7 iterations; the difference / 5 is one call. Median of 3.
--trace: also the layer's device span from the JAX profiler (`common.device_trace`: first
kernel's start to last kernel's end, 10 calls, each kernel's µs), which leaves out the loop's own
cost (~20-45 µs an iteration on the H200, 2026-12-02) and is the figure to set beside fla's graph.
Rows: ours (default plan, its other state-dot form, its other intra warp counts or, with
--state-stages, other state-kernel stages, and the default once more for the spread), the kernels
alone (the conv pass over q, k, v at several row blocks; the gated norm as XLA's fusion and as the
norm pass at several row steps, the default last once more; intra: grid (B, N, H); state: grid
(B, H, V/BV) plus the norm), the sweep of plans (intra: warps x precision; state: BV x warps x
stages), the best combination, the layer in chunks of 64 when C is not (the default before
2026-12-01), the XLA reference, and fla 0.6.0's chunk_kda
(the peer: L2 norm, gate and beta in kernel; no conv, no gated norm) under a CUDA graph where fla
imports (carry it as a wheel: ../shared/tools/device-wheels.sh).
Figures: µs per layer; TB/s over the bytes that must move (q, k, v, g_in, gate_in in, o out,
b_in, state in/out: ~408 MB; the conv and norm passes alone: their own, 403 and 201 MB) and the
share of the floor at the copy bandwidth measured in the same run; the design floor adds the
intermediates (~1.15 GB). A table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import traceback


from bench.common import rel_err, time_torch_graph
from bench.sass import capture_triton, compile_report, kernel_name
from bench.trace import device_trace

B, T, H, KD, W = 1, 8192, 32, 128, 4
T_CHECK = 1024
T0 = time.time()
LOG = None
ROWS: list[dict] = []
CHECKS: list[dict] = []
COMPILED: list[dict] = []


def log(*a):
    s = f"[{time.time() - T0:6.1f}s] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    if LOG:
        LOG.write(s + "\n")
        LOG.flush()


def must_move_bytes(t, e=2):
    """q, k, v, g_in, gate_in read and o written (activation dtype), b_in, conv states, the fp32
    state in and out: what any implementation moves."""
    c = H * KD
    return e * t * (6 * c + H) + 2 * (4 * H * KD * KD) + 2 * e * 3 * (W - 1) * c


def design_bytes(t, bv, e=2, chunk=32):
    """must_move + the intermediates written and read (w, u, qg, kg, aqk in the activation dtype,
    gc fp32) + with BV < V the unfused norm's o (written and read once more)."""
    tp = -(-t // chunk) * chunk
    inter = e * tp * H * (4 * KD + chunk) + 4 * (tp // chunk) * H * KD
    return must_move_bytes(t, e) + 2 * inter + (2 * e * t * H * KD if bv < KD else 0)


# ----------------------------------------------------------------------------------------------
# Inputs and timing


def make_inputs(t, key, dtype):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kda

    c = H * KD
    ks = jax.random.split(key, 12)
    nrm = lambda k, shape, s=1.0, dt=dtype: (s * jax.random.normal(k, shape, jnp.float32)).astype(dt)  # noqa: E731
    x = kda.KdaInputs(nrm(ks[0], (B, t, c)), nrm(ks[1], (B, t, c)), nrm(ks[2], (B, t, c)), nrm(ks[3], (B, t, H, KD)),
                      nrm(ks[4], (B, t, H)), nrm(ks[5], (B, t, c)))
    w = kda.KdaWeights(nrm(ks[6], (c, W), 0.3, jnp.float32), nrm(ks[7], (c, W), 0.3, jnp.float32),
                       nrm(ks[8], (c, W), 0.3, jnp.float32), jnp.log(jnp.linspace(1.0, 16.0, H, dtype=jnp.float32)),
                       nrm(ks[9], (c,), 0.5, jnp.float32), jnp.ones((KD,), dtype))
    s = kda.KdaState(nrm(ks[10], (B, W - 1, c)), nrm(ks[11], (B, W - 1, c)), nrm(ks[10], (B, W - 1, c), 0.5),
                     nrm(ks[11], (B, H, KD, KD), 0.1, jnp.float32))
    return x, w, s, jnp.full((B,), t, jnp.int32)


def time_loop(step, args, carry, lo=2, hi=7):
    """µs per step: fori_loop(n, step) in one dispatch for n = lo and hi, difference / (hi - lo)."""
    import jax

    def run(args, carry, n):
        return jax.lax.fori_loop(0, n, lambda i, c: step(args, c), carry)

    f = jax.jit(run)
    jax.block_until_ready(f(args, carry, 1))  # compile + warm-up

    def wall(n):
        t = time.perf_counter()
        jax.block_until_ready(f(args, carry, n))
        return time.perf_counter() - t

    t_lo = statistics.median(wall(lo) for _ in range(3))
    t_hi = statistics.median(wall(hi) for _ in range(3))
    return (t_hi - t_lo) / (hi - lo) * 1e6


def copy_ceiling():
    import jax.numpy as jnp

    a = jnp.zeros(((1 << 30) // 4,), jnp.uint32)
    us = time_loop(lambda _, c: c ^ jnp.uint32(1), (), a)
    return 2 * (1 << 30) / (us * 1e-6)  # read + write


def record(case, what, us, t, bv, ceiling, chunk=32, nbytes=None, **extra):
    """One timing; TB/s and the share of the floor over nbytes (a part's own bytes), else the
    layer's must-move bytes."""
    mm = nbytes or must_move_bytes(t)
    row = dict(case=case, what=what, us=us, tbs=mm / (us * 1e-6) / 1e12, floor_pct=100 * mm / ceiling / (us * 1e-6),
               design_floor_us=design_bytes(t, bv, chunk=chunk) / ceiling * 1e6 if bv else None, **extra)
    ROWS.append(row)
    log(f"  {case:9s} {what:48s} {us:9.1f} µs  {row['tbs']:.2f} TB/s  {row['floor_pct']:.0f}% of floor")
    return row


# ----------------------------------------------------------------------------------------------
# GPU run


def check(gate, t, backend, plan=None):
    import jax

    from pallas_kernels import kda_prefill as kp

    x, w, s, valid = make_inputs(t, jax.random.PRNGKey(t), jax.numpy.bfloat16)
    o, st = kp.kda_prefill(x, w, s, valid, gate=gate, plan=plan, backend=backend)
    o_ref, st_ref = jax.jit(lambda *a: kp.reference(*a, gate=gate))(x, w, s, valid)
    rec = dict(gate=gate, t=t, o=rel_err(o, o_ref), state=rel_err(st.recurrent, st_ref.recurrent),
               conv=max(rel_err(a, b) for a, b in zip(st[:3], st_ref[:3])),
               plan="default" if plan is None else plan_name(plan))
    CHECKS.append(rec)
    log(f"  check {gate} T={t} {rec['plan']}: rel err o {rec['o']:.2e}, state {rec['state']:.2e}, "
        f"conv {rec['conv']:.1e}")
    return rec


def bench_ours(gate, ceiling, backend, args):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels import kda_prefill as kp

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
            xc, _, conv = kp._convs(x, w, c, valid, interpret=interp, block_t=block_t, num_warps=warps)
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
                return kp._norm_pass(c, x.gate_in, w.o_norm, eps=1e-6, interpret=interp, block_t=rows, n_steps=steps,
                                     num_warps=warps)
            if time.time() - T0 < args.budget:
                record(gate, f"the gated norm alone (norm pass, {steps} x {rows} rows, {warps} warps)",
                       time_loop(pass_step, (x, w), o), T, None, ceiling, nbytes=norm_bytes)

    # The two kernels alone (kda_prefill's internals, with the same precisions it uses), on the
    # conv pass's outputs.
    xc, rn, _ = kp._convs(x, w, s, valid, interpret=interp)

    def intra(warps, precision):
        def step(a, c):
            x, w, rn, valid = a
            inter, tick = c
            inter = kp._intra(x._replace(q=x.q + tick), w, rn, valid, chunk=chunk, gate=gate, lower_bound=-5.0,
                              precision=prec(precision), inv_precision=inv_prec, num_warps=warps, interpret=interp)
            return inter, (inter[5][0, 0, 0, 0] * 0).astype(x.q.dtype)  # the next call depends on this one
        inter0 = jax.eval_shape(lambda: kp._intra(xc, w, rn, valid, chunk=chunk, gate=gate, lower_bound=-5.0,
                                                  precision=prec(precision), inv_precision=inv_prec,
                                                  num_warps=warps, interpret=interp))
        inter0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), inter0)
        return time_loop(step, (xc, w, rn, valid), (inter0, jnp.zeros((), xc.q.dtype)))

    inter = kp._intra(xc, w, rn, valid, chunk=chunk, gate=gate, lower_bound=-5.0, precision=prec(base.precision),
                      inv_precision=inv_prec, num_warps=base.intra_warps, interpret=interp)

    def state(bv, warps, stages, precision, hi_lo):
        def step(a, c):
            inter, x, w = a
            return kp._state(inter, x, w, c[1], chunk=chunk, eps=1e-6, bv=bv, precision=prec(precision),
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
    if chunk != 64 and time.time() - T0 < args.budget:  # the default before 2026-12-01
        plan = dataclasses.replace(base, intra_warps=8)
        record(gate, f"ours, chunks of 64 {plan_name(plan)}", full(plan, 64), T, plan.bv, ceiling, chunk=64)


def parse_plan(spec: str) -> dict:
    """'bv=16,state_stages=4' -> {'bv': 16, 'state_stages': 4}: Plan fields, ints, bools or strings."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        out[key] = int(val) if val.lstrip("-").isdigit() else {"true": True, "false": False}.get(val.lower(), val)
    return out


def plan_name(p):
    dots = "hi+lo" if p.state_hi_lo else "rounded"
    return f"(intra {p.intra_warps}w {p.precision}; state BV {p.bv} {p.state_warps}w {p.state_stages}s {dots})"


def bench_reference(gate, ceiling, args):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kda_prefill as kp

    x, w, s, valid = make_inputs(T, jax.random.PRNGKey(0), jnp.bfloat16)

    def step(a, c):
        x, w, valid = a
        return kp.reference(x, w, c[1], valid, gate=gate)

    us = time_loop(step, (x, w, valid), (jnp.zeros((B, T, H, KD), jnp.bfloat16), s), lo=1, hi=2)
    record(gate, "XLA reference (jnp chunked form, HIGHEST)", us, T, None, ceiling)


def bench_fla(gate, ceiling):
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        log(f"  fla unavailable: {type(e).__name__}: {e}")
        return
    try:
        dev, bf = "cuda", torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)
        rn = lambda *shape, dt=bf, s=1.0: (s * torch.randn(*shape, device=dev, generator=gen)).to(dt)  # noqa: E731
        q, k, v, g = (rn(B, T, H, KD) for _ in range(4))
        beta = rn(B, T, H)
        a_log = torch.log(torch.linspace(1.0, 16.0, H, device=dev))
        dt_bias = rn(H * KD, dt=torch.float32, s=0.5)
        h0 = rn(B, H, KD, KD, dt=torch.float32, s=0.1)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
        if gate == "safe":
            kw.update(safe_gate=True, lower_bound=-5.0)

        def call():
            return chunk_kda(q, k, v, g, beta, **kw)

        with torch.inference_mode():
            us = time_torch_graph([call] * 10)
        record(gate, "fla chunk_kda (no conv, no gated norm; CUDA graph)", us, T, None,
               ceiling)
    except Exception as e:  # noqa: BLE001
        log(f"  fla FAILED: {type(e).__name__}: {str(e)[:600]}")
        log(traceback.format_exc()[-1500:])


def run_gpu(args):
    import jax

    from pallas_kernels import kda_prefill as kp

    global T, T_CHECK, H, KD
    backend = "interpret" if args.smoke else "pallas"
    if args.smoke:
        T, T_CHECK, H, KD = 130, 70, 2, 32
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}; B {B}, T {T}, H {H}, K = V {KD}")
    ceiling = 4.3e12 if args.smoke else copy_ceiling()
    log(f"copy ceiling {ceiling / 1e12:.2f} TB/s; bytes that must move {must_move_bytes(T) / 1e6:.0f} MB "
        f"(floor {must_move_bytes(T) / ceiling * 1e6:.1f} µs); design {design_bytes(T, 32) / 1e6:.0f} MB")
    for gate in args.gates:
        base = kp.default_plan(KD, jax.numpy.bfloat16)
        other = dataclasses.replace(base, state_hi_lo=not base.state_hi_lo)  # the state kernel's other dot form
        checks = [(T, None)] if args.state_stages else [(T_CHECK, None), (T, None), (T, other)]
        for t, plan in checks:
            try:
                check(gate, t, backend, plan)
            except Exception as e:  # noqa: BLE001
                log(f"  check {gate} T={t} FAILED: {type(e).__name__}: {str(e)[:600]}")
        if time.time() - T0 > args.budget:
            log("budget spent: timing skipped")
            continue
        if not (args.smoke or args.quick):  # the peer first: a budget cut then loses our sweep, not the comparison
            bench_fla(gate, ceiling)
        try:
            bench_ours(gate, ceiling, backend, args)
        except Exception as e:  # noqa: BLE001
            log(f"  ours {gate} FAILED: {type(e).__name__}: {str(e)[:600]}")
            log(traceback.format_exc()[-1500:])
        if not (args.smoke or args.quick):
            if time.time() - T0 < args.budget:
                bench_reference(gate, ceiling, args)


def table():
    print("\n| gate | what | µs/layer | TB/s (must-move) | % of floor | design floor µs | vs fla |")
    print("|---|---|---|---|---|---|---|")
    for gate in sorted({r["case"] for r in ROWS}):
        rows = [r for r in ROWS if r["case"] == gate]
        fla = next((r["us"] for r in rows if r["what"].startswith("fla")), None)
        for r in rows:
            vs = f"{fla / r['us']:.2f}x" if fla else "—"
            d = f"{r['design_floor_us']:.0f}" if r["design_floor_us"] else ""
            print(f"| {gate} | {r['what']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['floor_pct']:.0f}% | {d} | {vs} |")
    for c in CHECKS:
        print(f"check {c['gate']} T={c['t']} {c['plan']}: rel err o {c['o']:.2e}, state {c['state']:.2e}, "
              f"conv {c['conv']:.1e}")


# ----------------------------------------------------------------------------------------------
# Offline: Triton IR and the sm_90a compile


def lower_all(out_dir, args):
    """Lower every plan of the sweep (both gates) at the timed shapes and keep each pallas_call's
    Triton module; jax 0.11 asks the local GPU for its compute capability: told sm_90."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kda, kda_prefill as kp

    captured = []
    capture_triton(captured)
    os.makedirs(out_dir, exist_ok=True)
    sds = jax.ShapeDtypeStruct
    bf, f32, c = jnp.bfloat16, jnp.float32, H * KD
    x = kda.KdaInputs(sds((B, T, c), bf), sds((B, T, c), bf), sds((B, T, c), bf), sds((B, T, H, KD), bf),
                      sds((B, T, H), bf), sds((B, T, c), bf))
    w = kda.KdaWeights(sds((c, W), f32), sds((c, W), f32), sds((c, W), f32), sds((H,), f32), sds((c,), f32),
                       sds((KD,), bf))
    s = kda.KdaState(sds((B, W - 1, c), bf), sds((B, W - 1, c), bf), sds((B, W - 1, c), bf), sds((B, H, KD, KD), f32))
    chunk = args.chunk or kp.CHUNK
    plans = [kp.default_plan(KD, bf), kp.Plan(bv=32, intra_warps=2), kp.Plan(bv=32, intra_warps=4),
             kp.Plan(bv=32, intra_warps=8), kp.Plan(bv=64, state_warps=8, state_stages=2),
             kp.Plan(bv=128, state_warps=8, state_stages=2), kp.Plan(bv=32, precision="bf16x3")]
    for gate in args.gates:
        for plan in plans:
            n0 = len(captured)
            jax.jit(lambda x, w, s, v: kp.kda_prefill(x, w, s, v, gate=gate, plan=plan, chunk=chunk,
                                                            backend="pallas")).trace(
                x, w, s, sds((B,), jnp.int32)).lower(lowering_platforms=("cuda",))
            for i, ir in enumerate(captured[n0:]):  # conv pass x 3, intra, state, (norm pass)
                name = kernel_name(ir).removeprefix("kda_prefill_")
                nw = {"intra": plan.intra_warps, "state": plan.state_warps}.get(name, 4)
                ns = plan.state_stages if name == "state" else 1
                tag = f"{gate}_c{chunk}_{i}{name}_bv{plan.bv}_{plan.precision}_w{nw}_s{ns}"
                with open(os.path.join(out_dir, tag + ".ttir"), "w") as f:
                    f.write(ir)
                log(f"lowered {tag}")


def main():
    global LOG
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; then the rest is skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes")
    ap.add_argument("--lower", metavar="DIR", help="CPU: Triton IR of every plan (+ sm_90a compile)")
    ap.add_argument("--no-sweep", action="store_true", help="only the default plan and the peers")
    ap.add_argument("--quick", action="store_true", help="no peer; the layer (default plan, twice), the conv and "
                    "norm pass sweeps, the intra and state kernels alone at the default plan")
    ap.add_argument("--plan", action="append", default=[], metavar="SPEC",
                    help="time the layer at the default plan with these Plan fields replaced, e.g. "
                    "bv=16,state_stages=2 (twice each; repeatable)")
    ap.add_argument("--trace", action="store_true", help="the layer's device span and kernels from the profiler "
                    "(10 calls), at the default plan and each --plan, twice")
    ap.add_argument("--chunk", type=int, help="tokens per chunk (default: kda_prefill.CHUNK)")
    ap.add_argument("--state-stages", type=int, nargs="*", default=[],
                    help="time the layer at these state-kernel stages instead of the intra warp variants")
    ap.add_argument("--gates", nargs="+", default=["safe", "softplus"], choices=["safe", "softplus"])
    args = ap.parse_args()
    if args.smoke or args.lower:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:  # leave room for torch (fla)
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    LOG = open(os.path.join(out_dir, "kda_prefill_log.txt"), "w")
    try:
        if args.lower:
            lower_all(args.lower, args)
            COMPILED.extend(compile_report(args.lower, log))
        else:
            run_gpu(args)
    except Exception:  # noqa: BLE001
        log("FAILED:", traceback.format_exc())
    with open(os.path.join(out_dir, "kda_prefill.json"), "w") as f:
        json.dump(dict(rows=ROWS, checks=CHECKS, compiled=COMPILED), f, indent=1, default=str)
    if not args.lower:
        table()


if __name__ == "__main__":
    main()

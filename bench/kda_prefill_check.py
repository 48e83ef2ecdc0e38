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
Parts: bench/kda_prefill_ours.py (ours and the sweep), bench/kda_prefill_peers.py (fla, the XLA
reference), bench/kda_prefill_lower.py (--lower), bench/kda_prefill_common.py (shapes, timer, rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback


from bench import kda_prefill_common as kc
from bench.kda_prefill_common import CHECKS, COMPILED, ROWS, T0, check, copy_ceiling, design_bytes, log, \
    must_move_bytes, table
from bench.kda_prefill_lower import lower_all
from bench.kda_prefill_ours import bench_ours
from bench.kda_prefill_peers import bench_fla, bench_reference
from bench.sass import compile_report


def run_gpu(args):
    import jax

    from pallas_kernels import kda_prefill as kp

    backend = "interpret" if args.smoke else "pallas"
    if args.smoke:
        kc.T, kc.T_CHECK, kc.H, kc.KD = 130, 70, 2, 32
    B, T, T_CHECK, H, KD = kc.B, kc.T, kc.T_CHECK, kc.H, kc.KD
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


def main():
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
    kc.LOG = open(os.path.join(out_dir, "kda_prefill_log.txt"), "w")
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

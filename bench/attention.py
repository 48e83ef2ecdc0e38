"""Attention decode kernels on the GPU at Ling-3.0-flash shapes: fused KDA verify and MLA decode.

    python -m bench.attention            (on the GPU machine; $OUT gets attention.log, attention.json)

KDA: B 1, 32 heads, K = V = 128, fp32 state, T = 1 and 6, bf16 activations, fp32 conv weights.
MLA: B 1, 32 heads, R 512, P 64, bf16 cache of 1k, 8k, 64k positions (all valid), T = 1 and 6.
Each figure is µs per layer: N calls unrolled in one jit (one CUDA graph: XLA's command buffers),
each call on its own state / cache buffer (together past the 60 MB L2, so reads are cold),
timed over repeated executions, median of 3. fla's Triton `fused_recurrent_kda` (the peer) is
timed the same way under a torch CUDA graph. Bytes "that must move" count each input read once
and each output written once; the floor is those bytes over the copy bandwidth measured here.
KDA cases: bench/attention_kda.py; MLA cases: bench/attention_mla.py; shared: bench/attention_common.py.
Every Pallas configuration is checked against the jnp reference on the GPU before it is timed.
BENCH_ONLY=mla (or kda) runs one kernel's cases; BENCH_BUDGET_S bounds the sweeps.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from bench.attention_common import MLA_LENGTHS, OUT, ROWS, T0, copy_ceiling, log, over_budget
from bench.attention_kda import bench_kda
from bench.attention_mla import bench_mla

import jax  # after bench.attention_common, which sets the memory fraction


def main():
    log(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d %H:%M')}")
    ceiling = copy_ceiling()
    summary = {}
    short, mid, long = MLA_LENGTHS
    steps = [("kda", 6), ("mla", (mid, 1)), ("mla", (mid, 6)), ("kda", 1),
             ("mla", (long, 1)), ("mla", (short, 1)), ("mla", (long, 6)), ("mla", (short, 6))]
    only = os.environ.get("BENCH_ONLY")  # "kda" or "mla": one kernel's cases
    for kind, arg in steps:
        if only and kind != only:
            continue
        try:
            if kind == "kda":
                summary[f"kda T={arg}"] = bench_kda(arg, ceiling, sweep=arg > 1 and not over_budget())
            else:
                summary[f"mla L={arg[0]} T={arg[1]}"] = bench_mla(*arg, ceiling,
                                                                  sweep=arg[0] == mid and not over_budget())
        except Exception as exc:
            log(f"{kind} {arg} FAILED: {type(exc).__name__}: {str(exc)[:600]}")
            log(traceback.format_exc()[-2000:])
    with open(os.path.join(OUT, "attention.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, rows=ROWS), f, indent=1, default=str)

    log("")
    log(f"== summary (H200, copy ceiling {ceiling:.2f} TB/s; floor = bytes / ceiling) ==")
    log(f"{'case':18s} {'best config':36s} {'us':>8s} {'TB/s':>6s} {'%floor':>7s} {'xXLA':>6s}  peer")
    for name, val in summary.items():
        if name.startswith("kda"):
            best, fla = val
            if best is None:
                log(f"{name:18s} (no passing config)")
                continue
            peer = ", ".join(f"fla {k} {v:.2f} us (x{v / best['us']:.2f})" for k, v in fla.items())
            log(f"{name:18s} {best['config']:36s} {best['us']:8.2f} {best['tbs']:6.2f} {best['pct_floor']:6.1f}% "
                f"{best['vs_xla']:6.2f}  {peer}")
        elif val is None:
            log(f"{name:18s} (no passing config)")
        else:
            log(f"{name:18s} {val['config']:36s} {val['us']:8.2f} {val['tbs']:6.2f} {val['pct_floor']:6.1f}% "
                f"{val['vs_xla']:6.2f}  flop floor {val['flop_floor_us']} us")
    log(f"targets: KDA T=6 < fla and <= 23.1 us (2 x 11.56); MLA 8k >= 60% of floor. wall {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()

"""Prefill benchmark on one H200: grouped GEMM, KDA prefill, MLA prefill attention, TTFT.

    python -m bench.prefill [--parts gemm,kda,mla,ttft] [--budget 420]   (GPU; log also in $OUT)
    python -m bench.prefill --tiny                                       (CPU: tiny shapes, the script runs)

Parts (each checked against its reference in the same run before it is timed):
  gemm  the MoE grouped GEMM, align to combine, against torch._grouped_mm (bench/prefill_gemm.py)
  kda   one KDA layer's prefill against the jnp chunked form and fla's chunk_kda (bench/prefill_kda.py)
  mla   MLA prefill attention, cuDNN and the blockwise jnp path (bench/prefill_mla.py)
  ttft  time to first token through the engine, extrapolated to the full model (bench/prefill_ttft.py)
Timing: JAX calls are queued back to back and the difference of two batch sizes is taken
(dispatch and sync cancel); torch peers with CUDA events; TTFT is wall clock around the engine's
prefill (best of two after a compiling run). --budget skips what would start after it.
Run with fla (carry .whl): install .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl into a
--target directory on PYTHONPATH first (bench/history/chronicle.md, attention decode).
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

from bench.prefill_common import ROWS, Part, log, row, table
from bench.prefill_gemm import GemmPart
from bench.prefill_kda import KdaPart
from bench.prefill_mla import MlaPart
from bench.prefill_ttft import TtftPart


class Bench(Part, GemmPart, KdaPart, MlaPart, TtftPart):
    """The parts, each a method (gemm, kda, mla, ttft), over the shared base."""


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="gemm,kda,mla,ttft", help="comma-separated: gemm, kda, mla, ttft")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; parts and steps past it are skipped")
    ap.add_argument("--tiny", action="store_true", help="CPU: ling-tiny and small token counts (checks the script)")
    ap.add_argument("--chunk", type=int, default=8192, help="TTFT prefill chunk (tokens)")
    ap.add_argument("--layers", type=int, default=0, help="TTFT: decoder layers kept (0: as many as fit)")
    ap.add_argument("--reserve-gb", type=float, default=20.0, help="TTFT: device memory left for activations")
    args = ap.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = sorted(set(args.parts) - {"gemm", "kda", "mla", "ttft"})
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from gemm, kda, mla, ttft")
    return args


def main():
    args = parse()
    if args.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Memory grows on demand (no preallocation) so the torch peers fit before the TTFT model is built.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's own Triton kernels, no plugins
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_prefill_cache")  # a rerun on a warm machine
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    log.open(os.path.join(out_dir, "prefill_log.txt"))
    import jax

    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, parts {args.parts}, "
        f"budget {args.budget:.0f} s{', tiny' if args.tiny else ''}")
    bench = Bench(args)
    for part in args.parts:
        if bench.left() < 0:
            log(f"budget spent: part {part} skipped")
            row(part, "skipped (budget)")
            continue
        try:
            getattr(bench, part)()
        except Exception as e:  # noqa: BLE001
            log(f"FAILED part {part}: {type(e).__name__}: {str(e)[:800]}")
            log(traceback.format_exc()[-3000:])
            row(part, f"FAILED: {type(e).__name__}")
    with open(os.path.join(out_dir, "prefill.json"), "w") as f:
        json.dump(ROWS, f, indent=1, default=str)
    table()


if __name__ == "__main__":
    main()

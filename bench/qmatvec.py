"""H200 benchmark of the fused dequantising matvecs (pallas_kernels/qmatvec.py: the Pallas kernel on
the tile layout, and int4 the tensor-core Triton kernel on the row layout) against their peers.

Run on the GPU machine from the repository root (gemlite carried as an sdist and jax_triton as a
wheel, see ../shared/tools/device-wheels.sh):
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        .whl/gemlite-*.tar.gz .whl/jax_triton-*.whl && PYTHONPATH=/tmp/site:. python -m bench.qmatvec
Options: --sweep (also time launch-plan variants), --quick (two shapes only).

Per shape (N x K), M in {1, 6}, int4 and int8 (G = 128, symmetric), bf16 activations (torch peers:
bench/qmatvec_peers.py):
  ours     qmatvec's default plan, many calls per iteration of a fori_loop in one jit; int4 twice:
           the tile layout (Pallas) and the row layout (tensor cores, Triton; "rows" lines)
  cuBLAS   torch F.linear bf16 under a CUDA graph
  gemlite  gemlite 0.6 A16W4 (int4 only), its H100-tuned config of the nearest shape, CUDA graph
  XLA      jnp.dot bf16, timed like ours
Every timed call reads its own weight buffer (rotation over > 240 MB, L2 is 60 MB), so weights
come from HBM as in decode. The copy ceiling (torch device-to-device copy, read + write) is
measured in the same run. Achieved TB/s counts the bytes a call must move: weights (+ scales),
x and y. Each kernel variant is checked against the plain-jnp reference first. Prints a table
last and writes the full log under $OUT (or ./bench_out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

from bench.common import Log, rotating_us
from bench.qmatvec_peers import torch_part
from bench.qmatvec_table import qmatvec_table

SHAPES = [(4096, 2560), (2560, 4096), (6144, 2560), (20480, 2560), (157184, 2560)]
MS = (1, 6)
BITS = (4, 8)
G = 128
BACKEND = "pallas"
ROTATE_BYTES = 240e6
log = Log()  # written as it goes: a run cut short still leaves its log
RESULTS: dict = {"rows": [], "sweep": [], "errors": []}
T0 = time.time()


MIN_CALLS = 8


def n_calls(nbytes):  # distinct buffers per timed batch: > ROTATE_BYTES in all, 8..96 calls
    return int(min(96, max(MIN_CALLS, math.ceil(ROTATE_BYTES / nbytes))))


# ------------------------------------------------------------------------------------ JAX part
def jax_part(shapes, args, peers):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.qmatvec import Plan, plan_for, qmatvec, reference
    from pallas_kernels.quant import QuantizedWeight, quantize

    try:
        from pallas_kernels.rows_plan import RowsPlan, rows_plan_for
    except ImportError:
        RowsPlan = rows_plan_for = None

    log("jax", jax.__version__, jax.devices()[0].device_kind)
    key = jax.random.PRNGKey(0)

    def random_qw(key, n, k, bits, block_n, count):
        """count distinct random quantised weights (random codes and scales: timing only);
        block_n 0: the row layout."""
        t = -(-n // block_n) if block_n else n
        out = []
        for i in range(count):
            k1, k2 = jax.random.split(jax.random.fold_in(key, i))
            tail = (block_n,) if block_n else ()
            words = jax.random.bits(k1, (t, k * bits // 32) + tail, jnp.uint32)
            scales = (jax.random.uniform(k2, (t, k // G) + tail) * 0.02 + 1e-3).astype(jnp.bfloat16)
            out.append(QuantizedWeight(words, scales, None, bits, G, True, (n, k),
                                       "tiles" if block_n else "rows"))
        return jax.block_until_ready(out)

    def check(x, qw, plan):
        """Relative error of the kernel against the reference on a real quantised weight."""
        y = qmatvec(x, qw, backend=BACKEND, plan=plan).astype(jnp.float32)
        r = reference(x, qw).astype(jnp.float32)
        err = float(jnp.linalg.norm(y - r) / jnp.linalg.norm(r))
        if not err < 4e-3:
            raise AssertionError(f"rel err {err:.2e} vs reference")
        return err

    real_w = {}

    def real_qw(n, k, bits, block_n):
        kk = (n, k, bits, block_n)
        if kk not in real_w:
            w = jax.random.normal(jax.random.fold_in(key, n * 7 + k), (n, k), jnp.bfloat16)
            real_w[kk] = quantize(w, bits=bits, group_size=G, block_n=block_n or 128,
                                  layout="tiles" if block_n else "rows")
        return real_w[kk]

    def run_variant(n, k, m, bits, plan, block_n, tag):
        nb = None
        try:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            err = check(x, real_qw(n, k, bits, block_n), plan)
            probe = random_qw(key, n, k, bits, block_n, 1)[0]
            nb = probe.nbytes + (m * k + m * n) * 2
            bufs = random_qw(key, n, k, bits, block_n, n_calls(probe.nbytes))
            us = rotating_us(lambda x, b: qmatvec(x, b, backend=BACKEND, plan=plan), x, bufs)
            del bufs
            return dict(n=n, k=k, m=m, bits=bits, block_n=block_n, plan=str(plan), tag=tag,
                        us=us, tbs=nb / us / 1e6, err=err)
        except Exception as e:
            log(f"FAILED {tag} {n}x{k} M={m} int{bits} {plan}: {e!r}")
            RESULTS["errors"].append(f"{tag} {n}x{k} M={m} int{bits} {plan}: "
                                     + traceback.format_exc(limit=3)[-800:])
            return None

    # XLA bf16 peer.
    xla = {}
    for n, k in shapes:
        for m in MS:
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            nb = n * k * 2
            ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16)
                  for i in range(n_calls(nb))]
            xla[(n, k, m)] = rotating_us(lambda x, w: jnp.dot(x, w.T), x, ws)
            del ws
            log(f"XLA bf16 {n}x{k} M={m}: {xla[(n, k, m)]:.2f} µs")

    # Default plans: the table. int4 also in the row layout (block_n 0): the tensor-core kernel.
    for n, k in shapes:
        for m in MS:
            for bits, block_n in [(b, 128) for b in BITS] + ([(4, 0)] if rows_plan_for and not args.smoke else []):
                if block_n:
                    probe = random_qw(key, n, k, bits, block_n, 1)[0]
                    plan = plan_for(m, probe, probe.n_tiles)
                else:
                    plan = rows_plan_for(m, n, k)
                r = run_variant(n, k, m, bits, plan, block_n, "default")
                if r is None:
                    continue
                t_cublas, t_gl = peers.get((n, k, m), (None, None))
                r.update(cublas=t_cublas, gemlite=t_gl if bits == 4 else None, xla=xla[(n, k, m)],
                         layout="tiles" if block_n else "rows")
                RESULTS["rows"].append(r)
                log(f"ours int{bits} {'rows ' if not block_n else ''}{n}x{k} M={m}: {r['us']:.2f} µs "
                    f"{r['tbs']:.2f} TB/s err {r['err']:.1e} {plan}")

    if args.sweep:  # launch-plan variants on the two shapes that matter most, int4 (block_n 0: rows)
        rows, rows_split = [], []
        if RowsPlan is not None and not args.smoke:
            rows = [(0, RowsPlan(128, 1, 2)), (0, RowsPlan(64, 1, 4)), (0, RowsPlan(256, 1, 4, 8))]
            rows_split = [(0, RowsPlan(128, 2, 2)), (0, RowsPlan(128, 4, 1)), (0, RowsPlan(64, 10, 2)),
                          (0, RowsPlan(128, 10, 2))]
        variants = {  # (shape N, M): [(block_n, Plan)], the tile layout's first
            (157184, 1): [(128, Plan("fma", 4, 1, chunk_words=8)),
                          (128, Plan("mma", 2, 4, num_stages=3))] + rows,
            (157184, 6): [(128, Plan("mma", 2, 4, num_stages=3))] + rows,
            (20480, 1): [(128, Plan("fma", 20, 1, chunk_words=8))] + rows_split,
            (20480, 6): [(128, Plan("mma", 2, 4, num_stages=3))] + rows_split,
        }
        for (n, m), plans in variants.items():
            if (n, 2560) not in shapes and not args.smoke:
                continue
            for bn, plan in plans:
                if time.time() - T0 > args.budget:
                    log("sweep stopped: time budget")
                    return
                nn, kk = (n, 2560) if not args.smoke else shapes[0]
                r = run_variant(nn, kk, m, 4, plan, bn, "sweep")
                if r is not None:
                    RESULTS["sweep"].append(r)
                    log(f"sweep int4 {nn}x{kk} M={m} {f'bn{bn}' if bn else 'rows'}: {r['us']:.2f} µs "
                        f"{r['tbs']:.2f} TB/s {plan}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, no torch (CPU)")
    ap.add_argument("--gemlite-budget", type=float, default=40.0,
                    help="seconds of gemlite M = 1 autotuning after which the rest are skipped")
    ap.add_argument("--budget", type=float, default=220.0, help="seconds after which the sweep stops")
    args = ap.parse_args()
    shapes = SHAPES[3:] if args.quick else SHAPES
    if args.smoke:
        global BACKEND, ROTATE_BYTES, MIN_CALLS
        shapes, BACKEND, ROTATE_BYTES, MIN_CALLS = [(300, 256)], "interpret", 1.0, 1
    outdir = os.environ.get("OUT", "bench_out")
    os.makedirs(outdir, exist_ok=True)
    log.open(os.path.join(outdir, "qmatvec_log.txt"))
    t0 = T0
    peers = {}
    try:
        peers = {} if args.smoke else torch_part(shapes, MS, G, args, RESULTS, log, n_calls)
    except Exception:
        log("torch part failed:", traceback.format_exc())
    log(f"[{time.time() - t0:.0f} s] torch peers done")
    try:
        jax_part(shapes, args, peers)
    except Exception:
        log("jax part failed:", traceback.format_exc())
    log(f"[{time.time() - t0:.0f} s] done")

    qmatvec_table(RESULTS, log)
    with open(os.path.join(outdir, "qmatvec.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()

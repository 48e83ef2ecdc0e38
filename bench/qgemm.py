"""GPU benchmark of the quantised projections at GEMM sizes (17-2048 rows): the grouped GEMM's
dense entry (`pallas_kernels.grouped_gemm.dense`) against what `ling.quantize.QLinear` ran before
it: `qmatvec` in calls of at most 16 rows, and dequantising the weight to bf16 for an XLA dot.

    python -m bench.qgemm [--ms 24 32 96 288 1024] [--sweep] [--smoke]
    python -m bench.qgemm --lower DIR     (CPU: the dense kernel's plans as Triton IR in DIR, and
                                          compiled for sm_90a where the triton package is installed)

Shapes: Ling-3.0-flash's fused KDA input projection (20512 x 2560), its output projection
(2560 x 4096) and the lm_head (157184 x 2560), int4 G = 128, symmetric, bf16 activations. Every
timed call reads its own weight buffer (rotation over > 240 MB; L2 is 50-60 MB), many calls an
iteration of a fori_loop in one jit (`bench.common.rotating_us`). Each variant is checked against
the float32 product of the dequantised weight first. TB/s counts the int4 weight (+ scales), x
and y once; the copy ceiling is measured in the same run. --sweep also times the dense kernel at
each plan of `PLANS` (row blocks of 16-128, swapped or not, half the layout's tile). Log and JSON
under $OUT (or ./bench_out); a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from bench.common import Log, copy_ceiling_tbs, rotating_us

SHAPES = {(20512, 2560): (6, 16, 24, 32, 64, 96, 192, 288, 512, 1024, 2048),  # rows timed per shape
          (2560, 4096): (16, 32, 96, 288, 2048), (157184, 2560): (16, 96, 288, 2048)}
MS = (24, 96, 288, 2048)  # rows at a shape outside SHAPES
SWEEP = {(20512, 2560): (96, 288), (157184, 2560): (96,)}  # --sweep: every plan at these
ROTATE_BYTES = 240e6
log = Log()


def _plans():
    """The sweep's plans by name: BM 16-128, swapped or not; BN 64 (half the layout's tile: twice
    the programs) at BM 64 and 128."""
    from pallas_kernels import grouped_gemm as gg

    plans = {}
    for bm, bn, swap in [(16, 0, False), (32, 0, False), (64, 0, False), (64, 64, False), (64, 64, True),
                         (128, 0, False), (128, 0, True), (128, 64, False)]:
        t = gg.Tile(0, bn, 8 if bm == 128 else 4, 3)
        plans[f"bm{bm}{f' bn{bn}' if bn else ''}{' swap' if swap else ''}"] = gg.Plan(bm, t, t, swap=swap)
    return plans


PLANS = _plans()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", help="rows timed at every shape (default: SHAPES')")
    ap.add_argument("--shape", type=int, nargs=2, metavar=("N", "K"), help="this shape only")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU: interpret mode, one tiny shape")
    ap.add_argument("--lower", metavar="DIR", help="CPU: Triton IR of every plan (+ sm_90a compile)")
    args = ap.parse_args(argv)
    if args.lower:
        return lower(args.lower)

    import jax
    import jax.numpy as jnp

    from pallas_kernels import grouped_gemm as gg
    from pallas_kernels.qmatvec import MAX_M, qmatvec
    from pallas_kernels.quant import QuantizedWeight, dequantize, quantize

    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    log.open(os.path.join(out_dir, "qgemm.log"))
    backend = "interpret" if args.smoke else "pallas"
    shapes = {(256, 256): (24, 40)} if args.smoke else SHAPES
    if args.shape:
        shapes = {tuple(args.shape): shapes.get(tuple(args.shape), MS)}
    key = jax.random.PRNGKey(0)
    copy = None if args.smoke else copy_ceiling_tbs()
    log("jax", jax.__version__, jax.devices()[0].device_kind, "copy TB/s", copy)

    def random_qw(n, k, count):  # random codes and scales: timing only
        out = []
        for i in range(count):
            k1, k2 = jax.random.split(jax.random.fold_in(key, 1000 + i))
            t = -(-n // 128)
            words = jax.random.bits(k1, (t, k // 8, 128), jnp.uint32)
            scales = (jax.random.uniform(k2, (t, k // 128, 128)) * 0.02 + 1e-3).astype(jnp.bfloat16)
            out.append(QuantizedWeight(words, scales, None, 4, 128, True, (n, k)))
        return jax.block_until_ready(out)

    def chunked(x, w):
        m = x.shape[0]
        size = -(-m // -(-m // MAX_M))
        return jnp.concatenate([qmatvec(x[i:i + size], w, backend=backend) for i in range(0, m, size)])

    def dequant_dot(x, w):  # what QLinear runs beyond DENSE_MAX_M rows: dense's reference
        return gg.dense(x, w, backend="reference")

    rows = []
    for (n, k), ms in shapes.items():
        ms = args.ms or ms
        w = quantize(jax.random.normal(jax.random.fold_in(key, n), (n, k), jnp.bfloat16), bits=4, group_size=128)
        probe = random_qw(n, k, 1)[0]
        count = int(min(48, max(4, math.ceil(ROTATE_BYTES / probe.nbytes))))
        bufs = None if args.smoke else random_qw(n, k, count)
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            ref = x.astype(jnp.float32) @ dequantize(w).T
            variants = [("dense", lambda x, b: gg.dense(x, b, backend=backend))]
            if args.sweep and m in SWEEP.get((n, k), ()):
                for tag, plan in PLANS.items():
                    variants.append((f"dense {tag}", lambda x, b, plan=plan: gg.dense(x, b, plan=plan, backend=backend)))
            if m <= 4 * MAX_M:
                variants.append((f"qmatvec x{-(-m // MAX_M)}", chunked))
            variants.append(("dequant + dot", dequant_dot))
            for tag, fn in variants:
                try:
                    y = jax.jit(fn)(x, w).astype(jnp.float32)
                    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                    if not err < 4e-3:
                        raise AssertionError(f"rel err {err:.2e}")
                    if args.smoke:
                        us = float("nan")
                    else:
                        us = rotating_us(fn, x, bufs, iters=4)
                    nbytes = probe.nbytes + 2 * m * (n + k)
                    r = dict(n=n, k=k, m=m, tag=tag, us=us, tbs=nbytes / us / 1e6, err=err)
                    rows.append(r)
                    log(f"{n}x{k} M={m} {tag}: {us:.1f} µs {r['tbs']:.2f} TB/s err {err:.1e}")
                except Exception as e:  # noqa: BLE001
                    log(f"FAILED {n}x{k} M={m} {tag}: {e!r}"[:600])
        del bufs

    with open(os.path.join(out_dir, "qgemm.json"), "w") as f:
        json.dump(dict(copy_tbs=copy, rows=rows), f, indent=1)
    log(f"\n| N x K | M | variant | µs | TB/s | % of copy ({copy and round(copy, 2)} TB/s) |")
    log("|---|---|---|---|---|---|")
    for r in rows:
        pct = f"{100 * r['tbs'] / copy:.0f}%" if copy else "-"
        log(f"| {r['n']} x {r['k']} | {r['m']} | {r['tag']} | {r['us']:.1f} | {r['tbs']:.2f} | {pct} |")


def lower(out_dir: str) -> None:
    """Lowers `dense` at every plan of the sweep for the 20512 x 2560 projection (96 rows), writes
    each kernel's Triton IR to out_dir and compiles them (`bench.sass.compile_report`)."""
    import jax
    import jax.numpy as jnp

    from bench.sass import capture_triton, compile_report
    from pallas_kernels import grouped_gemm as gg
    from pallas_kernels.quant import QuantizedWeight

    os.makedirs(out_dir, exist_ok=True)
    lowered: list[str] = []
    capture_triton(lowered)
    n, k, m = 20512, 2560, 96
    t = -(-n // 128)
    w = QuantizedWeight(jax.ShapeDtypeStruct((t, k // 8, 128), jnp.uint32),
                        jax.ShapeDtypeStruct((t, k // 128, 128), jnp.bfloat16), None, 4, 128, True, (n, k))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    for tag, plan in PLANS.items():
        jax.jit(lambda x, w, plan=plan: gg.dense(x, w, plan=plan, backend="pallas")).trace(x, w).lower(
            lowering_platforms=("cuda",))
        for text in lowered:
            name = f"dense_{tag.replace(' ', '_')}_w{plan.down.num_warps}_s{plan.down.num_stages}.ttir"
            with open(os.path.join(out_dir, name), "w") as f:
                f.write(text)
        lowered.clear()
    compile_report(out_dir, log)


if __name__ == "__main__":
    main()

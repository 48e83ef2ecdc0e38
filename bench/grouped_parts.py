"""H200: the grouped GEMM's parts at one token count, each timed alone (a breakdown of its time).

    python -m bench.grouped_parts [--m 4096]       (GPU; prints a table last)

Ling's MoE layer (E 512, top-8, D 2560, I 768), bf16, `grouped_gemm.plan_for`'s plan, one uniform
random routing: the whole call with each combine ("sum", "sum16", "atomic"), with the plan's
half flag flipped (`Plan.half`: blocks of at most BM/2 valid rows run at BM/2) and with a 4-warp up
tile (with --trace also each one's device span and kernels from the profiler), then the align, the
gate/up GEMM (the plan's tile, its half flag flipped, then a few other tiles), the down GEMM (each
combine, the half flag flipped, then a few other down tiles) and the XLA sum over the k pair rows
(fp32 and bf16), each in its own jit, timed as bench/common.queued_us (a part shorter than the
host's dispatch, ~40 µs, reads as the dispatch: the align alone does). TFLOP/s over the useful
6*P*D*I FLOPs, TB/s over the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


from bench.common import copy_ceiling_tbs, queued_us, random_experts
from bench.trace import device_trace

E, K, D, I = 512, 8, 2560, 768


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=4096, help="tokens (default 4096)")
    ap.add_argument("--trace", action="store_true", help="also each whole call's device span and kernels "
                    "from the profiler (10 calls each)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from pallas_kernels import grouped_gemm as gg
    from pallas_kernels.moe_align import align_sizes, moe_align

    if jax.devices()[0].platform != "gpu":
        sys.exit("bench/grouped_parts.py times GPU kernels: no GPU here")
    m = args.m
    key = jax.random.PRNGKey(0)
    w13, w2 = random_experts("bf16", key, e=E, d=D, inter=I, group=128, block_n=64)
    x = jax.random.normal(key, (m, D), jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 1), (m, E)), K)[1].astype(jnp.int32)
    tw = jax.random.uniform(jax.random.fold_in(key, 2), (m, K), jnp.float32) / K + 0.05
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; copy ceiling {copy_ceiling_tbs():.2f} TB/s")
    rows = []

    def t(label, f, *a):
        jax.block_until_ready(f(*a))
        us = queued_us(f, *a, hi=10, lo=3)
        rows.append((label, us))
        print(f"{label}: {us:.1f} µs", flush=True)
        return us

    plan = gg.plan_for(m * K, E, False)
    flop, wbytes = 6 * m * K * D * I, 3 * E * D * I * 2
    flip = dataclasses.replace(plan, half=not plan.half)
    ref = None
    wholes = [(c, dataclasses.replace(plan, combine=c)) for c in gg.COMBINES]
    wholes.append((f"{plan.combine}, half={flip.half}", flip))
    up4 = gg.Tile(64, 128, 4, 3)  # gate/up's fastest tile alone in the run of 2026-12-02 (third session)
    wholes.append((f"{plan.combine}, up {up4}", dataclasses.replace(plan, up=up4)))
    spans = []
    for label, p in wholes:
        f = jax.jit(lambda x, i, s, a, b, p=p: gg.grouped_moe(x, i, s, a, b, plan=p))
        y = f(x, ids, tw, w13, w2).astype(jnp.float32)
        ref = y if ref is None else ref
        print(f"{label}: rel. err. vs sum {float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)):.1e}")
        us = t(f"whole ({label})", f, x, ids, tw, w13, w2)
        print(f"   {flop / us / 1e6:.1f} TFLOP/s, {wbytes / us / 1e6:.2f} TB/s over the weights")
        if args.trace:
            tr = device_trace(lambda f=f: f(x, ids, tw, w13, w2), 10, os.environ.get("OUT", "bench_out"),
                              label=f"whole ({label})")
            spans.append((f"whole ({label}), device span", tr["span_us"]))
    align = jax.jit(lambda i: moe_align(i.reshape(-1), E, plan.block_m))
    t("align", align, ids)
    sp, be = align(ids)
    nb = align_sizes(m * K, E, plan.block_m).nb
    up = jax.jit(lambda x, sp, be, w: gg.gate_up(x, sp, be, w, k=K, n_blocks=nb, plan=plan))
    t("gate/up GEMM + SwiGLU", up, x, sp, be, w13)
    f = jax.jit(lambda x, sp, be, w: gg.gate_up(x, sp, be, w, k=K, n_blocks=nb, plan=flip))
    t(f"gate/up GEMM + SwiGLU, half={flip.half}", f, x, sp, be, w13)
    h = up(x, sp, be, w13)  # the plan's (plan.half: the flipped down reads rows left unwritten; timed only)
    for bk, bn, nw, ns in ((64, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3), (32, 128, 8, 6)):
        p = dataclasses.replace(plan, up=gg.Tile(bk, bn, nw, ns))
        f = jax.jit(lambda x, sp, be, w, p=p: gg.gate_up(x, sp, be, w, k=K, n_blocks=nb, plan=p))
        t(f"gate/up {bk}x{bn}, {nw} warps, {ns} stages", f, x, sp, be, w13)
    tiles = [(f"down ({c})", dataclasses.replace(plan, combine=c)) for c in gg.COMBINES]
    tiles += [(f"down ({plan.combine}, half={flip.half})", flip)]
    tiles += [(f"down {bk}x{bn}, {nw} warps, {ns} stages", dataclasses.replace(plan, down=gg.Tile(bk, bn, nw, ns)))
              for bk, bn, nw, ns in ((128, 128, 8, 3), (64, 128, 8, 4), (64, 256, 8, 3), (32, 128, 8, 6),
                                     (64, 64, 4, 4), (128, 64, 4, 3))]
    for label, p in tiles:
        down = jax.jit(lambda h, sp, be, tw, w, p=p: gg.down(h, sp, be, tw, w, n_blocks=nb, plan=p))
        t(label, down, h, sp, be, tw, w2)
    for dt in (jnp.float32, jnp.bfloat16):
        out = jax.random.normal(key, (m * K + 1, D), dt)
        t(f"XLA sum over the k pair rows ({jnp.dtype(dt).name})",
          jax.jit(lambda o: jnp.sum(o[:m * K].astype(jnp.float32).reshape(m, K, D), axis=1).astype(jnp.bfloat16)), out)
    print(f"\ngrouped GEMM parts, M = {m}, plan {plan}")
    for label, us in spans:
        print(f"  {label:40s} {us:9.1f} µs  {flop / us / 1e6:.1f} TFLOP/s")
    for label, us in rows:
        print(f"  {label:40s} {us:9.1f} µs")


if __name__ == "__main__":
    main()

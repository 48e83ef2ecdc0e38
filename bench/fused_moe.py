"""H200 benchmark of the fused MoE kernels (pallas_kernels/fused_moe.py) against XLA peers.

Run on the GPU machine from the repository root:
    python -m bench.fused_moe [--budget 160]          (log and JSON under $OUT, else ./bench_out)
    python -m bench.fused_moe --fmts int4 --ms 1,6    (a subset of the weight formats and token counts)
    python -m bench.fused_moe --fmts int4,int4r       (int4r: the row layout's tensor-core Triton kernel,
                                                       needs jax_triton; default plans only)
    python -m bench.fused_moe --ab                    (default and sweep plans in interleaved rounds)
    python -m bench.fused_moe --align-only            (the align alone, M > 1)
    python -m bench.fused_moe --smoke                 (CPU, interpret mode, tiny shapes: the script runs)
    python -m bench.fused_moe --lower DIR             (CPU: lower every timed kernel to Triton IR in DIR)
    python -m bench.fused_moe --mixed --profile-tiles [--tile-model PATH] [--budget 200]
        decode + prefill tokens in one MoE layer (union / split / tile-scheduled launches) and the
        tile-aware latency model's profile and fit: bench/mixed_moe.py (log, tiles.json under $OUT)

Ling-3.0-flash's MoE layer: E = 512 experts, top-8, D = 2560, I = 768; bf16 weights and grouped
int4 (G = 128, symmetric, B_N = 64); M in {1, 6, 16, 64} tokens. Per row:
  ours      fused_moe (align + up/SwiGLU + down + combine), the default plan (`plan_for`), and
            the launch-plan variants of the sweep (the best is shown with its plan)
  ragged    XLA `lax.ragged_dot` on bf16 weights (bench/peers.py `xla_ragged`)
  gathered  XLA einsum over gathered bf16 experts (bench/peers.py `xla_gathered`)
  torch     torch._grouped_mm on experts pre-gathered per routing (the gather is not timed): rows
            sorted by expert, gate/up GEMM, SiLU·up, down GEMM, weighted index_add (bf16, GPU
            only; the weights are JAX's own buffers through DLPack; bench/peers.py `torch_gathered_us`)
  SGLang    not measured (no wheel offline): perf-anchors.md's figures, another run, for reference
Timing: each timed dispatch is one jit of R calls, each with its own random routing (distinct
experts per token, uniform over E) so that every call reads experts cold from HBM (the R calls
touch far more than the 60 MB L2); many dispatches are queued and the difference of two counts
is divided out, so host dispatch and the final sync cancel. Achieved TB/s is over the bytes that
must move: the distinct experts' weights (+ scales) once, x, y. The floor is those bytes over
the copy bandwidth measured in the same run (XLA, 1 GiB read + write). Every kernel variant is
checked against `experts.reference` before it is timed. A table is printed last.
Parts: bench/fused_moe_peers.py (the peer rows), bench/fused_moe_ab.py (--ab), bench/fused_moe_align.py
(--align-only), bench/moe_plans.py (the sweep and its loop), bench/moe_tables.py (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback


from bench import mixed_moe
from bench.common import Log, copy_ceiling_tbs, queued_us, random_experts, run_tasks
from bench.fused_moe_ab import ab_task
from bench.fused_moe_align import align_task
from bench.fused_moe_peers import peer_tasks
from bench.moe_plans import fused_moe_sweep, sweep_plans
from bench.moe_tables import fused_moe_table
from bench.sass import capture_triton, dump_fused_moe

E, K, D, I = 512, 8, 2560, 768
MS = (1, 6, 16, 64)
G, BN_Q = 128, 64
SGLANG_ANCHOR = {1: 38.4, 6: 157.0, 16: 331.0, 64: 870.0}  # bf16, µs/layer, perf-anchors.md
T0 = time.time()
log = Log()
RESULTS: dict = {"rows": [], "sweep": [], "checks": [], "errors": []}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=105.0, help="seconds; then the rest is skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes")
    ap.add_argument("--lower", metavar="DIR", help="CPU: dump the Triton IR of every timed kernel")
    mixed_moe.add_args(ap)
    ap.add_argument("--fmts", default="bf16,int4", help="weight formats to time (comma-separated)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M (comma-separated)")
    ap.add_argument("--align-only", action="store_true", help="time only the align (M > 1)")
    ap.add_argument("--ab", action="store_true", help="only the default and the sweep's plans, timed in "
                    "interleaved rounds (plan comparisons that machine-to-machine spread does not blur)")
    args = ap.parse_args()
    global E, D, I
    if args.smoke or args.lower:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.smoke:
        E, D, I = 13, 256, 128
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    if args.mixed or args.profile_tiles:
        if args.lower:
            ap.error("--lower applies to the fused MoE sweep, not to --mixed / --profile-tiles")
        log.open(os.path.join(out_dir, "tiles_log.txt"))
        mixed_moe.main(args, (E, D, I), out_dir, log)
        return
    log.open(os.path.join(out_dir, "moe_log.txt"))
    try:
        run(args)
    except Exception:
        log("FAILED:", traceback.format_exc())
    with open(os.path.join(out_dir, "moe.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    fused_moe_table(RESULTS, (E, K, D, I), SGLANG_ANCHOR, log)


def run(args):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import experts
    from pallas_kernels import fused_moe as fm

    backend = "interpret" if args.smoke else "pallas"
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}"
    log("device:", RESULTS["device"], f"E={E} k={K} D={D} I={I}")
    deadline = T0 + args.budget
    key = jax.random.PRNGKey(0)

    def left():
        return deadline - time.time()

    # ------------------------------------------------------------------ weights and routings
    def weights(fmt):
        return random_experts(fmt, key, e=E, d=D, inter=I, group=G, block_n=BN_Q, abstract=bool(args.lower))

    def routings(m, r):
        """r random routings for M tokens: (x, [ids], [weights]) and the mean distinct experts."""
        if args.lower:
            sds = jax.ShapeDtypeStruct
            return (sds((m, D), jnp.bfloat16), [sds((m, K), jnp.int32)] * r,
                    [sds((m, K), jnp.float32)] * r, float(K * m))
        kx, ki = jax.random.split(jax.random.fold_in(key, 1000 + m))
        x = jax.random.normal(kx, (m, D), jnp.bfloat16)
        ids, ws, distinct = [], [], []
        for j in range(r):
            ka, kb = jax.random.split(jax.random.fold_in(ki, j))
            i = jax.lax.top_k(jax.random.uniform(ka, (m, E)), K)[1].astype(jnp.int32)  # distinct per token
            ids.append(i)
            ws.append(jax.random.uniform(kb, (m, K), jnp.float32) / K + 0.05)
            distinct.append(len(set(map(int, i.reshape(-1)))))
        return x, ids, ws, sum(distinct) / r

    def expert_bytes(fmt):  # int4r: the same bytes in the row layout
        if fmt == "bf16":
            return 3 * D * I * 2
        return 3 * D * I // 2 + 3 * D * I // G * 2  # int4 codes + bf16 scales

    # ------------------------------------------------------------------ timing
    lowered = []
    if args.lower:  # capture each pallas_call's Triton module as it is lowered
        capture_triton(lowered)
        os.makedirs(args.lower, exist_ok=True)

    def timed(fn, w, x, ids, ws, label="", plan=None):
        """(µs per call, outputs of the first dispatch): one jit of R calls, dispatched n times."""
        r = len(ids)
        f = jax.jit(lambda w, x, ids, ws: [fn(x, ids[j], ws[j], w) for j in range(r)])
        if args.lower:
            f.trace(w, x, ids, ws).lower(lowering_platforms=("cuda",))
            if plan is not None:
                dump_fused_moe(lowered, args.lower, label, plan)
            lowered.clear()
            return 0.0, None
        ys = jax.block_until_ready(f(w, x, ids, ws))
        if args.smoke:
            return 0.0, ys
        return queued_us(f, w, x, ids, ws, hi=12, lo=3) / r, ys

    refs = {}

    def check(fmt, m, w, x, ids, ws, ys, tag):
        """Relative error of ys[0] against the reference (computed once per format and M)."""
        if args.lower or ys is None:
            return None
        if (fmt, m) not in refs:
            refs[(fmt, m)] = jax.jit(lambda x, i, s, w: experts.reference(x, i, s, *w))(x, ids[0], ws[0], w)
        ref = refs[(fmt, m)].astype(jnp.float32)
        y = ys[0].astype(jnp.float32)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        RESULTS["checks"].append(dict(fmt=fmt, m=m, tag=tag, rel_err=err))
        if not err < 1e-2:
            raise AssertionError(f"{tag} {fmt} M={m}: rel err {err:.2e} vs reference")
        return err

    def ours(plan):
        return lambda x, i, s, w: fm.fused_moe(x, i, s, *w, backend=backend, plan=plan)

    # ------------------------------------------------------------------ the run
    if not (args.smoke or args.lower):
        RESULTS["copy_tbs"] = copy_ceiling_tbs()
        log(f"copy ceiling: {RESULTS['copy_tbs']:.2f} TB/s (XLA, 1 GiB read + write)")
    # Routings a dispatch: enough device work that the host's dispatch of the jit never bounds it
    # (2026-12-01: with 4 at M = 1 the same int4 plan read 11.4 and 34.0 µs in two runs).
    reps = {1: 16, 6: 4, 16: 2, 64: 2}
    ms = tuple(int(m) for m in args.ms.split(",")) if not args.smoke else (1, 6, 16)
    fmts = tuple(args.fmts.split(","))
    if args.align_only:  # the align alone takes any M (prefill sizes included)
        reps.update({m: 2 for m in ms if m not in reps})
    if set(fmts) - {"bf16", "int4", "int4r"} or not set(ms) <= set(reps):
        raise SystemExit(f"--fmts takes bf16,int4,int4r and --ms a subset of {MS}: got {args.fmts!r} / {args.ms!r}")
    sweep = fused_moe_sweep(D, I, G)
    wts = {fmt: weights(fmt) for fmt in fmts}
    rows = {(fmt, m): dict(fmt=fmt, m=m) for fmt in fmts for m in ms}
    RESULTS["rows"] = list(rows.values())
    routes = {}

    def routing(m):
        if m not in routes:
            routes[m] = routings(m, reps[m])
        return routes[m]

    def default(fmt, m):
        x, ids, ws, u = routing(m)
        nbytes = u * expert_bytes(fmt) + 2 * m * D * 2
        row = rows[(fmt, m)]
        plan = None if fmt == "int4r" else fm.plan_for(m, K, fmt == "int4", (D // G, I // G))
        row.update(distinct=u, mbytes=nbytes / 1e6, plan=str(plan or "rows_plan.moe_rows_plans"))
        us, ys = timed(ours(None), wts[fmt], x, ids, ws, f"{fmt}_m{m}_default", plan)
        row.update(err=check(fmt, m, wts[fmt], x, ids, ws, ys, "default"), us=us)
        log(f"ours {fmt} M={m}: {us:.1f} µs, {u:.1f} experts, {nbytes / 1e6:.1f} MB, "
            f"{nbytes / max(us, 1e-9) / 1e6:.2f} TB/s, err {row['err']}")

    peers, peer, torch_peer = peer_tasks(routing, timed, check, wts, fmts, rows, (K, D), log)
    align = align_task(routing, rows, fmts, (E, K), backend, args.smoke, log)
    interleaved = ab_task(routing, sweep, ours, check, wts, (K, D, I, G), args.smoke, RESULTS, log)

    def variants(fmt, m):
        x, ids, ws, _ = routing(m)
        sweep_plans(sweep.get((fmt, m), []), fmt, m,
                    lambda n, plan: timed(ours(plan), wts[fmt], x, ids, ws, f"{fmt}_m{m}_sweep{n}", plan),
                    lambda ys: check(fmt, m, wts[fmt], x, ids, ws, ys, "sweep"), rows[(fmt, m)], RESULTS, left, log)

    # In order of value: the budget may cut the tail. The peers run on bf16 weights.
    bf16, int4 = "bf16" in fmts, "int4" in fmts
    tasks = [(default, ("bf16", m)) for m in ms if bf16]
    if bf16 and not (args.lower or args.smoke):
        tasks += [(torch_peer, ("torch", m)) for m in ms]
    if bf16 and not args.lower:
        tasks += [(peer, (name, m)) for m in (1, 6) for name in peers]
    tasks += [(default, ("int4", m)) for m in ms if int4]
    tasks += [(default, ("int4r", m)) for m in ms if "int4r" in fmts and not (args.lower or args.smoke)]
    tasks += [(align, ("align", m)) for m in ms if m > 1 and not args.lower]
    tasks += [(variants, (fmt, 1)) for fmt in fmts]
    if bf16 and not args.lower:
        tasks += [(peer, (name, m)) for m in ms if m > 6 for name in peers]
    tasks += [(variants, (fmt, m)) for m in ms if m > 1 for fmt in fmts]
    if args.align_only:
        tasks = [t for t in tasks if t[0] is align]
    if args.ab:
        tasks = [(interleaved, (fmt, m)) for m in ms for fmt in fmts]
    run_tasks([t for t in tasks if t[1][1] in ms], left, log, RESULTS["errors"])
    log(f"[{time.time() - T0:.0f} s] done")


if __name__ == "__main__":
    main()

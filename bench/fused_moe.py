"""H200 benchmark of the fused MoE kernels (pallas_kernels/fused_moe.py) against XLA peers.

Run on the GPU machine from the repository root:
    python -m bench.fused_moe [--budget 160]          (log and JSON under $OUT, else ./bench_out)
    python -m bench.fused_moe --fmts int4 --ms 1,6    (a subset of the weight formats and token counts)
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
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback


from bench.common import Log, copy_ceiling_tbs, queued_us, random_experts, run_tasks
from bench.moe_plans import fused_moe_sweep
from bench.moe_tables import fused_moe_table
from bench.peers import torch_gathered_us, xla_gathered, xla_ragged
from bench.sass import capture_triton, kernel_name

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
    ap.add_argument("--mixed", action="store_true", help="decode + prefill tokens of one layer: one grouped "
                    "launch, two launches, the tile-scheduled kernel (bench/mixed_moe.py)")
    ap.add_argument("--profile-tiles", action="store_true", help="profile the tile kernel over (decode, prefill) "
                    "shapes and fit moe/tiles.py's latency model")
    ap.add_argument("--tile-model", metavar="PATH", help="--profile-tiles: where the fitted model goes "
                    "(default $OUT/tile_model.json)")
    ap.add_argument("--tile-per-sm", help="--mixed: the tile kernel's persistent programs per SM (comma-separated: "
                    "each is timed; default expert_tiles.PROGRAMS_PER_SM)")
    ap.add_argument("--tile-bm", default="0", help="--mixed: the tile kernel's BM (comma-separated; 0: plan_for's)")
    ap.add_argument("--tile-warps", default="0",
                    help="--mixed: the tile kernel's warps (comma-separated; 0: plan_for's)")
    ap.add_argument("--tile-bm-hot", default="0",
                    help="--mixed: the tile kernel's hot-block BM (comma-separated; 0: plan_for's)")
    ap.add_argument("--prefills", help="--mixed: prefill chunk sizes (comma-separated; default 512,2048,8192)")
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
        from bench import mixed_moe

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

    from pallas_kernels import experts, moe_align
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

    def expert_bytes(fmt):
        if fmt == "bf16":
            return 3 * D * I * 2
        return 3 * D * I // 2 + 3 * D * I // G * 2  # int4 codes + bf16 scales

    # ------------------------------------------------------------------ timing
    lowered = []
    if args.lower:  # capture each pallas_call's Triton module as it is lowered
        capture_triton(lowered)
        os.makedirs(args.lower, exist_ok=True)

    def dump(label, plan):
        """Write the kernels lowered for one timed call, named with their warps and stages."""
        seen = set()
        for text in lowered:
            name = kernel_name(text)
            if name in seen:
                continue
            seen.add(name)
            gp = plan.up if "_up_" in name else plan.down
            nw, ns = (4, 1) if name == "moe_align" else (gp.num_warps, gp.num_stages)
            with open(os.path.join(args.lower, f"{label}_{name}_w{nw}_s{ns}.ttir"), "w") as f:
                f.write(text)
        lowered.clear()

    def timed(fn, w, x, ids, ws, label="", plan=None):
        """(µs per call, outputs of the first dispatch): one jit of R calls, dispatched n times."""
        r = len(ids)
        f = jax.jit(lambda w, x, ids, ws: [fn(x, ids[j], ws[j], w) for j in range(r)])
        if args.lower:
            f.trace(w, x, ids, ws).lower(lowering_platforms=("cuda",))
            if plan is not None:
                dump(label, plan)
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
    if set(fmts) - {"bf16", "int4"} or not set(ms) <= set(reps):
        raise SystemExit(f"--fmts takes bf16,int4 and --ms a subset of {MS}: got {args.fmts!r} / {args.ms!r}")
    sweep = fused_moe_sweep(D, I, G)
    peers = {"ragged": lambda x, i, s, w: xla_ragged(x, i, s, w[0], w[1]),
             "gathered": lambda x, i, s, w: xla_gathered(x, i, s, w[0], w[1])}
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
        plan = fm.plan_for(m, K, fmt == "int4", (D // G, I // G))
        row.update(distinct=u, mbytes=nbytes / 1e6, plan=str(plan))
        us, ys = timed(ours(None), wts[fmt], x, ids, ws, f"{fmt}_m{m}_default", plan)
        row.update(err=check(fmt, m, wts[fmt], x, ids, ws, ys, "default"), us=us)
        log(f"ours {fmt} M={m}: {us:.1f} µs, {u:.1f} experts, {nbytes / 1e6:.1f} MB, "
            f"{nbytes / max(us, 1e-9) / 1e6:.2f} TB/s, err {row['err']}")

    def peer(name, m):
        x, ids, ws, _ = routing(m)
        us, ys = timed(peers[name], wts["bf16"], x, ids, ws)
        check("bf16", m, wts["bf16"], x, ids, ws, ys, name)
        for fmt in fmts:
            rows[(fmt, m)][name] = us
        log(f"{name} bf16 M={m}: {us:.1f} µs")

    def torch_peer(_, m):
        """torch._grouped_mm over pre-gathered experts, timed like `timed` (R routings a batch)."""
        x, ids, ws, _ = routing(m)
        us, y0 = torch_gathered_us(x, ids, ws, wts["bf16"], K, D)
        check("bf16", m, wts["bf16"], x, ids, ws, [jnp.asarray(y0.cpu().float().numpy())], "torch")
        for fmt in fmts:
            rows[(fmt, m)]["torch"] = us
        log(f"torch._grouped_mm bf16 M={m}: {us:.1f} µs")

    def align(_, m):
        """The align alone (M > 1; the kernel up to 64 pairs, the blocked path beyond), as the bf16
        default plan runs it: how much of the layer it is. N aligns of shifted routings a dispatch
        (one alone is shorter than the host's dispatch: the queue would time the host)."""
        x, ids, ws, _ = routing(m)
        bm, n = fm.plan_for(m, K, False).block_m, 32
        f = jax.jit(lambda ids: [moe_align.moe_align((i + j) % E, E, bm, backend=backend) for i in ids for j in range(n)])
        jax.block_until_ready(f(ids))
        us = 0.0 if args.smoke else queued_us(f, ids, hi=12, lo=3) / (n * len(ids))
        for fmt in fmts:
            rows[(fmt, m)]["align"] = us
        log(f"align M={m} ({m * K} pairs, block {bm}, {'kernel' if m * K <= moe_align.MAX_ALIGN_PAIRS else 'blocked'}): "
            f"{us:.1f} µs")

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
        for _ in range(0 if args.smoke else rounds):
            for f, t in zip(fns, times):
                t.append(queued_us(f, wts[fmt], x, ids, ws, hi=10, lo=2) / len(ids))
        for plan, t in zip(plans, times):
            RESULTS["sweep"].append(dict(fmt=fmt, m=m, us=min(t, default=0.0), rounds=t, plan=str(plan or "default")))
            log(f"ab {fmt} M={m}: {' '.join(f'{u:6.1f}' for u in t)}  best {min(t, default=0.0):6.1f} µs  "
                f"{'default ' + str(fm.plan_for(m, K, fmt == 'int4', (D // G, I // G))) if plan is None else plan}")

    def variants(fmt, m):
        x, ids, ws, _ = routing(m)
        for n, plan in enumerate(sweep.get((fmt, m), [])):
            if left() < 0:
                log(f"budget spent: sweep stopped at {fmt} M={m}")
                return
            try:
                us, ys = timed(ours(plan), wts[fmt], x, ids, ws, f"{fmt}_m{m}_sweep{n}", plan)
                err = check(fmt, m, wts[fmt], x, ids, ws, ys, "sweep")
                RESULTS["sweep"].append(dict(fmt=fmt, m=m, us=us, err=err, plan=str(plan)))
                log(f"sweep {fmt} M={m}: {us:.1f} µs err {err} {plan}")
                row = rows[(fmt, m)]
                if us and (not row.get("best_us") or us < row["best_us"]):
                    row.update(best_us=us, best_plan=str(plan))
            except Exception as e:
                log(f"FAILED sweep {fmt} M={m} {plan}: {e!r}")
                RESULTS["errors"].append(f"sweep {fmt} M={m} {plan}: " + traceback.format_exc(limit=4)[-1500:])

    # In order of value: the budget may cut the tail. The peers run on bf16 weights.
    bf16, int4 = "bf16" in fmts, "int4" in fmts
    tasks = [(default, ("bf16", m)) for m in ms if bf16]
    if bf16 and not (args.lower or args.smoke):
        tasks += [(torch_peer, ("torch", m)) for m in ms]
    if bf16 and not args.lower:
        tasks += [(peer, (name, m)) for m in (1, 6) for name in peers]
    tasks += [(default, ("int4", m)) for m in ms if int4]
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

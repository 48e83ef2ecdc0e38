"""H200 benchmark of the prefill grouped GEMM (pallas_kernels/grouped_gemm.py) against its peers.

Run on the GPU machine from the repository root:
    python -m bench.grouped_gemm [--budget 420]     (log and JSON under $OUT, else ./bench_out)
    python -m bench.grouped_gemm --smoke            (CPU, interpret mode, tiny shapes: the script runs)
    python -m bench.grouped_gemm --lower DIR        (CPU: lower every timed kernel to Triton IR in DIR
                                                      and, where triton imports, compile it for sm_90a)

Ling-3.0-flash's MoE layer: E = 512 experts, top-8, D = 2560, I = 768; bf16 weights and grouped
int4 (G = 128, symmetric, B_N = 64, random codes and scales); M in {512, 2048, 4096} tokens with
uniform random routing (distinct experts per token), so every expert has rows (M = 512: ~8 each).
Per row (format, M):
  ours     grouped_moe = align (blocked) + up GEMM/SwiGLU + down GEMM/weights + combine, with
           `plan_for`'s plan, then the sweep's plans (the best is shown with its plan)
  ragged   XLA `lax.ragged_dot` on bf16 weights (bench/peers.py `xla_ragged`)
  torch    torch._grouped_mm on its own random bf16 weights, same routing: argsort, gather,
           gate_up, SiLU*up, down, weights, index_add; eager, CUDA events over 20 layers (its
           ~10 launches a layer are noise at ~2 ms); the row says n/a if torch fails
Correctness first: every plan's y on the first CHECK_TOKENS tokens against `grouped_gemm.reference`
(fp32, HIGHEST) before it is timed (a token's output depends on its own row only).
Timing: one jit per call, many dispatches queued, difference of two counts (dispatch and sync
cancel); every call streams all ~6 GB (bf16) of experts, far beyond the 60 MB L2.
Figures: TFLOP/s over the useful 6*P*D*I FLOPs; TB/s over the bytes that must move (the distinct
experts' weights once + x + y); floor = max(bytes / copy bandwidth measured in the same run,
FLOPs / 989 TFLOP/s, the H200's dense bf16 peak from the data sheet). A table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback


from bench.common import Log, copy_ceiling_tbs, queued_us, random_experts, run_tasks
from bench.moe_plans import grouped_gemm_sweep, sweep_plans
from bench.moe_tables import grouped_gemm_table
from bench.peers import torch_grouped_mm_us, xla_ragged
from bench.sass import capture_triton, compile_report, kernel_name

E, K, D, I = 512, 8, 2560, 768
MS = (512, 2048, 4096)
FMTS = ("bf16", "int4")
G, BN_Q = 128, 64
PEAK_TFLOPS = 989.0  # H200 SXM dense bf16, data sheet
CHECK_TOKENS = 256
TORCH_ANCHOR = {512: 1950.0, 4096: 2090.0}  # µs, perf-anchors.md (another run)
T0 = time.time()
log = Log()
RESULTS: dict = {"rows": [], "sweep": [], "checks": [], "errors": [], "compiled": []}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; then the rest is skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes")
    ap.add_argument("--lower", metavar="DIR", help="CPU: Triton IR of every timed kernel (+ sm_90a compile)")
    ap.add_argument("--no-sweep", action="store_true", help="only the default plans and the peers")
    ap.add_argument("--ms", type=int, nargs="+", help="token counts (default: 512 2048 4096)")
    ap.add_argument("--fmts", nargs="+", choices=("bf16", "int4"), help="weight formats (default: both)")
    args = ap.parse_args()
    global E, D, I, MS, CHECK_TOKENS, FMTS
    MS, FMTS = tuple(args.ms or MS), tuple(args.fmts or FMTS)
    if args.smoke or args.lower:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:  # leave room for torch's peer
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    if args.smoke:
        E, D, I, MS, CHECK_TOKENS = 13, 256, 128, (24, 64), 16
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    log.open(os.path.join(out_dir, "grouped_gemm_log.txt"))
    try:
        run(args)
    except Exception:
        log("FAILED:", traceback.format_exc())
    with open(os.path.join(out_dir, "grouped_gemm.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    if args.lower:
        RESULTS["compiled"] = compile_report(args.lower, log)
    else:
        grouped_gemm_table(RESULTS, (E, K, D, I), PEAK_TFLOPS, TORCH_ANCHOR, log)


# ---------------------------------------------------------------------------------- the run
def run(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import experts
    from pallas_kernels import grouped_gemm as gg

    backend = "interpret" if args.smoke else "pallas"
    lowered: list[str] = []
    if args.lower:
        capture_triton(lowered)
        os.makedirs(args.lower, exist_ok=True)
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}"
    log("device:", RESULTS["device"], f"E={E} k={K} D={D} I={I}")
    deadline = T0 + args.budget
    key = jax.random.PRNGKey(0)
    sds = jax.ShapeDtypeStruct

    def left():
        return deadline - time.time()

    # ------------------------------------------------------------------ weights and routings
    def weights(fmt):
        return random_experts(fmt, key, e=E, d=D, inter=I, group=G, block_n=BN_Q, abstract=bool(args.lower))

    routes = {}

    def routing(m):
        """(x, ids, weights, distinct experts) for M tokens, distinct experts per token."""
        if m in routes:
            return routes[m]
        if args.lower:
            routes[m] = (sds((m, D), jnp.bfloat16), sds((m, K), jnp.int32), sds((m, K), jnp.float32), float(E))
            return routes[m]
        kx, ka, kb = jax.random.split(jax.random.fold_in(key, 1000 + m), 3)
        x = jax.random.normal(kx, (m, D), jnp.bfloat16)
        ids = jax.lax.top_k(jax.random.uniform(ka, (m, E)), K)[1].astype(jnp.int32)
        ws = jax.random.uniform(kb, (m, K), jnp.float32) / K + 0.05
        routes[m] = (x, ids, ws, float(np.unique(np.asarray(ids)).size))
        return routes[m]

    def expert_bytes(fmt):
        return 3 * D * I * 2 if fmt == "bf16" else 3 * D * I // 2 + 3 * D * I // G * 2

    # ------------------------------------------------------------------ timing
    def timed(fn, w, m, label="", plan=None, reps=(8, 2)):
        """(µs per call, y of one call)."""
        x, ids, ws, _ = routing(m)
        f = jax.jit(fn)
        if args.lower:
            f.trace(x, ids, ws, w).lower(lowering_platforms=("cuda",))
            if plan is not None:
                for text in list(lowered):
                    kname = kernel_name(text)
                    t = plan.up if "_up" in kname else plan.down
                    with open(os.path.join(args.lower, f"{label}_{kname}_w{t.num_warps}_s{t.num_stages}.ttir"),
                              "w") as fh:
                        fh.write(text)
            lowered.clear()
            return 0.0, None
        y = jax.block_until_ready(f(x, ids, ws, w))
        if args.smoke:
            return 0.0, y
        return queued_us(f, x, ids, ws, w, hi=reps[0], lo=reps[1]), y

    refs = {}

    def check(fmt, m, w, y, tag):
        """Relative error of y's first CHECK_TOKENS rows against the fp32 reference."""
        if args.lower or y is None:
            return None
        x, ids, ws, _ = routing(m)
        s = min(CHECK_TOKENS, m)
        if (fmt, m) not in refs:
            refs[(fmt, m)] = jax.jit(lambda x, i, t, w: experts.reference(x, i, t, *w))(x[:s], ids[:s], ws[:s], w)
        ref = refs[(fmt, m)].astype(jnp.float32)
        got = y[:s].astype(jnp.float32)
        err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        RESULTS["checks"].append(dict(fmt=fmt, m=m, tag=tag, rel_err=err))
        if not err < 1e-2:
            raise AssertionError(f"{tag} {fmt} M={m}: rel err {err:.2e} vs reference")
        return err

    def ours(plan):
        return lambda x, i, s, w: gg.grouped_moe(x, i, s, *w, backend=backend, plan=plan)

    # ------------------------------------------------------------------ peers
    def torch_peer(m):
        _, ids, ws, _ = routing(m)
        return torch_grouped_mm_us(np.asarray(ids), np.asarray(ws), e=E, d=D, inter=I)

    # ------------------------------------------------------------------ tasks
    if not (args.smoke or args.lower):
        RESULTS["copy_tbs"] = copy_ceiling_tbs()
        log(f"copy ceiling: {RESULTS['copy_tbs']:.2f} TB/s (XLA, 1 GiB read + write, queued dispatches)")
    wts = {fmt: weights(fmt) for fmt in FMTS}
    rows = {(fmt, m): dict(fmt=fmt, m=m) for fmt in FMTS for m in MS}
    RESULTS["rows"] = list(rows.values())

    def default(fmt, m):
        _, _, _, u = routing(m)
        plan = gg.plan_for(m * K, E, fmt == "int4")
        nbytes = u * expert_bytes(fmt) + 2 * m * D * 2
        row = rows[(fmt, m)]
        row.update(distinct=u, mbytes=nbytes / 1e6, gflop=6 * m * K * D * I / 1e9, plan=str(plan))
        us, y = timed(ours(None), wts[fmt], m, f"{fmt}_m{m}_default", plan)
        row.update(err=check(fmt, m, wts[fmt], y, "default"), us=us)
        if us:
            log(f"ours {fmt} M={m}: {us:.1f} µs, {row['gflop'] / us * 1e3:.0f} TFLOP/s, "
                f"{nbytes / us / 1e6:.2f} TB/s, err {row['err']:.2e}, {plan}")
        else:
            log(f"ours {fmt} M={m}: checked (err {row['err']}), {plan}")

    def variants(fmt, m):
        sweep_plans(grouped_gemm_sweep(fmt, m), fmt, m,
                    lambda n, plan: timed(ours(plan), wts[fmt], m, f"{fmt}_m{m}_sweep{n}", plan),
                    lambda y: check(fmt, m, wts[fmt], y, "sweep"), rows[(fmt, m)], RESULTS, left, log)

    def ragged(m):
        us, y = timed(lambda x, i, s, w: xla_ragged(x, i, s, w[0], w[1]), wts["bf16"], m,
                      reps=(3, 1))
        check("bf16", m, wts["bf16"], y, "ragged")
        for fmt in FMTS:
            rows[(fmt, m)]["ragged"] = us
        log(f"ragged_dot bf16 M={m}: {us:.1f} µs")

    def torch_row(m):
        import torch

        us = torch_peer(m)
        torch.cuda.empty_cache()  # its weights are gone with torch_peer's frame
        for fmt in FMTS:
            rows[(fmt, m)]["torch"] = us
        log(f"torch._grouped_mm bf16 M={m}: {us:.1f} µs")

    tasks = [(default, (fmt, m)) for fmt in FMTS for m in MS]
    if not args.lower:
        tasks += [(ragged, (MS[0],))] if "bf16" in FMTS else []
        if not args.smoke:
            tasks += [(torch_row, (m,)) for m in MS]
    if not args.no_sweep:
        tasks += [(variants, (fmt, m)) for m in MS[::-1] for fmt in FMTS]
    if not args.lower and "bf16" in FMTS:
        tasks += [(ragged, (m,)) for m in MS[1:]]
    run_tasks(tasks, (lambda: 1.0) if args.lower else left, log, RESULTS["errors"])
    log(f"[{time.time() - T0:.0f} s] done")


if __name__ == "__main__":
    main()

"""The launch-plan sweeps the MoE benchmarks time after each default plan (`plan_for`): the fused
MoE's (bench.fused_moe) and the grouped GEMM's (bench.grouped_gemm), most promising first; and the
loop both run a sweep with (each plan timed, checked, logged, the best kept, under the budget)."""

from __future__ import annotations

import traceback


def fused_moe_sweep(d: int, i: int, g: int) -> dict:
    """bench.fused_moe's sweep: (format, M) -> [Plan], timed after the default plan (`plan_for`),
    at D = d, I = i and quantisation groups of g."""
    from pallas_kernels.fused_moe import GemmPlan as GP, Plan, split_groups

    dot = lambda up, down: Plan("dot", 16, up, down)  # noqa: E731
    fma = lambda up, down: Plan("fma", 1, up, down)  # noqa: E731
    tiles = [dot(GP(128, 64, 4, 4), GP(128, 64, 4, 4)),  # the default before the plan sweep
             dot(GP(256, 32, 4, 3), GP(256, 32, 4, 3))]
    m1 = tiles + [dot(GP(128, 64, 2, 5), GP(128, 32, 2, 4)),
                  dot(GP(256, 64, 8, 3), GP(128, 64, 4, 4)),
                  fma(GP(64, 64, 2, 1), GP(64, 64, 2, 1))]
    # quantised: (warps, groups of K an up program, a down program; 0: no split), against
    # D / G = 20 and I / G = 6 groups at Ling's shapes
    ku, kd = d // g, i // g
    split = lambda n, per: split_groups(n, per) if per else 1  # noqa: E731
    q = lambda w, pu=0, pd=0: fma(GP(0, 0, w, 1, split=split(ku, pu)), GP(0, 0, w, 1, split=split(kd, pd)))  # noqa: E731
    qdot = lambda pu=0, pd=0: dot(GP(0, 0, 4, 4, split=split(ku, pu)), GP(0, 0, 4, 4, split=split(kd, pd)))  # noqa: E731
    return {("bf16", 1): m1, ("bf16", 6): tiles, ("bf16", 16): tiles[:1],
            ("bf16", 64): [dot(GP(64, 128, 4, 6), GP(64, 128, 4, 5))],
            ("int4", 1): [q(4, 2, 1), q(8, 1, 1), qdot(2, 1)],
            ("int4", 6): [q(4, 10, 3), q(4, 2, 2), qdot()],
            ("int4", 16): [q(4, 10, 3), qdot(), qdot(10, 0), qdot(10, 3)],
            ("int4", 64): [qdot(10, 3), q(4)]}


def grouped_gemm_sweep(fmt: str, m: int) -> list:
    """bench.grouped_gemm's sweep: plans timed after the default (`plan_for`), most promising first (the budget cuts the tail)."""
    from pallas_kernels.grouped_gemm import Plan, Tile as T

    if fmt == "bf16":
        base = [Plan(16, T(64, 128, 4, 5), T(64, 128, 4, 5)),
                Plan(16, T(64, 128, 4, 4), T(64, 128, 4, 4), swap=True),
                Plan(32, T(64, 128, 4, 4), T(64, 128, 4, 4)),
                Plan(32, T(64, 128, 4, 4), T(64, 128, 4, 4), swap=True),
                Plan(64, T(64, 128, 4, 4), T(64, 128, 4, 4)),
                Plan(64, T(64, 256, 8, 3), T(64, 256, 8, 3)),
                Plan(64, T(64, 128, 4, 4), T(64, 128, 4, 4), combine="atomic"),
                Plan(128, T(64, 128, 8, 3), T(64, 128, 8, 3)),
                Plan(128, T(64, 256, 8, 3), T(64, 256, 8, 3)),
                Plan(64, T(128, 128, 4, 3), T(128, 128, 4, 3)),
                Plan(64, T(64, 128, 4, 6), T(64, 128, 4, 6)),  # deeper pipelines: at 4096 tokens
                Plan(64, T(64, 256, 8, 4), T(64, 256, 8, 4)),  # the weight stream dominates
                Plan(128, T(64, 128, 8, 3), T(64, 128, 8, 3), half=True),  # 7 and 8 with half blocks
                Plan(128, T(64, 256, 8, 3), T(64, 256, 8, 3), half=True)]
        order = {512: [0, 1, 2, 3, 6, 4], 2048: [2, 3, 4, 6, 0, 5, 7, 12],
                 4096: [4, 10, 11, 5, 7, 12, 6, 8, 13, 2, 9, 3]}
    else:
        base = [Plan(16, T(0, 0, 4, 3), T(0, 0, 4, 3)),
                Plan(16, T(0, 0, 4, 3), T(0, 0, 4, 3), swap=True),
                Plan(64, T(0, 0, 4, 3), T(0, 0, 4, 3)),
                Plan(64, T(0, 0, 4, 3), T(0, 0, 4, 3), swap=True),
                Plan(64, T(0, 0, 8, 3), T(0, 0, 8, 3)),
                Plan(128, T(0, 0, 8, 3), T(0, 0, 8, 3)),
                Plan(128, T(0, 0, 8, 3), T(0, 0, 8, 3), swap=True),
                Plan(64, T(0, 0, 4, 3), T(0, 0, 4, 3), swap=True, combine="atomic"),
                Plan(32, T(0, 0, 4, 3), T(0, 0, 4, 3), swap=True),
                Plan(128, T(0, 0, 8, 3), T(0, 0, 8, 3), half=True),  # 5 and 6 with half blocks
                Plan(128, T(0, 0, 8, 3), T(0, 0, 8, 3), swap=True, half=True),
                # 11-15: 0, 1, 3, 2, 5 with the float32 unpack (the default unpacks int4 in bf16 pairs)
                Plan(16, T(0, 0, 4, 3), T(0, 0, 4, 3), unpack="f32"),
                Plan(16, T(0, 0, 4, 3), T(0, 0, 4, 3), swap=True, unpack="f32"),
                Plan(64, T(0, 0, 4, 3), T(0, 0, 4, 3), swap=True, unpack="f32"),
                Plan(64, T(0, 0, 4, 3), T(0, 0, 4, 3), unpack="f32"),
                Plan(128, T(0, 0, 8, 3), T(0, 0, 8, 3), unpack="f32")]
        order = {96: [11, 1, 12, 3, 13], 512: [11, 0, 1, 12, 8, 3, 13], 2048: [8, 3, 13, 2, 14, 1, 7],
                 4096: [3, 13, 2, 14, 6, 10, 5, 15, 9, 4, 7]}
    return [base[i] for i in order.get(m, range(len(base)))]


def sweep_plans(plans, fmt: str, m: int, time_plan, check_plan, row: dict, results: dict, left, log) -> None:
    """Each plan in turn until the budget is spent: (µs, outputs) = time_plan(n, plan), the error
    check_plan(outputs), a sweep row in results; row keeps the best. A failing plan is logged and
    the sweep goes on."""
    for n, plan in enumerate(plans):
        if left() < 0:
            log(f"budget spent: sweep stopped at {fmt} M={m}")
            return
        try:
            us, ys = time_plan(n, plan)
            err = check_plan(ys)
            results["sweep"].append(dict(fmt=fmt, m=m, us=us, err=err, plan=str(plan)))
            log(f"sweep {fmt} M={m}: {us:.1f} µs err {err} {plan}")
            if us and (not row.get("best_us") or us < row["best_us"]):
                row.update(best_us=us, best_plan=str(plan))
        except Exception as e:  # noqa: BLE001
            log(f"FAILED sweep {fmt} M={m} {plan}: {e!r}")
            results["errors"].append(f"sweep {fmt} M={m} {plan}: " + traceback.format_exc(limit=4)[-1500:])

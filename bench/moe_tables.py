"""The MoE benchmarks' tables, printed last: bench.grouped_gemm's and bench.fused_moe's (ours against
the floor and the peers)."""

from __future__ import annotations


def best_us(row: dict) -> float | None:
    """The faster of a row's default plan and its sweep's best (None when neither was timed)."""
    cands = [v for v in (row.get("us"), row.get("best_us")) if v]
    return min(cands) if cands else None


def grouped_gemm_table(results: dict, dims, peak_tflops: float, torch_anchor: dict, log) -> None:
    """bench.grouped_gemm's table: per (format, M) its default and best µs, TFLOP/s, TB/s, floor =
    max(bytes / copy ceiling, FLOPs / peak_tflops), and the peers' ratios. dims: (E, k, D, I)."""
    E, K, D, I = dims
    cbw = results.get("copy_tbs")
    lines = ["", f"grouped GEMM MoE layer, E={E} top-{K} D={D} I={I}, on {results.get('device')}; copy ceiling "
                 f"{cbw and round(cbw, 2)} TB/s; floor = max(bytes / copy, FLOPs / {peak_tflops:.0f} TFLOP/s)",
             "fmt     M  experts     GB  GFLOP  default µs  best µs  TFLOP/s  TB/s  floor µs  %floor  "
             "ragged µs      x  torch µs     x"]
    for r in results["rows"]:
        us = best_us(r)
        if not us or "mbytes" not in r:
            lines.append(f"{r['fmt']:4} {r['m']:5}  (no timing; rel err of the default plan {r.get('err')})")
            continue
        floor = max(r["mbytes"] / cbw if cbw else 0.0, r["gflop"] / peak_tflops * 1e3)
        rat = lambda p: f"{p:9.0f} {p / us:6.2f}" if p else "      n/a       "  # noqa: E731
        lines.append(
            f"{r['fmt']:4} {r['m']:5} {r['distinct']:7.1f} {r['mbytes'] / 1e3:6.2f} {r['gflop']:6.1f} "
            f"{r.get('us') or 0:10.1f} {us:8.1f} {r['gflop'] / us * 1e3:8.0f} {r['mbytes'] / us / 1e6:5.2f} "
            f"{floor:9.1f} {100 * floor / us:6.0f}%  {rat(r.get('ragged'))} {rat(r.get('torch'))}")
    lines.append("x = peer µs / ours (best): > 1 means ours is faster; the int4 rows' peers run bf16 weights. "
                 f"torch anchors (perf-anchors.md, another run): {torch_anchor} µs")
    for r in results["rows"]:
        if r.get("best_plan"):
            lines.append(f"best {r['fmt']} M={r['m']}: {r['best_plan']}")
    for line in lines:
        log(line)


def fused_moe_table(results: dict, dims, sglang_anchor: dict, log) -> None:
    """bench.fused_moe's table: per (format, M) its default and best µs, TB/s, floor = bytes / copy
    ceiling, and the peers' ratios (SGLang's from another run). dims: (E, k, D, I)."""
    E, K, D, I = dims
    cbw = results.get("copy_tbs")
    lines = ["", f"fused MoE, E={E} top-{K} D={D} I={I}, on {results.get('device')}; "
                 f"copy ceiling {cbw and round(cbw, 2)} TB/s",
             "fmt  M   experts   MB   ours µs (best)  TB/s  floor µs  %floor  torch µs   x    ragged µs  x    "
             "gathered µs  x    SGLang* x"]
    for r in results["rows"]:
        us = best_us(r)
        if not us or "mbytes" not in r:
            lines.append(f"{r['fmt']:4} {r['m']:3}  (no timing)")
            continue
        floor = r["mbytes"] / cbw if cbw else float("nan")
        rat = lambda p: f"{p:9.1f} {p / us:5.2f}" if p else "      n/a      "  # noqa: E731
        sgl = sglang_anchor.get(r["m"])
        lines.append(
            f"{r['fmt']:4} {r['m']:3} {r['distinct']:6.1f} {r['mbytes']:7.1f} {r.get('us') or 0:7.1f} ({us:6.1f}) "
            f"{r['mbytes'] / us:5.2f} {floor:8.1f} {100 * floor / us:6.0f}%  {rat(r.get('torch'))} {rat(r.get('ragged'))} "
            f" {rat(r.get('gathered'))}  {sgl / us if sgl else float('nan'):5.2f}")
    lines.append("x = peer µs / ours (best); SGLang* = perf-anchors.md bf16 figure (not this run) / ours")
    for r in results["rows"]:
        if r.get("best_plan"):
            lines.append(f"best {r['fmt']} M={r['m']}: {r['best_plan']}")
    for line in lines:
        log(line)

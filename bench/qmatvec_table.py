"""bench.qmatvec's table, printed last: per (shape, M, bits) ours in µs, TB/s over the bytes a call
must move and its share of the copy ceiling, and the peers' times over ours (cuBLAS, gemlite, XLA);
then the best sweep variant per (shape, M)."""

from __future__ import annotations


def qmatvec_table(results: dict, log) -> None:
    cbw = results.get("copy_tbs")
    lines = ["", f"qmatvec on {results.get('device')}, copy ceiling {cbw and round(cbw, 2)} TB/s "
             "(int4r: the row layout's tensor-core kernel; int4, int8: the tile layout's Pallas kernel)",
             "shape          M bits    ours µs  TB/s  %copy  cuBLAS µs  x   gemlite µs  x   XLA µs   x"]

    def ratio(peer, ours):
        return f"{peer / ours:5.2f}" if peer else "  n/a"

    for r in results["rows"]:
        pct = 100 * r["tbs"] / cbw if cbw else float("nan")
        cub, glt, xl = r["cublas"], r["gemlite"], r["xla"]
        lines.append(
            f"{r['n']:>6}x{r['k']:<6} {r['m']:>2} int{r['bits']}{'r' if r.get('layout') == 'rows' else ' '} {r['us']:8.2f} {r['tbs']:5.2f} {pct:5.0f}%"
            f" {cub or float('nan'):9.2f} {ratio(cub, r['us'])} {glt or float('nan'):10.2f}"
            f" {ratio(glt, r['us'])} {xl:7.2f} {ratio(xl, r['us'])}")
    if results["sweep"]:
        lines.append("best sweep variant per (shape, M), int4:")
        best = {}
        for r in results["sweep"]:
            kk = (r["n"], r["k"], r["m"])
            if kk not in best or r["us"] < best[kk]["us"]:
                best[kk] = r
        for kk, r in sorted(best.items()):
            lines.append(f"  {kk[0]}x{kk[1]} M={kk[2]}: {r['us']:.2f} µs {r['tbs']:.2f} TB/s "
                         f"{'bn' + str(r['block_n']) if r['block_n'] else 'rows'} {r['plan']}")
    if results["errors"]:
        lines.append(f"{len(results['errors'])} errors (see the log)")
    for line in lines:
        log(line)

"""Serving configurations compared as a client sees them: for each --server, `python -m serve.run`
with its arguments started on a free port, `python -m serve.bench` with the --bench arguments run
against it once it serves, then the server stopped (its whole process group, also when this tool
is interrupted or times out, so that the next server finds the device free); the results side by
side.

    python -m bench.served --bench "--streams 16 --num-prompts 6 --random-input-len 8192 ..." \\
        --server separate="--model ling-3-flash --num-layers 16 ... --mixed-iteration off" \\
        --server mixed="--model ling-3-flash --num-layers 16 ... --mixed-iteration on"

The servers run one after another, in the order given (put the one that must not be lost first);
a shared --compile-cache in their arguments shortens the later starts. With --together they all
start at once (their compilations overlap on the host's cores; each needs a --mem-fraction that
leaves the others room) and are benchmarked in turn, the others idle meanwhile. Writes
NAME.server.log, NAME.bench.json and served.json (each server's start-up seconds, exit status and
benchmark result; with --iteration-log the summary of each server's NAME.iterations.jsonl) under
$OUT (or ./bench_out); prints a table last. Exit status 1 when a server did
not serve or its benchmark failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

READY = re.compile(r"ling-serve: serving '[^']*' at (http://\S+)")
# Shown per server in the table, where its benchmark reported them: (label, path in the result).
ROWS = [
    ("start-up s", ("startup_s",)),
    ("mean TTFT ms", ("bench", "mean_ttft_ms")),
    ("mean TPOT ms", ("bench", "mean_tpot_ms")),
    ("P99 ITL ms", ("bench", "p99_itl_ms")),
    ("output tok/s", ("bench", "output_throughput")),
    ("streams alone: median ITL ms", ("bench", "alone", "stream_median_itl_ms")),
    ("streams alone: P99 ITL ms", ("bench", "alone", "stream_p99_itl_ms")),
    ("streams w/ arrivals: median ITL ms", ("bench", "arrivals", "stream_median_itl_ms")),
    ("streams w/ arrivals: P99 ITL ms", ("bench", "arrivals", "stream_p99_itl_ms")),
    ("P99 ITL arrivals / alone", ("bench", "p99_itl_ratio")),
    ("arrivals: mean TTFT ms", ("bench", "arrivals", "arrival_mean_ttft_ms")),
    ("arrivals: total tok/s", ("bench", "arrivals", "total_throughput")),
]


def named(text: str) -> tuple[str, str]:
    """NAME=ARGS -> (NAME, ARGS); argparse type of --server."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"--server takes NAME=\"serve.run arguments\" (NAME: letters, digits, "
                                         f"_ . -), got {text!r}")
    return name, rest


def lookup(result: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def table(results: dict) -> str:
    names = list(results)
    width = max(12, *(len(n) + 2 for n in names))
    lines = [f"{'':<36}" + "".join(f"{n:>{width}}" for n in names)]
    for label, path in ROWS:
        values = [lookup(results[n], path) for n in names]
        if all(v is None for v in values):
            continue
        cell = lambda v: f"{v:>{width}.2f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"  # noqa: E731
        lines.append(f"{label:<36}" + "".join(cell(v) for v in values))
    for n in names:
        if results[n].get("error"):
            lines.append(f"{n}: {results[n]['error']}")
    return "\n".join(lines)


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the server's process group (the server and anything it started), then, after the
    server has exited or `grace` seconds, SIGKILL to whatever of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return  # the group is gone
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def iteration_log(out_dir: str, name: str) -> str:
    return os.path.join(out_dir, f"{name}.iterations.jsonl")


def launch(name: str, server_args: str, out_dir: str, log_iterations: bool = False) -> tuple[subprocess.Popen, str,
                                                                                             float]:
    """Starts `python -m serve.run` with server_args on a free port, in a process group of its own,
    its output to NAME.server.log (with log_iterations its iteration log to NAME.iterations.jsonl):
    (process, log path, start time)."""
    log_path = os.path.join(out_dir, f"{name}.server.log")
    extra = ["--iteration-log", iteration_log(out_dir, name)] if log_iterations else []
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serve.run", *shlex.split(server_args), "--port", "0", *extra],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log_path, time.perf_counter()


def wait_ready(proc: subprocess.Popen, log_path: str, t0: float, start_timeout: float, result: dict) -> str | None:
    """The server's URL once its log says it serves (result's startup_s set), or None with
    result's error set (it exited, or did not serve within start_timeout of t0)."""
    while True:
        with open(log_path) as f:
            found = READY.search(f.read())
        if found:
            result["startup_s"] = time.perf_counter() - t0
            return found.group(1)
        if proc.poll() is not None:
            with open(log_path) as f:
                last = ([line.strip() for line in f if line.strip()] or ["(nothing logged)"])[-1]
            result["error"] = f"the server exited ({proc.returncode}) before serving: {last} ({log_path})"
            return None
        if time.perf_counter() - t0 > start_timeout:
            result["error"] = f"the server did not serve within {start_timeout:.0f} s; see {log_path}"
            return None
        time.sleep(0.5)


def run_bench(name: str, url: str, bench_args: list[str], out_dir: str, log_path: str, bench_timeout: float | None,
              result: dict) -> None:
    """`python -m serve.bench` against url; its result (NAME.bench.json) into result's bench."""
    json_path = os.path.join(out_dir, f"{name}.bench.json")
    if os.path.exists(json_path):  # an earlier run's: never read as this one's
        os.remove(json_path)
    try:
        with open(log_path, "a") as log:
            done = subprocess.run([sys.executable, "-m", "serve.bench", "--base-url", url, "--disable-tqdm",
                                   "--output-json", json_path, *bench_args], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=bench_timeout)
        result["bench_status"] = done.returncode
    except subprocess.TimeoutExpired:
        result["error"] = f"serve.bench outran --bench-timeout {bench_timeout:.0f} s"
    if os.path.exists(json_path):
        with open(json_path) as f:
            result["bench"] = json.load(f)
    elif result["error"] is None:
        result["error"] = f"serve.bench wrote no result (exit {result['bench_status']}); see {log_path}"


def iterations_over(out_dir: str, name: str, result: dict) -> None:
    """result's "iterations": `serve.iterations.summary` of the server's iteration log, over 1.3x
    its streams' P99 ITL alone (where its benchmark measured one; else 1.3x the log's median)."""
    from serve.iterations import summary

    path = iteration_log(out_dir, name)
    if not os.path.exists(path):
        return
    alone = lookup(result, ("bench", "alone", "stream_p99_itl_ms"))
    over = 1.3 * (alone if isinstance(alone, (int, float)) else summary(path, float("inf"))["median_ms"] or 0.0)
    result["iterations"] = {"over_ms": over, **summary(path, over)}


def run_all(servers: list[tuple[str, str]], bench_args: list[str], out_dir: str, *, together: bool,
            start_timeout: float, bench_timeout: float | None, grace: float, results: dict,
            log_iterations: bool = False) -> None:
    """Each server's run into results[name] = {"server", "startup_s", "bench", "bench_status",
    "error"} (and with log_iterations "iterations", `iterations_over`): in turn (started,
    benchmarked, stopped), or `together` (all started at once, each benchmarked in turn once all
    that can serve do, all stopped at the end)."""
    for name, server_args in servers:
        results[name] = {"server": server_args, "startup_s": None, "bench": None, "bench_status": None, "error": None}
    groups = [servers] if together else [[s] for s in servers]
    for group in groups:
        started = {}
        try:
            for name, server_args in group:
                started[name] = launch(name, server_args, out_dir, log_iterations)
            urls = {}
            for name, (proc, log_path, t0) in started.items():
                urls[name] = wait_ready(proc, log_path, t0, start_timeout, results[name])
                if urls[name]:
                    print(f"[{name}] serving at {urls[name]} after {results[name]['startup_s']:.0f} s", flush=True)
            for name, url in urls.items():
                if url:
                    run_bench(name, url, bench_args, out_dir, started[name][1], bench_timeout, results[name])
                    if log_iterations:
                        iterations_over(out_dir, name, results[name])
        finally:
            for proc, _, _ in started.values():
                stop(proc, grace)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--server", action="append", type=named, required=True, metavar='NAME="ARGS"',
                    help="a configuration: its name and python -m serve.run's arguments (repeat; run in order)")
    ap.add_argument("--bench", default="", metavar='"ARGS"', help="python -m serve.bench's arguments, the same for "
                    "every server (--base-url and --output-json are this tool's)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to serve")
    ap.add_argument("--bench-timeout", type=float, default=None, help="seconds a benchmark may take (default: none)")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds a stopped server has before SIGKILL")
    ap.add_argument("--together", action="store_true", help="start every server at once (their compilations "
                    "overlap), then benchmark each in turn while the others idle; give each a --mem-fraction "
                    "that leaves room for the others")
    ap.add_argument("--iteration-log", action="store_true", help="give each server an iteration log "
                    "(NAME.iterations.jsonl) and print, per server, its iterations over 1.3x the streams' P99 ITL "
                    "alone, grouped by what ran in them (serve/iterations.py)")
    args = ap.parse_args(argv)
    names = [n for n, _ in args.server]
    if len(set(names)) != len(names):
        ap.error(f"--server names must differ, got {names}")
    bench_args = shlex.split(args.bench)
    for own in ("--base-url", "--output-json"):
        if any(a == own or a.startswith(own + "=") for a in bench_args):
            ap.error(f"--bench must not set {own}: this tool sets it per server")
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    # SIGTERM (a timeout's) ends this tool through its finally clauses: the running server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict = {}
    try:
        run_all(args.server, bench_args, out_dir, together=args.together, start_timeout=args.start_timeout,
                bench_timeout=args.bench_timeout, grace=args.grace, results=results,
                log_iterations=args.iteration_log)
    finally:
        with open(os.path.join(out_dir, "served.json"), "w") as f:
            json.dump({"bench": args.bench, "results": results}, f, indent=1)
    from serve.iterations import describe

    for name, r in results.items():
        if r.get("iterations"):
            print(f"[{name}] " + describe(r["iterations"], r["iterations"]["over_ms"]))
    print(table(results))
    return int(any(r["error"] or r["bench_status"] for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())

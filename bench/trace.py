"""Device traces: a function run under the JAX profiler, the device's kernels read back from the
Perfetto trace (per kernel name: launches and µs a call; per call: device span and busy time)."""

from __future__ import annotations

import collections
import os
import statistics
import tempfile


def _traced_events(fn, out_dir: str) -> tuple[list[dict], set]:
    """Runs fn() once under the JAX profiler (a Perfetto trace under out_dir/trace): (its complete
    events, the pids of the device's processes)."""
    import glob
    import gzip
    import json

    import jax

    os.makedirs(os.path.join(out_dir, "trace"), exist_ok=True)
    trace_dir = tempfile.mkdtemp(dir=os.path.join(out_dir, "trace"))  # traces within one second share a name
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        fn()
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in procs.items() if "GPU" in name or "device" in name.lower()}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], gpu


def host_table(fn, calls: int, out_dir: str) -> list[dict]:
    """Runs fn() (`calls` calls) under the JAX profiler and returns the host's events per name:
    count and µs a call, inclusive (nested events count in each enclosing one), longest first:
    where the host's time to dispatch a call goes."""
    events, gpu = _traced_events(fn, out_dir)
    return kernel_table([e for e in events if e["pid"] not in gpu], calls)


def trace_kernels(fn, out_dir: str) -> list[dict]:
    """Runs fn() once under the JAX profiler (a Perfetto trace under out_dir/trace) and returns the
    device kernels of the busiest stream, in start order ({name, ts, dur} in µs)."""
    events, gpu = _traced_events(fn, out_dir)
    kern = [e for e in events if e["pid"] in gpu]
    if not kern:
        return []
    streams = collections.defaultdict(list)
    for e in kern:
        streams[(e["pid"], e.get("tid"))].append(e)
    return sorted(max(streams.values(), key=lambda es: sum(e["dur"] for e in es)), key=lambda e: e["ts"])


def kernel_table(events: list[dict], calls: int) -> list[dict]:
    """Per kernel name: launches and µs per call, longest first."""
    by = collections.defaultdict(list)
    for e in events:
        by[e["name"]].append(e["dur"])
    return sorted(({"name": k, "count": len(v) / calls, "us_per_call": sum(v) / calls} for k, v in by.items()),
                  key=lambda r: -r["us_per_call"])


def device_trace(fn, n: int, out_dir: str, log=print, label: str = "") -> dict:
    """Runs fn() n times under the JAX profiler, each call synced, and reads the device's kernels
    back: per kernel name, launches and µs a call; per call, its device span (first kernel's start
    to last kernel's end, launch gaps included: the time the call holds the GPU) and its kernels'
    busy time. The calls are told apart by the n - 1 widest gaps on the busiest stream (the host
    syncs between calls). Returns {span_us, busy_us: medians over the calls, kernels: [{name,
    count, us_per_call}], sequence: the last call's kernels in order, [name, µs]} and logs them."""
    import jax

    jax.block_until_ready(fn())

    def run():
        for _ in range(n):
            jax.block_until_ready(fn())

    main = trace_kernels(run, out_dir)
    if not main:
        log(f"trace {label}: no device kernels")
        return dict(span_us=None, busy_us=None, kernels=[])
    gaps = sorted(range(1, len(main)), key=lambda i: main[i]["ts"] - main[i - 1]["ts"] - main[i - 1]["dur"])
    cuts = [0] + sorted(gaps[len(gaps) - (n - 1):] if n > 1 else []) + [len(main)]
    calls = [main[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    spans = [c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls]
    busy = [sum(e["dur"] for e in c) for c in calls]
    kernels = kernel_table(main, len(calls))
    span, work = statistics.median(spans), statistics.median(busy)
    log(f"trace {label}: {len(calls)} calls, device span {span:.1f} µs a call (min {min(spans):.1f}, max "
        f"{max(spans):.1f}), kernels {work:.1f} µs, gaps {span - work:.1f} µs")
    for r in kernels[:16]:
        log(f"    {r['name'][:60]:60s} x{r['count']:4.1f} {r['us_per_call']:9.1f} µs a call")
    return dict(span_us=span, busy_us=work, kernels=kernels, launches=len(main) / len(calls),
                sequence=[[e["name"], round(e["dur"], 2)] for e in calls[-1]])


def stream_trace(run, n: int, out_dir: str) -> dict:
    """run() issues n calls back to back (no sync between them) and waits for the last: per call,
    the device span of the whole stream / n, its kernels' busy time / n, the idle time between them
    (span - busy) / n, launches / n and the kernel table."""
    main = trace_kernels(run, out_dir)
    if not main:
        return dict(span_us=None, busy_us=None, idle_us=None, launches=None, kernels=[])
    span = main[-1]["ts"] + main[-1]["dur"] - main[0]["ts"]
    busy = sum(e["dur"] for e in main)
    return dict(span_us=span / n, busy_us=busy / n, idle_us=(span - busy) / n, launches=len(main) / n,
                kernels=kernel_table(main, n))

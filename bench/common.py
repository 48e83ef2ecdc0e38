"""What the benchmarks share: the copy ceiling, relative error, the experts' random weights, XLA's
own MoE forms as peers (`xla_gathered`, `xla_ragged`), and
the offline path (capture each pallas_call's Triton IR as it is lowered, compile it for sm_90a
with the triton package, report registers, spills, shared memory and the SASS mix) — which runs on
a machine without a GPU, since Triton's compiler needs none: `pip install triton` there.
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import tempfile
import time


def queued_us(f, *args, hi: int = 8, lo: int = 2, tries: int = 3) -> float:
    """µs per call of f(*args) (already compiled): batches of hi and of lo calls dispatched
    back to back with one sync each, the difference over hi - lo (dispatch and sync cancel),
    after one warm-up batch. Each batch size is timed `tries` times and its fastest taken before
    the difference: the fastest difference would be biased low, picking the tries where a slow
    lo batch ate into it (on a noisy H200 that read a copy at 6.1 TB/s and a grouped GEMM above
    the copy ceiling, 2026-12-01). A noisy host (CPU runs) can make the difference non-positive:
    then the plain mean of a batch of hi."""
    import jax

    def batch(n):
        t = time.perf_counter()
        jax.block_until_ready([f(*args) for _ in range(n)])
        return time.perf_counter() - t

    batch(lo)
    t_hi, t_lo = [], []
    for _ in range(tries):  # interleaved, so a slow stretch of the machine touches both sizes
        t_hi.append(batch(hi))
        t_lo.append(batch(lo))
    per = (min(t_hi) - min(t_lo)) / (hi - lo)
    return (per if per > 0 else min(t_hi) / hi) * 1e6


def copy_ceiling_tbs(n_bytes: int = 1 << 30) -> float:
    """TB/s of an XLA read + write pass over n_bytes, timed like the kernels next to it
    (`queued_us`), so that it does not count dispatch and sync that theirs do not."""
    import jax
    import jax.numpy as jnp

    n = n_bytes // 4
    a = jnp.zeros((n,), jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(1))
    jax.block_until_ready(f(a))
    return 2 * n * 4 / queued_us(f, a, hi=10, lo=2, tries=3) / 1e6


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in float32; inf when a holds a non-finite value."""
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(b)))))


def time_torch_graph(calls) -> float:
    """µs per call of the zero-argument callables (torch), run twice on a side stream (autotune,
    warm-up), captured once in a CUDA graph, replayed 20 times a sample: median of 3."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / 20 / len(calls))
    return statistics.median(samples)


def _trace_kernels(fn, out_dir: str) -> list[dict]:
    """Runs fn() once under the JAX profiler (a Perfetto trace under out_dir/trace) and returns the
    device kernels of the busiest stream, in start order ({name, ts, dur} in µs)."""
    import collections as col
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
    kern = [e for e in events if e.get("ph") == "X" and e["pid"] in gpu and "dur" in e]
    if not kern:
        return []
    streams = col.defaultdict(list)
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
    count, us_per_call}]} and logs them."""
    import jax

    jax.block_until_ready(fn())

    def run():
        for _ in range(n):
            jax.block_until_ready(fn())

    main = _trace_kernels(run, out_dir)
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
    return dict(span_us=span, busy_us=work, kernels=kernels, launches=len(main) / len(calls))


def stream_trace(run, n: int, out_dir: str) -> dict:
    """run() issues n calls back to back (no sync between them) and waits for the last: per call,
    the device span of the whole stream / n, its kernels' busy time / n, the idle time between them
    (span - busy) / n, launches / n and the kernel table."""
    main = _trace_kernels(run, out_dir)
    if not main:
        return dict(span_us=None, busy_us=None, idle_us=None, launches=None, kernels=[])
    span = main[-1]["ts"] + main[-1]["dur"] - main[0]["ts"]
    busy = sum(e["dur"] for e in main)
    return dict(span_us=span / n, busy_us=busy / n, idle_us=(span - busy) / n, launches=len(main) / n,
                kernels=kernel_table(main, n))


def random_experts(fmt: str, key, *, e: int, d: int, inter: int, group: int, block_n: int, abstract: bool = False):
    """(w13 [E, D, 2I], w2 [E, I, D]) of random bf16 experts (std chosen so h and y stay O(1)), or,
    fmt "int4", a valid grouped-int4 pair of `QuantizedWeight`s with random codes and scales.
    abstract: ShapeDtypeStructs (lowering only)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quant import QuantizedWeight

    sds = jax.ShapeDtypeStruct
    k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, fmt == "int4"), 4)
    if fmt == "bf16":
        if abstract:
            return sds((e, d, 2 * inter), jnp.bfloat16), sds((e, inter, d), jnp.bfloat16)
        return (jax.random.normal(k1, (e, d, 2 * inter), jnp.bfloat16) * 0.03,
                jax.random.normal(k2, (e, inter, d), jnp.bfloat16) * 0.05)

    def q(ka, kb, n, k):
        shapes = (e, n // block_n, k // 8, block_n), (e, n // block_n, k // group, block_n)
        if abstract:
            words, scales = sds(shapes[0], jnp.uint32), sds(shapes[1], jnp.bfloat16)
        else:
            words = jax.random.bits(ka, shapes[0], jnp.uint32)
            scales = (jax.random.uniform(kb, shapes[1]) * 0.01 + 1e-3).astype(jnp.bfloat16)
        return QuantizedWeight(words, scales, None, 4, group, True, (n, k))

    return q(k1, k2, 2 * inter, d), q(k3, k4, d, inter)


# ---------------------------------------------------------------------------------- offline


def capture_triton(captured: list) -> None:
    """From now on every pallas_call lowered to Triton appends its module's text to `captured`;
    jax 0.11 asks the local GPU for its compute capability: it is told sm_90."""
    import types

    from jax._src.pallas.triton import lowering as tlow
    from jax._src.pallas.triton import pallas_call_registration as reg

    real = tlow.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        res = real(*a, **kw)
        captured.append(res.module.operation.get_asm())
        return res

    tlow.lower_jaxpr_to_triton_module = capture
    reg.lowering.lower_jaxpr_to_triton_module = capture
    if hasattr(reg, "gpu_info_lib"):
        reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)


def kernel_name(ttir: str) -> str:
    """The kernel's name in a captured Triton module's text."""
    return re.search(r'(?:tt\.func (?:\w+ )?@|sym_name = ")(\w+)', ttir).group(1)


KEY_OPS = ("HGMMA", "HMMA", "LDGSTS", "STS", "ATOMG", "RED", "MUFU", "BAR", "LDL", "STL")


def compile_report(ttir_dir: str, log=print) -> list[dict]:
    """Compiles every `*_w{warps}_s{stages}.ttir` in ttir_dir with triton for sm_90a and logs,
    per kernel: shared memory, registers, spilled bytes, SASS instructions and the opcodes in
    KEY_OPS (tensor cores, async copies, atomics, MUFU, barriers, local memory). ok: it fits the
    H100/H200's shared memory. Returns the records (also written to compile.json there)."""
    import json
    import subprocess
    import tempfile

    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except Exception as e:  # noqa: BLE001
        log(f"triton not importable ({e!r}): lowered only, not compiled")
        return []
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    log(f"compiling for sm_90a with triton {triton.__version__}")
    records = []
    for name in sorted(os.listdir(ttir_dir)):
        if not name.endswith(".ttir"):
            continue
        nw, ns = map(int, re.search(r"_w(\d+)_s(\d+)\.ttir$", name).groups())
        try:
            k = triton.compile(os.path.join(ttir_dir, name), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=nw, num_stages=ns))
            with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True,
                                  text=True).stdout
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(k.asm["ptx"])
            ptxas = subprocess.run([os.path.join(bin_dir, "ptxas"), "--gpu-name", "sm_90a", "-v", f.name, "-o",
                                    os.devnull], capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", ptxas)
            spill = re.search(r"(\d+) bytes spill stores", ptxas)
            ops = collections.Counter(o.split(".")[0] for o in re.findall(
                r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))
            rec = dict(kernel=name, ok=k.metadata.shared <= 232448, smem=k.metadata.shared,
                       regs=regs and int(regs.group(1)), spill=spill and int(spill.group(1)),
                       instructions=sum(ops.values()), ops={o: ops[o] for o in KEY_OPS if ops[o]})
            log(f"{'OK  ' if rec['ok'] else 'BAD '} {name}: smem {rec['smem']} B, {rec['regs']} regs, spill "
                f"{rec['spill']} B, {rec['instructions']} SASS instructions, {rec['ops']}")
        except Exception as e:  # noqa: BLE001
            rec = dict(kernel=name, ok=False, error=repr(e)[:1500])
            log(f"FAIL {name}: {repr(e)[:600]}")
        records.append(rec)
    log(f"compiled {sum(r['ok'] for r in records)} / {len(records)} kernels for sm_90a")
    with open(os.path.join(ttir_dir, "compile.json"), "w") as f:
        json.dump(records, f, indent=1)
    return records


def xla_gathered(x, topk_ids, topk_weights, w13, w2):
    """XLA's peer at decode sizes: an einsum over the pairs' gathered experts in x's dtype with
    float32 accumulation (w13 [E, D, 2I] interleaved, w2 [E, I, D])."""
    import jax
    import jax.numpy as jnp

    h = jnp.einsum("md,mkdn->mkn", x, w13[topk_ids].astype(x.dtype), preferred_element_type=jnp.float32)
    g, u = h[..., 0::2], h[..., 1::2]
    h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)  # [M, k, I]
    out = jnp.einsum("mki,mkid->mkd", h, w2[topk_ids].astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.sum(out * topk_weights[..., None].astype(jnp.float32), axis=1).astype(x.dtype)


def xla_ragged(x, topk_ids, topk_weights, w13, w2):
    """XLA's peer at prefill sizes: pairs sorted by expert, `lax.ragged_dot` in x's dtype with
    float32 accumulation (on the GPU it reads every expert)."""
    import jax
    import jax.numpy as jnp

    m, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w13.shape[0]).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // k], w13.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    g, u = h[:, 0::2], h[:, 1::2]
    h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
    out = jax.lax.ragged_dot(h, w2.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    out = out * topk_weights.reshape(-1)[order, None].astype(jnp.float32)
    return jnp.zeros((m, x.shape[1]), jnp.float32).at[order // k].add(out).astype(x.dtype)

"""The benchmarks' shared harness: the log, the task loop under a time budget, the copy ceiling,
the queued-dispatch timer, the rotating-buffer timer, torch's CUDA-graph timer, one relative error, and the experts' random
weights. Device traces are in bench/trace.py, the offline Triton compile in bench/sass.py, the
peers (XLA's MoE forms, torch's grouped GEMM) in bench/peers.py.
"""

from __future__ import annotations

import statistics
import time
import traceback


class Log:
    """log(*parts): prints the parts joined by spaces and, once `open`ed, appends the line to a file
    (written as it goes: a run cut short still leaves its log). t0: each line starts with the
    seconds since t0."""

    def __init__(self, t0: float | None = None):
        self.file, self.t0 = None, t0

    def open(self, path: str) -> None:
        self.file = open(path, "w")

    def write(self, s: str) -> None:
        """To the file only."""
        if self.file is not None:
            self.file.write(s)

    def __call__(self, *a) -> None:
        s = " ".join(str(x) for x in a)
        if self.t0 is not None:
            s = f"[{time.time() - self.t0:5.0f}s] " + s
        print(s, flush=True)
        if self.file is not None:
            self.file.write(s + "\n")
            self.file.flush()


def run_tasks(tasks, left, log, errors: list) -> None:
    """Runs each (fn, args) of tasks in order; once left() < 0 the rest are logged as skipped. A task
    that raises is logged and its traceback's tail appended to errors; the next one runs."""
    for fn, a in tasks:
        if left() < 0:
            log(f"budget spent: skipped {fn.__name__}{a}")
            continue
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001
            log(f"FAILED {fn.__name__}{a}: {e!r}")
            errors.append(f"{fn.__name__}{a}: " + traceback.format_exc(limit=4)[-1500:])


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


def rotating_us(fn, x, bufs, iters: int = 8) -> float:
    """µs per call of fn(x, buf): len(bufs) distinct calls an iteration of a fori_loop, one
    dispatch, the fastest of 3 runs. Each iteration's x depends (by 1e-30 x its outputs' first
    column) on the previous iteration's outputs, so nothing is hoisted or dropped and the host's
    dispatch is paid once a loop; distinct buffers (weights) keep each call's reads out of L2."""
    import jax
    import jax.numpy as jnp

    def run(x, bufs):
        def body(i, xc):
            ys = [fn(xc, b) for b in bufs]
            tail = sum(y[:, :1].astype(jnp.float32) for y in ys)  # [M, 1]
            return (xc.astype(jnp.float32) + 1e-30 * tail).astype(xc.dtype)
        return jax.lax.fori_loop(0, iters, body, x)

    f = jax.jit(run)
    jax.block_until_ready(f(x, bufs))
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, bufs))
        best.append((time.perf_counter() - t0) / (iters * len(bufs)) * 1e6)
    return min(best)


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


def random_experts(fmt: str, key, *, e: int, d: int, inter: int, group: int, block_n: int, abstract: bool = False):
    """(w13 [E, D, 2I], w2 [E, I, D]) of random bf16 experts (std chosen so h and y stay O(1)), or,
    fmt "int4" ("int4r": in the row layout), a valid grouped-int4 pair of `QuantizedWeight`s with
    random codes and scales. abstract: ShapeDtypeStructs (lowering only)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quant import QuantizedWeight

    sds = jax.ShapeDtypeStruct
    k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, fmt != "bf16"), 4)
    if fmt == "bf16":
        if abstract:
            return sds((e, d, 2 * inter), jnp.bfloat16), sds((e, inter, d), jnp.bfloat16)
        return (jax.random.normal(k1, (e, d, 2 * inter), jnp.bfloat16) * 0.03,
                jax.random.normal(k2, (e, inter, d), jnp.bfloat16) * 0.05)

    def q(ka, kb, n, k):
        if fmt == "int4r":
            shapes = (e, n, k // 8), (e, n, k // group)
        else:
            shapes = (e, n // block_n, k // 8, block_n), (e, n // block_n, k // group, block_n)
        if abstract:
            words, scales = sds(shapes[0], jnp.uint32), sds(shapes[1], jnp.bfloat16)
        else:
            words = jax.random.bits(ka, shapes[0], jnp.uint32)
            scales = (jax.random.uniform(kb, shapes[1]) * 0.01 + 1e-3).astype(jnp.bfloat16)
        return QuantizedWeight(words, scales, None, 4, group, True, (n, k), "rows" if fmt == "int4r" else "tiles")

    return q(k1, k2, 2 * inter, d), q(k3, k4, d, inter)


def time_loop(step, args, carry, lo=2, hi=7):
    """µs per step: fori_loop(n, step) in one dispatch for n = lo and hi, difference / (hi - lo)."""
    import jax

    def run(args, carry, n):
        return jax.lax.fori_loop(0, n, lambda i, c: step(args, c), carry)

    f = jax.jit(run)
    jax.block_until_ready(f(args, carry, 1))  # compile + warm-up

    def wall(n):
        t = time.perf_counter()
        jax.block_until_ready(f(args, carry, n))
        return time.perf_counter() - t

    t_lo = statistics.median(wall(lo) for _ in range(3))
    t_hi = statistics.median(wall(hi) for _ in range(3))
    return (t_hi - t_lo) / (hi - lo) * 1e6


def torch_us(fn, n=10, warm=3):
    """µs per call of a torch callable, CUDA events around n calls after warm-up calls."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n

"""What bench.prefill's parts share: the log (seconds since the start on each line), the rows of the
short table and the table, the timers (JAX: queued dispatches, `common.queued_us`; torch: CUDA
events) and the parts' base (the budget)."""

from __future__ import annotations

import time

from bench.common import Log, queued_us

T0 = time.time()
DENSE_TFLOPS = 790.0  # bf16 8192³ GEMM through torch on the H200 (769-798 TFLOP/s, device notes)
log = Log(T0)
ROWS: list[dict] = []  # the short table
TARGETS = {"gemm": "grouped GEMM >= 250 TFLOP/s at 4096 tokens", "kda": "KDA prefill <= 1.0 ms/layer at 8192",
           "ttft": "TTFT 8192 tokens, full model <= 0.6 s"}


def row(part, what, **kw):
    ROWS.append(dict(part=part, what=what, **kw))


def device_us(f, *args, reps=(6, 2)):
    """µs per call of f (jitted), after one call that compiles: `common.queued_us` with
    batches of reps = (hi, lo) calls."""
    import jax

    jax.block_until_ready(f(*args))
    return queued_us(f, *args, hi=reps[0], lo=reps[1])


def fmt_us(us):
    return "-" if us is None else (f"{us / 1e3:.2f} ms" if us >= 1e4 else f"{us:.1f} µs")


class Part:
    """The base of bench.prefill's parts: args, the backend (Pallas on the GPU, its interpreter
    elsewhere), the timers' batch sizes and the budget's deadline."""

    def __init__(self, args):
        import jax

        self.args = args
        self.tiny = args.tiny
        self.gpu = jax.default_backend() == "gpu"
        self.backend = "pallas" if self.gpu else "interpret"
        self.deadline = T0 + args.budget
        self.reps = (6, 2) if self.gpu else (2, 1)
        self.cudnn_checked = False  # the model's MLA prefill path (cuDNN) passed a check in this run

    def left(self):
        return self.deadline - time.time()


def table():
    lines = ["", "prefill benchmark, short table (µs per call; TFLOP/s over useful FLOPs; x = peer / ours)",
             f"{'part':<5} {'what':<34} {'time':>10} {'TFLOP/s':>8} {'peer':>22} {'x':>6}  extra"]
    for r in ROWS:
        us = r.get("us")
        peer = r.get("peer_us")
        extra = []
        if r.get("full_us") is not None:
            extra.append(f"{r['layers']} layers; full {r['full_layers']} ~{r['full_us'] / 1e3:.0f} ms, "
                         f"floor {r['floor_us'] / 1e3:.0f} ms ({r['floor_us'] / r['full_us']:.2f} of it)")
        elif r.get("floor_us") is not None:
            extra.append(f"{r['layers']} layers; floor (full) {r['floor_us'] / 1e3:.0f} ms")
        if r.get("note"):
            extra.append(r["note"])
        if r.get("target") is not None:
            extra.append("target MET" if r["target"] else "target MISSED")
        tf = "" if r.get("tflops") is None else f"{r['tflops']:.1f}"
        peer_s = "" if peer is None else f"{r.get('peer', '')} {fmt_us(peer)}"
        ratio = "" if not (peer and us) else f"{peer / us:.2f}"
        lines.append(f"{r['part']:<5} {r['what'][:34]:<34} {fmt_us(us):>10} {tf:>8} {peer_s:>22} {ratio:>6}  "
                     + "; ".join(extra))
    for r in ROWS:
        if r["part"] == "ttft" and r.get("per_layer"):
            lines.append(f"per layer, {r['what']}: {r['per_layer']}")
    lines.append("targets: " + "; ".join(TARGETS.values()))
    for line in lines:
        log(line)

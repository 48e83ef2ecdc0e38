"""A prompt's prefill as the server drives it: `serve.runner.Runner` prefilling a prompt of
--context tokens in the scheduler's chunks (`serve.scheduler.Scheduler`, one slot), the chunks
dispatched back to back and the first token read once at the end; beside it, the device span of one
chunk run alone (JAX profiler). What a client's TTFT is made of, before the first decode step.

    python -m bench.prefill_served --layers 16 --context 8192 --chunk 256 [--quantize int4 --quantize-experts]

Per chunk:
  served    wall time a chunk, the prompt's chunks back to back (the larger of the host's dispatch
            and the device's work); served x chunks is the prefill part of TTFT
  dispatch  the host's own time to queue a chunk (all queued, none read back)
  span      the device time of one chunk of the prompt's middle run alone (it attends to a cached
            prefix)
On a GPU, a chunk whose CUDA graph XLA re-records (a buffer it touches moved) is served well above
its span; `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3` logs each update. Random
weights. Writes prefill_served.json under $OUT (or ./bench_out); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.step import build_model
from bench.trace import device_trace


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ling-3-flash")
    ap.add_argument("--layers", type=int, default=16, help="keep the first N decoder layers (and NEXTN)")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=256, help="prompt tokens a chunk (the server's --prefill-chunk)")
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None,
                    help="projections (and lm_head) low-bit")
    ap.add_argument("--quantize-experts", action="store_true", help="the routed experts too")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills of the whole prompt (median)")
    args = ap.parse_args(argv)

    from serve.request import Request, Sampling
    from serve.runner import Runner
    from serve.scheduler import Scheduler

    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    model = build_model(args)
    # Room for the alone-timed chunk's repeats, which append past the prompt.
    runner = Runner(model, max_batch=1, max_seq_len=args.context + 12 * args.chunk, speculative_steps=0)
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.context).tolist()
    scheduler = Scheduler(1, args.chunk, eos_id=None)
    scheduler.add(Request(prompt, Sampling(max_tokens=1)))
    plan = []
    while (chunk := scheduler.next_chunk()) is not None:
        plan.append(chunk)

    def prefill_all():
        last = None
        for c in plan:
            last = runner.prefill(c)
        return runner.read_first(last)

    t = time.perf_counter()
    prefill_all()
    print(f"{len(plan)} chunks of {args.chunk}: compiled and run in {time.perf_counter() - t:.0f} s", flush=True)
    prefill_all()  # warm: the chunk programs' buffers are in place from here on
    walls = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        prefill_all()
        walls.append((time.perf_counter() - t) / len(plan))
    t = time.perf_counter()
    last = None
    for c in plan:
        last = runner.prefill(c)
    dispatch = (time.perf_counter() - t) / len(plan)
    runner.read_first(last)
    middle = plan[len(plan) // 2]
    alone = device_trace(lambda: runner.read_first(runner.prefill(middle)), 8, out_dir, log=lambda *a: None)

    served = float(np.median(walls))
    row = dict(chunks=len(plan), chunk=args.chunk, context=args.context, served_us=served * 1e6,
               walls_us=[w * 1e6 for w in walls], dispatch_us=dispatch * 1e6, span_us=alone["span_us"],
               launches=alone.get("launches"), prefill_ms=served * len(plan) * 1e3)
    with open(os.path.join(out_dir, "prefill_served.json"), "w") as f:
        json.dump(dict(args=vars(args), result=row), f, indent=1)
    span = "-" if row["span_us"] is None else f"{row['span_us']:.0f}"
    print(f"\n{'chunks':>7} {'served µs':>10} {'dispatch µs':>12} {'span µs':>8} {'prefill ms':>11}  (walls "
          f"{', '.join(f'{w:.0f}' for w in row['walls_us'])} µs)")
    print(f"{len(plan):>7} {row['served_us']:>10.0f} {row['dispatch_us']:>12.0f} {span:>8} {row['prefill_ms']:>11.1f}")


if __name__ == "__main__":
    main()

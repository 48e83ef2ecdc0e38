"""A prompt arriving beside running streams, as the server drives it: `serve.runner.Runner.iterate`
over --streams decoding slots while one prompt of --context tokens is prefilled in --chunk chunks,
the iterations back to back; the mixed iteration (the chunk and the step as one program, the MoE
one launch over both: `moe.block.DEFAULT_MIXED_LAUNCH`) against the chunk and the step as two programs, in one
process. What the running streams' inter-token latency becomes while a long prompt arrives.

    python -m bench.mixed_served --layers 16 --streams 15 --context 8192 --chunk 256
    python -m bench.mixed_served --model serve/default_model --streams 3 --context 768 --chunk 64   # CPU

Per mode, wall time an iteration (median over the prompt's chunks, each iteration ending when the
device has finished it):
  decode only  the streams' step with no prompt arriving: their inter-token time at rest
  separate     the chunk, then the step, two programs an iteration
  mixed        one program an iteration (`--mixed-iteration on`)
and each mode's ratio to decode only (issue target: the streams' P99 ITL at most 1.3x its value
without arrivals; one iteration is one step of theirs). Random weights for presets. Writes
mixed_served.json under $OUT (or ./bench_out); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def build(args):
    import ling

    if args.model is not None:
        return ling.load(args.model, dtype=args.dtype, progress=False)
    from bench.step import build_model

    return build_model(args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the --preset with random weights)")
    ap.add_argument("--preset", default="ling-3-flash")
    ap.add_argument("--layers", type=int, default=16, help="keep the first N decoder layers (and NEXTN)")
    ap.add_argument("--dtype", default=None, help="with --model: the dtype to load it in (default: as stored)")
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None, help="projections (and lm_head) low-bit")
    ap.add_argument("--quantize-experts", action="store_true", help="the routed experts too")
    ap.add_argument("--streams", type=int, default=15, help="requests decoding while the prompt arrives")
    ap.add_argument("--context", type=int, default=8192, help="the arriving prompt's tokens")
    ap.add_argument("--chunk", type=int, default=256, help="prompt tokens a chunk (the server's --prefill-chunk)")
    ap.add_argument("--spec-steps", type=int, default=5, help="NEXTN draft steps (0: plain decoding)")
    args = ap.parse_args(argv)

    import jax

    from serve.request import Request, Sampling
    from serve.runner import Runner
    from serve.scheduler import Scheduler

    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    model = build(args)
    slots = args.streams + 1
    steps = args.spec_steps if model.nextn is not None else 0
    # every iteration steps all the streams: one batch bucket (all slots) keeps the warm-up to 6 programs
    runner = Runner(model, max_batch=slots, max_seq_len=args.context + 4096, speculative_steps=steps, mixed=True,
                    prefix_entries=0, buckets=())
    t = time.perf_counter()
    runner.warmup_prefill(args.chunk)
    runner.warmup_mixed(args.chunk)
    runner.warmup_step()
    print(f"compiled in {time.perf_counter() - t:.0f} s", flush=True)
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size

    def settle():
        runner.drain()
        jax.block_until_ready(runner.stepper.slots)

    def iteration(sched):
        t0 = time.perf_counter()
        chunk = sched.next_chunk()
        first, _ = runner.iterate(chunk, sched.decoding())
        if first is not None:
            runner.read_first(first)
        jax.block_until_ready(runner.stepper.slots)
        return time.perf_counter() - t0

    results = {}
    for mode in ("decode only", "separate", "mixed"):
        runner.reset()
        runner.mixing = mode == "mixed"
        sched = Scheduler(slots, args.chunk, eos_id=None, mixed=runner.mixing)
        for _ in range(args.streams):  # the streams: short prompts, prefilled, then decoding
            sched.add(Request(rng.integers(2, vocab, 32).tolist(), Sampling(max_tokens=100_000, temperature=0.0)))
        while any(p is not None for p in sched.prefilled) or sched.waiting:
            iteration(sched)
        for _ in range(4):
            iteration(sched)
        settle()
        if mode == "decode only":
            walls = [iteration(sched) for _ in range(-(-args.context // args.chunk))]
        else:
            sched.add(Request(rng.integers(2, vocab, args.context).tolist(), Sampling(max_tokens=1)))
            walls = []
            while True:
                walls.append(iteration(sched))
                if all(p is None for p in sched.prefilled):
                    break
        settle()
        results[mode] = {"iterations": len(walls), "median_ms": float(np.median(walls) * 1e3),
                         "p99_ms": float(np.percentile(walls, 99) * 1e3), "max_ms": float(np.max(walls) * 1e3)}
        print(f"{mode}: {results[mode]}", flush=True)

    base = results["decode only"]["median_ms"]
    with open(os.path.join(out_dir, "mixed_served.json"), "w") as f:
        json.dump({"args": vars(args), "device": jax.devices()[0].device_kind, "results": results}, f, indent=1)
    print(f"\n{args.streams} streams, a {args.context}-token prompt in chunks of {args.chunk}, "
          f"{'speculative ' + str(steps) if steps else 'plain'} ({jax.devices()[0].device_kind})")
    print(f"{'mode':<12} {'iterations':>10} {'median ms':>10} {'p99 ms':>9} {'max ms':>9} {'x decode':>9}")
    for mode, r in results.items():
        print(f"{mode:<12} {r['iterations']:>10} {r['median_ms']:>10.2f} {r['p99_ms']:>9.2f} {r['max_ms']:>9.2f} "
              f"{r['median_ms'] / base:>9.2f}")


if __name__ == "__main__":
    main()

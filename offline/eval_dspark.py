"""Accepted length of NEXTN chain drafting vs the DSpark block drafter on held-out prompts.

    python -m offline.eval_dspark --model serve/default_model

Greedy speculative decoding of --prompts held-out prompts (`offline.eval.heldout_sequences`, the
sequences stored with the checkpoint: files the target and the drafter never trained on) of
--prompt-len tokens, --new-tokens each, in bf16 one prompt at a time as `offline.eval` runs it.
Rows: NEXTN S = 1..7; the block drafter at each block B (--blocks), with and without its
sequential head, with and without confidence scheduling (--threshold: verify the drafts whose
estimated survival is at least that). Accepted length: tokens emitted per verify step, pooled
over the prompts (`spec.generate.mean_accepted_length`); verified: drafts the step verified, on
average (B, or fewer when scheduled); = greedy: prompts whose output equals plain greedy.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import ling
from ling import dspark
from offline.eval import heldout_sequences
from spec.step import BlockDrafter


@dataclasses.dataclass(frozen=True)
class CountingDrafter(BlockDrafter):
    """A BlockDrafter that also reports, through a host callback (evaluation only), how many drafts
    each step verifies."""

    sink: object = dataclasses.field(default=None, compare=False)  # a list the callback appends to

    def __call__(self, model, slots, num_steps, *, sampling):
        out = super().__call__(model, slots, num_steps, sampling=sampling)
        limit = out[3] if len(out) > 3 else jnp.full(slots.done.shape, num_steps, jnp.int32)
        io_callback(lambda lim, live: self.sink.append(np.asarray(lim)[np.asarray(live)]), None,
                                     limit, ~slots.done, ordered=True)
        return out

    def __hash__(self):
        return hash((self.sequential, self.scheduled, self.threshold, self.budget, id(self.sink)))


def run_rows(model, prompts, new_tokens: int, blocks, nextn_steps, threshold: float, log=print) -> list[dict]:
    from spec.generate import generate_batch

    chunk = min(256, -(-max(len(p) for p in prompts) // 64) * 64)
    plain = [generate_batch(model, [p], new_tokens, speculative=False, prefill_chunk=chunk)[0] for p in prompts]

    def measure(name, num_steps, drafter=None, **extra):
        t0 = time.perf_counter()
        produced = steps = same = 0
        for p, ref in zip(prompts, plain):
            out, slots = generate_batch(model, [p], new_tokens, speculative=True, num_steps=num_steps,
                                        drafter=drafter, prefill_chunk=chunk, return_slots=True)
            s, n = jax.device_get((slots.steps.sum(), slots.produced.sum()))
            steps, produced, same = steps + int(s), produced + int(n), same + (out[0] == ref)
        jax.effects_barrier()
        verified = (float(np.concatenate(drafter.sink).mean()) if isinstance(drafter, CountingDrafter)
                    and drafter.sink else float(num_steps))
        row = {"drafter": name, "draft_tokens": num_steps, **extra, "accepted_length": produced / max(steps, 1),
               "verified": verified, "steps": steps, "prompts_matching": same, "seconds": time.perf_counter() - t0}
        log(f"  {name} {num_steps} {extra}: accepted length {row['accepted_length']:.3f}, verified {verified:.2f} "
            f"drafts a step, = greedy {same}/{len(prompts)} ({row['seconds']:.0f} s)", flush=True)
        return row

    rows = [measure("nextn", s) for s in nextn_steps] if model.nextn is not None else []
    if model.dspark is not None:
        for b in blocks:
            for sequential in (True, False):
                for scheduled in (False, True):
                    drafter = CountingDrafter(sequential=sequential, scheduled=scheduled, threshold=threshold,
                                              sink=[])
                    rows.append(measure("dspark", b, drafter, sequential=sequential,
                                        scheduled=threshold if scheduled else None))
    return rows


def table(rows: list[dict], n_prompts: int) -> str:
    lines = ["| drafter | draft tokens (S or B) | sequential head | confidence scheduling | accepted length "
             "| drafts verified a step | = plain greedy |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        seq = "" if r["drafter"] == "nextn" else ("yes" if r["sequential"] else "no")
        sch = "" if r["drafter"] == "nextn" else ("no" if r["scheduled"] is None else f"survival >= {r['scheduled']}")
        lines.append(f"| {r['drafter']} | {r['draft_tokens']} | {seq} | {sch} | {r['accepted_length']:.3f} "
                     f"| {r['verified']:.2f} | {r['prompts_matching']}/{n_prompts} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offline.eval_dspark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="serve/default_model")
    ap.add_argument("--drafter", default=None, help="directory of dspark.json (default: --model)")
    ap.add_argument("--nextn-steps", default="1,2,3,4,5,6,7")
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--threshold", type=float, default=0.5, help="survival threshold of the scheduled rows")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    from offline.train import cpu_deadlock_workaround

    cpu_deadlock_workaround()
    model = ling.load(args.model, dtype=args.dtype, progress=False)
    d = args.drafter or args.model
    if dspark.exists(d):
        model.attach_dspark(dspark.load(d, model.cfg, dtype=jnp.dtype(args.dtype)))
    else:
        print(f"no drafter in {d}: NEXTN rows only", file=sys.stderr)
    seqs = heldout_sequences(args.model)
    width = min(args.prompt_len, seqs.shape[1])
    starts = np.linspace(0, len(seqs) - 1, args.prompts).astype(int)
    prompts = [seqs[i, :width].tolist() for i in starts]
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} new tokens, greedy, {args.dtype}:", flush=True)
    rows = run_rows(model, prompts, args.new_tokens, [int(b) for b in args.blocks.split(",") if b],
                    [int(s) for s in args.nextn_steps.split(",") if s], args.threshold)
    print()
    print(table(rows, len(prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

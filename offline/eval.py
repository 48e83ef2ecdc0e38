"""Evaluate a trained checkpoint: held-out perplexity by weight format, NEXTN speculative
acceptance, and how much the verified positions share their experts (rho).

    python -m offline.eval --model serve/default_model [--record]

- Perplexity: exp(mean next-token NLL) over the held-out sequences stored with the checkpoint
  (`heldout_tokens.npy`, written by `offline.train`; else the held-out split of the corpus, encoded
  with the checkpoint's tokenizer), one prefill per sequence from an empty state, with the weights
  - `bf16`: as stored (bfloat16; router, expert bias, KDA decay and conv fp32);
  - `int8`, `int4`: `ling.load(dir, quantize=...)`, the quantisation issue's grouped codec on every
    projection, dense MLP and shared expert (routed experts, router, embeddings, lm_head and MLA's
    kv_b_proj stay as stored: see `ling.quantize`);
  - `int4+experts`: int4 as above and the routed experts' weights passed through the same codec
    (quantise then dequantise, group min(group, K)): what int4 costs when every MoE weight is 4-bit.
- Accepted length: greedy NEXTN chain speculative decoding (`spec.generate.generate_batch`) of
  --new-tokens tokens after each of --prompts held-out prompts of --prompt-len tokens, for every
  num_steps S in --num-steps; `spec.generate.mean_accepted_length`: tokens emitted per verify step,
  the bonus token included (1 .. S+1). Each row also says how many outputs equal plain greedy, and
  after how many tokens on average they first differ
  (at bf16 a near-tie of the top two logits can round differently in the verify pass than in a
  decode step; the shipped-checkpoint test checks equality at fp32).
- Expert sharing, measured on the same runs: in every verify step of every live slot and every
  target MoE layer, let E_0 .. E_S be the top-k expert sets of the w = S+1 verified tokens
  [last token, d_1 .. d_S] (recomputed from the verify pass's own MoE inputs). Reported:
  `union` = mean |E_0 ∪ .. ∪ E_S| (experts that layer must read in that step; k <= union <= min(E, w k)),
  `jaccard` = mean |∩ E_j| / |∪ E_j|, and rho: the weight-streaming model writes the union of a
  w-wide read as keep = 1 - s^w_eff, w_eff = 1 + (w-1)(1-rho), with s the per-token skip fraction.
  Here s = 1 - k/E and keep = mean union / E, so rho = 1 - (ln(1 - keep)/ln(s) - 1)/(w - 1):
  1 when all positions pick the same experts, 0 when the union is as large as for independently
  routed positions, negative when positions avoid each other's experts. (S = 0 has no rho.)

The figures go to DIR/eval.json (with a quick check value, the bf16 NLL of the first
CHECK_SEQS sequences, that the shipped-checkpoint test reproduces) and, with --record, to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ling
from offline import data
from offline.routing import moe_blocks, routed_ids, tap_moe

VARIANTS = ("bf16", "int8", "int4", "int4+experts")
CHECK_SEQS = 8
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "RESULTS.md")


# ----------------------------------------------------------------------------------------------
# Held-out data and perplexity


def heldout_sequences(model_dir: str, seq_len: int = 512) -> np.ndarray:
    """The held-out sequences [N, T] stored with the checkpoint, or the corpus' held-out split."""
    path = os.path.join(model_dir, data.HELDOUT_FILE)
    if os.path.exists(path):
        return np.load(path).astype(np.int32)
    tok = data.load_tokenizer(model_dir)
    _, held = data.split(data.stdlib_files())
    return data.pack(data.encode(tok, data.read_texts(held)), seq_len)


@functools.partial(jax.jit, static_argnames="graphdef")
def _nll_sum(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    state = ling.init_state(model.cfg, b, t, model.embed_tokens[...].dtype)
    logits, _, _ = model(tokens, state, form="prefill")
    lse = jax.nn.logsumexp(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logits[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(lse - picked)


def mean_nll(model, seqs: np.ndarray, batch: int = 8) -> float:
    """Mean next-token NLL (nats) over seqs [N, T]; the last batch may be smaller."""
    graphdef, params = nnx.split(model)
    total = 0.0
    for i in range(0, len(seqs), batch):
        total += float(_nll_sum(graphdef, params, jnp.asarray(seqs[i:i + batch])))
    return total / (len(seqs) * (seqs.shape[1] - 1))


def quantize_routed_experts(model, *, bits: int = 4, group_size: int = 128):
    """Passes every routed expert's weights through the grouped codec (quantise, dequantise), in place."""
    from pallas_kernels.quant import dequantize, quantize

    def roundtrip(w):  # [E, K, N] (x @ w per expert) -> same, through the codec on [N, K]
        g = min(group_size, w.shape[1])
        out = [dequantize(quantize(w[e].T.astype(jnp.float32), bits=bits, group_size=g)).T for e in range(w.shape[0])]
        return jnp.stack(out).astype(w.dtype)

    for moe in moe_blocks(model):
        moe.w13.set_value(roundtrip(moe.w13[...]))
        moe.w2.set_value(roundtrip(moe.w2[...]))
    return model


def load_variant(model_dir: str, variant: str, group_size: int):
    if variant == "bf16":
        return ling.load(model_dir, dtype="bfloat16", progress=False)
    if variant in ("int8", "int4"):
        return ling.load(model_dir, dtype="bfloat16", progress=False, quantize=variant, group_size=group_size)
    if variant == "int4+experts":
        model = ling.load(model_dir, dtype="bfloat16", progress=False, quantize="int4", group_size=group_size)
        return quantize_routed_experts(model, bits=4, group_size=group_size)
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


# ----------------------------------------------------------------------------------------------
# Speculative decoding and expert sharing


class SharingRecorder:
    """A NEXTN-chain drafter that also routes the verify step's tokens and sends, per target MoE
    layer and slot, |∪| and |∩| of their expert sets to the host (`jax.debug.callback`)."""

    def __init__(self):
        self.union: list[np.ndarray] = []  # [L] per live (step, slot)
        self.inter: list[np.ndarray] = []

    def _receive(self, union, inter, live):
        live = np.asarray(live, bool)
        for b in np.nonzero(live)[0]:
            self.union.append(np.asarray(union)[:, b])
            self.inter.append(np.asarray(inter)[:, b])

    def drafter(self, model, slots, num_steps: int, *, sampling: bool):
        from spec.step import nextn_chain

        drafts, q, cache = nextn_chain(model, slots, num_steps, sampling=sampling)
        verify = jnp.concatenate([slots.last_token[:, None], drafts], axis=1)  # [B, S+1]
        copy = nnx.merge(*nnx.split(model))
        taps = tap_moe(copy)
        copy(verify, slots.model, form="verify")  # the verify pass's MoE inputs; its outputs are unused
        unions, inters = [], []
        for moe, inputs in taps:
            if not inputs:  # the NEXTN layer's block: not part of the verify pass
                continue
            ids = routed_ids(moe, inputs[0])  # [B, S+1, k]
            picked = jax.nn.one_hot(ids, moe.gate_weight.shape[0], dtype=jnp.int32).max(axis=2)  # [B, S+1, E]
            unions.append(picked.max(axis=1).sum(-1))
            inters.append(picked.min(axis=1).sum(-1))
        jax.debug.callback(self._receive, jnp.stack(unions), jnp.stack(inters), ~slots.done)
        return drafts, q, cache

    def figures(self, num_experts: int, top_k: int, width: int) -> dict:
        if not self.union:
            return {"union": float("nan"), "jaccard": float("nan"), "rho": float("nan"), "samples": 0}
        u = np.stack(self.union).astype(np.float64)  # [N, L]
        i = np.stack(self.inter).astype(np.float64)
        keep = min(u.mean() / num_experts, 1 - 1e-9)
        s = 1 - top_k / num_experts
        rho = 1 - (math.log(1 - keep) / math.log(s) - 1) / (width - 1) if width > 1 else float("nan")
        return {"union": float(u.mean()), "jaccard": float((i / u).mean()), "rho": rho,
                "rho_by_layer": [1 - (math.log(1 - min(x / num_experts, 1 - 1e-9)) / math.log(s) - 1) / (width - 1)
                                 for x in u.mean(0)] if width > 1 else [],
                "samples": int(u.shape[0])}


def speculative_figures(model, prompts: list[list[int]], new_tokens: int, num_steps: list[int], *,
                        log=print) -> tuple[list[dict], list[list[int]]]:
    """One row per S: the pooled mean accepted length (`spec.generate.mean_accepted_length`'s
    produced / steps, summed over the prompts), expert sharing, and whether every output equals
    plain greedy. Prompts run one slot at a time: XLA:CPU (jax 0.10) cannot run the absorbed MLA
    reference's batched bf16 dot ("bhtl,blr->bthr", B > 1), and the slots are independent anyway."""
    from spec.generate import generate_batch

    chunk = min(256, -(-max(len(p) for p in prompts) // 64) * 64)  # one prefill chunk, not 256 padded tokens
    plain = [generate_batch(model, [p], new_tokens, speculative=False, prefill_chunk=chunk)[0] for p in prompts]
    moes = moe_blocks(model)
    e, k = (moes[0].gate_weight.shape[0], moes[0].top_k) if moes else (1, 1)
    rows = []
    for s in num_steps:
        t0 = time.perf_counter()
        rec = SharingRecorder()
        produced = steps = same = agree = 0
        for p, ref in zip(prompts, plain):
            out, slots = generate_batch(model, [p], new_tokens, speculative=True, num_steps=s, return_slots=True,
                                        drafter=rec.drafter, prefill_chunk=chunk)
            n_steps, n_produced = jax.device_get((slots.steps.sum(), slots.produced.sum()))
            steps, produced = steps + int(n_steps), produced + int(n_produced)
            same += out[0] == ref
            agree += next((i for i, (a, b) in enumerate(zip(out[0], ref)) if a != b), min(len(out[0]), len(ref)))
        jax.effects_barrier()
        row = {"num_steps": s, "accepted_length": produced / max(steps, 1), "verify_steps": steps,
               "matches_greedy": same == len(prompts), "prompts_matching": same,
               "mean_agreeing_prefix": agree / len(prompts), **rec.figures(e, k, s + 1), "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"  S={s}: accepted length {row['accepted_length']:.3f}, union {row['union']:.2f} of {e}, "
            f"rho {row['rho']:.3f}, = greedy: {same}/{len(prompts)} prompts, first difference at "
            f"{row['mean_agreeing_prefix']:.0f} tokens on average ({row['seconds']:.0f} s)", flush=True)
    return rows, plain


# ----------------------------------------------------------------------------------------------
# Report


def table(result: dict) -> str:
    lines = ["| weights | held-out NLL (nats/token) | perplexity | vs bf16 |", "|---|---|---|---|"]
    base = result["perplexity"].get("bf16", {}).get("ppl")
    for name, r in result["perplexity"].items():
        rel = f"{(r['ppl'] / base - 1) * 100:+.2f}%" if base else ""
        lines.append(f"| {name} | {r['nll']:.4f} | {r['ppl']:.3f} | {rel} |")
    e, k = result["routing"]["num_experts"], result["routing"]["top_k"]
    lines += ["", f"| num_steps S | mean accepted length | union of experts per layer (of {e}; top-{k}) "
              "| jaccard ∩/∪ | rho | prompts = plain greedy | tokens before the first difference |",
              "|---|---|---|---|---|---|---|"]
    n = result["prompts"]["count"]
    for r in result["speculative"]:
        lines.append(f"| {r['num_steps']} | {r['accepted_length']:.3f} | {r['union']:.2f} | {r['jaccard']:.3f} "
                     f"| {r['rho']:.3f} | {r['prompts_matching']}/{n} | {r['mean_agreeing_prefix']:.0f} |")
    return "\n".join(lines)


def record(result: dict, path: str = RESULTS) -> None:
    p = result["prompts"]
    text = (f"\n## ling-small: held-out perplexity, NEXTN acceptance, expert sharing\n\n"
            f"{result['date']}, {result['device']} (jax {result['jax']}, Python {result['python']}). Model "
            f"`{result['model']}` ({result['n_params'] / 1e6:.2f} M parameters). Command: `{result['command']}`.\n"
            f"Perplexity over {result['heldout_tokens']} held-out tokens ({result['heldout_seqs']} sequences of "
            f"the Python stdlib's held-out files); quantised projections at group {result['group_size']}. "
            f"Speculative rows: greedy, {p['count']} held-out prompts of {p['length']} tokens, {p['new_tokens']} "
            f"new tokens each; union / jaccard / rho over every verify step, live slot and target MoE layer "
            f"(definitions: `ling/eval.py`).\n\n{table(result)}\n")
    with open(path, "a") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offline.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint written by `python -m offline.train`")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"weight formats (default {','.join(VARIANTS)})")
    ap.add_argument("--seqs", type=int, default=64, help="held-out sequences for perplexity (default 64)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=None,
                    help="quantisation group (default: train_meta.json's int_group, else 128)")
    ap.add_argument("--num-steps", default="1,2,3,4,5,6,7", help="draft lengths S (comma-separated)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--record", action="store_true", help=f"append the table to {os.path.relpath(RESULTS)}")
    args = ap.parse_args(argv)
    from offline.train import cpu_deadlock_workaround

    cpu_deadlock_workaround()
    t_start = time.perf_counter()
    meta_path = os.path.join(args.model, "train_meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    group = args.group_size or meta.get("int_group", 128)
    seqs = heldout_sequences(args.model)
    check = seqs[:CHECK_SEQS]
    seqs = seqs[: args.seqs]
    result = {"model": os.path.normpath(args.model), "date": datetime.date.today().isoformat(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": sys.version.split()[0],
              "command": "python -m offline.eval " + " ".join(sys.argv[1:] if argv is None else argv),
              "heldout_seqs": int(len(seqs)), "heldout_tokens": int(len(seqs) * (seqs.shape[1] - 1)),
              "group_size": group, "perplexity": {}}

    print(f"perplexity over {len(seqs)} held-out sequences of {seqs.shape[1]} tokens:", flush=True)
    for variant in [v for v in args.variants.split(",") if v]:
        t0 = time.perf_counter()
        model = load_variant(args.model, variant, group)
        nll = mean_nll(model, seqs, args.batch)
        result["perplexity"][variant] = {"nll": nll, "ppl": math.exp(nll)}
        if variant == "bf16":
            result["check"] = {"seqs": int(len(check)), "batch": CHECK_SEQS, "nll": mean_nll(model, check, CHECK_SEQS)}
        print(f"  {variant}: NLL {nll:.4f}, perplexity {math.exp(nll):.3f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)

    model = load_variant(args.model, "bf16", group)
    result["n_params"] = sum(int(x.size) for x in jax.tree_util.tree_leaves(nnx.split(model)[1]))
    moes = moe_blocks(model)
    result["routing"] = {"num_experts": moes[0].gate_weight.shape[0] if moes else 0,
                         "top_k": moes[0].top_k if moes else 0, "moe_layers": len(moes)}
    width = min(args.prompt_len, seqs.shape[1])
    starts = np.linspace(0, len(seqs) - 1, args.prompts).astype(int)
    prompts = [seqs[i, :width].tolist() for i in starts]
    result["prompts"] = {"count": len(prompts), "length": width, "new_tokens": args.new_tokens}
    steps = [int(s) for s in args.num_steps.split(",") if s]
    print(f"speculative decoding, {len(prompts)} prompts x {args.new_tokens} new tokens:", flush=True)
    result["speculative"], _ = speculative_figures(model, prompts, args.new_tokens, steps)
    result["seconds"] = time.perf_counter() - t_start

    with open(os.path.join(args.model, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(table(result))
    if args.record:
        record(result)
        print(f"\nappended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

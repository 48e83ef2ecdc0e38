"""Run a model once: prefill a prompt, decode greedily, print the tokens and timings.

    python -m ling [--model ling-tiny | HUB_DIR | CONVERTED_DIR] [--prompt-ids 1,2,3] [--steps 16]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import ling
from ling.model import apply


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ling-tiny", help=f"preset ({', '.join(sorted(ling.config.PRESETS))}), "
                    "hub directory or converted directory (default: ling-tiny, random weights)")
    ap.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids (default: 32 random ids)")
    ap.add_argument("--steps", type=int, default=16, help="greedy decode steps (default 16)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", choices=["int8", "int4", "int2"], default=None, help="grouped low-bit projections")
    ap.add_argument("--group-size", type=int, default=128, help="input columns per scale (default 128)")
    ap.add_argument("--ep-size", type=int, default=1, help="shard the routed experts over this many devices")
    ap.add_argument("--coordinator-address", default=None, help="multi-host: JAX coordinator host:port")
    ap.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    ap.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    args = ap.parse_args(argv)
    from moe.parallel import initialize_distributed

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    try:
        model = ling.load(args.model, dtype=args.dtype, seed=args.seed, quantize=args.quantize,
                           group_size=args.group_size, ep_size=args.ep_size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = model.cfg
    if args.prompt_ids:
        try:
            prompt = np.array([int(x) for x in args.prompt_ids.split(",")], np.int32)
        except ValueError:
            print(f"error: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
        if prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
            print(f"error: --prompt-ids must lie in [0, {cfg.vocab_size}), the vocabulary", file=sys.stderr)
            return 2
    else:
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, 32).astype(np.int32)

    dtype = model.embed_tokens[...].dtype
    state = ling.init_state(cfg, 1, len(prompt) + args.steps, dtype)
    t0 = time.perf_counter()
    logits, _, state = apply(model, jnp.asarray(prompt)[None], state, form="prefill")
    token = jnp.argmax(logits[:, -1], axis=-1)[:, None]
    jax.block_until_ready(token)
    t_prefill = time.perf_counter() - t0
    out, times = [int(token[0, 0])], []
    for _ in range(args.steps - 1):
        t0 = time.perf_counter()
        logits, _, state = apply(model, token, state, form="decode")
        token = jnp.argmax(logits[:, -1], axis=-1)[:, None]
        out.append(int(token[0, 0]))
        times.append(time.perf_counter() - t0)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model))
    print(f"model      {args.model} ({cfg.model_type}, {cfg.num_hidden_layers} layers: "
          f"{cfg.layer_types.count('kda')} KDA + {cfg.layer_types.count('mla')} MLA, {n_params / 1e6:.2f} M params, "
          f"{dtype}, on {jax.devices()[0].platform})")
    print(f"prompt     {len(prompt)} tokens: {prompt.tolist()}")
    print(f"greedy     {out}")
    print(f"prefill    {t_prefill * 1e3:.1f} ms (first call includes compilation)")
    if len(times) > 1:
        print(f"decode     {np.median(times[1:]) * 1e3:.2f} ms/token median (eager host loop, one jit call per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

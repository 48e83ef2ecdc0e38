"""`python -m serve.run`: an OpenAI-compatible HTTP server over the (speculative) decoding engine.

    python -m serve.run [--model DIR_OR_PRESET] [--host 127.0.0.1] [--port 30000]
                        [--speculative-num-steps N] [--max-batch B] [--max-seq-len L] [--api-key KEY]
                        [--quantize int8|int4|int2 [--quantize-experts] [--quantize-lm-head]]
                        [--dtype bfloat16|float32] [--prefill-chunk C]
                        [--tile-model PATH --tpot-slo-ms MS] [--num-layers N]
                        [--prefix-cache-gb G] [--prefix-cache-interval N] [--disable-prefix-cache]
                        [--mixed-iteration auto|on|off] [--num-scheduler-steps N]

With no --model it serves serve/default_model: ling-small, a 15 M-parameter Ling-architecture model
trained by `python -m offline.train` on the Python standard library's sources, and its tokenizer. Start-up loads the tokenizer and the model and compiles the prefill chunk and the
decode step (JAX's persistent compilation cache makes a restart skip the compiling), then prints
one line with the address.

With --tile-model (a fitted moe.tiles.TileModel of the --mixed-moe launch: `python -m bench.fused_moe
--profile-tiles --profile-launch grouped|tiles`) and
--tpot-slo-ms, the prefill chunk is sized per iteration: --prefill-chunk wide when no request
decodes, else the widest power-of-two width (>= 16, or of --chunk-widths) the model predicts to keep an
iteration (decode step + chunk) within the budget, or where none does the widest within 10% of the
narrowest's iteration (`moe.tiles.ChunkSizer`); every such width is compiled at start-up.

With --mixed-iteration on (auto: with the Pallas kernels), an iteration that prefills one prompt
while other requests decode runs the chunk and their step as one program: attention apart, each
MoE layer one launch over both kinds of tokens (--mixed-moe: the grouped GEMM, or the tile-scheduled
kernel with the decode tokens' tiles first), so a long prompt arriving holds the running streams
back less (`serve.runner.Runner.mixable`).

The prefix cache (on unless --disable-prefix-cache) keeps checkpoints of prefilled prompts, every
--prefix-cache-interval tokens, and of finished requests, in a pool of --prefix-cache-gb on the
device; a new request restores its prompt's longest checkpoint and prefills only the rest (a
chat's next turn, a shared system prompt). Prefill chunks then end on multiples of the interval.

With --num-scheduler-steps N, while no prompt is being prefilled a call runs N decode (or
speculative) steps on the device, so the host's dispatch of the step is paid once for N of them;
tokens then stream N steps at a time, and a prompt that arrives waits for the call in flight.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import time

import uvicorn

from serve.memory import PREFIX_CPU_GB, PREFIX_SHARE, check_memory, memory_plan, plan_prefix_cache

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
DEFAULT_MODEL_NAME = "ling-default"
DEFAULT_CACHE = os.path.join("~", ".cache", "ling-serve", "jax")
DEFAULT_SPEC_STEPS = 5
# Defaults by platform (max_batch, max_seq_len cap, prefill_chunk): on a CPU the smaller slots and
# chunks keep a newcomer's first request near a second with the embedded model on 2 cores.
DEFAULTS = {"gpu": (16, 8192, 256), "cpu": (4, 1024, 64)}
# The cache lengths a call is compiled for by default (`--context-buckets auto`), as (smallest,
# factor); each rung costs a compiled prefill chunk (and on a CPU a step) per batch bucket. On a
# GPU only the prefill's prefix loop follows the cache's length (the decode kernel reads live
# positions): one short rung for the common short prompt. On a CPU the embedded model's attention
# is a small part of a step (bench/RESULTS.md): rungs only from 4096 on.
CONTEXT_LADDER = {"gpu": (2048, 1 << 30), "cpu": (4096, 4)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m serve.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="converted directory (python -m ling.convert), hub directory "
                    "(config.json + safetensors + tokenizer.json) or preset name; default: the embedded tiny model")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (and tokenizer_config.json); "
                    "default: the model directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' (default: the "
                    "model directory's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on the start-up line)")
    ap.add_argument("--speculative-num-steps", type=int, default=None,
                    help=f"NEXTN draft steps per verify (0 = plain decoding; default {DEFAULT_SPEC_STEPS} when the "
                    "model has a NEXTN layer, else 0)")
    ap.add_argument("--speculative-algorithm", default="nextn", choices=["nextn", "dspark"],
                    help="drafter: nextn (the model's NEXTN layer, chained) or dspark (the block drafter stored "
                    "next to the model, `python -m offline.train_dspark`; default nextn)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                    help="tokens drafted per verify: the NEXTN steps, or the DSpark block (default: "
                    "--speculative-num-steps for nextn, the drafter's trained block for dspark)")
    ap.add_argument("--speculative-draft-model-path", default=None,
                    help="directory of the DSpark drafter (dspark.json; default: the model directory)")
    ap.add_argument("--speculative-token-map", default=None, metavar="PATH",
                    help="draft over these tokens only: a file of token ids (.npy, .json or .txt; `python -m "
                    "offline.token_map` counts a corpus into one); a draft step then reads their rows of the "
                    "lm_head instead of all of it. Output is unchanged; acceptance may fall (default: the whole "
                    "vocabulary)")
    ap.add_argument("--speculative-confidence-threshold", type=float, default=None,
                    help="dspark: verify only the drafts whose estimated survival (confidence head) is at least "
                    "this, chosen on the device each step (default: verify the whole block)")
    ap.add_argument("--speculative-verify-budget", type=int, default=None,
                    help="dspark: drafts verified per step shared by all decoding slots, the likeliest to "
                    "survive first (default: no budget)")
    ap.add_argument("--max-batch", type=int, default=None, help="state slots: requests decoded at once (default 16 "
                    "on an accelerator, 4 on CPU)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="context length per request, prompt + output "
                    "(default: the model's max_position_embeddings, at most 8192 on an accelerator, 1024 on CPU)")
    ap.add_argument("--batch-buckets", default="auto", help="batch sizes the decode step is compiled for, "
                    "comma-separated; a step runs the smallest that holds the decoding requests (default auto: "
                    "powers of two up to --max-batch; off: every step runs all --max-batch slots)")
    ap.add_argument("--context-buckets", default="auto", help="cache lengths the prefill chunk (and, where "
                    "attention reads the whole cache, the step) is compiled for, comma-separated; a call runs the "
                    "shortest that holds its requests' tokens (default auto: 2048 on a GPU, 4096, 16384, ... on "
                    "CPU; off: always --max-seq-len)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per slot per prefill chunk "
                    "(with --tile-model: the widest chunk; default 256 on an accelerator, 64 on CPU)")
    ap.add_argument("--mixed-moe", default="grouped", choices=["tiles", "grouped"], help="a mixed iteration's MoE: "
                    "the union's tokens through the grouped GEMM as any others of their count (default: the faster "
                    "per expert tile), or one tile-scheduled launch with the decode rows' tiles first "
                    "(`moe.block.MIXED_LAUNCHES`)")
    ap.add_argument("--mixed-iteration", default="auto", choices=["auto", "on", "off"], help="run a chunk of one "
                    "prompt and the step of the requests decoding beside it as one program, the MoE over both kinds "
                    "of tokens in one launch (--mixed-moe) (default auto: on with the Pallas kernels; off on the "
                    "plain-jnp reference a CPU runs, which gains nothing from one launch and whose programs add "
                    "~40 s to the first start; off: two programs, for comparison)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1, help="decode (or speculative) steps a call runs "
                    "on the device while no prompt is being prefilled and no request asks for log-probabilities "
                    "(default 1; more pays the host's dispatch of a step once for that many, where it bounds the "
                    "step, and streams tokens that many steps at a time)")
    ap.add_argument("--ticket-sums", default="auto", choices=["auto", "on", "off"], help="a kernel whose programs each "
                    "hold a share of a sum (the split-K matvecs, the router, the MoE at one token) finishes the sum in "
                    "its own launch, the last program of each output taking an atomic ticket: fewer launches a step, "
                    "a shorter dispatch, a slightly longer device span (default auto: on with one device's Pallas "
                    "kernels)")
    ap.add_argument("--tile-model", default=None, metavar="PATH", help="fitted MoE tile model (JSON from "
                    "python -m bench.fused_moe --profile-tiles [--profile-launch grouped]: of the --mixed-moe "
                    "launch): size prefill chunks to --tpot-slo-ms")
    ap.add_argument("--tpot-slo-ms", type=float, default=None, help="with --tile-model: the budget of one iteration "
                    "(a decode step and the prefill chunk beside it), milliseconds")
    ap.add_argument("--chunk-widths", default=None, metavar="W,W,..", help="with --tile-model: the chunk widths "
                    "compiled at start-up and chosen from (each <= --prefill-chunk, which is always one; default: the "
                    "powers of two from 16 below it); fewer widths, a shorter start-up")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="weights and activations (default auto: bfloat16 on an accelerator, float32 on CPU, where "
                    "XLA has no bf16 x bf16 -> f32 dot)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "pallas", "interpret", "reference"],
                    help="kernel backend the model is built with (default auto: the Pallas kernels on a GPU, their "
                    "plain-jnp references elsewhere; LING_KERNELS may set auto's choice)")
    ap.add_argument("--quantize", default=None, choices=["int8", "int4", "int2"], help="low-bit weights (ling.load)")
    ap.add_argument("--group-size", type=int, default=128, help="input columns per scale with --quantize (default 128)")
    ap.add_argument("--quantize-experts", action="store_true", help="with --quantize int4 / int8: the routed "
                    "experts too, in the fused MoE kernel's format")
    ap.add_argument("--mem-fraction", type=float, default=0.92, help="share of each GPU's memory JAX takes for "
                    "weights, slots and workspace (XLA_PYTHON_CLIENT_MEM_FRACTION, which wins when set; default 0.92)")
    ap.add_argument("--quantize-lm-head", action="store_true", help="with --quantize: the lm_head too")
    ap.add_argument("--quantize-layout", default="tiles", choices=["tiles", "rows"], help="with --quantize int4|int8 "
                    "(groups of 128): the layout of the projections, lm_head, MLPs and experts; rows: the "
                    "tensor-core kernels in Triton (needs jax-triton, the gpu extra); tiles: the Pallas kernels "
                    "(default)")
    ap.add_argument("--ep-size", type=int, default=1, help="shard the routed experts over this many devices")
    ap.add_argument("--coordinator-address", default=None, help="multi-host: JAX coordinator host:port")
    ap.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    ap.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and the "
                    "profiler endpoints")
    ap.add_argument("--max-request-bytes", type=int, default=8 << 20, help="largest request body; larger ones "
                    "get 413 before they are read (default 8 MiB)")
    ap.add_argument("--max-queue", type=int, default=None, help="requests that may wait for a slot; beyond, new ones "
                    "get 429 with Retry-After (default: no limit)")
    ap.add_argument("--request-timeout", type=float, default=None, help="seconds a request may take from arrival, "
                    "queueing included; it ends with 408 or, streaming, an error event (default: no limit; a "
                    "request's own 'timeout' field may ask for less)")
    ap.add_argument("--shutdown-grace", type=float, default=30.0, help="on SIGINT/SIGTERM: seconds running requests "
                    "may go on before each ends with an error event (default 30; new requests get 503)")
    ap.add_argument("--log-requests", action="store_true", help="an access line per request on stderr (id, "
                    "prompt and completion tokens, TTFT, duration, finish reason)")
    ap.add_argument("--iteration-log", default=None, metavar="PATH", help="a JSON line per decode step read "
                    "back: the time since the last, what ran beside it (chunk tokens, mixed or not, prompts ended) "
                    "and the tile model's prediction (serve/iterations.py; its summary traces a latency tail)")
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True, help="after start-up, "
                    "keep every object made so far out of the garbage collector's scans (gc.freeze): a full "
                    "collection otherwise walks the model's and the tokenizer's objects while every thread waits, "
                    "a pause the streams feel between tokens (default on; --no-gc-freeze to compare)")
    ap.add_argument("--profile-dir", default="profiles", help="where /start_profile writes traces (default "
                    "./profiles; a request body may name another)")
    ap.add_argument("--compile-cache", default=DEFAULT_CACHE, help="JAX persistent compilation cache directory "
                    f"(default {DEFAULT_CACHE}; '' turns it off)")
    ap.add_argument("--prefix-cache-gb", type=float, default=None, help="the prefix cache's pool on the device, GB "
                    f"(default: {PREFIX_SHARE:g} of the memory left after the weights and slots on an accelerator, "
                    f"{PREFIX_CPU_GB:g} on CPU)")
    ap.add_argument("--prefix-cache-interval", type=int, default=None, help="tokens between two checkpoints of a "
                    "prompt; prefill chunks end on its multiples (default: the platform's prefill chunk, 256 on an "
                    "accelerator, 64 on CPU)")
    ap.add_argument("--disable-prefix-cache", action="store_true", help="no prefix cache: every prompt is "
                    "prefilled whole")
    ap.add_argument("--seed", type=int, default=0, help="weight seed for a preset (random weights)")
    ap.add_argument("--num-layers", type=int, default=None, help="with a preset: only its first N decoder layers "
                    "(and the NEXTN layer), random weights, so that a cut of a large model fits for benchmarks "
                    "(python -m serve.bench)")
    args = ap.parse_args(argv)
    if (args.tile_model is None) != (args.tpot_slo_ms is None):
        ap.error("--tile-model and --tpot-slo-ms go together")
    if (args.quantize_experts or args.quantize_lm_head) and args.quantize is None:
        ap.error("--quantize-experts and --quantize-lm-head take the bits of --quantize (int4 or int8)")
    if args.quantize_layout == "rows" and (args.quantize not in ("int4", "int8") or args.group_size != 128):
        ap.error("--quantize-layout rows holds int4 or int8 in groups of 128: use --quantize int4|int8 --group-size 128")
    if args.batch_buckets not in ("auto", "off"):
        try:
            sizes = sorted({int(x) for x in args.batch_buckets.split(",")})
        except ValueError:
            ap.error(f"--batch-buckets takes auto, off or comma-separated sizes, got {args.batch_buckets!r}")
        if sizes[0] < 1 or args.max_batch is not None and sizes[-1] > args.max_batch:
            ap.error(f"--batch-buckets sizes must lie in [1, --max-batch {args.max_batch}], got {args.batch_buckets}")
    if args.prefix_cache_gb is not None and not 0 <= args.prefix_cache_gb < float("inf"):
        ap.error(f"--prefix-cache-gb must be a number of GB >= 0, got {args.prefix_cache_gb}")
    if args.context_buckets not in ("auto", "off"):
        try:
            lengths = sorted({int(x) for x in args.context_buckets.split(",")})
        except ValueError:
            ap.error(f"--context-buckets takes auto, off or comma-separated lengths, got {args.context_buckets!r}")
        if lengths[0] < 1:
            ap.error(f"--context-buckets lengths must be at least 1, got {args.context_buckets}")
    if not 0 < args.mem_fraction <= 1:
        ap.error(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    if args.iteration_log is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.iteration_log))):
        ap.error(f"--iteration-log {args.iteration_log}: its directory does not exist")
    if args.ticket_sums == "on" and args.ep_size > 1:
        ap.error(f"--ticket-sums on: the counters serve one device's kernels; --ep-size {args.ep_size} shards the "
                 "experts (use auto or off)")
    if args.tpot_slo_ms is not None and args.tpot_slo_ms <= 0:
        ap.error(f"--tpot-slo-ms must be positive, got {args.tpot_slo_ms}")
    if args.chunk_widths is not None:
        if args.tile_model is None:
            ap.error("--chunk-widths applies with --tile-model (the widths it chooses from)")
        try:
            args.chunk_widths = sorted({int(w) for w in args.chunk_widths.split(",")})
        except ValueError:
            ap.error(f"--chunk-widths takes comma-separated integers, got {args.chunk_widths!r}")
        if args.chunk_widths[0] < 1:
            ap.error(f"--chunk-widths must be positive, got {args.chunk_widths}")
    if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
        ap.error(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    if not 0 <= args.shutdown_grace < float("inf"):
        ap.error(f"--shutdown-grace must be a number of seconds >= 0, got {args.shutdown_grace}")
    if (args.speculative_num_steps is not None and args.speculative_num_draft_tokens is not None
            and args.speculative_num_steps != args.speculative_num_draft_tokens):
        ap.error(f"--speculative-num-steps {args.speculative_num_steps} and --speculative-num-draft-tokens "
                 f"{args.speculative_num_draft_tokens} disagree (both are the tokens drafted per verify)")
    if args.speculative_algorithm != "dspark":
        for name in ("speculative_draft_model_path", "speculative_confidence_threshold", "speculative_verify_budget"):
            if getattr(args, name) is not None:
                ap.error(f"--{name.replace('_', '-')} applies to --speculative-algorithm dspark only")
    if args.speculative_confidence_threshold is not None and not 0 <= args.speculative_confidence_threshold <= 1:
        ap.error(f"--speculative-confidence-threshold must lie in [0, 1], got {args.speculative_confidence_threshold}")
    for name, low in (("max_batch", 1), ("prefill_chunk", 1), ("max_seq_len", 2), ("speculative_num_steps", 0),
                      ("speculative_num_draft_tokens", 0), ("speculative_verify_budget", 1),
                      ("num_layers", 1), ("max_request_bytes", 1), ("max_queue", 0),
                      ("prefix_cache_interval", 1), ("num_scheduler_steps", 1)):
        v = getattr(args, name)
        if v is not None and v < low:
            ap.error(f"--{name.replace('_', '-')} must be at least {low}, got {v}")
    return args


class StartupError(Exception):
    """A start-up step failed; the message says which and why."""


def platform_defaults(args, platform: str) -> int:
    """Fills --max-batch and --prefill-chunk left out with the platform's defaults (`DEFAULTS`)
    and checks --batch-buckets against the batch; returns the cap on the default --max-seq-len."""
    max_batch, seq_cap, chunk = DEFAULTS[platform]
    args.max_batch = args.max_batch or max_batch
    args.prefill_chunk = args.prefill_chunk or chunk
    args.prefix_cache_interval = args.prefix_cache_interval or chunk
    if args.batch_buckets not in ("auto", "off") and max(map(int, args.batch_buckets.split(","))) > args.max_batch:
        raise StartupError(f"--batch-buckets {args.batch_buckets}: sizes must lie in [1, --max-batch {args.max_batch}]")
    return seq_cap


def ticket_sums(args, model) -> bool:
    """Whether the step's split sums finish in their kernels' own launches (--ticket-sums; `on` with
    --ep-size > 1 is refused by parse_args)."""
    parallel = getattr(model, "mesh", None) is not None
    return args.ticket_sums == "on" or (args.ticket_sums == "auto" and model.kernels == "pallas" and not parallel)


def context_ladder(args, platform: str, max_seq_len: int) -> tuple[int, ...]:
    """The cache lengths below max_seq_len that the calls are compiled for (--context-buckets)."""
    from spec.stepper import context_buckets

    if args.context_buckets == "off":
        return ()
    if args.context_buckets == "auto":
        smallest, factor = CONTEXT_LADDER[platform]
        return context_buckets(max_seq_len, smallest, factor)[:-1]
    return tuple(c for c in sorted({int(x) for x in args.context_buckets.split(",")}) if c < max_seq_len)


def _enable_compile_cache(path: str) -> None:
    import jax

    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _attach_dspark(args, model, steps):
    """Loads the DSpark drafter (`ling.dspark`), attaches it, drops the NEXTN layer (its cache would
    be kept for nothing); returns (the step's drafter, the block). StartupError if it is missing or
    does not fit the model or the block."""
    import jax.numpy as jnp

    from ling import dspark
    from spec.step import BlockDrafter

    where = args.speculative_draft_model_path or args.model
    try:
        d = dspark.load(where, model.cfg, dtype=jnp.dtype(args.dtype))
    except (OSError, ValueError) as e:
        raise StartupError(f"--speculative-algorithm dspark: {e}") from None
    block = d.cfg.block_size if steps is None else steps
    if not 1 <= block <= d.cfg.block_size:
        raise StartupError(f"--speculative-num-draft-tokens {block}: the DSpark drafter in {where} drafts blocks "
                           f"of 1 to {d.cfg.block_size}")
    model.attach_dspark(d)
    model.nextn = None
    threshold, budget = args.speculative_confidence_threshold, args.speculative_verify_budget
    scheduled = threshold is not None or budget is not None
    return BlockDrafter(scheduled=scheduled, threshold=threshold or 0.0, budget=budget or 0), block


def _attach_token_map(args, model, steps, bar) -> None:
    """--speculative-token-map: the drafters' reduced vocabulary (`ling.draft_vocab`), placed as the
    model is. StartupError when the file is unusable or does not fit the model's vocabulary."""
    from ling.build import place
    from ling.draft_vocab import load_token_map

    if not steps:
        bar.write("warning: --speculative-token-map without speculative decoding: ignored", file=sys.stderr)
        return
    try:
        ids = load_token_map(args.speculative_token_map, model.cfg.vocab_size)
    except (OSError, ValueError) as e:
        raise StartupError(f"--speculative-token-map: {e}") from None
    place(model.attach_draft_vocab(ids).draft_vocab, model.mesh)
    bar.write(f"draft vocabulary: {ids.size} of {model.cfg.vocab_size} tokens ({args.speculative_token_map}), "
              f"{model.draft_vocab.nbytes / 1e6:.0f} MB", file=sys.stderr)


def _load_model(args):
    import ling

    return ling.load(args.model, dtype=args.dtype, seed=args.seed, quantize=args.quantize,
                     group_size=args.group_size, quantize_experts=args.quantize_experts,
                     quantize_lm_head=args.quantize_lm_head, ep_size=args.ep_size,
                     num_layers=args.num_layers, progress=sys.stderr.isatty(), kernels=args.kernels,
                     quantize_layout=args.quantize_layout)


def chunk_sizer(args, cfg, mixed: bool | None = None):
    """The moe.tiles.ChunkSizer of --tile-model / --tpot-slo-ms for the model config cfg, or None
    without them. StartupError when the file is unusable, was fitted for other experts, or, where
    mixed iterations run (mixed; default: unless --mixed-iteration off), on another launch than
    --mixed-moe."""
    if args.tile_model is None:
        return None
    from ling.config import MOE
    from moe.tiles import ChunkSizer, TileModel, chunk_candidates

    try:
        tm = TileModel.load(args.tile_model)
    except (OSError, ValueError) as e:
        raise StartupError(f"--tile-model: {e}") from None
    layers = sum(t == MOE for t in cfg.mlp_types)
    if layers == 0:
        raise StartupError("--tile-model: the model has no MoE layer to size chunks by")
    if (tm.n_experts, tm.top_k) != (cfg.num_experts, cfg.num_experts_per_tok):
        raise StartupError(f"--tile-model {args.tile_model} was fitted for {tm.n_experts} experts top-{tm.top_k}; "
                           f"the model has {cfg.num_experts} experts top-{cfg.num_experts_per_tok}")
    launch = tm.info.get("launch", "tiles")  # the MoE launch the model was fitted on
    mixed = args.mixed_iteration != "off" if mixed is None else mixed  # whether mixed iterations run
    if mixed and launch != args.mixed_moe:
        raise StartupError(f"--tile-model {args.tile_model} models the {launch} launch, but a mixed iteration's MoE "
                           f"is --mixed-moe {args.mixed_moe}: fit its model (python -m bench.fused_moe --profile-tiles "
                           f"--profile-launch {args.mixed_moe}) or pass --mixed-moe {launch}")
    widths = chunk_candidates(args.prefill_chunk)
    if args.chunk_widths is not None:
        if args.chunk_widths[-1] > args.prefill_chunk:
            raise StartupError(f"--chunk-widths {','.join(map(str, args.chunk_widths))}: widths must be at most "
                               f"--prefill-chunk {args.prefill_chunk}")
        widths = sorted(set(args.chunk_widths) | {args.prefill_chunk})
    return ChunkSizer(tm, args.tpot_slo_ms * 1e3, tuple(widths), rows=args.max_batch, layers=layers)


@dataclasses.dataclass
class Loaded:
    tokenizer: object
    model: object
    runner: object
    max_seq_len: int
    speculative_steps: int
    sizer: object = None  # moe.tiles.ChunkSizer or None


def start(args, bar) -> Loaded:
    """Tokenizer, model, slots, then the compiled prefill chunk and decode step; `bar` advances by
    one per stage."""
    import jax

    from moe.block import use_mixed_launch
    from serve.runner import Runner
    from serve.tokenizer import Tokenizer

    tok_dir = args.tokenizer or args.model
    if not os.path.isdir(tok_dir):
        import ling

        if args.model in ling.config.PRESETS:
            raise StartupError(f"--model {args.model} is a preset, with no tokenizer: pass --tokenizer DIR")
        raise StartupError(f"--model {args.model!r}: no such directory (nor a preset: "
                           f"{', '.join(sorted(ling.config.PRESETS))})")
    bar.set_description("tokenizer")
    try:
        tokenizer = Tokenizer(tok_dir)
    except (OSError, ValueError) as e:
        raise StartupError(f"tokenizer: {e}") from None
    bar.update()

    bar.set_description("model")
    from moe.parallel import initialize_distributed

    initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    _enable_compile_cache(args.compile_cache)
    platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
    if args.dtype == "auto":
        args.dtype = "float32" if platform == "cpu" else "bfloat16"
    seq_cap = platform_defaults(args, platform)
    try:
        model = _load_model(args)
    except (OSError, ValueError) as e:
        raise StartupError(f"--model {args.model}: {e}") from None
    cfg = model.cfg
    if tokenizer.vocab_size > cfg.vocab_size:
        raise StartupError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                           f"{cfg.vocab_size}: they do not belong together")
    max_seq_len = args.max_seq_len or min(cfg.max_position_embeddings, seq_cap)
    if max_seq_len > cfg.max_position_embeddings:
        raise StartupError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                           f"{cfg.max_position_embeddings}")
    steps = args.speculative_num_steps if args.speculative_num_draft_tokens is None else \
        args.speculative_num_draft_tokens
    drafter = None
    if args.speculative_algorithm == "dspark":
        drafter, steps = _attach_dspark(args, model, steps)
        if not args.disable_prefix_cache:  # a restored slot would keep a stale drafter cache
            bar.write("warning: the prefix cache does not hold the DSpark drafter's cache: prefix cache off",
                      file=sys.stderr)
            args.disable_prefix_cache = True
    elif steps is None:
        steps = DEFAULT_SPEC_STEPS if model.nextn is not None else 0
    elif steps > 0 and model.nextn is None:
        bar.write("warning: the model has no NEXTN layer: speculative decoding is off", file=sys.stderr)
        steps = 0
    if args.speculative_token_map is not None:
        _attach_token_map(args, model, steps, bar)
    mixed = args.mixed_iteration == "on" or (args.mixed_iteration == "auto" and model.kernels != "reference")
    sizer = chunk_sizer(args, cfg, mixed)
    memory = memory_plan(model, max_seq_len=max_seq_len, speculative_steps=steps,
                         prefix_interval=0 if args.disable_prefix_cache else args.prefix_cache_interval)
    try:
        plan_prefix_cache(memory, args)
        check_memory(memory, args.max_batch, max_seq_len)
    except ValueError as e:
        raise StartupError(str(e)) from None
    bar.write(memory.describe(args.max_batch), file=sys.stderr)
    bar.update()

    bar.set_description(f"slots ({args.max_batch} x {max_seq_len})")
    buckets = {"auto": None, "off": ()}.get(args.batch_buckets) if args.batch_buckets in ("auto", "off") else \
        tuple(int(x) for x in args.batch_buckets.split(","))
    use_mixed_launch(model, args.mixed_moe)
    runner = Runner(model, max_batch=args.max_batch, max_seq_len=max_seq_len, speculative_steps=steps,
                    buckets=buckets, contexts=context_ladder(args, platform, max_seq_len),
                    prefix_entries=memory.prefix_entries, prefix_interval=args.prefix_cache_interval,
                    drafter=drafter, mixed=mixed, steps_per_call=args.num_scheduler_steps,
                    tickets=ticket_sums(args, model))
    bar.update()
    try:
        bar.set_description("compiling prefill")
        for width in (sizer.candidates if sizer is not None else (args.prefill_chunk,)):
            runner.warmup_prefill(width)
            runner.warmup_mixed(width)  # the chunk beside a step (--mixed-iteration)
        runner.warmup_copy()  # the slot copy of n > 1 choices
        runner.warmup_prefix()  # the prefix cache's save and restore
        bar.update()
        bar.set_description("compiling decode step")
        runner.warmup_step()
        bar.update()
    except Exception as e:  # the model cannot run here (dtype, memory, kernels): say so, no traceback
        raise StartupError(f"the warm-up step failed ({args.dtype}, {args.max_batch} slots x {max_seq_len} "
                           f"tokens): {type(e).__name__}: {e}") from None
    return Loaded(tokenizer, model, runner, max_seq_len, steps, sizer)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))  # read when JAX starts
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.log_requests:
        access = logging.getLogger("serve.access")
        access.setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access.addHandler(handler)
        access.propagate = False

    default = args.model is None
    args.model = DEFAULT_MODEL if default else args.model
    name = args.served_model_name or (DEFAULT_MODEL_NAME if default else
                                      os.path.basename(os.path.normpath(args.model)))
    try:
        with _stages(total=5) as bar:
            s = start(args, bar)
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import jax

    from serve.api import ServerInfo, create_app
    from serve.engine import Engine
    from serve.iterations import IterationLog
    from serve.metrics import Metrics
    from serve.profiler import Profiler

    cfg, tokenizer = s.model.cfg, s.tokenizer
    eos_id = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.token_id(tokenizer.eos_token)
    metrics = Metrics(name)
    iterations = None if args.iteration_log is None else IterationLog(args.iteration_log, s.sizer,
                                                                       s.runner.stepper.width)
    engine = Engine(s.runner, tokenizer, metrics, chunk=args.prefill_chunk, eos_id=eos_id,
                    stop_ids=tokenizer.stop_token_ids(args.tokenizer or args.model), sizer=s.sizer,
                    iterations=iterations)
    app = create_app(engine, tokenizer, metrics, Profiler(args.profile_dir),
                     ServerInfo(model_name=name, max_seq_len=s.max_seq_len, vocab_size=cfg.vocab_size,
                                api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                                max_queue=args.max_queue, request_timeout=args.request_timeout,
                                shutdown_grace=args.shutdown_grace))
    decoding = (f"speculative {args.speculative_algorithm} {s.speculative_steps} draft tokens" if s.speculative_steps
                else "plain decoding")
    prefix = (f"prefix cache every {args.prefix_cache_interval} tokens" if s.runner.pool is not None
              else "no prefix cache")
    mixing = "mixed iterations" if s.runner.mixing else "separate prefill and decode calls"
    about = (f"{args.max_batch} slots x {s.max_seq_len} tokens, {decoding}, {prefix}, {mixing}, {args.dtype}"
             f"{', ' + args.quantize if args.quantize else ''}, {jax.devices()[0].platform}")
    if args.gc_freeze:
        freeze_heap()
    engine.start()
    # uvicorn waits for open responses a little longer than the grace: by then each has ended itself.
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=args.shutdown_grace + 5),
                     lambda host, port: f"ling-serve: serving '{name}' at http://{host}:{port} ({about})",
                     app.state.ctx)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    finally:
        engine.shutdown()
    return 0 if server.started else 1


def freeze_heap() -> int:
    """Collects once, then moves every object left to the collector's permanent generation
    (`gc.freeze`): later collections scan only what serving allocates, and the start-up's objects
    are still freed by reference counting. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _Server(uvicorn.Server):
    """Prints the one start-up line once the socket listens (so the address already answers). On
    SIGINT/SIGTERM it stops listening and the API stops admitting, while running requests go on
    for --shutdown-grace seconds; a second Ctrl-C exits at once."""

    def __init__(self, config, banner, ctx):
        super().__init__(config)
        self.banner, self.ctx = banner, ctx

    async def startup(self, sockets=None):
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(self.banner(host, port), flush=True)

    def handle_exit(self, sig, frame) -> None:
        if self.ctx.shutdown_at is None and self.started:
            self.ctx.begin_shutdown()
            print(f"ling-serve: shutting down; running requests have {self.ctx.info.shutdown_grace:g} s to finish",
                  file=sys.stderr, flush=True)
        super().handle_exit(sig, frame)


class _PlainStages:
    """The start-up stages as plain lines, for logs (stderr not a terminal): no carriage returns."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.monotonic()

    def set_description(self, desc: str) -> None:
        print(f"ling-serve: [{self.n + 1}/{self.total}] {desc} ({time.monotonic() - self.t0:.0f} s)",
              file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stages(total: int):
    """A progress bar of the start-up stages on a terminal, plain lines otherwise."""
    if not sys.stderr.isatty():
        return _PlainStages(total)
    from tqdm import tqdm

    return tqdm(total=total, unit="stage", file=sys.stderr, leave=False,
                bar_format="{desc:<28} {bar} {n_fmt}/{total_fmt} [{elapsed}]")


if __name__ == "__main__":
    sys.exit(main())

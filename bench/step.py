"""The decode step as the server drives it, on the GPU: `spec.stepper.Stepper` dispatching step k+1
before it reads step k's tokens, back to back, for the plain decode step, the verify pass and the
whole speculative step; beside each, what the device did (JAX profiler), and the floor.

    python -m bench.step --preset ling-3-flash --layers 16 [--context 512] [--steps 32]
    python -m bench.step --layers 16 --quantize int4 --quantize-experts      # + lm_head in int4
    python -m bench.step --layers 16 --quantize int4 --quantize-experts --quantize-layout rows
                                                      # the tensor-core Triton kernels (jax-triton)
    python -m bench.step --layers 42 --quantize int4 --quantize-experts   # the whole model (~73 GB built)
    python -m bench.step ... --tickets        # cross-program sums in the kernels' own launches
    python -m bench.step ... --steps-per-call 4   # 4 steps a dispatch (the server's --num-scheduler-steps)
    python -m bench.step ... --tickets both --steps-per-call 1 4   # every variant, one model built
    python -m bench.step ... --batch 16 --slots 17 --modes chunk mixed   # a 256-token prefill chunk
                                     # alone, and beside the speculative step of 16 live slots
    python -m bench.step ... --batch 16 --slots 17 --modes mixed --tile-model PATH   # the tile model's
                                     # step_overhead_us: the mixed iteration outside its MoE launches
    python -m bench.step --tile-model PATH --from-json step.json   # the same from an earlier run
    python -m bench.step ... --modes mixed --mixed-moe tiles   # the tile-scheduled launch (default: grouped GEMM)
    python -m bench.step ... --modes mixed --chunk 16 256 --mixed-moe tiles grouped   # each pair
    python -m bench.step ... --modes spec --draft-vocab 0 32768   # drafts over the whole vocabulary,
                                     # then over 32768 tokens (`ling.draft_vocab`)

Random weights, batch 1 (`--batch B`: B slots, all live; `--slots N` holds N slots, the first B
live and stepped in a batch bucket of B rows, as the server steps them), a prompt of --context tokens prefilled
first. Per mode:
  served   wall-clock time a step, K steps back to back through the Stepper (what a client waits
           for: the host's dispatch and the device's work overlap, so it is the larger of the two)
  dispatch the host's own time to queue a step (K steps queued, none read back); mode mixed
           queues through `Stepper.step`, which reads the previous call's report: its figure
           includes that wait for the device
  span     the device time of one step run alone (first kernel's start to last kernel's end)
  host     the host's events while it dispatches K steps (profiler), by name: where dispatch goes
  stream   over the K back-to-back steps, a step's share of the device span, of kernel busy time
           and of idle time between kernels (host round trips and dispatch gaps show up here)
  launches kernels a step, and device time a step by category (kernel names: projections,
           attention kernels, MoE, sort/top-k, other XLA glue)
  copies   the copies of 8 MB or more in the compiled program (`big_copies`): a slot state
           copied whole is a buffer the compiler could not update in place
With --steps-per-call N each dispatch runs N steps on the device; every figure is still a step's
(a call's divided by N; "alone" is then a call of N steps run alone, / N).
Modes chunk and mixed time the server's prefill chunk (`spec.stepper.ChunkPrefiller`) of --chunk
new tokens of one prompt in slot --batch (the first idle one, prefilled with --context tokens
first; each chunk goes on from the last): alone, and in the mixed iteration beside the step of
the live slots (speculative with --num-steps > 0, else plain), one program (`Stepper.dispatch`
with a chunk). Their floor counts the weights and the experts of the chunk's tokens (and the
step's) once.
The floor is `ling.roofline`'s bytes at the copy ceiling measured in the same run. The verify
pass is the target's forward over S + 1 tokens and the commit, without drafting or acceptance.
Writes step.json (all figures and kernel tables) under $OUT (or ./bench_out); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import copy_ceiling_tbs
from bench.step_categories import big_copies, by_category, hlo_scopes
from bench.trace import device_trace, host_table, stream_trace


def build_model(args):
    import ling

    t = time.perf_counter()
    model = ling.load(args.preset, num_layers=args.layers, quantize=args.quantize,
                      quantize_experts=args.quantize_experts, quantize_lm_head=args.quantize is not None,
                      quantize_layout=args.quantize_layout)
    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    gb = sum(x.nbytes for x in leaves) / 1e9
    stats = jax.devices()[0].memory_stats() or {}
    peak = f", device peak {stats['peak_bytes_in_use'] / 1e9:.1f} GB" if "peak_bytes_in_use" in stats else ""
    print(f"weights {gb:.1f} GB made in {time.perf_counter() - t:.0f} s{peak}", flush=True)
    return model


def floors(cfg, args, bw: float, chunk: int, draft_vocab: int = 0) -> dict:
    from ling.roofline import step_bytes

    bits = {None: 16, "int8": 8, "int4": 4}[args.quantize]
    s, ctx, b = args.num_steps, args.context, args.batch

    def nbytes(t, nextn=False, batch=b):
        # Routed experts stay bf16 unless --quantize-experts: count them at their stored width.
        q = step_bytes(cfg, t, ctx, weight_bits=bits, batch=batch, nextn=nextn)
        if args.quantize and not args.quantize_experts:
            full = step_bytes(cfg, t, ctx, batch=batch, nextn=nextn)
            return q.total - q.experts + full.experts
        return q.total

    nextn_only = lambda t: nbytes(t, nextn=True) - nbytes(t)  # noqa: E731
    # a draft step's lm_head: the draft vocabulary's rows (and its [V] int32 slot map), or all V
    rows = draft_vocab or cfg.vocab_size
    lm_head = rows * cfg.hidden_size * (2 if bits == 16 else (bits + 16 / 128) / 8)
    lm_head += 4 * cfg.vocab_size if draft_vocab else 0
    drafting = s * (nextn_only(1) + lm_head) + nextn_only(s + 1)
    width = s + 1 if s > 0 else 1  # the mixed iteration's step: speculative with S > 0
    return {"decode": nbytes(1) / bw, "verify": nbytes(s + 1) / bw, "spec": (nbytes(s + 1) + drafting) / bw,
            "chunk": nbytes(chunk, batch=1) / bw,
            "mixed": (nbytes(chunk + b * width, batch=1) + (drafting if s > 0 else 0)) / bw}


def calibrate(path: str, run: dict, results: dict, device: str) -> None:
    """Sets the tile model at `path`'s overhead outside its MoE launches so that
    `moe.tiles.ChunkSizer` predicts the measured mixed iterations whole. Each mixed result of the
    launch the model was fitted on (its info's launch: the tile-scheduled kernel, or the grouped
    GEMM) gives rest(C) = served - layers x the model's own launch time at the iteration's
    expected x_moe (its decode and chunk tokens, uniform routing). Chunks of two or more widths:
    rest(C) = step_overhead_us + chunk_us_per_token * C fitted by least squares (a slope below 0,
    noise, taken as 0); one width: the model's chunk_us_per_token kept and step_overhead_us set to
    match it. Prints, beside each, that kernel's measured time a layer (every launch of it in the
    trace, the NEXTN layer's and, for the grouped GEMM, the drafting steps' too: an upper bound on
    the layers' launches). run: this script's arguments (as step.json keeps them)."""
    from ling.config import MOE, preset
    from moe.tiles import TileModel, fit_overhead

    tm = TileModel.load(path)
    launch = tm.info.get("launch", "tiles")
    # a step.json of one launch and chunk width keeps them in its arguments only
    ran = run.get("mixed_moe") or "tiles"  # a step.json from before the flag: the tile kernel
    ran = ran if isinstance(ran, str) else ran[0]
    width = run["chunk"] if isinstance(run["chunk"], int) else run["chunk"][0]
    same = [n for n in results if n.startswith("mixed") and (results[n].get("mixed_moe") or ran) == launch]
    if not same:
        print(f"--tile-model: {path} models the {launch} launch; no mixed iteration ran it; {path} unchanged")
        return
    layers = sum(t == MOE for t in preset(run["preset"]).mlp_types[:run["layers"]])
    decode = run["batch"] * (run["num_steps"] + 1 if run["num_steps"] > 0 else 1)
    category = {"tiles": "tile-scheduled MoE", "grouped": "grouped GEMM MoE"}[launch]
    points = []  # (name, chunk, served, x_moe, rest, measured MoE µs)
    for name in sorted(same, key=lambda n: results[n].get("chunk") or width):
        r = results[name]
        chunk = r.get("chunk") or width
        x = tm.expected_tiles(decode + chunk)
        measured = sum(us for c, (_, us) in by_category(r["stream"]["kernels"], {}).items() if c.startswith(category))
        points.append((name, chunk, r["served_us"], x, r["served_us"] - layers * tm.launch_us(x), measured))
    info = dict(step_overhead=dict(
        layers=layers, decode_tokens=decode, device=device,
        points=[dict(mode=n, chunk=c, served_us=us, x_moe=x, rest_us=o, kernel_us=m) for n, c, us, x, o, m in points]))
    fitted = fit_overhead(tm, [(decode, c, us) for _, c, us, *_ in points], layers=layers, info=info)
    if len({p[1] for p in points}) > 1 and fitted.chunk_us_per_token == 0:
        print("--tile-model: the overhead falls with the chunk: taken as fixed")
    fitted.save(path)
    for name, chunk, served, x, _, measured in points:
        predicted = fitted.iteration_us(decode_tiles=0, prefill_tiles=0, layers=layers, union_tiles=x,
                                        chunk_tokens=chunk)
        print(f"--tile-model: the {name} iteration {served:.0f} µs, predicted {predicted:.0f} "
              f"({predicted / served - 1:+.1%}); the model's launch at x_moe {x:.0f} {tm.launch_us(x):.0f} µs a "
              f"layer x {layers} (the trace's {category} kernels: {measured / layers:.0f} µs a layer, every launch)")
    print(f"--tile-model: step_overhead_us {fitted.step_overhead_us:.0f} + chunk_us_per_token "
          f"{fitted.chunk_us_per_token:.2f} x chunk "
          f"written to {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ling-3-flash")
    ap.add_argument("--layers", type=int, default=16, help="keep the first N decoder layers (and NEXTN)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens prefilled before stepping")
    ap.add_argument("--batch", type=int, default=1, help="live slots stepped")
    ap.add_argument("--slots", type=int, default=None,
                    help="slots the step holds (default --batch): with more, the live ones run in a batch bucket of "
                         "--batch rows (the server's --max-batch with --batch-buckets), the others idle")
    ap.add_argument("--steps", type=int, default=32, help="K: steps back to back per measurement")
    ap.add_argument("--num-steps", type=int, default=5, help="S: NEXTN draft steps per speculative step")
    ap.add_argument("--modes", nargs="+", default=["decode", "verify", "spec"],
                    choices=["decode", "verify", "spec", "chunk", "mixed"])
    ap.add_argument("--chunk", type=int, nargs="+", default=[256],
                    help="prompt tokens of a prefill chunk (modes chunk, mixed); several: each measured")
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None,
                    help="low-bit projections and lm_head (ling.quantize)")
    ap.add_argument("--quantize-experts", action="store_true", help="the routed experts too")
    ap.add_argument("--quantize-layout", choices=["tiles", "rows"], default="tiles",
                    help="low-bit weights' layout: rows (tensor-core Triton kernels) or tiles (Pallas)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling of every slot (0: greedy)")
    ap.add_argument("--tickets", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                    help="sums across a kernel's programs in its own launch (pallas_kernels.tickets); both: "
                         "the decode and speculative steps measured without and with them")
    ap.add_argument("--steps-per-call", type=int, nargs="+", default=[1],
                    help="decode / speculative steps a dispatch runs on the device (spec.stepper.Stepper); "
                         "several: each measured")
    ap.add_argument("--mixed-moe", nargs="+", default=["grouped"], choices=["tiles", "grouped"],
                    help="mode mixed: the MoE over both kinds of tokens (as serve.run's --mixed-moe); both: each "
                         "measured")
    ap.add_argument("--tile-model", metavar="PATH",
                    help="with mode mixed: complete this tile model (bench.fused_moe --profile-tiles --tile-fmt "
                         "int4 [--profile-launch grouped]) with the iteration's time outside its MoE launches (its "
                         "step_overhead_us), and print the model's MoE time a layer against the measured one")
    ap.add_argument("--from-json", metavar="STEP_JSON", help="with --tile-model: take the mixed iteration from "
                    "this step.json (a run with mode mixed) instead of measuring")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[0], metavar="N",
                    help="drafts over N tokens (`ling.draft_vocab`: N random ids, for timing; 0: the whole "
                         "vocabulary); several: each, for modes spec and mixed")
    ap.add_argument("--mem-fraction", type=float, default=0.92,
                    help="share of the GPU's memory JAX takes, as serve.run's (XLA_PYTHON_CLIENT_MEM_FRACTION wins "
                         "when set): the whole model in int4 needs ~73 GB while it is built")
    args = ap.parse_args()
    if args.tile_model:  # before minutes of building the model
        from moe.tiles import TileModel

        try:
            TileModel.load(args.tile_model)
        except (OSError, ValueError) as e:
            ap.error(f"--tile-model: {e}")
    if args.from_json:
        if not args.tile_model:
            ap.error("--from-json goes with --tile-model")
        try:
            with open(args.from_json) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"--from-json: {e}")
        if not any(n.startswith("mixed") for n in doc.get("results", {})):
            ap.error(f"--from-json {args.from_json}: no mode mixed in it")
        calibrate(args.tile_model, doc["args"], doc["results"], doc.get("device", "?"))
        return
    if min(args.steps_per_call) < 1:
        ap.error(f"--steps-per-call must be at least 1, got {args.steps_per_call}")
    args.slots = args.batch if args.slots is None else args.slots
    if args.slots < args.batch:
        ap.error(f"--slots must be at least --batch ({args.batch}), got {args.slots}")
    if args.slots > args.batch and "verify" in args.modes:
        ap.error("the verify pass runs every slot: leave it out of --modes with --slots")
    chunked = {"chunk", "mixed"} & set(args.modes)
    if args.tile_model and "mixed" not in args.modes:
        ap.error("--tile-model takes its overhead from mode mixed: add it to --modes")
    if chunked and args.slots <= args.batch:
        ap.error(f"modes {', '.join(sorted(chunked))} prefill slot --batch beside the live ones: give --slots > --batch")
    if any(not 0 <= n for n in args.draft_vocab):
        ap.error(f"--draft-vocab must be 0 (the whole vocabulary) or a token count, got {args.draft_vocab}")
    if not 0 < args.mem_fraction <= 1:
        ap.error(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))  # read when JAX starts
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="bench_step_")  # traces and the compilation cache: not results

    from moe.block import use_mixed_launch
    from pallas_kernels.backend import resolve
    from spec.step import new_slots
    from spec.stepper import ChunkPrefiller, Stepper
    from spec.generate import chunk_for, prefill
    from spec.sampling import SamplingParams

    bw = copy_ceiling_tbs() * 1e12
    model = build_model(args)
    cfg = model.cfg
    print(f"device {jax.devices()[0].device_kind}; kernels {resolve()}; {args.preset} cut to {cfg.num_hidden_layers} "
          f"layers + NEXTN; weights {args.quantize or 'bf16'}{' (experts too)' if args.quantize_experts else ''}; "
          f"batch {args.batch} ({args.slots} slots), context {args.context}; copy ceiling {bw / 1e12:.2f} TB/s", flush=True)
    s, k, b, n_slots = args.num_steps, args.steps, args.batch, args.slots
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(n_slots)]
    live = np.arange(n_slots) < b  # the slots stepped: the first --batch
    chunk_slot = np.arange(n_slots) == b  # the slot a prefill chunk goes on in (modes chunk, mixed)
    chunked = bool({"chunk", "mixed"} & set(args.modes))
    # The step variants measured (ticket sums, steps a call), and each one's label in the tables.
    variants = [(t, n) for t in {"off": [False], "on": [True], "both": [False, True]}[args.tickets]
                for n in args.steps_per_call]
    label = lambda mode, t, n: mode if len(variants) == 1 else f"{mode}{' tickets' if t else ''} x{n}"  # noqa: E731
    max_new = (3 * k + 8) * (s + 1) * max(args.steps_per_call)
    params = SamplingParams.make(n_slots, temperature=args.temperature, seed=1)
    # Room for the chunks run between two resets (k timed, two to warm up) after the prompt.
    room = max(max_new + s + 2, (k + 4) * max(args.chunk) if chunked else 0)

    def fresh():
        slots = new_slots(model, n_slots, args.context + room, max_new + s + 1)
        return prefill(model, slots, prompts, live | chunk_slot if chunked else live, params,
                       np.full(n_slots, max_new), np.full(n_slots, -1), chunk=chunk_for(prompts))

    graphdef, weights = nnx.split(model)

    def verify_fn(p, slots):
        from ling.state import commit

        m = nnx.merge(graphdef, p)
        toks = (slots.last_token[:, None] + 7919 * jnp.arange(s + 1)[None]) % cfg.vocab_size  # distinct: real routing
        logits, _, pending = m(toks, slots.model, form="verify")
        state = commit(pending, jnp.where(slots.done, 0, s + 1))
        return slots.replace(model=state, last_token=jnp.argmax(logits[:, -1], -1).astype(jnp.int32))

    verify = jax.jit(verify_fn, donate_argnums=1)
    prefiller = ChunkPrefiller(model) if chunked else None

    def chunk_args(width):
        """A chunk's arguments (`ChunkPrefiller`): width more (new random) tokens of slot --batch's prompt."""
        tokens = rng.integers(0, cfg.vocab_size, (2, 1, width))
        return dict(start=np.zeros(1, np.int32), params=SamplingParams.make(1, on_host=True),
                    max_new=np.full(1, max_new),
                    eos=np.full(1, -1), tokens=tokens[0], next_tokens=tokens[1], valid=np.full(1, width),
                    ends=np.zeros(1, bool), sampling=False, rows=np.array([b], np.int32))
    jax.config.update("jax_compilation_cache_dir", os.path.join(scratch, "jax_cache"))  # the HLO read compiles again
    results = {}

    def save():
        with open(os.path.join(out_dir, "step.json"), "w") as f:
            json.dump(dict(args=vars(args), copy_tbs=bw / 1e12, device=jax.devices()[0].device_kind, results=results),
                      f, indent=1)

    single = ("verify", "chunk")  # no Stepper of their own: one program a call, timed through one()
    # (mode, ticket sums, steps a call, chunk width, mixed launch, draft vocabulary) of each measurement
    drafting = ("spec", "mixed") if s > 0 else ("spec",)
    runs = [(mode, t, n, c, launch, dv) for mode in args.modes
            for t, n in ([(False, 1)] if mode in single else [(t, 1) for t in dict(variants)] if mode == "mixed"
                         else variants)
            for c in (args.chunk if mode in ("chunk", "mixed") else [None])
            for launch in (args.mixed_moe if mode == "mixed" else [None])
            for dv in (args.draft_vocab if mode in drafting else [0])]
    for mode, tickets, per_step, width, launch, dv in runs:  # per_step: steps a call
        model.attach_draft_vocab(np.sort(rng.choice(cfg.vocab_size, dv, replace=False)) if dv else None)
        name = mode if mode in single else label(mode, tickets, per_step)
        if width is not None and len(args.chunk) > 1:
            name += f" {width}"
        if launch is not None and len(args.mixed_moe) > 1:
            name += f" {launch}"
        if mode in drafting and len(args.draft_vocab) > 1:
            name += f" vocab {dv or cfg.vocab_size}"
        fl = floors(cfg, args, bw, width or 0, dv)
        if mode == "chunk":
            holder = {"slots": fresh()}

            def one():
                holder["slots"] = prefiller(holder["slots"], **chunk_args(width))[0]

            def sync():
                jax.block_until_ready(holder["slots"].model.lengths)

            lowered = prefiller.lower(holder["slots"], prefiller.prepare(holder["slots"], **chunk_args(width)))
        elif mode == "mixed":
            use_mixed_launch(model, launch)  # read when the Stepper's program is traced, below
            stepper = Stepper(model, fresh(), speculative=s > 0, num_steps=max(s, 1), tickets=tickets, buckets=(b,))
            holder = {"stepper": stepper}

            def one(stepper=stepper):
                stepper.step(live=live, chunk=prefiller.prepare(stepper.slots, **chunk_args(width)), steps=1)

            sync = stepper.drain
            lowered = stepper.lower(live=live, chunk=prefiller.prepare(stepper.slots, **chunk_args(width)))
        elif mode == "verify":
            holder = {"slots": fresh()}

            def one():
                holder["slots"] = verify(weights, holder["slots"])

            def sync():
                jax.block_until_ready(holder["slots"].last_token)

            lowered = verify.lower(weights, holder["slots"])
        else:
            stepper = Stepper(model, fresh(), speculative=mode == "spec", num_steps=s, tickets=tickets,
                              steps_per_call=per_step, buckets=(b,))
            holder = {"stepper": stepper}
            one, sync = (lambda: stepper.step(live=live)), stepper.drain
            lowered = stepper.lower(live=live)
        t = time.perf_counter()
        one(), one(), sync()  # compile, warm up
        print(f"{name}: compiled in {time.perf_counter() - t:.0f} s", flush=True)

        def reset():  # fresh slots, their prefill finished and two steps run before any timing starts
            slots = fresh()
            jax.block_until_ready(slots)
            if mode in single:
                holder["slots"] = slots
            else:
                holder["stepper"].slots = slots
            one(), one(), sync()  # new slots are new addresses: the step's CUDA graph is updated once, here

        def back_to_back():
            for _ in range(k):
                one()
            sync()

        reset()
        walls = []
        for _ in range(3):
            reset()
            t = time.perf_counter()
            back_to_back()
            walls.append((time.perf_counter() - t) / k / per_step)
        served = float(np.median(walls))
        reset()  # the host's own time to dispatch a step: k dispatches queued, none read back
        t = time.perf_counter()
        queue = one if mode in ("verify", "chunk", "mixed") else (lambda: holder["stepper"].dispatch(live=live))
        for _ in range(k):
            queue()
        dispatch = (time.perf_counter() - t) / k / per_step
        sync() if mode in single else jax.block_until_ready(holder["stepper"].slots)
        reset()
        host = host_table(lambda: [queue() for _ in range(k)], k * per_step, scratch)
        sync() if mode in single else (holder["stepper"].drain(), jax.block_until_ready(holder["stepper"].slots))
        reset()
        stream = stream_trace(back_to_back, k * per_step, scratch)
        reset()
        alone = device_trace(lambda: (one(), sync()), 8, scratch, log=lambda *a: None)
        if alone.get("span_us") is not None:
            alone["span_us"] /= per_step
        produced = None
        if mode == "spec":
            sl = holder["stepper"].slots
            produced = float(jax.device_get(sl.produced.sum())) / max(float(jax.device_get(sl.steps.sum())), 1.0)
        results[name] = dict(served_us=served * 1e6, dispatch_us=dispatch * 1e6, span_us=alone.get("span_us"),
                             stream=stream, host=host[:40], sequence=alone.get("sequence"),
                             floor_us=fl[mode] * 1e6, tokens_per_step=produced, walls_us=[w * 1e6 for w in walls],
                             chunk=width, mixed_moe=launch, draft_vocab=dv)
        hlo = lowered.compile().as_text()
        cats = by_category(stream["kernels"], hlo_scopes(hlo))
        copies = results[name]["big_copies"] = big_copies(hlo)
        if stream["span_us"] is None:
            print(f"{name}: served {served * 1e6:.0f} µs a step; no device kernels in the trace (not a GPU?)")
            results[name]["categories"] = cats
            save()
            continue
        reps = ", ".join(f"{w * 1e6:.0f}" for w in walls)
        print(f"{name}: served {served * 1e6:.0f} µs a step (repetitions {reps}), "
              f"host dispatch {dispatch * 1e6:.0f}; alone span "
              f"{alone['span_us']:.0f} µs; stream: span "
              f"{stream['span_us']:.0f}, busy {stream['busy_us']:.0f}, idle {stream['idle_us']:.0f} µs, "
              f"{stream['launches']:.0f} launches a step; floor {fl[mode] * 1e6:.0f} µs", flush=True)
        for c, (n, us) in sorted(cats.items(), key=lambda kv: -kv[1][1]):
            print(f"    {c:<36} {n:6.0f} launches {us:8.0f} µs", flush=True)
        for r in stream["kernels"][:12]:
            print(f"      {r['name'][:64]:64s} x{r['count']:5.1f} {r['us_per_call']:8.1f} µs", flush=True)
        if copies:
            print(f"    copies of 8 MB or more in the program: {len(copies)}, "
                  f"{sum(c['bytes'] for c in copies) / 1e6:.0f} MB", flush=True)
            for c in copies[:6]:
                print(f"      {c['shape']:28s} {c['bytes'] / 1e6:8.1f} MB  {c['op_name'][-60:]}", flush=True)
        print("    the host's dispatch, by event (inclusive µs a step):", flush=True)
        for r in host[:16]:
            print(f"      {r['name'][:64]:64s} x{r['count']:5.1f} {r['us_per_call']:8.1f} µs", flush=True)
        results[name]["categories"] = cats
        save()  # after each measurement: a run cut short keeps what it measured

    layers = cfg.num_hidden_layers
    print(f"\n{'mode':<22} {'served':>9} {'dispatch':>9} {'span':>9} {'busy':>9} {'idle':>8} {'launch':>7} "
          f"{'/layer':>7} {'floor':>8} {'floor/served':>12} {'tok/step':>8}")
    for mode, r in results.items():
        st, tps = r["stream"], r["tokens_per_step"]
        if st["span_us"] is None:
            continue
        print(f"{mode:<22} {r['served_us']:>7.0f}µs {r['dispatch_us']:>7.0f}µs {r['span_us']:>7.0f}µs "
              f"{st['busy_us']:>7.0f}µs {st['idle_us']:>6.0f}µs {st['launches']:>7.0f} "
              f"{st['launches'] / layers:>7.1f} {r['floor_us']:>6.0f}µs {r['floor_us'] / r['served_us']:>12.2f} "
              f"{'' if tps is None else f'{tps:.2f}':>8}")
    if args.tile_model:
        calibrate(args.tile_model, vars(args), results, jax.devices()[0].device_kind)
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"device memory: peak {stats['peak_bytes_in_use'] / 1e9:.1f} GB of {stats['bytes_limit'] / 1e9:.1f} GB")


if __name__ == "__main__":
    main()

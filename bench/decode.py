"""Decode benchmark on the GPU: prefill, plain decode step, speculative step (draft / verify /
extend), each against its roofline floor at the copy bandwidth measured in the same run.

    python -m bench.decode --preset ling-3-flash --layers 16 [--prompt 1024] [--iters 32]
    python -m bench.decode --preset ling-3-flash --layers 42 --ep 2      # two GPUs, experts split

Random weights (bf16), batch 1. `--layers N` keeps the first N decoder layers (and the NEXTN
layer) so that the model fits. `--ep N` shards the routed experts over N GPUs (`moe.parallel`,
attention replicated): the weights are made already sharded, and the table gains the cost of the
MoE block's cross-GPU sum (a psum of [M, D] fp32 per MoE layer) at decode and verify sizes, and
one MoE layer at prefill sizes (`--dispatch-tokens`, multiples of N) by the psum path and by the
all-to-all, the measurement behind `moe.parallel.A2A_MIN_TOKENS`; the floors are then per GPU
(the replicated weights plus 1/N of the experts, each GPU at the measured copy bandwidth).
Prints a table last. Its decode and speculative rows subtract the per-call cost of the compiled
loop, which a server pays every step: for the step as the server drives it, `bench/step.py`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ling.config import preset
from ling.roofline import step_bytes
from moe import parallel
from moe.block import MoE, routed_experts
from moe.parallel import EXPERT, make_mesh, replicate
from spec.step import nextn_chain, new_slots
from spec.generate import chunk_for, decode, prefill
from spec.sampling import SamplingParams


def psum_seconds(mesh, m: int, d: int, iters: int = 200) -> float:
    """Seconds of one psum of [m, d] fp32 over the mesh's expert axis (as the EP MoE block does
    once a layer), from a loop of `iters` dependent psums inside one shard_map."""
    def body(x):
        def step(i, a):
            return jax.lax.psum(a, EXPERT) * 0.5
        return jax.lax.fori_loop(0, iters, step, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.ones((m, d), jnp.float32), NamedSharding(mesh, P()))
    return timed(f, x, repeat=3) / iters


def dispatch_seconds(model, mesh, m: int) -> tuple[float, float]:
    """Seconds of the first MoE layer's routed experts on m tokens under EP, by the replicated
    psum path and by the all-to-all path (random tokens, routing uniform over the experts)."""
    moe = next(n for _, n in nnx.iter_graph(model) if isinstance(n, MoE))
    e, d = moe.w13.shape[0], moe.w13.shape[1]
    key = jax.random.PRNGKey(m)
    x = 0.1 * jax.random.normal(key, (m, d), jnp.bfloat16)
    ids = jax.vmap(lambda k: jax.random.permutation(k, e)[: moe.top_k])(jax.random.split(key, m)).astype(jnp.int32)
    weights = jnp.full(ids.shape, 1.0 / moe.top_k, jnp.float32)
    x, ids, weights = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, ids, weights))
    out = []
    for path in (parallel.replicated, parallel.all_to_all):
        f = jax.jit(lambda x, i, w, a, b, path=path: path(x, i, w, a, b, None, mesh, routed_experts))
        out.append(timed(f, x, ids, weights, moe.w13[...], moe.w2[...], repeat=3))
    return out[0], out[1]


def copy_bandwidth(nbytes=1 << 30, calls=10) -> float:
    """Read + write bytes/s of a 1 GiB fp32 elementwise pass (XLA), median of three runs of 10 calls."""
    x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    samples = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            y = f(x)
        jax.block_until_ready(y)
        samples.append((time.perf_counter() - t) / calls)
    return 2 * nbytes / float(np.median(samples))


def timed(fn, *args, repeat=2):
    """Seconds of the fastest of `repeat` calls after one warm-up call (which compiles)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ling-3-flash")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=32)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None, help="low-bit projections")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel over this many GPUs")
    ap.add_argument("--dispatch-tokens", type=int, nargs="*", default=[256, 1024, 4096, 8192],
                    help="with --ep: token counts (multiples of --ep) at which one MoE layer is timed by the "
                         "psum and by the all-to-all path")
    args = ap.parse_args()
    full = preset(args.preset)
    n = min(args.layers, full.num_hidden_layers)
    cfg = full.replace(num_hidden_layers=n, layer_types=full.layer_types[:n], mlp_types=full.mlp_types[:n],
                       expert_swiglu_limits=(), shared_swiglu_limits=())
    s, k = args.num_steps, args.iters
    from pallas_kernels.backend import resolve

    print(f"device {jax.devices()[0].device_kind}; kernels: {resolve()}; weights: {args.quantize or 'bf16'}; "
          f"{args.preset} cut to {n} layers "
          f"({cfg.layer_types.count('kda')} KDA, {cfg.layer_types.count('mla')} MLA) + NEXTN, bf16, batch 1, "
          f"EP {args.ep} over {len(jax.devices())} devices", flush=True)
    mesh = make_mesh(args.ep) if args.ep > 1 else None
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    from ling import build
    from ling.quantize import Quantization, bits_of

    quant = Quantization(bits_of(args.quantize)) if args.quantize else None
    model = build.random(cfg, dtype=jnp.bfloat16, quant=quant, mesh=mesh)
    jax.block_until_ready(jax.tree_util.tree_leaves(nnx.state(model)))
    n_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))
    print(f"weights {n_bytes / 1e9:.1f} GB made in {time.perf_counter() - t0:.0f} s", flush=True)

    max_new = k * (s + 1) + 8
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    params = SamplingParams.make(1)

    def fresh():
        slots = new_slots(model, 1, args.prompt + max_new + s + 2, max_new + s + 1)
        if mesh is not None:  # as the server does: the decoding state on every GPU
            slots = replicate(slots, mesh)
        return prefill(model, slots, [prompt], [True], params, [max_new], [-1], chunk=chunk_for([prompt]))

    t_prefill = timed(lambda: fresh().n_out)
    rows = []
    ctx = args.prompt
    # Floors at the weights' stored width (the routed experts stay bf16 under --quantize: the
    # projections' share is small, so the bf16 floor is used for both; see bench/history/chronicle.md).
    # Under EP each GPU reads the replicated weights and 1/ep of the routed experts, in parallel.
    floor_decode = step_bytes(cfg, 1, ctx).floor_seconds(bw, ep=args.ep)
    floor_verify = step_bytes(cfg, s + 1, ctx).floor_seconds(bw, ep=args.ep)
    nextn_only = lambda t: (step_bytes(cfg, t, ctx, nextn=True).per_device(args.ep)
                            - step_bytes(cfg, t, ctx).per_device(args.ep))
    lm_head = cfg.vocab_size * cfg.hidden_size * 2
    floor_draft = s * (nextn_only(1) + lm_head) / bw
    floor_extend = nextn_only(s + 1) / bw
    rows.append((f"prefill {args.prompt}", None, t_prefill, None, args.prompt / t_prefill))
    print(f"prefill {t_prefill * 1e3:.1f} ms", flush=True)

    for spec_on in (False, True):
        base = fresh()
        run = lambda slots: decode(model, jax.tree.map(jnp.copy, slots), speculative=spec_on,  # noqa: E731
                                   num_steps=s, max_iters=k)
        t = timed(lambda: run(base).n_out)
        # The same compiled loop on finished slots runs zero steps: what is left is the per-call
        # cost (dispatching a jit of every weight, copying the slots, the exit test), which a
        # k-step call would otherwise spread over its steps.
        t_call = timed(lambda: run(base.replace(done=jnp.ones_like(base.done))).n_out)
        out = run(base)
        steps, produced = int(out.steps[0]), int(out.produced[0])
        step_t = (t - t_call) / max(steps, 1)
        print(f"per-call overhead {t_call * 1e3:.1f} ms (subtracted)", flush=True)
        name = f"spec step (S={s})" if spec_on else "decode step"
        floor = floor_verify + floor_draft + floor_extend if spec_on else floor_decode
        rows.append((name, produced / max(steps, 1), step_t, floor, produced / max(steps, 1) / step_t))
        print(f"{name}: {step_t * 1e6:.0f} us/step, floor {floor * 1e6:.0f} us", flush=True)

    # The parts of a speculative step, each repeated inside one jit on inputs that change per iteration.
    base = fresh()
    graphdef, p = nnx.split(model)

    def loop(part):
        def run(p, slots):
            def body(i, acc):
                return acc + part(nnx.merge(graphdef, p), slots.replace(last_token=(slots.last_token + i) % cfg.vocab_size))
            return jax.lax.fori_loop(0, k, body, jnp.float32(0))
        return jax.jit(run)

    def draft_part(m, slots):
        drafts, _, _ = nextn_chain(m, slots, s, sampling=False)
        return drafts.sum().astype(jnp.float32)

    def distinct_tokens(slots):  # S+1 different tokens: they route like a real verify, not all alike
        return (slots.last_token[:, None] + 7919 * jnp.arange(s + 1)[None, :]) % cfg.vocab_size

    def verify_part(m, slots):
        toks = distinct_tokens(slots)
        logits, _, _ = m(toks, slots.model, form="verify")
        return logits[0, 0, 0]

    def extend_part(m, slots):
        toks = distinct_tokens(slots)
        h = jnp.broadcast_to(slots.last_hidden[:, None], (1, s + 1, cfg.hidden_size))
        _, hh, _ = m.draft(h, toks, slots.model.nextn, slots.model.lengths - 1, form="decode", logits=False)
        return hh[0, 0, 0].astype(jnp.float32)

    for name, part, floor in (("  draft (NEXTN x S)", draft_part, floor_draft),
                              ("  verify (S+1 tokens)", verify_part, floor_verify),
                              ("  extend (NEXTN, S+1)", extend_part, floor_extend)):
        rows.append((name, None, timed(loop(part), p, base) / k, floor, None))
        print(f"{name.strip()}: {rows[-1][2] * 1e6:.0f} us", flush=True)

    if mesh is not None:  # the MoE block's cross-GPU sum, once per target MoE layer
        n_moe = cfg.mlp_types.count("moe")
        for t in (1, s + 1):
            one = psum_seconds(mesh, t, cfg.hidden_size)
            rows.append((f"  psum [{t}, D] x {n_moe}", None, one * n_moe, None, None))
            print(f"psum of [{t}, {cfg.hidden_size}] fp32 over {args.ep} GPUs: {one * 1e6:.1f} us a layer, "
                  f"{one * n_moe * 1e6:.0f} us a step ({n_moe} MoE layers)", flush=True)
        # Where the all-to-all dispatch starts to pay (moe.parallel.A2A_MIN_TOKENS): one MoE
        # layer's routed experts by each path.
        for m in args.dispatch_tokens:
            rep, a2a = dispatch_seconds(model, mesh, m)
            rows.append((f"  MoE {m} tok psum", None, rep, None, None))
            rows.append((f"  MoE {m} tok a2a", None, a2a, None, None))
            print(f"MoE layer, {m} tokens: replicated + psum {rep * 1e6:.0f} us, all-to-all {a2a * 1e6:.0f} us "
                  f"(ratio {a2a / rep:.2f})", flush=True)

    print(f"\n{'what':<22} {'tok/step':>8} {'time':>10} {'floor':>9} {'floor/time':>10} {'tok/s':>8}")
    for name, tps, t, floor, rate in rows:
        unit = f"{t * 1e3:.1f} ms" if name.startswith("prefill") else f"{t * 1e6:.0f} us"
        print(f"{name:<22} {'' if tps is None else f'{tps:.2f}':>8} {unit:>10} "
              f"{'' if floor is None else f'{floor * 1e6:.0f} us':>9} {'' if floor is None else f'{floor / t:.2f}':>10} "
              f"{'' if rate is None else f'{rate:.0f}':>8}")


if __name__ == "__main__":
    main()

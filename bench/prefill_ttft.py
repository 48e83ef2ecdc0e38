"""bench.prefill --parts ttft: time to first token through the engine.

ttft  time to first token through the engine (spec.generate.prefill, chunks of --chunk tokens) for
      1k, 8k and 32k-token prompts on ling-3-flash cut to the layers that fit (random bf16
      weights, NEXTN layer included), the per-layer times of each layer kind at those sizes,
      and the full 42 layers extrapolated: measured + the missing layers' per-layer times.
      Floor: prefill FLOPs of the full model (ling.roofline.prefill_flops) over the bf16 dense
      GEMM rate: XLA 8192³ measured in the same run, or 790 TFLOP/s if that is higher (torch's
      8192³ on this GPU). Target: 8192 tokens <= 0.6 s.
"""

from __future__ import annotations

import time

from bench.prefill_common import DENSE_TFLOPS, device_us, log, row


class TtftPart:
    """bench.prefill's ttft part (a base of its Bench, beside `prefill_common.Part`)."""

    def ttft(self):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx

        from ling import build
        from ling.config import KDA, preset
        from ling.model import LingModel
        from ling.roofline import prefill_flops
        from ling.state import init_state
        from pallas_kernels.backend import resolve
        from spec.step import new_slots
        from spec.generate import prefill
        from spec.sampling import SamplingParams

        if self.gpu:
            self.check_cudnn()
        full = preset("ling-tiny" if self.tiny else "ling-3-flash")
        # The target's size first, then the one sharing its compile, then the one needing its own
        # (so a budget cut leaves the 8k figures whole).
        prompts = (100, 300, 40) if self.tiny else (8192, 32768, 1024)
        chunk_max = 128 if self.tiny else self.args.chunk
        dense_rate = self.dense_tflops()

        def cut(n):
            return full.replace(num_hidden_layers=n, layer_types=full.layer_types[:n], mlp_types=full.mlp_types[:n],
                                expert_swiglu_limits=(), shared_swiglu_limits=())

        # Weight bytes by decoder layer (and the rest: embeddings, lm_head, NEXTN), from one abstract model.
        abstract = nnx.eval_shape(lambda: LingModel(full, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        by_layer, base = [0] * full.num_hidden_layers, 0
        for path, var in nnx.to_flat_state(nnx.state(abstract)):
            a = var.get_value()
            if path[0] == "layers":
                by_layer[path[1]] += a.size * a.dtype.itemsize
            else:
                base += a.size * a.dtype.itemsize
        del abstract

        def weight_bytes(n):
            return base + sum(by_layer[:n])

        n = self.args.layers or (3 if self.tiny else self.layers_that_fit(full, weight_bytes))
        n = min(n, full.num_hidden_layers)
        cfg = cut(n)
        log(f"ttft: {full.num_hidden_layers}-layer model cut to {n} ({cfg.layer_types.count(KDA)} KDA, "
            f"{n - cfg.layer_types.count(KDA)} MLA) + NEXTN, {weight_bytes(n) / 1e9:.1f} GB bf16; kernels {resolve()}; "
            f"dense bf16 rate {dense_rate:.0f} TFLOP/s")
        model = build.random(cfg, dtype=jnp.bfloat16)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        log("ttft: weights made")
        max_len = max(prompts) + 8
        params = SamplingParams.make(1)
        rng = np.random.default_rng(0)

        def chunk_for(p):  # one compile for every prompt at least chunk_max long
            return min(chunk_max, -(-p // 256) * 256)

        measured = {}
        for p in prompts:
            if self.left() < 0:
                log(f"budget spent: TTFT {p} skipped")
                continue
            prompt = rng.integers(0, cfg.vocab_size, p).tolist()
            c = chunk_for(p)

            def once():
                slots = new_slots(model, 1, max_len, 2)
                jax.block_until_ready(slots)
                t0 = time.perf_counter()
                out = prefill(model, slots, [prompt], [True], params, [1], [-1], chunk=c)
                jax.block_until_ready(out.out)
                return time.perf_counter() - t0

            first = once()
            measured[p] = min(once() for _ in range(2))
            log(f"ttft {p} tokens (chunks of {c}, {n} layers): {measured[p] * 1e3:.1f} ms (first run, compiling: "
                f"{first:.1f} s)")

        # Per-layer figures: one layer of each kind at the chunk size, over each chunk's prefix.
        kinds = {}  # kind -> a layer index of the cut model
        for i in range(n):
            kinds.setdefault((cfg.layer_types[i], cfg.mlp_types[i]), i)
        per_layer = {}  # (kind, prompt) -> seconds for the whole prompt

        compiled = {}  # (layer index, tokens) -> (jitted call, its params, x, cache): one compile each

        def layer_time(i, t, prefix):
            if (i, t) not in compiled:
                gd, ps = nnx.split(model.layers[i])
                cache = init_state(cfg, 1, max_len, jnp.bfloat16).layers[i]  # random, never zeros (a prefix)
                cache = jax.tree.map(lambda a: (0.1 * jax.random.normal(jax.random.PRNGKey(7), a.shape, jnp.float32)
                                                ).astype(a.dtype), cache)
                x = jax.random.normal(jax.random.PRNGKey(i), (1, t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)

                @jax.jit
                def f(ps, x, cache, lengths):
                    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
                    y, _ = nnx.merge(gd, ps)(x, positions, lengths, jnp.full((1,), t, jnp.int32), cache,
                                             form="prefill")
                    return y

                compiled[(i, t)] = (f, ps, x, cache)
            f, ps, x, cache = compiled[(i, t)]
            lengths = jnp.asarray([prefix], jnp.int32)
            return device_us(f, ps, x, cache, lengths, reps=(3, 1) if self.gpu else (2, 1)) / 1e6

        for p in measured:
            c = chunk_for(p)
            starts = list(range(0, -(-p // c) * c, c))
            for kind, i in kinds.items():
                if self.left() < 0:
                    log(f"budget spent: per-layer {kind} at {p} skipped")
                    continue
                # KDA and dense layers cost the same in every chunk; MLA grows with the prefix.
                chunk_starts = starts if kind[0] != KDA else starts[:1]
                secs = [layer_time(i, c, s0) for s0 in chunk_starts]
                total = sum(secs) if kind[0] != KDA else secs[0] * len(starts)
                per_layer[(kind, p)] = total
                log(f"  layer {i} {kind[0]}+{kind[1]} at {p} tokens: {total * 1e3:.2f} ms "
                    f"({', '.join(f'{s * 1e3:.2f}' for s in secs)} ms per chunk of {c})")
        compiled.clear()

        for p, secs in sorted(measured.items()):
            missing = [(full.layer_types[i], full.mlp_types[i]) for i in range(n, full.num_hidden_layers)]
            extra = [per_layer.get((kind, p)) for kind in missing]
            ok = all(e is not None for e in (extra or [0.0]))
            est = secs + sum(e for e in extra if e is not None) if ok else None
            floor = prefill_flops(full, p, nextn=full.num_nextn_layers > 0) / (dense_rate * 1e12)
            est_s = "n/a" if est is None else f"{est * 1e3:.1f} ms"
            log(f"ttft {p}: {n} layers {secs * 1e3:.1f} ms; full {full.num_hidden_layers} layers {est_s} "
                f"(+{len(missing)} layers); floor {floor * 1e3:.1f} ms")
            per = ", ".join(f"{k[0]}+{k[1]} {v * 1e3:.2f} ms" for (k, q), v in per_layer.items() if q == p)
            row("ttft", f"TTFT {p} tok", us=secs * 1e6, layers=n, full_layers=full.num_hidden_layers,
                full_us=None if est is None else est * 1e6,
                floor_us=floor * 1e6, per_layer=per,
                target=(est <= 0.6) if (p == 8192 and est is not None and not self.tiny) else None)
        missing_kinds = {(full.layer_types[i], full.mlp_types[i]) for i in range(n, full.num_hidden_layers)}
        if not all(k in kinds for k in missing_kinds):
            log(f"note: layer kinds {sorted(missing_kinds - set(kinds))} are not in the cut model: no extrapolation")

    def layers_that_fit(self, full, weight_bytes):
        """Most decoder layers whose bf16 weights fit the device memory less --reserve-gb."""
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            log("ttft: the device reports no memory limit; assuming 0.95 x 141 GB")
        limit = stats.get("bytes_limit", 0.95 * 141e9) - stats.get("bytes_in_use", 0)
        budget = limit - self.args.reserve_gb * 1e9
        n = 2
        while n < full.num_hidden_layers and weight_bytes(n + 1) <= budget:
            n += 1
        log(f"ttft: device memory free {limit / 1e9:.1f} GB, weights budget {budget / 1e9:.1f} GB -> {n} layers")
        return n

    def dense_tflops(self):
        """The bf16 dense GEMM rate (TFLOP/s) for the floor: the larger of XLA's 8192³ measured here
        and 790 (torch's 8192³ on this H200, 769-798 in the device notes), so the floor is never
        inflated by a slow XLA GEMM."""
        import jax
        import jax.numpy as jnp

        if not self.gpu:
            return DENSE_TFLOPS
        a = jax.random.normal(jax.random.PRNGKey(9), (8192, 8192), jnp.bfloat16)
        f = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        rate = 2 * 8192**3 / device_us(f, a, reps=(12, 4)) / 1e6
        log(f"dense bf16 GEMM 8192³ (XLA): {rate:.0f} TFLOP/s; the floor uses {max(rate, DENSE_TFLOPS):.0f}")
        return max(rate, DENSE_TFLOPS)

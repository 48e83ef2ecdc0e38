"""Prefill benchmark on one H200: grouped GEMM, KDA prefill, MLA prefill attention, TTFT.

    python -m bench.prefill [--parts gemm,kda,mla,ttft] [--budget 420]   (GPU; log also in $OUT)
    python -m bench.prefill --tiny                                       (CPU: tiny shapes, the script runs)

Parts (each checked against its reference in the same run before it is timed):
  gemm  the MoE grouped GEMM (pallas_kernels.grouped_gemm.grouped_moe: align + up GEMM/SwiGLU + down
        GEMM/weights + combine), E 512, top-8, D 2560, I 768, bf16, uniform random routing, at 512,
        4096 and 16384 tokens; TFLOP/s over 6·M·k·D·I; the peer torch._grouped_mm on the same routing
        (bench/peers.py `torch_grouped_mm_us`). Ceilings from the same run: its bytes (the
        used experts' weights once, x, y, h and the bf16 pair rows written and read) over the copy
        ceiling, and the experts' weights streamed by XLA's dense dot (cuBLAS) at 64 rows (a TMA
        kernel streamed them no faster, bench/history/chronicle.md). Target >= 250 TFLOP/s at 4096 tokens.
  kda   KDA prefill at 8192 tokens, B 1, H 32, K = V 128, bf16 activations, fp32 state, one layer
        between its projections (conv + delta rule + gated norm): `pallas_kernels.kda_prefill`
        against the jnp chunked form under jit (ling/kda.py) and fla's Triton `chunk_kda` (delta rule
        with l2norm, gate and beta in kernel: no conv, no gated norm). Target <= 1.0 ms a layer.
  mla   MLA prefill attention (pallas_kernels/mla_prefill.py) at 8192 tokens, B 1, H 32, qk 192,
        v 128, R 512: cuDNN and the blockwise jnp path, a first chunk and a second chunk over an
        8192-token prefix; TFLOP/s over the causal attention plus the latent expansion.
  ttft  time to first token through the engine (spec.generate.prefill, chunks of --chunk tokens) for
        1k, 8k and 32k-token prompts on ling-3-flash cut to the layers that fit (random bf16
        weights, NEXTN layer included), the per-layer times of each layer kind at those sizes,
        and the full 42 layers extrapolated: measured + the missing layers' per-layer times.
        Floor: prefill FLOPs of the full model (ling.roofline.prefill_flops) over the bf16 dense
        GEMM rate: XLA 8192³ measured in the same run, or 790 TFLOP/s if that is higher (torch's
        8192³ on this GPU). Target: 8192 tokens <= 0.6 s.
Timing: JAX calls are queued back to back and the difference of two batch sizes is taken
(dispatch and sync cancel); torch peers with CUDA events; TTFT is wall clock around the engine's
prefill (best of two after a compiling run). --budget skips what would start after it.
Run with fla (carry .whl): install .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl into a
--target directory on PYTHONPATH first (bench/history/chronicle.md, attention decode).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback


from bench.common import copy_ceiling_tbs, queued_us, rel_err

T0 = time.time()
DENSE_TFLOPS = 790.0  # bf16 8192³ GEMM through torch on the H200 (769-798 TFLOP/s, device notes)
LOG = None
ROWS: list[dict] = []  # the short table
TARGETS = {"gemm": "grouped GEMM >= 250 TFLOP/s at 4096 tokens", "kda": "KDA prefill <= 1.0 ms/layer at 8192",
           "ttft": "TTFT 8192 tokens, full model <= 0.6 s"}


def log(*a):
    s = f"[{time.time() - T0:5.0f}s] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    if LOG is not None:
        LOG.write(s + "\n")
        LOG.flush()


def row(part, what, **kw):
    ROWS.append(dict(part=part, what=what, **kw))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="gemm,kda,mla,ttft", help="comma-separated: gemm, kda, mla, ttft")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; parts and steps past it are skipped")
    ap.add_argument("--tiny", action="store_true", help="CPU: ling-tiny and small token counts (checks the script)")
    ap.add_argument("--chunk", type=int, default=8192, help="TTFT prefill chunk (tokens)")
    ap.add_argument("--layers", type=int, default=0, help="TTFT: decoder layers kept (0: as many as fit)")
    ap.add_argument("--reserve-gb", type=float, default=20.0, help="TTFT: device memory left for activations")
    args = ap.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = sorted(set(args.parts) - {"gemm", "kda", "mla", "ttft"})
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from gemm, kda, mla, ttft")
    return args


def main():
    global LOG
    args = parse()
    if args.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Memory grows on demand (no preallocation) so the torch peers fit before the TTFT model is built.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's own Triton kernels, no plugins
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_prefill_cache")  # a rerun on a warm machine
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    LOG = open(os.path.join(out_dir, "prefill_log.txt"), "w")
    import jax

    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, parts {args.parts}, "
        f"budget {args.budget:.0f} s{', tiny' if args.tiny else ''}")
    bench = Bench(args)
    for part in args.parts:
        if bench.left() < 0:
            log(f"budget spent: part {part} skipped")
            row(part, "skipped (budget)")
            continue
        try:
            getattr(bench, part)()
        except Exception as e:  # noqa: BLE001
            log(f"FAILED part {part}: {type(e).__name__}: {str(e)[:800]}")
            log(traceback.format_exc()[-3000:])
            row(part, f"FAILED: {type(e).__name__}")
    with open(os.path.join(out_dir, "prefill.json"), "w") as f:
        json.dump(ROWS, f, indent=1, default=str)
    table()


# ---------------------------------------------------------------------------------- timing


def device_us(f, *args, reps=(6, 2)):
    """µs per call of f (jitted), after one call that compiles: `common.queued_us` with
    batches of reps = (hi, lo) calls."""
    import jax

    jax.block_until_ready(f(*args))
    return queued_us(f, *args, hi=reps[0], lo=reps[1])


def torch_us(fn, n=10, warm=3):
    """µs per call of a torch callable, CUDA events around n calls after warm-up calls."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def gemm_bytes(ids, *, e: int, d: int, inter: int) -> int:
    """Bytes the grouped GEMM must move for this routing (ids [M, k] host array), bf16, plan_for's
    "sum16" combine: each used expert's weights once, x and y, h's pair rows written and read, the
    bf16 pair rows written and read (pallas_kernels/grouped_gemm.py, Bytes)."""
    import numpy as np

    m, k = ids.shape
    p = m * k
    used = int(np.unique(ids[ids < e]).size)
    return 2 * (used * 3 * d * inter + 2 * m * d + 2 * p * inter + 2 * p * d)


def fmt_us(us):
    return "-" if us is None else (f"{us / 1e3:.2f} ms" if us >= 1e4 else f"{us:.1f} µs")


class Bench:
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

    # ------------------------------------------------------------------------------ (a) gemm
    def gemm(self):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels import experts
        from pallas_kernels import grouped_gemm as gg

        e, k, d, inter = (13, 4, 256, 128) if self.tiny else (512, 8, 2560, 768)
        sizes = (24, 64) if self.tiny else (512, 4096, 16384)
        key = jax.random.PRNGKey(0)
        k1, k2 = jax.random.split(key)
        w13 = jax.random.normal(k1, (e, d, 2 * inter), jnp.bfloat16) * 0.03  # std: h and y stay O(1)
        w2 = jax.random.normal(k2, (e, inter, d), jnp.bfloat16) * 0.05
        ours = jax.jit(lambda x, i, s, a, b: gg.grouped_moe(x, i, s, a, b, backend=self.backend))
        ref = jax.jit(lambda x, i, s, a, b: experts.reference(x, i, s, a, b))
        ceiling = copy_ceiling_tbs(1 << (20 if self.tiny else 30))
        stream = self.weight_stream_us(w13, w2)
        log(f"copy ceiling {ceiling:.2f} TB/s; the experts' weights through XLA's dense dot at 64 rows "
            f"(cuBLAS on the GPU; [64, D] @ [D, E*2I] and [64, I] @ [I, E*D]): {stream:.1f} µs")
        for m in sizes:
            if self.left() < 0:
                log(f"budget spent: gemm M={m} skipped")
                continue
            kx, ka, kb = jax.random.split(jax.random.fold_in(key, m), 3)
            x = jax.random.normal(kx, (m, d), jnp.bfloat16)
            ids = jax.lax.top_k(jax.random.uniform(ka, (m, e)), k)[1].astype(jnp.int32)  # distinct per token
            ws = jax.random.uniform(kb, (m, k), jnp.float32) / k + 0.05
            s = min(m, 256)  # a token's output depends on its own row only
            err = rel_err(ours(x, ids, ws, w13, w2)[:s].astype(jnp.float32),
                          ref(x[:s], ids[:s], ws[:s], w13, w2).astype(jnp.float32))
            if not err < 1e-2:
                raise AssertionError(f"grouped_moe M={m}: rel err {err:.2e} against grouped_gemm.reference")
            us = device_us(ours, x, ids, ws, w13, w2, reps=self.reps)
            flop = 6 * m * k * d * inter
            peer = None
            if self.gpu:
                try:
                    from bench.peers import torch_grouped_mm_us

                    peer = torch_grouped_mm_us(np.asarray(ids), np.asarray(ws), e=e, d=d, inter=inter)
                except Exception as exc:  # noqa: BLE001
                    log(f"  torch._grouped_mm peer failed: {type(exc).__name__}: {str(exc)[:300]}")
            tf = flop / us / 1e6
            floor = gemm_bytes(np.asarray(ids), e=e, d=d, inter=inter) / ceiling / 1e6
            log(f"gemm M={m}: {us:.1f} µs, {tf:.1f} TFLOP/s, err {err:.1e}; torch._grouped_mm "
                f"{fmt_us(peer)}{f' (ours {peer / us:.2f}x)' if peer else ''}; its bytes at the copy ceiling "
                f"{floor:.1f} µs ({floor / us:.2f} of ours); the weights through XLA's dot {stream:.1f} µs "
                f"({stream / us:.2f} of ours)")
            row("gemm", f"grouped_moe M={m}", us=us, tflops=tf, peer="torch._grouped_mm", peer_us=peer,
                target=(tf >= 250) if m == 4096 and not self.tiny else None,
                note=f"bytes floor {floor / us:.2f}, XLA-dot weights {stream / us:.2f} of ours")

    def weight_stream_us(self, w13, w2):
        """µs for XLA's dense dot (cuBLAS on the GPU) to stream the experts' weights at 64 rows,
        measured beside ours: what a vendor GEMM takes for these bytes on this GPU. The weights are
        laid out as one [D, E*2I] and one [I, E*D] matrix (a transposed copy, made once)."""
        import jax

        e, d, n13 = w13.shape
        b13 = w13.transpose(1, 0, 2).reshape(d, e * n13)
        b2 = w2.transpose(1, 0, 2).reshape(w2.shape[1], e * d)
        a13 = jax.random.normal(jax.random.PRNGKey(7), (64, d), w13.dtype)
        a2 = jax.random.normal(jax.random.PRNGKey(8), (64, w2.shape[1]), w2.dtype)
        us = device_us(jax.jit(lambda a13, b13, a2, b2: (a13 @ b13, a2 @ b2)), a13, b13, a2, b2, reps=self.reps)
        del b13, b2
        return us

    # ------------------------------------------------------------------------------ (b) kda
    def kda(self):
        import jax
        import jax.numpy as jnp

        from pallas_kernels.kda import KdaInputs, KdaState, KdaWeights

        b, t, h, kd, w = (1, 200, 2, 16, 4) if self.tiny else (1, 8192, 32, 128, 4)
        c = h * kd
        ks = iter(jax.random.split(jax.random.PRNGKey(1), 16))

        def rnd(shape, dt=jnp.bfloat16, s=1.0):
            return (jax.random.normal(next(ks), shape, jnp.float32) * s).astype(dt)

        x = KdaInputs(rnd((b, t, c)), rnd((b, t, c)), rnd((b, t, c)), rnd((b, t, h, kd)), rnd((b, t, h)),
                      rnd((b, t, c)))
        wts = KdaWeights(rnd((c, w), jnp.float32, 0.3), rnd((c, w), jnp.float32, 0.3), rnd((c, w), jnp.float32, 0.3),
                         jnp.log(jnp.linspace(1.0, 16.0, h, dtype=jnp.float32)), rnd((c,), jnp.float32, 0.5),
                         1.0 + rnd((kd,), jnp.bfloat16, 0.1))
        st = KdaState(rnd((b, w - 1, c)), rnd((b, w - 1, c)), rnd((b, w - 1, c)), rnd((b, h, kd, kd), jnp.float32, 0.1))
        valid = jnp.full((b,), t, jnp.int32)
        try:
            from pallas_kernels import kda_prefill as kp
        except ImportError as exc:
            log(f"pallas_kernels.kda_prefill not importable yet ({exc}): kda_prefill rows skipped, "
                "the jnp chunked form timed from ling.kda")
            row("kda", "kda_prefill: not importable yet")
            kp = None
        kw = dict(gate="safe", eps=1e-6, lower_bound=-5.0)
        jnp_form = kp.reference if kp is not None else kda_jnp
        ref = jax.jit(lambda x, w_, s, v: jnp_form(x, w_, s, v, **kw))
        o_ref, s_ref = ref(x, wts, st, valid)
        s_ref = getattr(s_ref, "recurrent", s_ref)
        us_ref = device_us(ref, x, wts, st, valid, reps=self.reps)
        log(f"kda jnp chunked (jit) T={t}: {fmt_us(us_ref)}")
        row("kda", f"jnp chunked T={t}", us=us_ref, target=None)
        us = None
        if kp is not None:
            try:
                f = jax.jit(lambda x, w_, s, v: kp.kda_prefill(x, w_, s, v, backend=self.backend, **kw))
                o, s_new = f(x, wts, st, valid)
                err_o = rel_err(o.astype(jnp.float32), o_ref.astype(jnp.float32))
                err_s = rel_err(s_new.recurrent, s_ref)
                log(f"kda_prefill vs jnp: rel err o {err_o:.1e}, state {err_s:.1e}")
                if not (err_o < 2e-2 and err_s < 2e-2):
                    raise AssertionError(f"rel err o {err_o:.2e}, state {err_s:.2e} against the jnp form")
                us = device_us(f, x, wts, st, valid, reps=self.reps)
            except Exception as exc:  # noqa: BLE001  (the peer's row still follows)
                log(f"kda_prefill FAILED: {type(exc).__name__}: {str(exc)[:800]}")
                row("kda", "kda_prefill: FAILED")
        fla_us = self.fla_chunk_kda(b, t, h, kd) if self.gpu else None
        if us is not None:
            log(f"kda_prefill T={t}: {fmt_us(us)} ({us_ref / us:.2f}x jnp); fla chunk_kda {fmt_us(fla_us)}")
            row("kda", f"kda_prefill T={t}", us=us, peer="fla chunk_kda", peer_us=fla_us,
                target=(us <= 1000) if not self.tiny else None)
        elif fla_us is not None:
            row("kda", f"fla chunk_kda T={t} (peer alone)", us=fla_us)

    def fla_chunk_kda(self, b, t, h, kd):
        """µs of fla's chunk_kda (l2norm, safe gate, beta in kernel; initial and final state)."""
        try:
            import torch
            from fla.ops.kda import chunk_kda
        except Exception as exc:  # noqa: BLE001
            log(f"fla unavailable ({type(exc).__name__}: {exc}); install the carried wheels for the peer")
            return None
        try:
            dv, bf = "cuda", torch.bfloat16
            g = torch.Generator(device=dv).manual_seed(0)
            rn = lambda *s, dt=bf: torch.randn(*s, device=dv, generator=g).to(dt)  # noqa: E731
            q, k, v, gi = (rn(b, t, h, kd) for _ in range(4))
            beta = rn(b, t, h)
            a_log = torch.log(torch.linspace(1.0, 16.0, h, device=dv))
            dt_bias = rn(h * kd, dt=torch.float32) * 0.5
            h0 = rn(b, h, kd, kd, dt=torch.float32) * 0.1

            def call():
                return chunk_kda(q, k, v, gi, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                 safe_gate=True, lower_bound=-5.0, A_log=a_log, dt_bias=dt_bias)

            with torch.inference_mode():
                us = torch_us(call)
            del q, k, v, gi, beta, h0
            torch.cuda.empty_cache()
            log(f"fla chunk_kda T={t}: {fmt_us(us)} (perf-anchors: 1.14 ms at 8192)")
            return us
        except Exception as exc:  # noqa: BLE001
            log(f"fla chunk_kda FAILED: {type(exc).__name__}: {str(exc)[:600]}")
            return None

    # ------------------------------------------------------------------------------ (c) mla
    def mla(self):
        import jax
        import jax.numpy as jnp

        from pallas_kernels import mla_prefill as mp

        h, n, p, v, r = (2, 16, 8, 16, 32) if self.tiny else (32, 128, 64, 128, 512)
        scale = (n + p) ** -0.5
        impls = ("cudnn", "xla") if self.gpu else ("xla",)

        def inputs(b, t, l_max, lengths, seed):
            ks = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
            rnd = lambda *s: jax.random.normal(next(ks), s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
            return (rnd(b, t, h, n), rnd(b, t, h, p), rnd(b, t, r), rnd(b, t, p), rnd(b, l_max, r), rnd(b, l_max, p),
                    rnd(r, h, n) * r**-0.5, rnd(r, h, v) * r**-0.5, jnp.asarray(lengths, jnp.int32))

        run = {i: jax.jit(lambda *a, i=i: mp.prefill_attention(*a, scale=scale, impl=i)) for i in impls}
        ref = jax.jit(lambda *a: mp.reference(*a, scale=scale))
        # Correctness first, at a size the reference's [B, H, T, L + T] scores fit: ragged B = 2, one
        # sequence with a prefix spanning several cuDNN prefix blocks (the merge and its lse).
        ct, cl = (40, 96) if self.tiny else (1024, 12288)
        args = inputs(2, ct, cl, [0, cl - ct - 7], 0)
        want = ref(*args).astype(jnp.float32)
        checked = []
        for i in impls:
            try:
                err = rel_err(run[i](*args).astype(jnp.float32), want)
                if not err < 2e-2:
                    raise AssertionError(f"rel err {err:.2e} against mla_prefill.reference")
            except Exception as exc:  # noqa: BLE001  (cuDNN: a failure here must not hide the jnp rows)
                log(f"mla {i} FAILED its check: {type(exc).__name__}: {str(exc)[:800]}")
                row("mla", f"{i}: FAILED check")
                continue
            log(f"mla {i}: rel err {err:.1e} against the reference (T={ct}, lengths {[0, cl - ct - 7]})")
            checked.append(i)
            self.cudnn_checked |= i == "cudnn"
        del want, args
        t = 64 if self.tiny else 8192
        for prefix in (0, t):
            if self.left() < 0:
                log(f"budget spent: mla prefix {prefix} skipped")
                continue
            args = inputs(1, t, 2 * t, [prefix], 1)
            flop = (2 * h * (n + p + v) * (t * (t + 1) / 2 + t * prefix)  # attention over the visible pairs
                    + 2 * r * h * (n + v) * (t + prefix))  # expanding the chunk's and the prefix's latents
            for i in checked:
                us = device_us(run[i], *args, reps=self.reps)
                tf = flop / us / 1e6
                log(f"mla {i} T={t} prefix {prefix}: {fmt_us(us)}, {tf:.0f} TFLOP/s ({flop / 1e9:.0f} GFLOP)")
                row("mla", f"{i} T={t} prefix {prefix}", us=us, tflops=tf)

    # ------------------------------------------------------------------------------ (d) ttft
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

    def check_cudnn(self):
        """The model's MLA prefill runs cuDNN on the GPU: checked once (here, unless the mla part
        did), else the TTFT runs the blockwise jnp path and says so."""
        import jax
        import jax.numpy as jnp

        from pallas_kernels import mla_prefill as mp

        if self.cudnn_checked:
            return
        try:
            ks = iter(jax.random.split(jax.random.PRNGKey(3), 9))
            rnd = lambda *s: (0.5 * jax.random.normal(next(ks), s, jnp.float32)).astype(jnp.bfloat16)  # noqa: E731
            h, r = 32, 512
            args = (rnd(2, 256, h, 128), rnd(2, 256, h, 64), rnd(2, 256, r), rnd(2, 256, 64), rnd(2, 5000, r),
                    rnd(2, 5000, 64), rnd(r, h, 128) * r**-0.5, rnd(r, h, 128) * r**-0.5,
                    jnp.asarray([0, 4500], jnp.int32))
            got = jax.jit(lambda *a: mp.prefill_attention(*a, scale=192**-0.5, impl="cudnn"))(*args)
            err = rel_err(got.astype(jnp.float32), mp.reference(*args, scale=192**-0.5).astype(jnp.float32))
            if not err < 2e-2:
                raise AssertionError(f"rel err {err:.2e} against mla_prefill.reference")
            log(f"mla cuDNN path checked (rel err {err:.1e})")
            self.cudnn_checked = True
        except Exception as exc:  # noqa: BLE001
            mp.PALLAS_IMPL = "xla"
            log(f"mla cuDNN path FAILED its check ({type(exc).__name__}: {str(exc)[:400]}): the TTFT runs the "
                "blockwise jnp MLA path")

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


def kda_jnp(x, w, st, valid, *, gate="safe", lower_bound=-5.0, eps=1e-6):
    """One KDA layer between its projections in plain jnp (`pallas_kernels.kda_prefill.reference`,
    the model's chunked form). x KdaInputs, w KdaWeights, st KdaState (pallas_kernels.kda).
    Returns (o [B, T, H, V], recurrent state [B, H, K, V])."""
    from pallas_kernels import kda_prefill

    o, new = kda_prefill.reference(x, w, st, valid, gate=gate, lower_bound=lower_bound, eps=eps)
    return o, new.recurrent


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


if __name__ == "__main__":
    main()

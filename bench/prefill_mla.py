"""bench.prefill --parts mla: MLA prefill attention.

mla   MLA prefill attention (pallas_kernels/mla_prefill.py) at 8192 tokens, B 1, H 32, qk 192,
      v 128, R 512: cuDNN and the blockwise jnp path, a first chunk and a second chunk over an
      8192-token prefix; TFLOP/s over the causal attention plus the latent expansion.
"""

from __future__ import annotations

from bench.common import rel_err
from bench.prefill_common import device_us, fmt_us, log, row


class MlaPart:
    """bench.prefill's mla part (a base of its Bench, beside `prefill_common.Part`)."""

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

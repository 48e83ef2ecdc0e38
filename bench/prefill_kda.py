"""bench.prefill --parts kda: one KDA layer's prefill.

kda   KDA prefill at 8192 tokens, B 1, H 32, K = V 128, bf16 activations, fp32 state, one layer
      between its projections (conv + delta rule + gated norm): `pallas_kernels.kda_prefill`
      against the jnp chunked form under jit (ling/kda.py) and fla's Triton `chunk_kda` (delta rule
      with l2norm, gate and beta in kernel: no conv, no gated norm). Target <= 1.0 ms a layer.
"""

from __future__ import annotations

from bench.common import rel_err, torch_us
from bench.prefill_common import device_us, fmt_us, log, row


class KdaPart:
    """bench.prefill's kda part (a base of its Bench, beside `prefill_common.Part`)."""

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


def kda_jnp(x, w, st, valid, *, gate="safe", lower_bound=-5.0, eps=1e-6):
    """One KDA layer between its projections in plain jnp (`pallas_kernels.kda_prefill.reference`,
    the model's chunked form). x KdaInputs, w KdaWeights, st KdaState (pallas_kernels.kda).
    Returns (o [B, T, H, V], recurrent state [B, H, K, V])."""
    from pallas_kernels import kda_prefill

    o, new = kda_prefill.reference(x, w, st, valid, gate=gate, lower_bound=lower_bound, eps=eps)
    return o, new.recurrent

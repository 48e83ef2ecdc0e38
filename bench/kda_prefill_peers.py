"""bench.kda_prefill_check's peers: the XLA reference (the jnp chunked form at HIGHEST, on the loop
timer) and fla 0.6.0's chunk_kda (L2 norm, gate and beta in kernel; no conv, no gated norm) under a
CUDA graph, where fla imports. Rows as ours: µs per layer, TB/s over the bytes that must move.
"""

from __future__ import annotations

import traceback


from bench import kda_prefill_common as kc
from bench.common import time_loop, time_torch_graph
from bench.kda_prefill_common import log, make_inputs, record


def bench_reference(gate, ceiling, args):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kda_prefill as kp

    B, T, H, KD = kc.B, kc.T, kc.H, kc.KD
    x, w, s, valid = make_inputs(T, jax.random.PRNGKey(0), jnp.bfloat16)

    def step(a, c):
        x, w, valid = a
        return kp.reference(x, w, c[1], valid, gate=gate)

    us = time_loop(step, (x, w, valid), (jnp.zeros((B, T, H, KD), jnp.bfloat16), s), lo=1, hi=2)
    record(gate, "XLA reference (jnp chunked form, HIGHEST)", us, T, None, ceiling)


def bench_fla(gate, ceiling):
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        log(f"  fla unavailable: {type(e).__name__}: {e}")
        return
    B, T, H, KD = kc.B, kc.T, kc.H, kc.KD
    try:
        dev, bf = "cuda", torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)
        rn = lambda *shape, dt=bf, s=1.0: (s * torch.randn(*shape, device=dev, generator=gen)).to(dt)  # noqa: E731
        q, k, v, g = (rn(B, T, H, KD) for _ in range(4))
        beta = rn(B, T, H)
        a_log = torch.log(torch.linspace(1.0, 16.0, H, device=dev))
        dt_bias = rn(H * KD, dt=torch.float32, s=0.5)
        h0 = rn(B, H, KD, KD, dt=torch.float32, s=0.1)
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
        if gate == "safe":
            kw.update(safe_gate=True, lower_bound=-5.0)

        def call():
            return chunk_kda(q, k, v, g, beta, **kw)

        with torch.inference_mode():
            us = time_torch_graph([call] * 10)
        record(gate, "fla chunk_kda (no conv, no gated norm; CUDA graph)", us, T, None,
               ceiling)
    except Exception as e:  # noqa: BLE001
        log(f"  fla FAILED: {type(e).__name__}: {str(e)[:600]}")
        log(traceback.format_exc()[-1500:])


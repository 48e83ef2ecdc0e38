"""Random inputs and float64 helpers shared by the MoE kernel tests (fused, grouped, tiles)."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import experts
from pallas_kernels.quant import QuantizedWeight, dequantize

E, D, I = 13, 256, 128  # experts, model dim, expert inter dim: small, E not a power of two


def expert_weights(rng, bits, symmetric=True, group_size=128):
    """(w13 [E, D, 2I], w2 [E, I, D]) in bf16, or quantised (`experts.quantize_experts`) when bits."""
    w13 = jnp.asarray(rng.standard_normal((E, D, 2 * I)) * 0.06, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((E, I, D)) * 0.09, jnp.bfloat16)
    if bits is None:
        return w13, w2
    q = experts.quantize_experts(w13, w2, bits=bits, group_size=group_size, symmetric=symmetric, block_n=64)
    return q.w13, q.w2


def dense32(w):
    """[E, K, N] float32 in x @ W orientation, from either format (exact for quantised weights)."""
    if isinstance(w, QuantizedWeight):
        return jax.vmap(dequantize)(w).transpose(0, 2, 1)
    return w.astype(jnp.float32)


def dense64(w):
    return np.asarray(dense32(w), np.float64)


def routing(rng, m, k, kind):
    """(ids [M, k] int32, weights [M, k]) with distinct experts per token. kind "one": every token
    on the same k experts; "skewed": a few popular experts (ragged counts); else uniform."""
    if kind == "one":
        ids = np.tile(rng.choice(E, k, replace=False), (m, 1))
    elif kind == "skewed":
        ids = np.stack([rng.choice(E, k, replace=False, p=np.r_[[8.0] * 3, [1.0] * (E - 3)] / (24 + E - 3))
                        for _ in range(m)])
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(m)]).reshape(m, k)
    w = rng.random((m, k)).astype(np.float32) + 0.1
    return jnp.asarray(ids, jnp.int32), jnp.asarray(w)


def swiglu64(g, u, limit):
    g = g / (1 + np.exp(-g))
    if limit is not None:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g * u

"""Norms and rotary embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe.nn import param
from pallas_kernels.rmsnorm import rms_norm


class RMSNorm(nnx.Module):
    """As transformers: normalise in fp32, round to the input dtype, then scale. With kernels, a
    decode or verify step's rows run `pallas_kernels.rmsnorm` (one launch, the residual add in it)."""

    def __init__(self, d: int, eps: float, *, dtype, rngs: nnx.Rngs, axis_name: str = "norm",
                 kernels: str = "reference"):
        self.weight = param(rngs, (d,), (axis_name,), dtype, init="ones")
        self.eps = eps
        self.kernels = kernels  # the kernel backend (pallas_kernels.backend)

    @jax.named_scope("norm")
    def __call__(self, x, residual=None):
        """norm(x) [..., D], or with a residual (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight[...], eps=self.eps, residual=residual, backend=self.kernels)


def rope_angles(positions, dim: int, theta: float):
    """positions [B, T] -> (cos, sin) [B, T, dim // 2] in fp32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope_interleaved(x, cos, sin):
    """Rotates interleaved pairs (x0, x1), (x2, x3), ... of x [B, T, ..., P].

    The result is written de-interleaved, [rotated evens | rotated odds], as transformers does: the
    same permutation applies to queries and keys, so every q.k product equals the interleaved
    rotation's. cos, sin [B, T, P/2] broadcast over the middle (head) axes.
    """
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

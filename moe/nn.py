"""Parameter-holding building blocks shared by the model (`ling`) and the MoE block.

Every weight is declared once, here or in the module that owns it, with its logical axis names
(`logical_axes` metadata on the `nnx.Param`), so that an expert-parallel or tensor-parallel layout
is a table of rules from these names to mesh axes, not a rewrite.
Logical axes: "vocab", "embed" (hidden D), "mlp" (dense/expert intermediate), "heads" (a flattened
heads x head-dim projection axis), "kv_lora" (MLA latent), "experts", "norm" (a small per-channel
vector), "conv" (conv taps).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.quant import QuantizedWeight


def param(rngs: nnx.Rngs, shape, axes: tuple[str, ...], dtype, *, init: str = "normal", std: float = 0.02) -> nnx.Param:
    assert len(axes) == len(shape), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = normal(rngs.params(), tuple(shape), dtype, std)
    return nnx.Param(value, logical_axes=axes)


DRAW_CHUNK = 1 << 24  # elements an array of random weights is drawn by at most


def normal(key, shape: tuple, dtype, std: float):
    """std * N(0, 1) [shape], drawn in fp32 and rounded to dtype, so a model is the same function
    whatever its dtype. Past DRAW_CHUNK elements the array is drawn a block of leading-axis slices
    at a time (slice i from fold_in(key, i); a block is the most slices that divide shape[0] and
    hold at most DRAW_CHUNK elements), so that the draw's fp32 temporaries, several times the
    bytes drawn at once, are a block's and not the whole array's."""
    if math.prod(shape) <= DRAW_CHUNK or len(shape) < 2:
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    rows = shape[0]
    per = min(rows, max(1, DRAW_CHUNK // math.prod(shape[1:])))
    block = next(b for b in range(per, 0, -1) if rows % b == 0)  # dividing rows: no remainder to stitch on
    return _normal_blocks(key, shape, jnp.dtype(dtype), float(std), block)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std", "block"))
def _normal_blocks(key, shape, dtype, std, block):
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(shape[0]))
    return jax.lax.map(lambda k: (std * jax.random.normal(k, shape[1:], jnp.float32)).astype(dtype), keys,
                       batch_size=block)


def dot(x, w):
    """x @ w with fp32 accumulation, rounded once to x's dtype."""
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


class QuantizedParams(nnx.Module):
    """A `QuantizedWeight` held as Params with logical axes: its words and scales (and zeros) after
    the `lead` axes (("experts",) for stacked experts), its static fields as attributes."""

    def __init__(self, qw: QuantizedWeight, lead: tuple[str, ...] = ()):
        inner = ("rows",) if qw.layout == "rows" else ("tiles",)
        last = () if qw.layout == "rows" else ("tile_rows",)
        self.words = nnx.Param(qw.words, logical_axes=(*lead, *inner, "words", *last))
        self.scales = nnx.Param(qw.scales, logical_axes=(*lead, *inner, "groups", *last))
        self.zeros = None if qw.zeros is None else nnx.Param(qw.zeros, logical_axes=(*lead, *inner, "groups", *last))
        self.bits, self.group_size, self.symmetric, self.shape = qw.bits, qw.group_size, qw.symmetric, qw.shape
        self.layout = qw.layout

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.words[...], self.scales[...], None if self.zeros is None else self.zeros[...],
                               self.bits, self.group_size, self.symmetric, self.shape, self.layout)


class Linear(nnx.Module):
    """y = x @ kernel, kernel [d_in, d_out] (the transpose of a torch Linear weight), no bias."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (d_in, d_out), axes, dtype)

    @jax.named_scope("proj")
    def __call__(self, x):
        return dot(x, self.kernel[...])


def swiglu(gate, up, limit: float | None = None):
    """silu(gate) * up, with the optional clamp `min(silu(g), L) * clamp(u, -L, L)`; fp32 inside."""
    g = jax.nn.silu(gate.astype(jnp.float32))
    u = up.astype(jnp.float32)
    if limit is not None:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return (g * u).astype(gate.dtype)

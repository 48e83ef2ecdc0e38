"""Grouped low-bit weight codec in the tile-transposed layout.

A weight W [N, K] (out, in — a torch Linear weight) is cut into groups of G input columns. Each
group of one row has a bf16 scale s (and, when asymmetric, an integer zero z stored as bf16) and
b-bit unsigned codes u in [0, 2^b), with  W ≈ (u - z) * s  (symmetric: z = 2^(b-1), implicit).

Packing. 32/b codes share one uint32 word. Inside a group, word w (0 <= w < WPG = G*b/32) holds
the columns  w + i*WPG  in bits [i*b, (i+1)*b) for lane i = 0 .. 32/b - 1. So lane i of a group's
words lines up with the contiguous activation slice x[g*G + i*WPG : g*G + (i+1)*WPG], which lets
a kernel unpack one lane of a whole [words, B_N] tile with one shift-and-mask and multiply it by a
contiguous slice of x.

Tile transposition. N is padded up to a multiple of B_N (padded rows are all-zero weights) and
the packed rows are stored as words [n_tiles, WPR, B_N] (WPR = K*b/32 words per row), scales and
zeros as [n_tiles, K/G, B_N]: the B_N words of one column-group index are adjacent, so a tile's
read is unit-stride and a skipped tile is simply never addressed.

Cost per weight: b + 16/G bits (symmetric), b + 32/G (asymmetric); 4.125 bits for int4, G = 128.

Idempotence. `quantize(dequantize(qw))` reproduces qw's words, scales and zeros exactly: the
dequantised values (u - z) * s are exact in float32 (an 8-bit integer times a bf16), and the
parameter rules map such a lattice back onto itself:
  symmetric   s = bf16_nearest(max|w| / qmax), qmax = 2^(b-1) - 1; the largest |w| lands on
              code +-qmax (bf16 rounding moves it by < 0.5 code), so max|W'| = qmax * s again.
  asymmetric  range [lo, hi] = [min(w, 0), max(w, 0)], s = bf16_floor((hi - lo) / L),
              L = 2^b - 1, z = -round(lo / s). Rounding s down makes the codes of lo and hi span
              at least L steps, clipping makes it exactly [0, L], so W' has range
              [-z s, (L - z) s] and gives back the same s and z.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

BITS = (2, 4, 8)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["words", "scales", "zeros"],
    meta_fields=["bits", "group_size", "symmetric", "shape"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantised [N, K] weight in the tile-transposed layout (see the module docstring)."""

    words: jax.Array  # uint32 [n_tiles, WPR, B_N]
    scales: jax.Array  # bf16 [n_tiles, K // G, B_N]
    zeros: jax.Array | None  # bf16 [n_tiles, K // G, B_N] integer codes; None when symmetric
    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, int]  # (N, K) of the unpadded weight

    @property
    def block_n(self) -> int:
        return self.words.shape[2]

    @property
    def n_tiles(self) -> int:
        return self.words.shape[0]

    @property
    def words_per_row(self) -> int:
        return self.words.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a full matvec must read: words, scales and zeros of every tile."""
        arrays = [self.words, self.scales] + ([] if self.zeros is None else [self.zeros])
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays)


def check_config(k: int, bits: int, group_size: int, block_n: int) -> None:
    """Raise ValueError naming the argument that makes (K, bits, group_size, block_n) invalid."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 32, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size={group_size} must divide K={k} (the input dimension of w)")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")


def _bf16_nearest(v):  # f32 -> f32 holding a bf16 value
    return v.astype(jnp.bfloat16).astype(jnp.float32)


def _bf16_floor(v):  # non-negative finite f32 -> largest bf16 <= v, as f32
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _round(v):  # round half up: one rounding rule for lo and for every code (see asymmetric)
    return jnp.floor(v + 0.5)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "block_n"))
def quantize_arrays(w, *, bits, group_size, symmetric, block_n):
    n, k = w.shape
    g, vpw = group_size, 32 // bits
    n_pad = -n % block_n
    w = jnp.pad(w.astype(jnp.float32), ((0, n_pad), (0, 0)))  # [Np, K]
    wg = w.reshape(n + n_pad, k // g, g)  # [Np, NG, G]
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        s = _bf16_nearest(jnp.max(jnp.abs(wg), axis=2) / qmax)  # [Np, NG]
        s = jnp.where(s == 0, 1.0, s)  # an all-zero group: any scale, codes 0
        q = jnp.clip(jnp.round(wg / s[..., None]), -qmax, qmax)
        u = q + 2 ** (bits - 1)
        z = None
    else:
        top = 2**bits - 1
        lo = jnp.minimum(jnp.min(wg, axis=2), 0.0)  # [Np, NG]
        hi = jnp.maximum(jnp.max(wg, axis=2), 0.0)
        s = _bf16_floor((hi - lo) / top)
        s = jnp.where(s == 0, 1.0, s)
        z = jnp.clip(-_round(lo / s), 0, top)
        u = jnp.clip(_round(wg / s[..., None]) + z[..., None], 0, top)
    u = u.astype(jnp.uint32).reshape(n + n_pad, k // g, vpw, g // vpw)  # [Np, NG, lane, WPG]
    shifts = (jnp.arange(vpw, dtype=jnp.uint32) * bits)[:, None]  # [lane, 1]
    words = jnp.sum(u << shifts, axis=2, dtype=jnp.uint32)  # disjoint bits: sum == or
    words = words.reshape(-1, block_n, k * bits // 32).transpose(0, 2, 1)  # [T, WPR, B_N]

    def tiles(a):  # [Np, NG] -> [T, NG, B_N]
        return a.reshape(-1, block_n, k // g).transpose(0, 2, 1).astype(jnp.bfloat16)

    return words, tiles(s), None if z is None else tiles(z)


def quantize(w, *, bits=4, group_size=128, symmetric=True, block_n=128) -> QuantizedWeight:
    """Quantise w [N, K] (out, in) into groups of `group_size` input columns.

    Returns a QuantizedWeight whose words are uint32 [ceil(N / block_n), K*bits/32, block_n].
    Raises ValueError naming the argument when bits, group_size, block_n or w's shape is invalid.
    """
    if getattr(w, "ndim", None) != 2:
        raise ValueError(f"w must be a 2-D [N, K] array, got shape {getattr(w, 'shape', None)}")
    check_config(w.shape[1], bits, group_size, block_n)
    if not isinstance(symmetric, bool):
        raise ValueError(f"symmetric must be a bool, got {symmetric!r}")
    words, scales, zeros = quantize_arrays(
        w, bits=bits, group_size=group_size, symmetric=symmetric, block_n=block_n
    )
    return QuantizedWeight(words, scales, zeros, bits, group_size, symmetric, tuple(w.shape))


@jax.jit
def codes(qw: QuantizedWeight) -> jax.Array:
    """The unsigned codes u as uint32 [N, K] in natural column order (undoes packing and tiling)."""
    n, k = qw.shape
    vpw, (t, _, bn) = 32 // qw.bits, qw.words.shape
    words = qw.words.transpose(0, 2, 1).reshape(t * bn, k // qw.group_size, 1, -1)  # [Np, NG, 1, WPG]
    shifts = (jnp.arange(vpw, dtype=jnp.uint32) * qw.bits)[:, None]  # [lane, 1]
    u = (words >> shifts) & jnp.uint32(2**qw.bits - 1)  # [Np, NG, lane, WPG]
    return u.reshape(t * bn, k)[:n]


@jax.jit
def group_params(qw: QuantizedWeight) -> tuple[jax.Array, jax.Array]:
    """Per-group (scale, zero) as float32 [N, K // G]."""
    n, k = qw.shape

    def untile(a):
        return a.transpose(0, 2, 1).reshape(-1, k // qw.group_size)[:n].astype(jnp.float32)

    s = untile(qw.scales)
    z = jnp.full_like(s, 2 ** (qw.bits - 1)) if qw.zeros is None else untile(qw.zeros)
    return s, z


@jax.jit
def dequantize(qw: QuantizedWeight) -> jax.Array:
    """W' = (u - z) * s as float32 [N, K]; exact (an 8-bit integer times a bf16 scale)."""
    n, k = qw.shape
    s, z = group_params(qw)  # [N, NG]
    u = codes(qw).astype(jnp.float32).reshape(n, k // qw.group_size, qw.group_size)
    return ((u - z[..., None]) * s[..., None]).reshape(n, k)

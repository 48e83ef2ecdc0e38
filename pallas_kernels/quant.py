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

Row layout (int4 or int8, G = 128; `layout="rows"`). The tensor-core kernels
(pallas_kernels.triton_qmatvec) read each row's words in place: words [N, K*b/32], scales and zeros
[N, K/G], no padding. Inside a group of 128 columns, word m holds in lane j (bits [bj, bj + b))
the column ROW_ORDERS[b][m, j]:

    int4 (16 words of 8):  16*(2*(j % 4) + (m % 4) // 2) + 8*(m % 2) + 2*(m // 4) + j // 4
    int8 (32 words of 4):  16*(4*(m // 16) + m % 4) + 8*(j % 2) + 2*((m % 16) // 4) + j // 2

the column order of a wgmma A fragment: thread t of a quad loads words 4t..4t+3 of a row (int8:
also 16 + 4t..16 + 4t + 3), 128 bits at a time, and its magic-number unpack of one word's nibbles
at shifts 0, 4, 8, 12 gives bf16x2 registers whose halves are exactly the columns
{16b + 8h + 2t + p} the tensor core expects from it (int8: a byte's two nibbles, combined), so no
shuffle and no permutation of x is needed.

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
LAYOUTS = ("tiles", "rows")
ROW_BLOCK = 128  # columns of one row-layout group
ROW_BITS = (4, 8)


def _row_order(bits: int) -> np.ndarray:
    if bits == 4:
        m, j = np.arange(16)[:, None], np.arange(8)[None, :]
        return 16 * (2 * (j % 4) + (m % 4) // 2) + 8 * (m % 2) + 2 * (m // 4) + j // 4
    m, j = np.arange(32)[:, None], np.arange(4)[None, :]
    return 16 * (4 * (m // 16) + m % 4) + 8 * (j % 2) + 2 * ((m % 16) // 4) + j // 2


ROW_ORDERS = {b: _row_order(b) for b in ROW_BITS}  # [word, lane] -> column in the group
ROW_INVERSES = {b: np.argsort(o.ravel()) for b, o in ROW_ORDERS.items()}  # column -> word * lanes + lane


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["words", "scales", "zeros"],
    meta_fields=["bits", "group_size", "symmetric", "shape", "layout"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantised [N, K] weight in the tile-transposed layout or the row layout (see the module
    docstring). Stacked experts carry a leading E axis on words, scales and zeros."""

    words: jax.Array  # uint32 tiles: [n_tiles, WPR, B_N]; rows: [N, WPR]
    scales: jax.Array  # bf16 tiles: [n_tiles, K // G, B_N]; rows: [N, K // G]
    zeros: jax.Array | None  # bf16 integer codes, shaped as scales; None when symmetric
    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, int]  # (N, K) of the unpadded weight
    layout: str = "tiles"  # LAYOUTS

    @property
    def block_n(self) -> int:
        return 1 if self.layout == "rows" else self.words.shape[-1]

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


def check_config(k: int, bits: int, group_size: int, block_n: int, layout: str = "tiles") -> None:
    """Raise ValueError naming the argument that makes (K, bits, group_size, block_n, layout)
    invalid (block_n is not used by the row layout)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "rows" and (bits not in ROW_BITS or group_size != ROW_BLOCK):
        raise ValueError(f"the row layout holds int4 or int8 in groups of {ROW_BLOCK}: got bits={bits}, "
                         f"group_size={group_size}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 32, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size={group_size} must divide K={k} (the input dimension of w)")
    if layout == "tiles" and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")


def _bf16_nearest(v):  # f32 -> f32 holding a bf16 value
    return v.astype(jnp.bfloat16).astype(jnp.float32)


def _bf16_floor(v):  # non-negative finite f32 -> largest bf16 <= v, as f32
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _round(v):  # round half up: one rounding rule for lo and for every code (see asymmetric)
    return jnp.floor(v + 0.5)


def _quantize_codes(w, *, bits, group_size, symmetric):
    """w f32 [N, K] -> (codes u f32 [N, NG, G], scales s f32 [N, NG], zeros z f32 [N, NG] | None)."""
    n, k = w.shape
    wg = w.reshape(n, k // group_size, group_size)  # [N, NG, G]
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        s = _bf16_nearest(jnp.max(jnp.abs(wg), axis=2) / qmax)  # [N, NG]
        s = jnp.where(s == 0, 1.0, s)  # an all-zero group: any scale, codes 0
        q = jnp.clip(jnp.round(wg / s[..., None]), -qmax, qmax)
        return q + 2 ** (bits - 1), s, None
    top = 2**bits - 1
    lo = jnp.minimum(jnp.min(wg, axis=2), 0.0)  # [N, NG]
    hi = jnp.maximum(jnp.max(wg, axis=2), 0.0)
    s = _bf16_floor((hi - lo) / top)
    s = jnp.where(s == 0, 1.0, s)
    z = jnp.clip(-_round(lo / s), 0, top)
    return jnp.clip(_round(wg / s[..., None]) + z[..., None], 0, top), s, z


def _pack(u, s, z, *, bits, group_size, block_n, layout):
    """Codes u [Np, K] (natural column order; Np a multiple of block_n for tiles) and per-group
    s, z [Np, NG] -> (words, scales, zeros) in `layout`."""
    n, k = u.shape
    vpw = 32 // bits
    u = u.astype(jnp.uint32)
    if layout == "rows":
        lanes = u.reshape(n, k // ROW_BLOCK, ROW_BLOCK)[..., ROW_ORDERS[bits]]  # [N, NB, word, lane]
        shifts = jnp.arange(vpw, dtype=jnp.uint32) * bits  # [lane]
        words = jnp.sum(lanes << shifts, axis=3, dtype=jnp.uint32).reshape(n, k * bits // 32)

        def params(a):
            return a.astype(jnp.bfloat16)
    else:
        u = u.reshape(n, k // group_size, vpw, group_size // vpw)  # [Np, NG, lane, WPG]
        shifts = (jnp.arange(vpw, dtype=jnp.uint32) * bits)[:, None]  # [lane, 1]
        words = jnp.sum(u << shifts, axis=2, dtype=jnp.uint32)  # disjoint bits: sum == or
        words = words.reshape(-1, block_n, k * bits // 32).transpose(0, 2, 1)  # [T, WPR, B_N]

        def params(a):  # [Np, NG] -> [T, NG, B_N]
            return a.reshape(-1, block_n, k // group_size).transpose(0, 2, 1).astype(jnp.bfloat16)

    return words, params(s), None if z is None else params(z)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "block_n", "layout"))
def quantize_arrays(w, *, bits, group_size, symmetric, block_n, layout="tiles"):
    n, k = w.shape
    n_pad = -n % block_n if layout == "tiles" else 0
    w = jnp.pad(w.astype(jnp.float32), ((0, n_pad), (0, 0)))  # [Np, K]
    u, s, z = _quantize_codes(w, bits=bits, group_size=group_size, symmetric=symmetric)
    return _pack(u.reshape(n + n_pad, k), s, z, bits=bits, group_size=group_size, block_n=block_n,
                 layout=layout)


def quantize(w, *, bits=4, group_size=128, symmetric=True, block_n=128, layout="tiles") -> QuantizedWeight:
    """Quantise w [N, K] (out, in) into groups of `group_size` input columns.

    Returns a QuantizedWeight whose words are uint32 [ceil(N / block_n), K*bits/32, block_n]
    (layout "tiles") or [N, K*bits/32] (layout "rows": int4 or int8, groups of 128).
    Raises ValueError naming the argument when bits, group_size, block_n, layout or w's shape is
    invalid.
    """
    if getattr(w, "ndim", None) != 2:
        raise ValueError(f"w must be a 2-D [N, K] array, got shape {getattr(w, 'shape', None)}")
    check_config(w.shape[1], bits, group_size, block_n, layout)
    if not isinstance(symmetric, bool):
        raise ValueError(f"symmetric must be a bool, got {symmetric!r}")
    words, scales, zeros = quantize_arrays(
        w, bits=bits, group_size=group_size, symmetric=symmetric, block_n=block_n, layout=layout
    )
    return QuantizedWeight(words, scales, zeros, bits, group_size, symmetric, tuple(w.shape), layout)


@jax.jit
def codes(qw: QuantizedWeight) -> jax.Array:
    """The unsigned codes u as uint32 [N, K] in natural column order (undoes packing and tiling)."""
    n, k = qw.shape
    vpw = 32 // qw.bits
    mask = jnp.uint32(2**qw.bits - 1)
    if qw.layout == "rows":
        words = qw.words.reshape(n, k // ROW_BLOCK, ROW_BLOCK // vpw, 1)  # [N, NB, word, 1]
        lanes = (words >> (jnp.arange(vpw, dtype=jnp.uint32) * qw.bits)) & mask  # [N, NB, word, lane]
        return lanes.reshape(n, k // ROW_BLOCK, ROW_BLOCK)[..., ROW_INVERSES[qw.bits]].reshape(n, k)
    t, _, bn = qw.words.shape
    words = qw.words.transpose(0, 2, 1).reshape(t * bn, k // qw.group_size, 1, -1)  # [Np, NG, 1, WPG]
    shifts = (jnp.arange(vpw, dtype=jnp.uint32) * qw.bits)[:, None]  # [lane, 1]
    u = (words >> shifts) & mask  # [Np, NG, lane, WPG]
    return u.reshape(t * bn, k)[:n]


def _untile(a, qw: QuantizedWeight):  # scales or zeros -> [N, NG] in their stored dtype
    if qw.layout == "rows":
        return a
    return a.transpose(0, 2, 1).reshape(-1, a.shape[1])[: qw.shape[0]]


@jax.jit
def group_params(qw: QuantizedWeight) -> tuple[jax.Array, jax.Array]:
    """Per-group (scale, zero) as float32 [N, K // G]."""
    s = _untile(qw.scales, qw).astype(jnp.float32)
    z = jnp.full_like(s, 2 ** (qw.bits - 1)) if qw.zeros is None else _untile(qw.zeros, qw).astype(jnp.float32)
    return s, z


@functools.partial(jax.jit, static_argnames=("layout", "block_n"))
def relayout(qw: QuantizedWeight, layout: str, block_n: int = 128) -> QuantizedWeight:
    """The same codes, scales and zeros in another layout (exact; "rows" needs int4 or int8, G = 128)."""
    check_config(qw.shape[1], qw.bits, qw.group_size, block_n, layout)
    n, k = qw.shape
    u = codes(qw)
    s = _untile(qw.scales, qw)
    z = None if qw.zeros is None else _untile(qw.zeros, qw)
    if layout == "tiles":
        pad = ((0, -n % block_n), (0, 0))  # padded rows as quantize makes them: zero weights
        u = jnp.pad(u, pad, constant_values=2 ** (qw.bits - 1) if qw.symmetric else 0)
        s = jnp.pad(s, pad, constant_values=1)
        z = None if z is None else jnp.pad(z, pad)
    words, scales, zeros = _pack(u, s, z, bits=qw.bits, group_size=qw.group_size, block_n=block_n,
                                 layout=layout)
    return QuantizedWeight(words, scales, zeros, qw.bits, qw.group_size, qw.symmetric, qw.shape, layout)


def take_rows(qw: QuantizedWeight, rows) -> QuantizedWeight:
    """The weight's rows `rows` (int [R], each in [0, N)) as a QuantizedWeight [R, K] in the same
    layout, exactly: a row's words, scales and zeros are its own in both layouts, so they are
    gathered, never unpacked. Tiles: the R rows re-tiled with qw's B_N, padded as `quantize` pads
    (zero weights)."""
    rows = jnp.asarray(rows, jnp.int32)
    if rows.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    return _take_rows(qw, rows)


@jax.jit
def _take_rows(qw: QuantizedWeight, rows) -> QuantizedWeight:
    n, k = qw.shape
    r = rows.shape[0]
    if qw.layout == "rows":
        zeros = None if qw.zeros is None else qw.zeros[rows]
        return dataclasses.replace(qw, words=qw.words[rows], scales=qw.scales[rows], zeros=zeros, shape=(r, k))
    bn = qw.block_n
    pad = -r % bn
    vpw = 32 // qw.bits
    code = 2 ** (qw.bits - 1) if qw.symmetric else 0  # a padded row's code: a zero weight
    pad_word = sum(code << (i * qw.bits) for i in range(vpw))

    def gather(a, fill):  # [T, X, B_N] -> the rows' [T', X, B_N]
        flat = a.transpose(0, 2, 1).reshape(-1, a.shape[1])[rows]  # [R, X]
        flat = jnp.concatenate([flat, jnp.full((pad, a.shape[1]), fill, a.dtype)])
        return flat.reshape(-1, bn, a.shape[1]).transpose(0, 2, 1)

    zeros = None if qw.zeros is None else gather(qw.zeros, 0)
    return dataclasses.replace(qw, words=gather(qw.words, np.uint32(pad_word)), scales=gather(qw.scales, 1),
                               zeros=zeros, shape=(r, k))


@jax.jit
def dequantize(qw: QuantizedWeight) -> jax.Array:
    """W' = (u - z) * s as float32 [N, K]; exact (an 8-bit integer times a bf16 scale)."""
    n, k = qw.shape
    s, z = group_params(qw)  # [N, NG]
    u = codes(qw).astype(jnp.float32).reshape(n, k // qw.group_size, qw.group_size)
    return ((u - z[..., None]) * s[..., None]).reshape(n, k)

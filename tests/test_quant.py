"""The grouped low-bit codec: layout, exactness, idempotence, error bound, argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant import (ROW_ORDERS, QuantizedWeight, codes, dequantize, group_params, quantize, relayout,
                                  take_rows)

CONFIGS = [(b, g, sym) for b in (2, 4, 8) for g in (32, 128) for sym in (True, False)]
# Every bit width and both modes, each with one of the group sizes (keeps compile time down).
SOME = [(2, 32, True), (2, 128, False), (4, 128, True), (4, 32, False), (8, 32, True), (8, 128, False)]


def _weights(rng, n, k, offset=0.0):
    # Rows of very different magnitude, optionally shifted (one-sided groups for asymmetric).
    w = rng.standard_normal((n, k)) * rng.uniform(0.01, 3.0, (n, 1)) + offset
    return jnp.asarray(w, jnp.bfloat16)


@pytest.mark.parametrize("bits,group_size,symmetric", SOME)
def test_shapes_and_layout(bits, group_size, symmetric):
    rng = np.random.default_rng(bits * 1000 + group_size)
    n, k, bn = 70, 256, 32  # N not a multiple of block_n: 3 tiles, the last one padded
    w = _weights(rng, n, k)
    qw = quantize(w, bits=bits, group_size=group_size, symmetric=symmetric, block_n=bn)
    wpr, vpw, wpg = k * bits // 32, 32 // bits, group_size * bits // 32
    assert qw.words.shape == (3, wpr, bn) and qw.words.dtype == jnp.uint32
    assert qw.scales.shape == (3, k // group_size, bn) and qw.scales.dtype == jnp.bfloat16
    assert (qw.zeros is None) == symmetric
    assert (qw.bits, qw.group_size, qw.symmetric, qw.shape) == (bits, group_size, symmetric, (n, k))
    assert dequantize(qw).shape == (n, k)

    # The documented layout, element by element: lane i of word (t, g*WPG + w, r) is the code of
    # row t*B_N + r, column g*G + i*WPG + w; the codes are round(w / s) + z.
    s, z = (np.asarray(a) for a in group_params(qw))
    wf = np.asarray(w, np.float32).reshape(n, k // group_size, group_size) / s[..., None]
    if symmetric:  # round half to even, codes +-qmax around z = 2^(b-1)
        qmax = 2 ** (bits - 1) - 1
        u = np.clip(np.round(wf), -qmax, qmax) + z[..., None]
    else:  # round half up, codes [0, 2^b - 1]
        u = np.clip(np.floor(wf + 0.5) + z[..., None], 0, 2**bits - 1)
    u = u.reshape(n, k).astype(np.uint32)
    got = np.asarray(codes(qw))
    # XLA may divide through a reciprocal: only exact rounding ties may come out the other way.
    tie = (np.abs(np.abs(wf - np.floor(wf)) - 0.5) < 1e-4).reshape(n, k)
    assert np.all((got == u) | tie)
    u = got
    words = np.asarray(qw.words)
    for row in (0, 33, n - 1):
        t, r = divmod(row, bn)
        for col in (0, 5, group_size + 3, k - 1):
            g, c = divmod(col, group_size)
            i, wi = divmod(c, wpg)
            word = int(words[t, g * wpg + wi, r])
            assert (word >> (i * bits)) & (2**bits - 1) == u[row, col], (row, col)
    assert vpw * wpg == group_size
    # Padded rows hold zero weights.
    assert float(jnp.abs(dequantize(QuantizedWeight(
        qw.words, qw.scales, qw.zeros, bits, group_size, symmetric, (3 * bn, k)))[n:]).max()) == 0


@pytest.mark.parametrize("bits,group_size,symmetric", CONFIGS)
def test_idempotent(bits, group_size, symmetric):
    rng = np.random.default_rng(7 + bits + group_size)
    n, k = 48, 256
    w = np.asarray(_weights(rng, n, k, offset=0.0 if symmetric else 0.7), np.float32)
    w[3] = 0.0  # an all-zero row
    w[4] = 1.5  # a constant row
    w[5, : k // 2] = -np.abs(w[5, : k // 2])  # one-sided groups
    qw = quantize(jnp.asarray(w), bits=bits, group_size=group_size, symmetric=symmetric, block_n=16)
    qw2 = quantize(dequantize(qw), bits=bits, group_size=group_size, symmetric=symmetric, block_n=16)
    np.testing.assert_array_equal(np.asarray(qw.words), np.asarray(qw2.words))
    np.testing.assert_array_equal(np.asarray(qw.scales), np.asarray(qw2.scales))
    if not symmetric:
        np.testing.assert_array_equal(np.asarray(qw.zeros), np.asarray(qw2.zeros))


@pytest.mark.parametrize("bits,group_size,symmetric", SOME)
def test_dequant_error_bound(bits, group_size, symmetric):
    rng = np.random.default_rng(3 * bits + group_size)
    n, k = 64, 512
    w = _weights(rng, n, k, offset=0.0 if symmetric else -0.4)
    qw = quantize(w, bits=bits, group_size=group_size, symmetric=symmetric)
    s, _ = group_params(qw)
    err = jnp.abs(dequantize(qw) - w.astype(jnp.float32)).reshape(n, k // group_size, group_size)
    # Half a step, plus (asymmetric) the bf16 rounding-down of the scale: the range may overrun
    # the 2^b - 1 steps by at most (2^b - 1) * 2^-7 of a step at its ends.
    bound = 0.5 + (0.0 if symmetric else (2**bits - 1) / 127)
    assert float((err / s[..., None]).max()) <= bound * (1 + 1e-6)
    # And the scale itself is as small as the rule allows (the bound is not vacuous).
    wf = w.astype(jnp.float32).reshape(n, k // group_size, group_size)
    span = jnp.max(jnp.abs(wf), 2) / (2 ** (bits - 1) - 1) if symmetric else (
        jnp.maximum(wf.max(2), 0) - jnp.minimum(wf.min(2), 0)) / (2**bits - 1)
    assert float(jnp.max(jnp.abs(s / span - 1))) <= 2**-7


def test_pytree_and_jit():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((40, 128)), jnp.bfloat16)
    qw = quantize(w, bits=4, group_size=64, symmetric=False, block_n=16)
    leaves, treedef = jax.tree_util.tree_flatten(qw)
    assert len(leaves) == 3
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (again.bits, again.group_size, again.symmetric, again.shape) == (4, 64, False, (40, 128))
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(qw)), np.asarray(dequantize(qw)))
    assert qw.nbytes == 3 * 16 * 16 * 4 + 2 * 3 * 2 * 16 * 2


@pytest.mark.parametrize(
    "kwargs,shape,name",
    [
        (dict(bits=3), (16, 128), "bits"),
        (dict(group_size=100), (16, 200), "group_size"),
        (dict(group_size=16), (16, 128), "group_size"),
        (dict(group_size=64), (16, 96), "group_size"),  # 64 does not divide K = 96
        (dict(block_n=48), (16, 128), "block_n"),
        (dict(symmetric=1), (16, 128), "symmetric"),
        (dict(), (128,), "w"),
    ],
)
def test_errors_name_the_argument(kwargs, shape, name):
    with pytest.raises(ValueError, match=name):
        quantize(jnp.ones(shape, jnp.bfloat16), **kwargs)


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_row_layout(bits, symmetric):
    """The row layout holds the tile layout's codes and parameters, word by word as ROW_ORDERS says,
    and relayout converts either way exactly (the tile layout's padded rows included)."""
    rng = np.random.default_rng(3)
    n, k = 70, 384
    w = _weights(rng, n, k, offset=0.0 if symmetric else 0.5)
    tiles = quantize(w, bits=bits, symmetric=symmetric, block_n=32)
    rows = quantize(w, bits=bits, symmetric=symmetric, layout="rows")
    assert rows.layout == "rows" and tiles.layout == "tiles"
    assert rows.words.shape == (n, k * bits // 32) and rows.scales.shape == (n, k // 128)
    assert (rows.zeros is None) == symmetric
    u = np.asarray(codes(tiles))
    np.testing.assert_array_equal(np.asarray(codes(rows)), u)
    np.testing.assert_array_equal(np.asarray(dequantize(rows)), np.asarray(dequantize(tiles)))
    words, order = np.asarray(rows.words), ROW_ORDERS[bits]
    wpg, vpw = order.shape
    for row in (0, 41, n - 1):
        for block in range(k // 128):
            for m in range(wpg):
                for j in range(vpw):
                    code = (int(words[row, block * wpg + m]) >> (bits * j)) & (2**bits - 1)
                    assert code == u[row, block * 128 + order[m, j]], (row, block, m, j)
    for got, want in ((relayout(rows, "tiles", 32), tiles), (relayout(tiles, "rows"), rows)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs,name", [(dict(bits=2), "bits"), (dict(group_size=64), "group_size"),
                                         (dict(layout="columns"), "layout")])
def test_row_layout_errors_name_the_argument(kwargs, name):
    w = jnp.ones((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=name):
        quantize(w, **{"layout": "rows", **kwargs})


@pytest.mark.parametrize("bits,symmetric,layout", [(4, True, "tiles"), (2, False, "tiles"), (8, True, "rows"),
                                                   (4, False, "rows")])
def test_take_rows_is_quantising_those_rows(bits, symmetric, layout):
    """A row subset (unsorted, a repeat, the last padded tile's rows) equals quantising those rows
    of W: words, scales and zeros leaf for leaf, the tile layout's padding included."""
    rng = np.random.default_rng(bits)
    n, k = 70, 256
    w = _weights(rng, n, k, offset=0.0 if symmetric else 0.5)
    kw = dict(bits=bits, group_size=128, symmetric=symmetric, layout=layout)
    if layout == "tiles":
        kw["block_n"] = 32
    ids = np.array([69, 3, 40, 3, 0, 65, 12])
    got = take_rows(quantize(w, **kw), ids)
    want = quantize(w[ids], **kw)
    assert got.shape == (len(ids), k) and got.layout == layout
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="rows"):
        take_rows(quantize(w, **kw), ids[None])

"""The fused dequantising matvec in interpret mode against dequantise-then-multiply (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qmatvec import Plan, _finish, _launch, qmatvec, reference
from pallas_kernels.quant import dequantize, quantize
from backends import KERNELS

N, BN = 100, 32  # 4 tiles, the last one ragged (4 valid rows)

# (bits, group_size, symmetric, M, K, plan): every bit width, several group sizes, both paths,
# split-K and the hand-pipelined loop.
CASES = [
    (4, 128, True, 1, 512, Plan("fma", 1, 1)),
    (4, 64, False, 3, 512, Plan("fma", 2, 1, prefetch=True)),
    (8, 128, True, 6, 256, Plan("mma", 1, 4)),
    (8, 32, False, 1, 256, Plan("fma", 1, 1, chunk_words=4)),
    (2, 256, False, 16, 512, Plan("mma", 2, 4, prefetch=True)),
    (2, 32, True, 2, 256, Plan("fma", 4, 1, prefetch=True)),
    (4, 128, False, 16, 256, Plan("mma", 2, 4)),
    (4, 128, True, 6, 256, Plan("mma", 1, 4)),  # int4's bf16 pairs, symmetric
]


def _problem(bits, group_size, symmetric, m, k, seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((N, k)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    qw = quantize(w, bits=bits, group_size=group_size, symmetric=symmetric, block_n=BN)
    return x, qw


def _check(y, x, qw, active_rows=None):
    """y agrees with x @ W'^T up to its bf16 rounding plus float32 accumulation error."""
    w = np.asarray(dequantize(qw), np.float64)
    xf = np.asarray(x, np.float64)
    exact = xf @ w.T
    bound = 2.0**-8 * np.abs(exact) + 2.0**-20 * (np.abs(xf) @ np.abs(w).T)
    y = np.asarray(y.astype(jnp.float32), np.float64)
    rows = slice(None) if active_rows is None else active_rows
    assert np.all(np.abs(y[:, rows] - exact[:, rows]) <= bound[:, rows])


def _poison(plan, m, qw):
    if plan.split == 1:
        return jnp.full((m, qw.shape[0]), jnp.nan, jnp.bfloat16)
    return jnp.full((plan.split, m, qw.n_tiles * BN), jnp.nan, jnp.float32)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("bits,group_size,symmetric,m,k,plan", CASES)
def test_kernel_matches_dequantize_then_matmul(backend, bits, group_size, symmetric, m, k, plan):
    x, qw = _problem(bits, group_size, symmetric, m, k, seed=bits * 100 + m)
    # Every tile, outputs poisoned: every element must be written, every word read exactly once.
    out, touch = _launch(x, qw, None, plan, interpret=backend == "interpret", init=_poison(plan, m, qw), count=True)
    np.testing.assert_array_equal(np.asarray(touch), 1)
    _check(_finish(out, N, plan), x, qw)

    # A tile list (unordered, with the ragged last tile): a smaller grid; only those tiles' words
    # are read, only their outputs are written.
    tiles = jnp.array([3, 1], jnp.int32)
    out, touch = _launch(x, qw, tiles, plan, interpret=backend == "interpret", init=_poison(plan, m, qw), count=True)
    touch = np.asarray(touch)
    assert touch.sum() * BN == len(tiles) * qw.words_per_row * BN
    np.testing.assert_array_equal(touch[[1, 3]], 1)
    np.testing.assert_array_equal(touch[[0, 2]], 0)
    y = np.asarray(out.astype(jnp.float32))
    written = np.zeros(y.shape[-1], bool)
    written[32:64] = written[96:] = True
    assert not np.isnan(y[..., written]).any() and np.isnan(y[..., ~written]).all()
    _check(_finish(out, N, plan), x, qw, active_rows=written[:N])


@pytest.mark.parametrize("backend", KERNELS)
def test_public_api_tiles_zero_the_rest(backend):
    x, qw = _problem(4, 128, True, 6, 256, seed=5)
    tiles = jnp.array([2, 0], jnp.int32)
    y = qmatvec(x, qw, tiles=tiles, backend=backend)  # plan_for's choice: the mma path
    ref = reference(x, qw, tiles=tiles)
    assert y.shape == (6, N) and y.dtype == jnp.bfloat16
    assert float(jnp.abs(y[:, 32:64]).max()) == 0 and float(jnp.abs(y[:, 96:]).max()) == 0
    _check(y, x, qw, active_rows=np.r_[np.ones(32, bool), np.zeros(32, bool),
                                      np.ones(32, bool), np.zeros(4, bool)])
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               rtol=2**-7, atol=1e-2)
    y1 = qmatvec(x[:1], qw, backend=backend)  # M = 1: the fma path, split K
    _check(y1, x[:1], qw)
    if jax.default_backend() == "cpu":
        assert jnp.array_equal(qmatvec(x, qw, backend="auto"), reference(x, qw))  # CPU: auto is the reference


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(backend="cuda"), "backend"),
        (dict(x=jnp.ones((17, 256), jnp.bfloat16)), "M"),
        (dict(x=jnp.ones((2, 128), jnp.bfloat16)), "x"),
        (dict(tiles=jnp.ones((2, 2), jnp.int32)), "tiles"),
    ],
)
def test_errors_name_the_argument(kwargs, name):
    _, qw = _problem(4, 128, True, 1, 256, seed=0)
    x = kwargs.pop("x", jnp.ones((1, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=name):
        qmatvec(x, qw, **kwargs)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5]], ids=["fma-m3", "mma-m16", "fma-m2-split4"])
def test_split_k_summed_by_tickets_in_the_launch(backend, case):
    """Inside a tickets scope the split partials are summed by each tile's last program: the same
    y as the XLA sum of the same partials (in split order both), every counter zero again after,
    and the scope's buffer threaded through (two calls, one after the other)."""
    from pallas_kernels import tickets

    bits, group_size, symmetric, m, k, plan = case
    x, qw = _problem(bits, group_size, symmetric, m, k, seed=11)
    want = _finish(_launch(x, qw, None, plan, interpret=backend == "interpret"), qw.shape[0], plan)

    def twice(x, counters):
        with tickets.scope(counters) as scope:
            y1 = qmatvec(x, qw, backend=backend, plan=plan)
            y2 = qmatvec(x * 2, qw, backend=backend, plan=plan)
        return y1, y2, scope.buffer

    y1, y2, counters = jax.jit(twice)(x, tickets.zeros())
    _check(y1, x, qw)
    _check(y2, x * 2, qw)
    np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(want, np.float32), rtol=2**-8, atol=0)
    assert not np.asarray(counters).any()
    ops = [e.primitive.name for e in jax.make_jaxpr(twice)(x, tickets.zeros()).jaxpr.eqns]
    assert ops.count("pallas_call") == 2 and "reduce_sum" not in ops  # no XLA sum after the launches

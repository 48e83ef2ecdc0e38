"""The fused residual add and RMSNorm kernel (interpret mode, and compiled on a GPU) against its
plain-jnp reference and transformers' formula, on fresh random rows: Ling's D (five chunks of 512),
a power of two, a D of three 32-column chunks; 1 to MAX_ROWS rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rmsnorm

from backends import KERNELS


def _close(got, want):
    """Equal up to the fp32 sum's order: a normalised element may round to the neighbouring bf16
    value (one in thousands), so one bf16 ulp (2^-7 relative) at most, and nearly all equal."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 1e-30)
    assert np.mean(got == want) > 0.99


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,d", [(1, 2560), (7, 256), (3, 96), (rmsnorm.MAX_ROWS, 512)])
def test_rms_norm_matches_transformers_formula(backend, m, d):
    rng = np.random.default_rng([m, d])
    x = jnp.asarray(rng.standard_normal((m, d)) * 3.0, jnp.bfloat16)
    w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(d), jnp.bfloat16)
    eps = 1e-6
    xf = x.astype(jnp.float32)  # transformers' RMSNorm: fp32 statistics, rounded, then scaled
    model = w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rmsnorm.reference(x, w, eps=eps), np.float32),
                                  np.asarray(model, np.float32))
    _close(rmsnorm.rms_norm(x, w, eps=eps, backend=backend), model)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("shape", [(1, 1, 2560), (2, 3, 256)])
def test_residual_add_then_norm(backend, shape):
    rng = np.random.default_rng(list(shape))
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal(shape) * 4.0, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(shape[-1]), jnp.bfloat16)
    y, h = rmsnorm.rms_norm(x, w, eps=1e-5, residual=r, backend=backend)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(x + r, np.float32))  # the add: exact
    _close(y, rmsnorm.reference(x + r, w, eps=1e-5))
    assert y.shape == h.shape == shape and y.dtype == h.dtype == jnp.bfloat16


def test_beyond_the_kernel_the_reference_runs_and_errors_name_the_argument():
    x = jnp.ones((rmsnorm.MAX_ROWS + 1, 64), jnp.bfloat16)
    w = jnp.ones((64,), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rmsnorm.rms_norm(x, w, eps=1e-6, backend="interpret")),
                                  np.asarray(rmsnorm.reference(x, w, eps=1e-6)))
    with pytest.raises(ValueError, match="w must be"):
        rmsnorm.rms_norm(x, w[:32], eps=1e-6, backend="interpret")
    with pytest.raises(ValueError, match="residual"):
        rmsnorm.rms_norm(x, w, eps=1e-6, residual=x[:2], backend="interpret")

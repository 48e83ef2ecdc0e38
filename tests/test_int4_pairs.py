"""int4_pairs and dot_acc against plain decoding and a float32 dot: the jnp rule here, the PTX and
the tensor-core accumulation on the GPU (through a one-program Pallas kernel)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.int4_pairs import dot_acc, int4_pairs, subtrahend
from backends import KERNELS


def _words_and_zeros(seed, shape=(16, 64)):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
    zeros = rng.integers(0, 16, size=(1, shape[1])).astype(np.float32)
    return words, zeros


def _decoded(words, zeros):
    return [((words >> np.uint32(4 * i)) & np.uint32(15)).astype(np.float32) - zeros for i in range(8)]


@pytest.mark.parametrize("backend", KERNELS)
def test_int4_pairs_are_the_exact_codes_minus_zero(backend):
    words, zeros = _words_and_zeros(0)
    words[0, :4] = [0, 0xFFFFFFFF, 0x0F0F0F0F, 0xF0F0F0F0]  # every lane at 0 and at 15

    def kernel(w_ref, z_ref, o_ref):
        w = w_ref[...]
        c = subtrahend(z_ref[...], w.shape)
        for i, v in enumerate(int4_pairs(w, c)):
            o_ref[i] = v

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, *words.shape), jnp.bfloat16),
                         interpret=backend == "interpret")(jnp.asarray(words), jnp.asarray(zeros))
    for i, want in enumerate(_decoded(words, zeros)):
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), want, err_msg=f"lane {i}")


def test_int4_pairs_symmetric_subtrahend():
    assert int(subtrahend(8.0, ())) == 0xC308C308  # -136 in both halves
    words, _ = _words_and_zeros(1)
    c = subtrahend(8.0, words.shape)
    for i, (got, want) in enumerate(zip(jax.jit(int4_pairs)(jnp.asarray(words), c),
                                        _decoded(words, np.float32(8.0)))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=f"lane {i}")


@pytest.mark.parametrize("backend", KERNELS)
def test_dot_acc_accumulates_a_chain(backend):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((3, 16, 32)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((3, 32, 64)), jnp.bfloat16)
    acc0 = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)

    def kernel(a_ref, b_ref, acc_ref, o_ref):
        acc = acc_ref[...]
        for i in range(3):
            acc = dot_acc(a_ref[i], b_ref[i], acc)
        o_ref[...] = acc

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32),
                         interpret=backend == "interpret")(a, b, acc0)
    want = np.asarray(acc0, np.float64) + sum(np.asarray(a[i], np.float64) @ np.asarray(b[i], np.float64)
                                              for i in range(3))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="acc float32"):
        jax.jit(dot_acc)(a[0], b[0], acc0.astype(jnp.bfloat16))

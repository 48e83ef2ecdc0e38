"""The KDA conv states' in-place advance (interpret mode, and compiled on a GPU) against the window
cut written out in numpy, on fresh random inputs: Ling's widths read as columns of a fused
projection, unequal q/k and v widths, fp32 states beside bf16 inputs, every n in 0..T."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conv_state

from backends import KERNELS


def _case(rng, b, t, widths, x_dtype, s_dtype, nw1=3):
    n_cols = sum(widths) + 64  # the fields sit in a wider projection output, past a leading field
    proj = jnp.asarray(rng.standard_normal((b, t, n_cols)), x_dtype)
    starts = tuple(64 + sum(widths[:i]) for i in range(3))
    states = tuple(jnp.asarray(rng.standard_normal((b, nw1, w)), s_dtype) for w in widths)
    n = rng.integers(0, t + 1, b).astype(np.int32)
    n[: min(b, 2)] = (0, t)[: min(b, 2)]
    return proj, starts, states, n


def _want(proj, starts, states, n):
    """window[b, n[b] : n[b] + W-1] of concat(state in x's dtype, x), back in the state's dtype."""
    out = []
    for s, st in zip(starts, states):
        x = np.asarray(proj[..., s:s + st.shape[2]].astype(jnp.float32))
        old = np.asarray(st.astype(proj.dtype).astype(jnp.float32))
        win = np.concatenate([old, x], axis=1)
        nw1 = st.shape[1]
        out.append(np.stack([win[i, c:c + nw1] for i, c in enumerate(n)]))
    return out


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
@pytest.mark.parametrize("b,t,widths,x_dtype,s_dtype", [
    (1, 1, (4096, 4096, 4096), jnp.bfloat16, jnp.bfloat16),  # Ling's decode step
    (3, 4, (64, 64, 128), jnp.bfloat16, jnp.float32),  # v wider than q/k; fp32 states
    (2, 8, (48, 48, 48), jnp.float32, jnp.float32),  # a block of 16 columns
])
def test_advance_matches_the_window_cut(backend, b, t, widths, x_dtype, s_dtype):
    rng = np.random.default_rng([b, t, *widths])
    proj, starts, states, n = _case(rng, b, t, widths, x_dtype, s_dtype)
    got = conv_state.advance([(proj, s) for s in starts], states, jnp.asarray(n), backend=backend)
    for g, w, st in zip(got, _want(proj, starts, states, n), states):
        assert g.shape == st.shape and g.dtype == st.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w.astype(np.float32))


@pytest.mark.parametrize("backend", KERNELS)
def test_advance_writes_the_donated_states_in_place(backend):
    rng = np.random.default_rng(7)
    proj, starts, states, n = _case(rng, 2, 1, (256, 256, 256), jnp.bfloat16, jnp.bfloat16)
    want = _want(proj, starts, states, n)
    before = [s.unsafe_buffer_pointer() for s in states]
    step = jax.jit(lambda st, p, n: conv_state.advance([(p, s) for s in starts], st, n, backend=backend),
                   donate_argnums=0)
    got = step(states, proj, jnp.asarray(n))
    assert [g.unsafe_buffer_pointer() for g in got] == before
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w)

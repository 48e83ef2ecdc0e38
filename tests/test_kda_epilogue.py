"""KDA decode's epilogue (interpret mode, and compiled on a GPU): the conv states' in-place advance
against the window cut written out in numpy, and the gated norm against its reference formula, on
fresh random inputs: Ling's widths read as columns of a fused projection, unequal q/k and v
widths, fp32 states beside bf16 inputs, more heads than conv blocks and fewer, every n in 0..T."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_epilogue
from pallas_kernels.kda_reference import gated_norm

from backends import KERNELS


def _case(rng, b, t, widths, x_dtype, s_dtype, nw1=3):
    n_cols = sum(widths) + 128 + widths[0]  # the fields sit in a wider projection output, past a leading field
    proj = jnp.asarray(rng.standard_normal((b, t, n_cols)), x_dtype)
    starts = tuple(128 + sum(widths[:i]) for i in range(4))  # q, k, v, then the gate (q's width)
    states = tuple(jnp.asarray(rng.standard_normal((b, nw1, w)), s_dtype) for w in widths)
    n = rng.integers(0, t + 1, b).astype(np.int32)
    n[: min(b, 2)] = (0, t)[: min(b, 2)]
    return proj, starts, states, n


def _want_states(proj, starts, states, n):
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
@pytest.mark.parametrize("b,t,widths,heads,x_dtype,s_dtype", [
    (1, 1, (4096, 4096, 4096), 32, jnp.bfloat16, jnp.bfloat16),  # Ling's decode step: 32 heads, 8 conv blocks
    (3, 4, (64, 64, 128), 1, jnp.bfloat16, jnp.float32),  # v wider than q/k; fp32 states; one head
    (2, 8, (48, 48, 48), None, jnp.float32, jnp.float32),  # a block of 16 columns; no norm
])
def test_epilogue_matches_its_formulas(backend, b, t, widths, heads, x_dtype, s_dtype):
    rng = np.random.default_rng([b, t, *widths])
    proj, starts, states, n = _case(rng, b, t, widths, x_dtype, s_dtype)
    norm = None
    if heads:
        v = widths[0] // heads
        o = jnp.asarray(rng.standard_normal((b, t, heads, v)) * 2.0, jnp.float32)
        w = jnp.asarray(1.0 + 0.1 * rng.standard_normal(v), x_dtype)
        norm = kda_epilogue.Norm(o, (proj, starts[3]), w, 1e-6)
    y, got = kda_epilogue.decode_epilogue([(proj, s) for s in starts[:3]], states, jnp.asarray(n), norm=norm,
                                          backend=backend)
    for g, want, st in zip(got, _want_states(proj, starts, states, n), states):
        assert g.shape == st.shape and g.dtype == st.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), want.astype(np.float32))
    if heads is None:
        assert y is None
        return
    gate = proj[..., starts[3]:starts[3] + widths[0]].reshape(b, t, heads, -1)
    want = np.asarray(gated_norm(o, gate, w, 1e-6), np.float32)
    got_y = np.asarray(y.astype(jnp.float32))
    assert y.dtype == proj.dtype and y.shape == o.shape
    ulp = 2.0 ** -7 if x_dtype == jnp.bfloat16 else 1e-6  # the fp32 sum's order may move one rounding
    assert np.all(np.abs(got_y - want) <= ulp * np.abs(want) + 1e-6)


@pytest.mark.parametrize("backend", KERNELS)
def test_epilogue_writes_the_donated_states_in_place(backend):
    rng = np.random.default_rng(7)
    proj, starts, states, n = _case(rng, 2, 1, (256, 256, 256), jnp.bfloat16, jnp.bfloat16)
    want = _want_states(proj, starts, states, n)
    before = [s.unsafe_buffer_pointer() for s in states]
    o = jnp.asarray(rng.standard_normal((2, 1, 4, 64)), jnp.float32)
    w = jnp.ones((64,), jnp.bfloat16)

    def step(st, p, n, o):
        norm = kda_epilogue.Norm(o, (p, starts[3]), w, 1e-6)
        return kda_epilogue.decode_epilogue([(p, s) for s in starts[:3]], st, n, norm=norm, backend=backend)

    _, got = jax.jit(step, donate_argnums=0)(states, proj, jnp.asarray(n), o)
    assert [g.unsafe_buffer_pointer() for g in got] == before
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w_)

"""The KDA short convolutions' states advanced over a decode step, written in place: the q, k and v
conv states of a layer in one launch, after the layer's KDA kernel has read them.

    window = concat(state.astype(x.dtype), x)      [B, W-1+T, C]: the state, oldest row first
    state' = window[b, n[b] : n[b] + W-1]          n[b] ∈ 0..T new tokens kept, in the state's dtype

(`kda_reference.conv_state_after` on the window: the same values, bit for bit).

Layouts: x_{q,k,v} [B, T, N] with the field's columns at a static start (a fused projection's
output, read in place) or [B, T, C]; state_{q,k,v} [B, W-1, C]; n [B] int32.
Kernel (Triton lowering): grid (B, C_max / BC), one program a channel block of BC columns of each
of q, k and v; it loads its W-1 state rows and T new rows of each before it stores any row, so
writing the state over itself (input_output_aliases) is safe: no other program reads those
columns. `after` (any array, never read) orders the launch behind the KDA kernel that reads the
old states: pass one of its outputs. Bytes: 2·3·(W-1)·C·(state bytes) + 3·T·C·(x bytes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve
from pallas_kernels.kda_reference import conv_state_after

MAX_BLOCK = 512


def reference(xs, states, n):
    """The three new conv states; xs, states: (q, k, v) [B, T, C] and [B, W-1, C] arrays."""
    nw1 = states[0].shape[1]
    return tuple(conv_state_after(jnp.concatenate([s.astype(x.dtype), x], axis=1), n, nw1).astype(s.dtype)
                 for x, s in zip(xs, states))


def block(widths) -> int:
    """BC: the largest power of two dividing every width and every field's start, at most MAX_BLOCK."""
    g = 0
    for w in widths:
        g |= w
    return min(g & -g, MAX_BLOCK)


def _kernel(n_ref, xq, xk, xv, _after, sq, sk, sv, oq, ok, ov, *, t: int, nw1: int, blocks: tuple):
    j = pl.program_id(1)
    n = n_ref[()]
    fields = list(zip((xq, xk, xv), (sq, sk, sv), (oq, ok, ov), blocks))
    loaded = [([s[r, :] for r in range(nw1)], [x[r, :] for r in range(t)]) for x, s, _, _ in fields]

    for (_, s_ref, o_ref, nb), (rows, new) in zip(fields, loaded):
        window = [r.astype(new[0].dtype) for r in rows] + new
        out = []
        for r in range(nw1):
            v = window[r]
            for i in range(1, t + 1):
                v = jnp.where(n >= i, window[r + i], v)
            out.append(v.astype(o_ref.dtype))

        def store(o_ref=o_ref, out=out):
            for r in range(nw1):
                o_ref[r, :] = out[r]

        if nb == max(blocks):
            store()
        else:
            pl.when(j < nb)(store)


@functools.partial(jax.jit, static_argnames=("starts", "interpret"))
def _advance_pallas(xs, states, n, after, *, starts, interpret):
    b, nw1, _ = states[0].shape
    t = xs[0].shape[1]
    widths = tuple(s.shape[2] for s in states)
    bc = block(widths + starts)
    blocks = tuple(w // bc for w in widths)
    nb = max(blocks)
    # A field with fewer blocks clamps the block index; its programs past the end do not store.
    x_specs = [pl.BlockSpec((None, t, bc), lambda i, j, s=s // bc, m=m - 1: (i, 0, s + jnp.minimum(j, m)))
               for s, m in zip(starts, blocks)]
    s_specs = [pl.BlockSpec((None, nw1, bc), lambda i, j, m=m - 1: (i, 0, jnp.minimum(j, m))) for m in blocks]
    after = after.reshape(-1)
    return pl.pallas_call(
        functools.partial(_kernel, t=t, nw1=nw1, blocks=blocks),
        grid=(b, nb),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (i,)), *x_specs, pl.BlockSpec((1,), lambda i, j: (0,)),
                  *s_specs],
        out_specs=s_specs,
        out_shape=[jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states],
        input_output_aliases={5: 0, 6: 1, 7: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kda_conv_state",
    )(n, *xs, after, *states)


def advance(xs, states, n, *, after=None, backend: str = "auto"):
    """The q, k, v conv states after the first n[b] of T new tokens (module docstring). xs: three
    (array [B, T, N], start) pairs or [B, T, C] arrays; states: three [B, W-1, C] arrays (written
    in place when the caller donates them); n [B]; after: an array the launch must follow."""
    pairs = [x if isinstance(x, tuple) else (x, 0) for x in xs]
    n = jnp.asarray(n, jnp.int32).reshape(states[0].shape[0])
    backend = resolve(backend)
    starts = tuple(s for _, s in pairs)
    if backend == "reference" or block(tuple(s.shape[2] for s in states) + starts) < 16:
        values = [a[..., s:s + st.shape[2]] for (a, s), st in zip(pairs, states)]
        return reference(values, states, n)
    return tuple(_advance_pallas(tuple(a for a, _ in pairs), tuple(states), n,
                                 jnp.zeros((1,), jnp.int32) if after is None else after, starts=starts,
                                 interpret=backend == "interpret"))

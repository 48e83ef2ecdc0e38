"""KDA decode's epilogue in one launch, after the KDA kernel: the gated RMSNorm of its output, and
the q, k and v conv states advanced over the step, written in place.

    y = round(o / sqrt(mean_V(o²) + eps) · w · σ(gate))     per token and head, fp32 inside
    window = concat(state.astype(x.dtype), x)               [B, W-1+T, C]: the state, oldest first
    state' = window[b, n[b] : n[b] + W-1]                   n[b] ∈ 0..T new tokens kept

(`kda_reference.gated_norm` and `kda_reference.conv_state_after`; the states bit for bit).

Layouts: o [B, T, H, V] fp32; gate, x_{q,k,v}: [B, T, N] arrays with the field's columns at a
static start (a fused projection's output, read in place; gate's start a multiple of V);
w [V]; state_{q,k,v} [B, W-1, C]; n [B] int32 -> y [B, T, H, V] in x_q's dtype, the states.
Kernel (Triton lowering): grid (B, max(H, C_max / BC)); program (b, j) normalises head j (j < H)
and advances channel block j of BC columns of each conv state (j below its block count). It
loads all its rows before it stores any, so writing a state over itself (input_output_aliases)
is safe: no other program reads those columns. Without the norm (o None: the KDA kernel fused
it), `after` (any array, never read) orders the launch behind the kernel that reads the old
states: pass one of its outputs. Bytes: T·H·V·(4 + 2·2) + 2·3·(W-1)·C·(state bytes) + 3·T·C·(x bytes).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import slot_rows
from pallas_kernels.backend import resolve
from pallas_kernels.kda_reference import conv_state_after, gated_norm

MAX_BLOCK = 512


class Norm(NamedTuple):
    """The gated norm's operands: o [B, T, H, V] fp32, gate (array [B, T, N], start), w [V], eps."""
    o: jax.Array
    gate: tuple
    w: jax.Array
    eps: float


def reference(norm: Norm | None, xs, states, n):
    """(y or None, the three new conv states); xs, states: (q, k, v) [B, T, C] and [B, W-1, C]."""
    y = None
    if norm is not None:
        (a, s), (b, t, h, v) = norm.gate, norm.o.shape
        y = gated_norm(norm.o, a[..., s:s + h * v].reshape(b, t, h, v), norm.w, norm.eps).astype(xs[0].dtype)
    nw1 = states[0].shape[1]
    return y, tuple(conv_state_after(jnp.concatenate([s.astype(x.dtype), x], axis=1), n, nw1).astype(s.dtype)
                    for x, s in zip(xs, states))


def block(widths) -> int:
    """BC: the largest power of two dividing every width and every field's start, at most MAX_BLOCK."""
    g = 0
    for w in widths:
        g |= w
    return min(g & -g, MAX_BLOCK)


def _kernel(n_ref, xq, xk, xv, sq, sk, sv, *refs, t: int, nw1: int, blocks: tuple, heads: int, grid: int,
            norm: bool, eps: float, slotted: bool):
    """slotted: refs start with rows (`slot_rows`), and the states (in and out) are the whole
    [B, W-1, C] arrays, indexed at the row's slot; a padding row stores no state."""
    rows_ref, refs = (refs[0], refs[1:]) if slotted else (None, refs)
    if norm:
        o_ref, g_ref, w_ref, oq, ok, ov, y_ref = refs
    else:
        _after, oq, ok, ov = refs
    j = pl.program_id(1)
    n = n_ref[()]
    if slotted:  # one indexer a load or store (the Triton lowering's limit)
        row = rows_ref[()]
        sl = slot_rows.slot(row, sq.shape[0])
        bc = xq.shape[-1]
        at = lambda r, nb: (sl, r, pl.ds(jnp.minimum(j, nb - 1) * bc, bc))  # noqa: E731
    else:
        at = lambda r, nb: (r, slice(None))  # noqa: E731
    # Every load first (each conv state's and new rows, then the norm's), then the stores.
    fields = list(zip((xq, xk, xv), (sq, sk, sv), (oq, ok, ov), blocks))
    loaded = [([s[at(r, nb)] for r in range(nw1)], [x[r, :] for r in range(t)]) for x, s, _, nb in fields]
    if norm:
        o = [o_ref[i, :] for i in range(t)]  # [V] fp32 each
        g = [g_ref[i, :] for i in range(t)]
        w = w_ref[...].astype(jnp.float32)

    def when(limit, fn, state: bool = False):  # programs past a part's end skip it
        if slotted and state:
            pl.when((j < limit) & (row < sq.shape[0]))(fn)
        elif limit == grid:
            fn()
        else:
            pl.when(j < limit)(fn)

    if norm:
        def store_norm():
            for i in range(t):
                scaled = o[i] * jax.lax.rsqrt(jnp.sum(o[i] * o[i]) / o[i].shape[0] + eps)
                y_ref[i, :] = (scaled * w * jax.nn.sigmoid(g[i].astype(jnp.float32))).astype(y_ref.dtype)
        when(heads, store_norm)

    for (_, _, o_ref_s, nb), (rows, new) in zip(fields, loaded):
        window = [r.astype(new[0].dtype) for r in rows] + new
        out = []
        for r in range(nw1):
            v = window[r]
            for i in range(1, t + 1):
                v = jnp.where(n >= i, window[r + i], v)
            out.append(v.astype(o_ref_s.dtype))

        def store(o_ref_s=o_ref_s, out=out, nb=nb):
            for r in range(nw1):
                o_ref_s[at(r, nb)] = out[r]
        when(nb, store, state=True)


@functools.partial(jax.jit, static_argnames=("starts", "eps", "interpret"))
def _epilogue_pallas(xs, states, n, o, gate, w, after, rows, *, starts, eps, interpret):
    b, t = xs[0].shape[:2]
    nw1 = states[0].shape[1]
    slotted = rows is not None
    widths = tuple(s.shape[2] for s in states)
    bc = block(widths + starts[:3])
    blocks = tuple(wd // bc for wd in widths)
    heads = 0 if o is None else o.shape[2]
    grid = max(*blocks, heads)
    # A field with fewer blocks (or heads) than the grid clamps its block index; the programs past
    # its end do not store.
    x_specs = [pl.BlockSpec((None, t, bc), lambda i, j, s=s // bc, m=m - 1: (i, 0, s + jnp.minimum(j, m)))
               for s, m in zip(starts, blocks)]
    if slotted:  # the whole states: the kernel indexes them at the row's slot
        s_specs = [pl.BlockSpec(s.shape, lambda i, j: (0, 0, 0)) for s in states]
    else:
        s_specs = [pl.BlockSpec((None, nw1, bc), lambda i, j, m=m - 1: (i, 0, jnp.minimum(j, m))) for m in blocks]
    in_specs = [pl.BlockSpec((None,), lambda i, j: (i,)), *x_specs, *s_specs]
    out_specs, out_shape = list(s_specs), [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states]
    args = [n, *xs, *states]
    if slotted:
        in_specs.append(pl.BlockSpec((None,), lambda i, j: (i,)))
        args.append(rows)
    if o is None:
        in_specs.append(pl.BlockSpec((1,), lambda i, j: (0,)))
        args.append(after.reshape(-1))
    else:
        v, last = o.shape[3], heads - 1
        in_specs += [pl.BlockSpec((None, t, None, v), lambda i, j: (i, 0, jnp.minimum(j, last), 0)),
                     pl.BlockSpec((None, t, v), lambda i, j, s=starts[3] // v: (i, 0, s + jnp.minimum(j, last))),
                     pl.BlockSpec((v,), lambda i, j: (0,))]
        args += [o, gate, w]
        out_specs.append(pl.BlockSpec((None, t, None, v), lambda i, j: (i, 0, jnp.minimum(j, last), 0)))
        out_shape.append(jax.ShapeDtypeStruct(o.shape, xs[0].dtype))
    outs = pl.pallas_call(
        functools.partial(_kernel, t=t, nw1=nw1, blocks=blocks, heads=heads, grid=grid, norm=o is not None,
                          eps=eps, slotted=slotted),
        grid=(b, grid),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={4: 0, 5: 1, 6: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kda_decode_epilogue",
    )(*args)
    return (None if o is None else outs[3]), tuple(outs[:3])


def decode_epilogue(xs, states, n, *, norm: Norm | None = None, after=None, rows=None, backend: str = "auto"):
    """(y, or None without norm; the q, k, v conv states after the first n[b] of T new tokens);
    see the module docstring. xs: three (array [B, T, N], start) pairs or [B, T, C] arrays;
    states: three [B, W-1, C] arrays (written in place when the caller donates them); n [B];
    after: without norm, an array the launch must follow. rows [B] int32 (`slot_rows`): the
    states hold every slot (any number) and row b is slot rows[b]; the states returned are the
    whole arrays, the real rows' slots advanced."""
    pairs = [x if isinstance(x, tuple) else (x, 0) for x in xs]
    n = jnp.asarray(n, jnp.int32).reshape(pairs[0][0].shape[0])
    backend = resolve(backend)
    starts = tuple(s for _, s in pairs)
    widths = tuple(s.shape[2] for s in states)
    if norm is not None:
        gate = norm.gate if isinstance(norm.gate, tuple) else (norm.gate.reshape(*norm.gate.shape[:2], -1), 0)
        norm = norm._replace(gate=gate)
    v = None if norm is None else norm.o.shape[3]
    if (backend == "reference" or block(widths + starts) < 16
            or (norm is not None and (norm.gate[1] % v or v & (v - 1)))):
        values = [a[..., s:s + st.shape[2]] for (a, s), st in zip(pairs, states)]
        if rows is None:
            return reference(norm, values, states, n)
        y, new = reference(norm, values, slot_rows.take(list(states), rows), n)
        return y, slot_rows.put(tuple(states), rows, new)
    o, gate, w, eps = (None, (None, 0), None, 0.0) if norm is None else norm
    if after is None:
        after = jnp.zeros((1,), jnp.int32)
    return _epilogue_pallas(tuple(a for a, _ in pairs), tuple(states), n, o, gate[0], w,
                            None if o is not None else after, None if rows is None else jnp.asarray(rows, jnp.int32),
                            starts=starts + (gate[1],), eps=float(eps), interpret=backend == "interpret")

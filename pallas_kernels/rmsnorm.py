"""RMSNorm, with the residual add in front of it, in one launch: the decode and verify steps' norms
(XLA makes two fusions of a norm and a third of the add).

    h = x + residual                 rounded to x's dtype (when a residual is given)
    y = w * round(h / rms(h))        rms(h) = sqrt(mean(h²) + eps) in fp32; transformers' order:
                                     the normalised row rounded to x's dtype, then times w (cast
                                     to x's dtype), the product rounded once

Layouts: x, residual [M, D]; w [D] -> y [M, D], and h [M, D] with a residual; x's dtype.
Kernel (Triton lowering): grid (M,), one program a row, which holds it in registers as D / C
chunks of C columns (C: the largest power of two dividing D, at most 4096; Ling's D = 2560: five
of 512), issues every load (x, residual, w) before it uses any, reads it once and writes y (and h)
once. Bytes: M·D·2·(2 or 4) + D·2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve

MAX_ROWS = 64  # more rows (prefill) run the reference: XLA's fusions have rows enough to fill the GPU
MAX_CHUNK = 4096


def reference(x, w, *, eps: float, residual=None):
    """y, or (y, h) with a residual; see the module docstring."""
    h = x if residual is None else x + residual.astype(x.dtype)
    xf = h.astype(jnp.float32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w.astype(x.dtype) * n.astype(x.dtype)
    return y if residual is None else (y, h)


def chunk(d: int) -> int:
    """C: the largest power of two dividing d, at most MAX_CHUNK."""
    return min(d & -d, MAX_CHUNK)


def _kernel(*refs, d: int, c: int, eps: float, add: bool):
    if add:
        x_ref, r_ref, w_ref, y_ref, h_ref = refs
    else:
        (x_ref, w_ref, y_ref), r_ref, h_ref = refs, None, None
    i = pl.program_id(0)
    parts = [pl.ds(j * c, c) for j in range(d // c)]
    # Every load is issued before the first use of any: one memory latency a program, not one a chunk.
    xs = [x_ref[i, cols] for cols in parts]
    rs = [r_ref[i, cols] for cols in parts] if add else None
    ws = [w_ref[cols] for cols in parts]
    dtype = y_ref.dtype
    rows = []
    for j, cols in enumerate(parts):
        h = xs[j]
        if add:
            h = (h.astype(jnp.float32) + rs[j].astype(jnp.float32)).astype(dtype)
            h_ref[i, cols] = h
        rows.append(h.astype(jnp.float32))
    ss = jnp.sum(sum(r * r for r in rows))  # the chunks added elementwise first: one block reduction
    inv = jax.lax.rsqrt(ss / d + eps)
    for cols, r, w in zip(parts, rows, ws):
        n = (r * inv).astype(dtype).astype(jnp.float32)
        y_ref[i, cols] = (w.astype(dtype).astype(jnp.float32) * n).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _rms_norm_pallas(x, w, residual, *, eps: float, interpret: bool):
    m, d = x.shape
    add = residual is not None
    out = jax.ShapeDtypeStruct((m, d), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, d=d, c=chunk(d), eps=eps, add=add),
        grid=(m,),
        out_shape=(out, out) if add else out,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if add else "rms_norm",
    )(*((x, residual.astype(x.dtype), w) if add else (x, w)))


def rms_norm(x, w, *, eps: float, residual=None, backend: str = "auto"):
    """y = RMSNorm(x (+ residual)) over the last axis: y, or (y, h = x + residual); x and residual
    [..., D], w [D]. The kernel runs up to MAX_ROWS rows with chunks of at least 16 columns; the
    reference otherwise (and on the reference backend)."""
    d = x.shape[-1]
    if w.shape != (d,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"w must be [D={d}] and residual x's shape {x.shape}, got {w.shape} and "
                         f"{None if residual is None else residual.shape}")
    backend = resolve(backend)
    m = x.size // d
    if backend == "reference" or m > MAX_ROWS or chunk(d) < 16:
        return reference(x, w, eps=eps, residual=residual)
    flat = lambda a: a.reshape(m, d)  # noqa: E731
    out = _rms_norm_pallas(flat(x), w, None if residual is None else flat(residual), eps=float(eps),
                           interpret=backend == "interpret")
    if residual is None:
        return out.reshape(x.shape)
    return out[0].reshape(x.shape), out[1].reshape(x.shape)

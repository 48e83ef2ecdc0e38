"""Stacked routed experts: their weight formats, shape checks, the low-bit quantiser, and the
reference every MoE kernel and the model's reference path are checked against.

    y [M, D] = sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])
    expert_e(x) = swiglu(x @ W13_e) @ W2_e,  swiglu(g, u) = silu(g) * u
                  (with a limit L: min(silu(g), L) * clamp(u, -L, L))

Layouts (x @ W orientation):
  x [M, D]; topk_ids, topk_weights [M, k]; ids >= E mark skipped pairs (weight 0, no expert read).
  w13 [E, D, 2I] gate and up INTERLEAVED by column (column 2j = gate j, 2j+1 = up j).
  w2  [E, I, D].
  Or grouped low-bit (`quantize_experts`): a `QuantizedWeight` (pallas_kernels/quant.py) whose
  arrays carry a leading E axis -- expert e's matrix in torch orientation, w13_e^T [2I, D] and
  w2_e^T [D, I] (the interleave kept on the N axis), tile-transposed words [E, T, K*b/32, B_N],
  bf16 scales [E, T, K/G, B_N]; or (layout "rows": int4, groups of 128) the row layout, words
  [E, N, K/8], scales [E, N, K/128], which the tensor-core kernels read
  (pallas_kernels/triton_qmatvec.py). `jax.vmap(quant.dequantize)` gives the experts back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant import QuantizedWeight, check_config, dequantize, quantize_arrays

@functools.partial(jax.tree_util.register_dataclass, data_fields=["w13", "w2"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """Stacked quantised experts: w13 per expert [2I, D] (interleaved rows), w2 per expert [D, I]."""

    w13: QuantizedWeight
    w2: QuantizedWeight


def quantize_experts(w13, w2, *, bits=4, group_size=128, symmetric=True, block_n=64,
                     layout="tiles") -> QuantizedExperts:
    """Quantise stacked experts w13 [E, D, 2I], w2 [E, I, D] (x @ W) into the grouped format.

    Each expert's matrix is transposed to torch orientation and quantised alone (pallas_kernels/
    quant.py), one expert at a time (`lax.map`: no fp32 copy of the whole stack); the arrays are
    stacked on a leading E axis. block_n must divide 2I and D (layout "tiles").
    """

    def stack(w, name):
        if getattr(w, "ndim", None) != 3:
            raise ValueError(f"{name} must be [E, K, N], got shape {getattr(w, 'shape', None)}")
        _, k, n = w.shape
        check_config(k, bits, group_size, block_n, layout)
        if layout == "tiles" and n % block_n:
            raise ValueError(f"block_n={block_n} must divide {name}'s output dimension {n}")
        quant = functools.partial(quantize_arrays, bits=bits, group_size=group_size, symmetric=symmetric,
                                  block_n=block_n, layout=layout)
        words, scales, zeros = lax.map(lambda we: quant(we.T), w)
        return QuantizedWeight(words, scales, zeros, bits, group_size, symmetric, (n, k), layout)

    return QuantizedExperts(stack(w13, "w13"), stack(w2, "w2"))


def expert_matrices(w, ids):
    """Experts ids [P] of w as float32 [P, K, N] (x @ W orientation); dequantised exactly."""
    if isinstance(w, QuantizedWeight):
        sub = jax.tree.map(lambda a: a[ids], w)
        return jax.vmap(dequantize)(sub).transpose(0, 2, 1)
    return w[ids].astype(jnp.float32)


def check_args(x, topk_ids, topk_weights, w13, w2) -> None:
    """Raises ValueError naming the argument whose shape or dtype does not fit the others."""
    _, d, _ = expert_dims(w13, w2)
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x must be [M, D={d}], got shape {x.shape}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [M={x.shape[0]}, k], got "
                         f"{topk_ids.shape} and {topk_weights.shape}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")


def expert_dims(w13, w2):
    """(E, D, I) from either weight format, with the shapes checked against each other."""
    if isinstance(w13, QuantizedWeight):
        if not isinstance(w2, QuantizedWeight):
            raise ValueError("w13 and w2 must both be quantised or both be arrays")
        e, (n13, d), (d2, i) = w13.words.shape[0], w13.shape, w2.shape
        e2 = w2.words.shape[0]
    else:
        if w13.ndim != 3 or w2.ndim != 3:
            raise ValueError(f"w13 must be [E, D, 2I] and w2 [E, I, D], got {w13.shape}, {w2.shape}")
        (e, d, n13), (e2, i, d2) = w13.shape, w2.shape
    if e != e2 or d != d2 or n13 != 2 * i:
        raise ValueError(f"w13 (E={e}, D={d}, 2I={n13}) and w2 (E={e2}, I={i}, D={d2}) disagree")
    return e, d, i


def rows_layout(w) -> bool:
    """Whether stacked experts w are low-bit in the row layout (the tensor-core kernels')."""
    return isinstance(w, QuantizedWeight) and w.layout == "rows"


def num_experts(w) -> int:
    """E of stacked experts in either format ([E, K, N] array or a stacked `QuantizedWeight`)."""
    return w.words.shape[0] if isinstance(w, QuantizedWeight) else w.shape[0]


def k_groups(w13: QuantizedWeight, w2: QuantizedWeight) -> tuple[int, int]:
    """Groups of K of the up and down GEMMs (D / G, I / G)."""
    return tuple(w.shape[1] // w.group_size for w in (w13, w2))


# ---------------------------------------------------------------------------------- reference
def swiglu(g, u, limit):
    """silu(g) * u in float32, with the optional clamp min(silu(g), L) * clamp(u, -L, L)."""
    g = g * jax.nn.sigmoid(g)
    if limit is not None:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return g * u


GATHER_MAX_PAIRS = 64  # up to here the reference gathers each pair's expert; beyond, one grouped matmul


class SharedExpert(NamedTuple):
    """A shared expert that the routed experts' kernels run in their own launches: one expert in
    their format (w13 [1, D, 2I], w2 [1, I, D], or quantised alike), which every token takes as
    one more pair with weight 1 and its own SwiGLU limit."""

    w13: Any
    w2: Any
    swiglu_limit: float | None = None


def same_format(a, b) -> bool:
    """Whether stacked experts a and b (either format) differ only in E: what one kernel's
    launch needs to read both."""
    if isinstance(a, QuantizedWeight) != isinstance(b, QuantizedWeight):
        return False
    if isinstance(a, QuantizedWeight):
        facts = lambda w: (w.bits, w.group_size, w.symmetric, w.shape, w.layout, w.words.shape[1:])  # noqa: E731
        return facts(a) == facts(b)
    return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]


def check_shared(w13, w2, shared: SharedExpert) -> None:
    """Raises ValueError unless shared is one expert in the routed experts' format."""
    if num_experts(shared.w13) != 1 or not (same_format(w13, shared.w13) and same_format(w2, shared.w2)):
        raise ValueError("shared: one expert (w13 [1, D, 2I], w2 [1, I, D]) in the routed experts' format "
                         "(dtype, or bits, groups and layout) is needed to share their launches")


def reference(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit=None, form: str | None = None,
              shared: SharedExpert | None = None):
    """The routed experts in plain jnp, any size: the specification the MoE kernels and the
    model's reference path share.

    x is rounded to the activation dtype (the weights' dtype; bf16 for low-bit weights, as the
    kernels take it), products are exact float32 (HIGHEST) on the exactly dequantised weights,
    h is rounded to the activation dtype between the GEMMs, the combine sums in float32 and y is
    rounded once to x's dtype. Pairs whose id is >= E are skipped (add nothing, read nothing).
    form "gathered": each pair gathers its expert ([P, K, N] float32); "grouped": the pairs are
    sorted by expert and run as one `lax.ragged_dot` over all E experts; None: gathered up to
    GATHER_MAX_PAIRS pairs, grouped beyond. Both compute the same sums. shared: a `SharedExpert`
    whose output joins the float32 sum before the one rounding."""
    y = _sum(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, form=form)
    if shared is not None:
        check_shared(w13, w2, shared)
        m = x.shape[0]
        y = y + _sum(x, jnp.zeros((m, 1), jnp.int32), jnp.ones((m, 1), jnp.float32), shared.w13, shared.w2,
                     swiglu_limit=shared.swiglu_limit, form=form)
    return y.astype(x.dtype)


def _sum(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit, form):
    """`reference`'s float32 sum, before its rounding."""
    m, k = topk_ids.shape
    e, d, _ = expert_dims(w13, w2)
    act = jnp.bfloat16 if isinstance(w13, QuantizedWeight) else w13.dtype
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    live = ids < e
    weights = jnp.where(live, topk_weights.reshape(-1).astype(jnp.float32), 0.0)  # [P]
    xs = x.astype(act).astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    if form not in (None, "gathered", "grouped"):
        raise ValueError(f"form must be None, 'gathered' or 'grouped', got {form!r}")
    if form == "gathered" or form is None and ids.shape[0] <= GATHER_MAX_PAIRS:
        safe = jnp.where(live, ids, 0)
        rows = jnp.repeat(xs, k, axis=0)  # [P, D]
        h = jnp.einsum("pd,pdn->pn", rows, expert_matrices(w13, safe), precision=hi)  # [P, 2I]
        h = swiglu(h[:, 0::2], h[:, 1::2], swiglu_limit).astype(act).astype(jnp.float32)  # [P, I]
        out = jnp.einsum("pi,pid->pd", h, expert_matrices(w2, safe), precision=hi)  # [P, D]
        return jnp.sum((out * weights[:, None]).reshape(m, k, d), axis=1)
    order = jnp.argsort(ids, stable=True)  # skipped pairs (id >= E) sort last, in no group
    tok = order // k
    sizes = jnp.bincount(ids, length=e).astype(jnp.int32)
    h = lax.ragged_dot(xs[tok], _all(w13), sizes, precision=hi, preferred_element_type=jnp.float32)  # [P, 2I]
    h = swiglu(h[:, 0::2], h[:, 1::2], swiglu_limit).astype(act).astype(jnp.float32)  # [P, I]
    out = lax.ragged_dot(h, _all(w2), sizes, precision=hi, preferred_element_type=jnp.float32)  # [P, D]
    out = jnp.where(live[order, None], out * weights[order, None], 0.0)
    return jnp.zeros((m, d), jnp.float32).at[tok].add(out)


def _all(w):
    """Every expert of w as float32 [E, K, N] (x @ W orientation); dequantised exactly."""
    if isinstance(w, QuantizedWeight):
        return jax.vmap(dequantize)(w).transpose(0, 2, 1)
    return w.astype(jnp.float32)

"""The router's selection in one launch: sigmoid scores, expert bias, group-limited top-k and the
renormalised weights (DeepSeek-V3 style), from the gate logits.

    s = σ(logits) [M, E];  b = s + expert_bias                       (fp32)
    group score = sum of the group's top 2 of b (G groups of E/G experts); the topk_group best
        groups are kept (higher score first, equal scores by lower group index);
    ids = the top_k of b among the kept experts (equal values by lower index, as lax.top_k);
    w = s[ids] / (Σ s[ids] + 1e-20) if norm_topk_prob else s[ids];  weights = w · scale.

Layouts: logits [M, E] fp32, expert_bias [E] fp32 -> (weights [M, k] fp32, ids [M, k] int32).
Kernel (Triton lowering): grid (M,), one program per token holding its [G, E/G] scores in
registers; the top k is k rounds of one argmax over the E scores (the lower index of equal values
first) with the pick masked, then the picks' scores in one reduction. G, E/G and k must be powers
of two (Ling: 8 x 64, k = 8); other shapes run the reference. Bytes: M·E·4 in, M·k·8 out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve


def reference(logits, expert_bias, *, top_k: int, n_group: int, topk_group: int, scale: float, norm: bool):
    """Plain jnp, sort-free up to one top_k (XLA fuses it into a few reductions)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + expert_bias.astype(jnp.float32)
    m, e = choice.shape
    if n_group > 1:
        grouped = choice.reshape(m, n_group, e // n_group)
        best = jnp.max(grouped, axis=-1)  # [M, G]
        first = jnp.argmax(grouped, axis=-1)  # the best's first position: a tied second still counts
        second = jnp.max(jnp.where(jnp.arange(e // n_group) == first[..., None], -jnp.inf, grouped), axis=-1)
        group_scores = best + second  # the sum of each group's top 2
        # Group g is kept when fewer than topk_group groups rank above it.
        g = jnp.arange(n_group)
        other, this = group_scores[:, None, :], group_scores[:, :, None]  # [M, G (this), G (other)]
        above = (other > this) | ((other == this) & (g[None, None, :] < g[None, :, None]))
        keep = jnp.sum(above, axis=-1) < topk_group  # [M, G]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(m, e)
    _, ids = jax.lax.top_k(choice, top_k)  # [M, k]
    w = jnp.take_along_axis(scores, ids, axis=1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, ids.astype(jnp.int32)


def _select_kernel(logits_ref, bias_ref, w_ref, ids_ref, *, top_k, topk_group, scale, norm):
    scores = jax.nn.sigmoid(logits_ref[...])  # [G, E/G]
    choice = scores + bias_ref[...]
    g, eg = choice.shape
    col = jax.lax.broadcasted_iota(jnp.int32, (g, eg), 1)
    if g > 1:
        best = jnp.max(choice, axis=1)  # [G]
        first = jnp.min(jnp.where(choice == best[:, None], col, eg), axis=1)
        second = jnp.max(jnp.where(col == first[:, None], -jnp.inf, choice), axis=1)
        group_scores = best + second
        this = jax.lax.broadcasted_iota(jnp.int32, (g, g), 0)
        other = jax.lax.broadcasted_iota(jnp.int32, (g, g), 1)
        gs_this, gs_other = group_scores[:, None], group_scores[None, :]
        above = (gs_other > gs_this) | ((gs_other == gs_this) & (other < this))
        keep = jnp.sum(above.astype(jnp.int32), axis=1) < topk_group  # [G]
        choice = jnp.where(keep[:, None], choice, -jnp.inf)
    # The top k: k rounds of one argmax over the flattened choice (a (value, index) reduction
    # that keeps the lower index of equal values, as lax.top_k), each pick masked for the next
    # round; then every pick's score in one [k, E] reduction.
    e = g * eg
    choice, scores = choice.reshape(e), scores.reshape(e)
    expert = jax.lax.broadcasted_iota(jnp.int32, (e,), 0)
    slot = jax.lax.broadcasted_iota(jnp.int32, (top_k,), 0)
    ids = jnp.zeros((top_k,), jnp.int32)
    for j in range(top_k):
        idx = jnp.argmax(choice).astype(jnp.int32)
        ids = jnp.where(slot == j, idx, ids)
        choice = jnp.where(expert == idx, -jnp.inf, choice)
    picked = expert[None, :] == ids[:, None]  # [k, E]
    ws = jnp.sum(jnp.where(picked, scores[None, :], 0.0), axis=1)
    if norm:
        ws = ws / (jnp.sum(ws) + 1e-20)
    w_ref[...] = ws * scale
    ids_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("top_k", "n_group", "topk_group", "scale", "norm", "interpret"))
def _select_pallas(logits, expert_bias, *, top_k, n_group, topk_group, scale, norm, interpret):
    m, e = logits.shape
    eg = e // n_group
    kernel = functools.partial(_select_kernel, top_k=top_k, topk_group=topk_group, scale=scale, norm=norm)
    return pl.pallas_call(
        kernel,
        grid=(m,),
        in_specs=[pl.BlockSpec((None, n_group, eg), lambda i: (i, 0, 0)),
                  pl.BlockSpec((n_group, eg), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((None, top_k), lambda i: (i, 0)), pl.BlockSpec((None, top_k), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((m, top_k), jnp.float32), jax.ShapeDtypeStruct((m, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="router_select",
    )(logits.astype(jnp.float32).reshape(m, n_group, eg), expert_bias.astype(jnp.float32).reshape(n_group, eg))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def select_experts(logits, expert_bias, *, top_k: int, n_group: int, topk_group: int, scale: float = 1.0,
                   norm: bool = True, backend: str = "auto"):
    """(weights [M, k] fp32, ids [M, k] int32) from logits [M, E]; see the module docstring."""
    m, e = logits.shape
    if e % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= e:
        raise ValueError(f"E={e} experts in n_group={n_group} groups, topk_group={topk_group}, top_k={top_k}: "
                         "groups must divide E, 1 <= topk_group <= n_group and 1 <= top_k <= E")
    backend = resolve(backend)
    opts = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scale=float(scale), norm=norm)
    if backend == "reference" or not all(map(_pow2, (n_group, e // n_group, top_k))):
        return reference(logits, expert_bias, **opts)
    return _select_pallas(logits, expert_bias, **opts, interpret=backend == "interpret")

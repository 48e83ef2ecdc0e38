"""The sigmoid router with expert bias and group-limited top-k (DeepSeek-V3 style), in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.named_scope("router")
def route(x, weight, expert_bias, *, top_k: int, n_group: int, topk_group: int,
          routed_scaling_factor: float, norm_topk_prob: bool):
    """Picks top_k experts per token.

    x [M, D]; weight [E, D] fp32; expert_bias [E] fp32.
    Returns (topk_weights [M, k] fp32, topk_ids [M, k] int32).
    The bias only steers the choice; the weights are the unbiased sigmoid scores, renormalised over
    the chosen experts and multiplied by the routed scaling factor.
    """
    logits = jnp.dot(x.astype(jnp.float32), weight.astype(jnp.float32).T,
                     precision=jax.lax.Precision.HIGHEST)  # [M, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + expert_bias.astype(jnp.float32)
    m, e = choice.shape
    if n_group > 1:
        # Sort-free, so XLA fuses it into a few reductions: one top_k remains, the final one.
        grouped = choice.reshape(m, n_group, e // n_group)
        best = jnp.max(grouped, axis=-1)  # [M, G]
        first = jnp.argmax(grouped, axis=-1)  # the best's first position: a tied second still counts
        second = jnp.max(jnp.where(jnp.arange(e // n_group) == first[..., None], -jnp.inf, grouped), axis=-1)
        group_scores = best + second  # the sum of each group's top 2
        # Group g is kept when fewer than topk_group groups rank above it, ranked as top_k ranks:
        # higher score first, equal scores by lower index.
        g = jnp.arange(n_group)
        other, this = group_scores[:, None, :], group_scores[:, :, None]  # [M, G (this), G (other)]
        above = (other > this) | ((other == this) & (g[None, None, :] < g[None, :, None]))
        keep = jnp.sum(above, axis=-1) < topk_group  # [M, G]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(m, e)
    _, ids = jax.lax.top_k(choice, top_k)  # [M, k]
    w = jnp.take_along_axis(scores, ids, axis=1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * routed_scaling_factor, ids.astype(jnp.int32)

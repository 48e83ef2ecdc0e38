"""The sigmoid router with expert bias and group-limited top-k (DeepSeek-V3 style), in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
        grouped = choice.reshape(m, n_group, e // n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [M, G]
        _, keep = jax.lax.top_k(group_scores, topk_group)  # [M, topk_group]
        group_mask = jnp.zeros((m, n_group), bool).at[jnp.arange(m)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)  # [M, k]
    w = jnp.take_along_axis(scores, ids, axis=1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * routed_scaling_factor, ids.astype(jnp.int32)

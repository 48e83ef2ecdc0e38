"""The sigmoid router with expert bias and group-limited top-k (DeepSeek-V3 style), in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import tickets
from pallas_kernels.router import gate_and_select, select_experts


@jax.named_scope("router")
def route(x, weight, expert_bias, *, top_k: int, n_group: int, topk_group: int,
          routed_scaling_factor: float, norm_topk_prob: bool, backend: str = "auto"):
    """Picks top_k experts per token.

    x [M, D]; weight [E, D] fp32; expert_bias [E] fp32.
    Returns (topk_weights [M, k] fp32, topk_ids [M, k] int32).
    The bias only steers the choice; the weights are the unbiased sigmoid scores, renormalised over
    the chosen experts and multiplied by the routed scaling factor. Two launches: the gate matmul
    (XLA, fp32) and the selection (`pallas_kernels.router`; its reference on backend "reference",
    which has a gradient: training passes it); for one token inside a `pallas_kernels.tickets`
    scope, one launch (`gate_and_select`).
    """
    opts = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scale=routed_scaling_factor,
                norm=norm_topk_prob, backend=backend)
    scope = tickets.current()
    if scope is not None:  # one launch: the gate and the selection, by a ticket
        fused = gate_and_select(x, weight, expert_bias, scope.take(1), **opts)
        if fused is not None:
            weights, ids, counters = fused
            scope.give(counters)
            return weights, ids
    logits = jnp.dot(x.astype(jnp.float32), weight.astype(jnp.float32).T,
                     precision=jax.lax.Precision.HIGHEST)  # [M, E]
    return select_experts(logits, expert_bias, **opts)

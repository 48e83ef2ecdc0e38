"""Which experts a forward picks: taps on the MoE blocks of a model, for training's load balancing
and evaluation's expert-sharing figures (rho).

The MoE block returns only its output; `tap_moe` wraps each block of a model *copy made inside a
trace* (e.g. `nnx.merge(graphdef, params)` under jit) so that every call also records its input.
The routing is then recomputed from that input with the block's own router (`moe.router.route`,
the same function on the same fp32 parameters), so the ids are the ones the block used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe.block import MoE
from moe.router import route


class _Tap:
    """Stands in for a MoE block: records the input, then calls the block."""

    def __init__(self, moe: MoE, sink: list):
        self.moe, self.sink = moe, sink

    def __call__(self, x):
        self.sink.append(x)
        return self.moe(x)


def _moe_layers(model) -> list:
    layers = list(model.layers) + ([model.nextn.layer] if model.nextn is not None else [])
    return [layer for layer in layers if isinstance(layer.mlp, (MoE, _Tap))]


def moe_blocks(model) -> list[MoE]:
    """The MoE blocks of the target layers, then the NEXTN layer's (the order of `tap_moe`)."""
    return [layer.mlp.moe if isinstance(layer.mlp, _Tap) else layer.mlp for layer in _moe_layers(model)]


def tap_moe(model) -> list[tuple[MoE, list]]:
    """Replaces every MoE block of `model` (target layers, then the NEXTN layer) by a recording
    stand-in; returns (block, inputs) per block, the inputs filled as the model runs. Use it on a
    throw-away copy made inside the trace: the model is changed in place."""
    taps = []
    for layer in _moe_layers(model):
        moe = layer.mlp.moe if isinstance(layer.mlp, _Tap) else layer.mlp
        sink: list = []
        taps.append((moe, sink))
        layer.mlp = _Tap(moe, sink)
    return taps


def routed_ids(moe: MoE, x):
    """x [..., D] (a recorded input) -> top-k expert ids [..., k] int32, as the block chose them."""
    flat = jax.lax.stop_gradient(x).reshape(-1, x.shape[-1])
    _, ids = route(flat, moe.gate_weight[...], moe.expert_bias[...], top_k=moe.top_k, n_group=moe.n_group,
                   topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
                   norm_topk_prob=moe.norm_topk_prob)
    return ids.reshape(*x.shape[:-1], moe.top_k)


def expert_load(moe: MoE, inputs: list) -> jnp.ndarray:
    """Share of the (token, slot) picks each expert got over all recorded calls [E] (sums to 1)."""
    e = moe.gate_weight.shape[0]
    counts = sum(jnp.zeros((e,), jnp.float32).at[routed_ids(moe, x).reshape(-1)].add(1.0) for x in inputs)
    return counts / jnp.maximum(counts.sum(), 1.0)

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
from moe.nn import swiglu
from moe.router import route


def dense_experts_moe(moe: MoE, x):
    """The MoE block's function computed for training: x [B, T, D] -> [B, T, D].

    The same router (`moe.router.route`) and shared expert as `MoE.__call__`; the routed experts
    run as two dense GEMMs over all E experts, [M, D] @ [D, E*2I] and (SwiGLU output scaled by
    each token's routing weight per expert, zero for unchosen experts) [M, E*I] @ [E*I, D].
    That is E/k times the routed FLOPs, but plain GEMMs on any backend, where a grouped
    `ragged_dot` (the reference path) runs every row against every expert anyway on XLA:CPU and
    XLA:GPU, with k times the rows; and it has a gradient, which the Pallas kernels lack. Equal
    to the block's output up to summation order (and, in bf16, the rounding of the scaled SwiGLU
    output)."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    weights, ids = route(flat, moe.gate_weight[...], moe.expert_bias[...], top_k=moe.top_k, n_group=moe.n_group,
                         topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
                         norm_topk_prob=moe.norm_topk_prob, backend="reference")  # differentiable
    w13, w2 = moe.w13[...], moe.w2[...]  # [E, D, 2I], [E, I, D]
    e, _, i2 = w13.shape
    m = flat.shape[0]
    combine = jnp.zeros((m, e), jnp.float32).at[jnp.arange(m)[:, None], ids].add(weights)  # [M, E]
    h = jnp.dot(flat, w13.transpose(1, 0, 2).reshape(d, e * i2).astype(x.dtype),
                preferred_element_type=jnp.float32).reshape(m, e, i2)
    h = swiglu(h[..., 0::2], h[..., 1::2], moe.swiglu_limit)  # [M, E, I] fp32
    h = (h * combine[..., None]).astype(x.dtype).reshape(m, e * (i2 // 2))
    y = jnp.dot(h, w2.reshape(e * (i2 // 2), d).astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(flat)
    return y.reshape(b, t, d)


class _Tap:
    """Stands in for a MoE block: records the input, then calls the block (or, for training,
    `dense_experts_moe`)."""

    def __init__(self, moe: MoE, sink: list, dense: bool):
        self.moe, self.sink, self.dense = moe, sink, dense

    def __call__(self, x, live=None):  # live: as `MoE`'s (the dense stand-in computes every row)
        self.sink.append(x)
        return dense_experts_moe(self.moe, x) if self.dense else self.moe(x, live=live)


def _moe_layers(model) -> list:
    layers = list(model.layers) + ([model.nextn.layer] if model.nextn is not None else [])
    return [layer for layer in layers if isinstance(layer.mlp, (MoE, _Tap))]


def moe_blocks(model) -> list[MoE]:
    """The MoE blocks of the target layers, then the NEXTN layer's (the order of `tap_moe`)."""
    return [layer.mlp.moe if isinstance(layer.mlp, _Tap) else layer.mlp for layer in _moe_layers(model)]


def tap_moe(model, *, dense_experts: bool = False) -> list[tuple[MoE, list]]:
    """Replaces every MoE block of `model` (target layers, then the NEXTN layer) by a recording
    stand-in; returns (block, inputs) per block, the inputs filled as the model runs. With
    dense_experts the stand-in computes `dense_experts_moe` (training). Use it on a throw-away
    copy made inside the trace: the model is changed in place."""
    taps = []
    for layer in _moe_layers(model):
        moe = layer.mlp.moe if isinstance(layer.mlp, _Tap) else layer.mlp
        sink: list = []
        taps.append((moe, sink))
        layer.mlp = _Tap(moe, sink, dense_experts)
    return taps


def routed_ids(moe: MoE, x):
    """x [..., D] (a recorded input) -> top-k expert ids [..., k] int32, as the block chose them."""
    flat = jax.lax.stop_gradient(x).reshape(-1, x.shape[-1])
    _, ids = route(flat, moe.gate_weight[...], moe.expert_bias[...], top_k=moe.top_k, n_group=moe.n_group,
                   topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
                   norm_topk_prob=moe.norm_topk_prob, backend=moe.kernels)
    return ids.reshape(*x.shape[:-1], moe.top_k)


def expert_load(moe: MoE, inputs: list) -> jnp.ndarray:
    """Share of the (token, slot) picks each expert got over all recorded calls [E] (sums to 1)."""
    e = moe.gate_weight.shape[0]
    counts = sum(jnp.zeros((e,), jnp.float32).at[routed_ids(moe, x).reshape(-1)].add(1.0) for x in inputs)
    return counts / jnp.maximum(counts.sum(), 1.0)

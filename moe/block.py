"""The MoE block: router, routed experts and the shared expert.

Expert weights are stacked per layer: w13 [E, D, 2I] with gate and up interleaved column by column
(column 2j is gate j, column 2j+1 is up j, so a fused kernel forms silu(gate) * up from adjacent
columns), and w2 [E, I, D]; or, once `ling.quantize` stored them low-bit, the fused MoE kernel's
grouped format (`QExperts`, `experts.quantize_experts`). The routed experts (`routed_experts`)
run Pallas kernels when the kernel backend is not the reference: the fused MoE kernels
(pallas_kernels/fused_moe.py) at decode and verify sizes, the grouped GEMM
(pallas_kernels/grouped_gemm.py) beyond GATHER_MAX_PAIRS pairs (prefill); experts in the row
layout run fused_moe's tensor-core Triton kernel at every size; otherwise the plain-jnp
specification all are checked against (`pallas_kernels.experts.reference`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe.nn import QuantizedParams, param, swiglu
from moe.parallel import expert_parallel
from moe.router import route
from pallas_kernels.backend import resolve
from pallas_kernels.experts import GATHER_MAX_PAIRS, SharedExpert, num_experts, rows_layout, same_format
from pallas_kernels.experts import reference as experts_reference
from pallas_kernels.expert_tiles import supports as tiles_support
from pallas_kernels.expert_tiles import tile_moe
from pallas_kernels.fused_moe import fused_moe
from pallas_kernels.grouped_gemm import grouped_moe
from pallas_kernels.quant import QuantizedWeight, dequantize


@jax.named_scope("experts")
def routed_experts(x, topk_ids, topk_weights, w13, w2, *, swiglu_limit=None, backend="auto", skips=False,
                   n_decode=None, shared: SharedExpert | None = None):
    """The routed experts: unless the backend resolves to the reference, the fused Pallas kernels
    up to GATHER_MAX_PAIRS (token, slot) pairs and the grouped GEMM beyond, or, for a mixed
    iteration's tokens (n_decode not None: rows [0, n_decode) decode tokens, the rest a prefill
    chunk's), the tile-scheduled kernel that runs the decode rows' tiles first
    (`pallas_kernels.expert_tiles`, where it takes the weights' format); `experts_reference`
    otherwise. skips: pairs whose id is E (= w13.shape[0]) are skipped and add nothing (expert
    parallelism marks the pairs of other ranks so). The grouped GEMM leaves such pairs out; up
    to GATHER_MAX_PAIRS a skipped pair borrows the expert of a live one with weight 0, adding a
    row to an expert read anyway rather than a read of another. Off by default: the masking is
    a few small kernels a layer that the single-device decode step need not pay.
    shared: a shared expert run in the fused MoE kernels' launches (`fused_moe`'s shared; the
    caller checks that they take it: `MoE.shared_in_launch`)."""
    backend = resolve(backend)
    if skips:
        live = topk_ids < num_experts(w13)
        topk_weights = jnp.where(live, topk_weights, 0)
        if topk_ids.size <= GATHER_MAX_PAIRS:
            flat = live.reshape(-1)
            borrow = jnp.where(jnp.any(flat), topk_ids.reshape(-1)[jnp.argmax(flat)], 0)
            topk_ids = jnp.where(live, topk_ids, borrow)
    if backend != "reference" and n_decode is not None and tiles_support(w13, w2):
        return tile_moe(x, topk_ids, topk_weights, w13, w2, n_decode=n_decode, swiglu_limit=swiglu_limit,
                        backend=backend)
    if backend != "reference":
        # The row layout's experts: the tensor-core kernel at every size (the grouped GEMM reads tiles).
        if shared is not None:
            return fused_moe(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, backend=backend,
                             shared=shared)
        kernel = fused_moe if topk_ids.size <= GATHER_MAX_PAIRS or rows_layout(w13) else grouped_moe
        return kernel(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, backend=backend)
    return experts_reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, shared=shared)




def _dense(w):
    """Stacked experts as an array [E, K, N] (x @ W orientation), dequantised if low-bit."""
    return jnp.swapaxes(jax.vmap(dequantize)(w), 1, 2) if isinstance(w, QuantizedWeight) else w


class QExperts(QuantizedParams):
    """Stacked routed experts in the fused MoE kernel's grouped low-bit format (one
    `QuantizedWeight` with a leading E axis), held as Params with logical axes."""

    def __init__(self, qw: QuantizedWeight):
        super().__init__(qw, lead=("experts",))


def expert_weights(w13, w2):
    """(w13, w2) of `Param`s or `QExperts`: arrays, or stacked `QuantizedWeight`s."""
    return tuple(w.weight if isinstance(w, QExperts) else w[...] for w in (w13, w2))


class SwiGLUMLP(nnx.Module):
    """down(swiglu(gate(x), up(x))): the dense MLP of the first layers and the shared expert.

    Held as one expert in the routed experts' format, w13 [1, D, 2I] (gate and up interleaved)
    and w2 [1, I, D], or `QExperts`: with the kernels, up to GATHER_MAX_PAIRS rows (decode,
    verify) run the fused MoE kernels as an expert that every row picks with weight 1 (two
    launches, the weights streamed once); longer inputs (prefill, training), and any input on
    the reference backend (whose gathered form would copy the weights once a row), run two plain
    matmuls."""

    def __init__(self, d: int, inter: int, *, limit: float | None = None, dtype, rngs: nnx.Rngs,
                 kernels: str = "auto"):
        self.kernels = resolve(kernels)  # the kernel backend (pallas_kernels.backend), fixed at build
        self.w13 = param(rngs, (1, d, 2 * inter), ("one", "embed", "mlp"), dtype)
        self.w2 = param(rngs, (1, inter, d), ("one", "mlp", "embed"), dtype)
        self.limit = limit

    def expert_weights(self):
        """(w13, w2): one expert [1, ...] as arrays, or stacked `QuantizedWeight`s."""
        return expert_weights(self.w13, self.w2)

    @jax.named_scope("mlp")
    def __call__(self, x, n_decode=None, live=None):  # [..., D]; n_decode, live: as `MoE`'s (a dense MLP
        # has nothing to schedule or skip: every row reads the same weights)
        flat = x.reshape(-1, x.shape[-1])
        m = flat.shape[0]
        w13, w2 = self.expert_weights()
        if m <= GATHER_MAX_PAIRS and self.kernels != "reference":
            y = routed_experts(flat, jnp.zeros((m, 1), jnp.int32), jnp.ones((m, 1), jnp.float32), w13, w2,
                               swiglu_limit=self.limit, backend=self.kernels)
        else:
            h = jnp.dot(flat, _dense(w13)[0].astype(x.dtype), preferred_element_type=jnp.float32)  # [M, 2I]
            h = swiglu(h[:, 0::2], h[:, 1::2], self.limit).astype(x.dtype)
            y = jnp.dot(h, _dense(w2)[0].astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
        return y.reshape(x.shape)


# How a mixed iteration's decode and prefill tokens run through the routed experts: "tiles", one
# tile-scheduled launch with the decode rows' tiles first (`pallas_kernels.expert_tiles`); "grouped",
# the union as any other tokens of its size (the grouped GEMM beyond GATHER_MAX_PAIRS pairs). In one
# program the next layer waits for the whole launch, so the decode rows finishing first shortens
# nothing there; the faster launch of the union wins: the grouped GEMM, the default (int4 on an
# H100: 2.27 µs an expert tile against the tile kernel's 2.95, bench/tile_model_h100_int4*.json).
MIXED_LAUNCHES = ("tiles", "grouped")
DEFAULT_MIXED_LAUNCH = "grouped"


def use_mixed_launch(model: nnx.Module, launch: str) -> nnx.Module:
    """Sets every MoE under model to run a mixed iteration's tokens by `launch` (MIXED_LAUNCHES), in
    place, and returns it; as `ling.model.use_kernels`, before the programs that trace it are built."""
    if launch not in MIXED_LAUNCHES:
        raise ValueError(f"the mixed launch must be one of {MIXED_LAUNCHES}, got {launch!r}")
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            node.mixed_launch = launch
    return model


class MoE(nnx.Module):
    def __init__(self, d: int, *, num_experts: int, top_k: int, inter: int, num_shared: int, n_group: int,
                 topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool,
                 swiglu_limit: float | None, shared_swiglu_limit: float | None, dtype, rngs: nnx.Rngs,
                 mesh=None, kernels: str = "auto"):
        self.kernels = resolve(kernels)  # the kernel backend (pallas_kernels.backend), fixed at build
        # The router stays fp32 (as the checkpoints store it): bf16 scores reorder near-ties.
        self.gate_weight = param(rngs, (num_experts, d), ("experts", "embed"), jnp.float32)
        self.expert_bias = param(rngs, (num_experts,), ("experts",), jnp.float32, init="zeros")
        self.w13 = param(rngs, (num_experts, d, 2 * inter), ("experts", "embed", "mlp"), dtype)
        self.w2 = param(rngs, (num_experts, inter, d), ("experts", "mlp", "embed"), dtype)
        self.shared_experts = (SwiGLUMLP(d, inter * num_shared, limit=shared_swiglu_limit, dtype=dtype, rngs=rngs,
                                         kernels=self.kernels)
                               if num_shared else None)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.swiglu_limit = swiglu_limit
        self.mesh = mesh  # a jax.sharding.Mesh with an "expert" axis: the experts run expert-parallel
        self.mixed_launch = DEFAULT_MIXED_LAUNCH  # a mixed iteration's tokens (`use_mixed_launch`)

    def expert_weights(self):
        """(w13, w2): arrays, or stacked `QuantizedWeight`s where `ling.quantize` made them `QExperts`."""
        return expert_weights(self.w13, self.w2)

    def shared_in_launch(self, m: int, w13, w2) -> SharedExpert | None:
        """The shared expert as the fused MoE kernels' extra pair of each of m tokens, where they
        take it: one device, kernels, decode and verify sizes (m (k + 1) <= GATHER_MAX_PAIRS),
        the tile layout or bf16, the routed experts' format; else None (its own launches)."""
        if self.shared_experts is None or self.mesh is not None or self.kernels == "reference":
            return None
        s13, s2 = self.shared_experts.expert_weights()
        if (m * (self.top_k + 1) > GATHER_MAX_PAIRS or rows_layout(w13)
                or not (same_format(w13, s13) and same_format(w2, s2))):
            return None
        return SharedExpert(s13, s2, self.shared_experts.limit)

    def __call__(self, x, n_decode=None, live=None):
        """x [B, T, D]. n_decode (static): None, or the flattened rows [0, n_decode) are a mixed
        iteration's decode tokens and the rest a prefill chunk's (one tile-scheduled launch, decode
        tiles first, on one device; expert parallelism, and `mixed_launch` "grouped", run them as
        any other tokens). live: None, or [B * T] bool over the flattened rows: the others (a
        chunk's padding) take no routed expert on one device (their pairs are skipped: no expert
        reads or computes them; their output is the shared expert's alone). At decode and verify
        sizes the shared expert runs in the routed experts' launches (`shared_in_launch`)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        if self.mixed_launch == "grouped":  # the union as any other tokens (`MIXED_LAUNCHES`)
            n_decode = None
        weights, ids = route(flat, self.gate_weight[...], self.expert_bias[...], top_k=self.top_k,
                             n_group=self.n_group, topk_group=self.topk_group,
                             routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob,
                             backend=self.kernels)
        w13, w2 = self.expert_weights()
        if self.mesh is not None:
            y = expert_parallel(flat, ids, weights, w13, w2, swiglu_limit=self.swiglu_limit, mesh=self.mesh,
                                compute=functools.partial(routed_experts, backend=self.kernels))
            shared = None
        else:
            skips = live is not None
            if skips:  # id E: a skipped pair (in the shared launch E names the shared expert: not there)
                ids = jnp.where(live[:, None], ids, num_experts(w13))
            shared = None if n_decode is not None or skips else self.shared_in_launch(flat.shape[0], w13, w2)
            y = routed_experts(flat, ids, weights, w13, w2, swiglu_limit=self.swiglu_limit, backend=self.kernels,
                               n_decode=n_decode, shared=shared, skips=skips)
        if self.shared_experts is not None and shared is None:
            y = y + self.shared_experts(flat)
        return y.reshape(b, t, d)

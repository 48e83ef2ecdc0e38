"""Grouped low-bit weights for a model: a step then streams ~4.125 bits a weight at int4, G = 128.

`quantize_model(model, bits=4)` replaces every projection (`moe.nn.Linear`: the KDA and MLA
projections) and optionally the lm_head with a `QLinear` holding the weight in
`pallas_kernels.quant`'s tile-transposed layout (or its row layout, `layout="rows"`: int4 or int8
in groups of 128, which the tensor-core Triton kernels read); the dense MLPs and the shared experts (one
expert each, `moe.block.SwiGLUMLP`) take the fused MoE kernel's format below (int4 and int8; at
other widths, or sizes that format does not divide, they stay in full precision). What stays in
full precision, and why:
- the router gate (fp32: low-bit scores reorder near-ties and change the routing);
- MLA's kv_b_proj (used as a tensor, split into W_UK and W_UV for the absorbed form);
- embeddings, norms, conv and decay parameters (small, read a few rows per token);
- the routed experts, unless asked (`experts=True`): they then take the fused MoE kernel's own
  grouped format (`moe.block.QExperts`, int4 or int8, symmetric, B_N 64), which the fused MoE
  kernels (decode, verify) and the grouped GEMM (prefill) read directly; with layout "rows" the
  row layout, which the tensor-core Triton kernels read at every size.
Decode runs `qmatvec`, dequantising in registers (up to 16 rows in one call). From 17 to
DENSE_MAX_M = 96 rows (verify passes of 3-16 slots) a projection in the tile layout with groups
the tensor cores can take runs the grouped GEMM's dense kernel (`pallas_kernels.grouped_gemm.dense`):
the low-bit weight read once, unpacked in registers, the rows on the tensor cores. Beyond 96 rows
it is slower than dequantising (latency-bound: too few programs for its K loop; `python -m
bench.qgemm` times the three paths). Other weights run `qmatvec` in two calls up to 32 rows.
Longer inputs, and on the reference backend more than 16 rows, dequantise the weight to bf16
once per call and multiply (~4.5 bytes a weight moved at int4, against ~0.5 read by the kernels).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe.block import MoE, QExperts, SwiGLUMLP
from moe.nn import Linear, QuantizedParams
from pallas_kernels.backend import resolve
from pallas_kernels.experts import quantize_experts
from pallas_kernels.grouped_gemm import dense, dense_applies
from pallas_kernels.qmatvec import MAX_M, qmatvec
from pallas_kernels.quant import LAYOUTS, QuantizedWeight, check_config, dequantize, quantize, relayout

SCHEMES = {"int8": 8, "int4": 4, "int2": 2}
EXPERT_BITS = (4, 8)  # the fused MoE kernels' tested formats
EXPERT_BLOCK_N = 64  # the fused MoE kernels' tile of output columns
KEEP_FULL = ("kv_b_proj",)  # attribute names of Linears that stay in full precision
CHUNKED_MAX_M = 2 * MAX_M  # rows a projection runs through `qmatvec` (in calls of MAX_M rows)
DENSE_MAX_M = 96  # rows a projection runs through the grouped GEMM's dense kernel (where it was measured faster)


class QLinear(QuantizedParams):
    """y = x @ Wᵀ with W [N, K] stored grouped low-bit; the drop-in for a `Linear`."""

    def __init__(self, qw: QuantizedWeight, *, kernels: str = "auto"):
        super().__init__(qw)
        self.kernels = resolve(kernels)  # the kernel backend (pallas_kernels.backend), fixed at build

    @jax.named_scope("proj")
    def __call__(self, x):  # x [..., K] -> [..., N]
        n, k = self.shape
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        if m <= MAX_M:
            y = qmatvec(flat, self.weight, backend=self.kernels)
        elif m <= DENSE_MAX_M and self.kernels != "reference" and dense_applies(self.weight):
            y = dense(flat, self.weight, backend=self.kernels)  # the weight read once, on the tensor cores
        elif m <= CHUNKED_MAX_M and self.kernels != "reference":  # calls of at most MAX_M rows, as even as they split
            size = -(-m // -(-m // MAX_M))
            y = jnp.concatenate([qmatvec(flat[i:i + size], self.weight, backend=self.kernels)
                                 for i in range(0, m, size)])
        else:
            y = jnp.dot(flat, dequantize(self.weight).T.astype(x.dtype), preferred_element_type=jnp.float32)
        return y.astype(x.dtype).reshape(*x.shape[:-1], n)


def bits_of(scheme: str) -> int:
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {sorted(SCHEMES)}, got {scheme!r}")
    return SCHEMES[scheme]


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How a model's weights are stored: the projections, dense MLPs and shared experts at `bits`
    with one scale per `group_size` input columns; the lm_head and the routed experts too when
    asked. layout (`pallas_kernels.quant`): "tiles" (the Pallas kernels) or "rows" (int4 or int8,
    groups of 128: the tensor-core Triton kernels), for the projections, lm_head, MLPs and experts."""

    bits: int
    group_size: int = 128
    lm_head: bool = False
    experts: bool = False
    layout: str = "tiles"

    def __post_init__(self):
        check_config(self.group_size * 2, self.bits, self.group_size, 128, self.layout)  # names a bad value
        if self.experts and self.bits not in EXPERT_BITS:
            raise ValueError(f"quantize_experts takes int4 or int8 (the fused MoE kernels' formats), got {self.bits} bits")

    def check(self, cfg) -> None:
        """ValueError unless the group divides the hidden size (the input of most projections)."""
        if cfg.hidden_size % self.group_size:
            raise ValueError(f"group_size {self.group_size} divides the input size of no projection "
                             f"(hidden size {cfg.hidden_size}): use a smaller --group-size")


def _eligible(name, lin: Linear, group_size: int) -> bool:
    if name in KEEP_FULL:
        return False
    try:
        check_config(lin.kernel.shape[0], 4, group_size, 128)
    except ValueError:
        return False  # K not a multiple of the group: left in full precision
    return True


def _attributes(node, leaf):
    """(parent, name, child) for every attribute under `node`, descending into modules and lists
    (not into a child for which leaf(child) holds)."""
    for name, child in list(vars(node).items()):
        yield node, name, child
        if leaf(child):
            continue
        if isinstance(child, nnx.List):
            for item in child:
                yield from _attributes(item, leaf)
        elif isinstance(child, nnx.Module):
            yield from _attributes(child, leaf)


def quantize_module(module, q: Quantization) -> None:
    """Quantises, in place, the full-precision projections, MLPs and (q.experts) routed experts
    found under `module` (a model, a decoder layer); what is already low-bit is left as it is, so
    a module may be passed again. The lm_head is `quantize_lm_head`'s. The new `QLinear`s run the
    kernel backend of `module` (its `kernels`; the default backend where it has none)."""
    kernels = getattr(module, "kernels", "auto")
    found, moes, mlps = [], [], []
    for node, name, child in _attributes(module, leaf=lambda c: isinstance(c, Linear)):
        if isinstance(child, MoE) and not isinstance(child.w13, QExperts):
            moes.append(child)
        if isinstance(child, SwiGLUMLP) and not isinstance(child.w13, QExperts):
            mlps.append(child)
        if isinstance(child, Linear) and _eligible(name, child, q.group_size):
            found.append((node, name, child))
    for parent, name, lin in found:
        w = lin.kernel[...].T  # [N, K], the torch orientation the codec takes
        qw = quantize(w, bits=q.bits, group_size=q.group_size, layout=q.layout)
        setattr(parent, name, QLinear(qw, kernels=kernels))
    for mlp in mlps if q.bits in EXPERT_BITS else ():
        try:
            e = quantize_experts(mlp.w13[...], mlp.w2[...], bits=q.bits, group_size=q.group_size,
                                 block_n=EXPERT_BLOCK_N, layout=q.layout)
        except ValueError:
            continue  # sizes the format does not divide: left in full precision
        mlp.w13, mlp.w2 = QExperts(e.w13), QExperts(e.w2)
    for moe in moes if q.experts else ():
        try:
            e = quantize_experts(moe.w13[...], moe.w2[...], bits=q.bits, group_size=q.group_size,
                                 block_n=EXPERT_BLOCK_N, layout=q.layout)
        except ValueError as err:
            raise ValueError(f"the routed experts (D {moe.w13.shape[1]}, I {moe.w2.shape[1]}) cannot be quantised "
                             f"with group_size {q.group_size}: {err}") from err
        moe.w13, moe.w2 = QExperts(e.w13), QExperts(e.w2)


def quantize_lm_head(model, q: Quantization) -> None:
    """The lm_head (the embedding's transpose when tied) as a QLinear, if q.lm_head and not yet."""
    if q.lm_head and not isinstance(model.lm_head, QLinear):
        w = model.embed_tokens[...] if model.lm_head is None else model.lm_head[...].T  # [V, D]
        qw = quantize(w, bits=q.bits, group_size=q.group_size, layout=q.layout)
        model.lm_head = QLinear(qw, kernels=model.kernels)


def _relayout_experts(qw: QuantizedWeight, layout: str) -> QuantizedWeight:
    """Stacked experts in another layout, one expert at a time (`lax.map`: no [E, N, K] codes)."""
    one = lambda a: QuantizedWeight(*a, qw.bits, qw.group_size, qw.symmetric, qw.shape, qw.layout)  # noqa: E731
    out = jax.lax.map(lambda a: relayout(one(a), layout, EXPERT_BLOCK_N), (qw.words, qw.scales, qw.zeros))
    return QuantizedWeight(out.words, out.scales, out.zeros, qw.bits, qw.group_size, qw.symmetric, qw.shape, layout)


def relayout_module(module, layout: str) -> None:
    """Every QLinear and QExperts under `module` (its lm_head included) rewritten in `layout`, in
    place and exactly (`pallas_kernels.quant.relayout`); what is already in it is left alone."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    low_bit = (QLinear, QExperts)
    for node, name, child in list(_attributes(module, leaf=lambda c: isinstance(c, low_bit))):
        if isinstance(child, QLinear) and child.weight.layout != layout:
            setattr(node, name, QLinear(relayout(child.weight, layout), kernels=child.kernels))
        elif isinstance(child, QExperts) and child.weight.layout != layout:
            setattr(node, name, QExperts(_relayout_experts(child.weight, layout)))


def quantize_model(model, *, bits: int, group_size: int = 128, lm_head: bool = False, experts: bool = False,
                   layout: str = "tiles"):
    """Quantises the model's projections in place (see the module docstring); returns the model.
    Linears whose input size the group does not divide stay in full precision. experts: the
    routed experts too (int4 / int8; the group must divide D and I, and 64 divide 2I and D).
    layout: "rows" (int4 or int8, groups of 128) or "tiles", for projections, lm_head, MLPs and experts."""
    q = Quantization(bits, group_size, lm_head, experts, layout)
    q.check(model.cfg)
    quantize_module(model, q)
    quantize_lm_head(model, q)
    return model


def quantization_of(model) -> Quantization | None:
    """How the model's weights are stored (None: full precision)."""
    nodes = [m for _, m in nnx.iter_graph(model)]
    found = [m for m in nodes if isinstance(m, QLinear)]
    if not found:
        return None
    return Quantization(found[0].bits, found[0].group_size, isinstance(model.lm_head, QLinear),
                        any(isinstance(m, MoE) and isinstance(m.w13, QExperts) for m in nodes),
                        found[0].weight.layout)

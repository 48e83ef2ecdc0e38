"""`l2_prefetch(ref, idx)`: ask L2 for the lines of ref[idx] ahead of their loads (PTX `prefetch.global.L2`).

A weight-streaming kernel's loads wait on HBM. Where ptxas places each load shortly before its use
(it spreads a loop's loads through the body to keep registers free), a warp has few in flight. A
prefetch holds no register and has side effects, so it stays where it is issued, and ptxas does not
sink the loads issued before it past it: a loop step that loads its group and then asks for a later
group's lines issues all of its group's loads together, with the later group on its way to L2.

    ref[idx]: any block of a kernel ref; each element's address is prefetched, so index one element
    a 128-byte line (e.g. a strided `pl.ds(0, n // 32, stride=32)` over a uint32 row) to issue one
    prefetch a line.

Only a hint: it reads nothing into the kernel and changes no memory, so interpret mode (the CPU)
discharges it to nothing. The Triton lowering is the inline PTX over the block's pointers. These are
jax._src internals, as in `relaxed_atomic`.
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src import state
from jax._src import tree_util
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives

from pallas_kernels.ref_pointers import block_pointers

l2_prefetch_p = jax_core.Primitive("l2_prefetch")
l2_prefetch_p.multiple_results = True


@l2_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree):
    del avals_flat, args_tree
    return [], {state.WriteEffect(0)}  # a read with no result would be dead code to jax: kept as a write


@state_discharge.register_discharge_rule(l2_prefetch_p)
def _discharge(in_avals, out_avals, *args_flat, args_tree):
    del out_avals, args_flat, args_tree
    return [None] * len(in_avals), []


@lowering.register_lowering(l2_prefetch_p)
def _lowering(ctx: lowering.LoweringRuleContext, *args_flat, args_tree):
    ptr, indexers = args_tree.unflatten(args_flat)
    ptrs = block_pointers(ctx, ptr, indexers, "l2_prefetch")
    shape = ir.RankedTensorType(ptrs.type).shape if isinstance(ptrs.type, ir.RankedTensorType) else []
    i32 = ir.IntegerType.get_signless(32)
    result = ir.RankedTensorType.get(shape, i32) if shape else i32
    # The result is a dummy (an elementwise asm op has one); pure=False keeps the op without a use.
    tt_dialect.ElementwiseInlineAsmOp([result], "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", constraints="=r,l",
                                      pure=False, packed_element=1, args=[ptrs])
    return []


def l2_prefetch(ref, idx=()) -> None:
    """Prefetch into L2 the lines that hold ref[idx] (see the module docstring)."""
    x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "l2_prefetch")
    args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms))
    l2_prefetch_p.bind(*args_flat, args_tree=args_tree)

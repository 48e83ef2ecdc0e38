"""`relaxed_atomic_add`: Pallas' Triton `atomic_add` with relaxed memory order.

Pallas lowers every atomic with acquire-release semantics, which on sm_90 puts a full
`MEMBAR.ALL.GPU` in front of each `ATOMG`: the fence waits for the thread's earlier atomics, so an
epilogue that adds a [BM, BN] fp32 tile (16 vectorised atomics a thread at BM 64) pays 16
serialised L2 round trips. Accumulation into a sum needs atomicity, not ordering; this primitive
is the same op with `sem = relaxed` (the atomics pipeline; no fence). Use acquire-release atomics
(`pltriton.atomic_add`) where ordering matters (flags, counters).

It reuses Pallas' own abstract evaluation and CPU discharge (interpret mode: a gather-add-scatter,
so the indices of one call must be distinct, as for `pltriton.atomic_add`) and its pointer
arithmetic; only the lowering's memory order differs. These are jax._src internals, identical in
jax 0.10.2 and 0.11.2 (the two versions this code base runs on); a change shows as an import or
lowering error here, nowhere else.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import primitives as tprim
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives

from pallas_kernels.ref_pointers import block_pointers

relaxed_atomic_add_p = jax_core.Primitive("relaxed_atomic_add")
relaxed_atomic_add_p.def_effectful_abstract_eval(tprim._atomic_abstract_eval)
state_discharge.register_discharge_rule(relaxed_atomic_add_p)(tprim._atomic_rmw_discharge_rule)


@lowering.register_lowering(relaxed_atomic_add_p)
def _lowering(ctx: lowering.LoweringRuleContext, *args_flat, args_tree, atomic_type):
    del atomic_type  # always ADD
    ptr, indexers, val, mask = args_tree.unflatten(args_flat)
    *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
    ptr = block_pointers(ctx, ptr, indexers, "relaxed_atomic_add")
    val = lowering._ensure_ir_value(val, value_aval)
    if mask is not None:
        mask = lowering._ensure_ir_value(mask, mask_aval)
    op = tt_dialect.RMWOp.ADD if jnp.issubdtype(value_aval.dtype, jnp.integer) else tt_dialect.RMWOp.FADD
    return lowering._atomic_rmw(op, ptr, val, mask=mask, semantic=tt_dialect.MemSemantic.RELAXED)


def relaxed_atomic_add(ref, idx, val, *, mask=None):
    """ref[idx] += val atomically, relaxed order; returns the old values (as `pltriton.atomic_add`)."""
    x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "relaxed_atomic_add")
    args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, mask))
    return relaxed_atomic_add_p.bind(*args_flat, args_tree=args_tree, atomic_type=tprim.AtomicOpType.ADD)

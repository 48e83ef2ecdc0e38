"""`block_pointers`: in a Pallas Triton lowering rule, the pointers of a kernel ref's indexed block.

For primitives of this package that take a ref and an index as Pallas' own loads do
(`relaxed_atomic`): the index's transforms end in one NDIndexer (a trivial one is
made for a bare ref), whose offsets Pallas' pointer arithmetic turns into a tensor of pointers of
the block's shape. These are jax._src internals, as in `relaxed_atomic`.
"""

from __future__ import annotations

from jax._src import state
from jax._src.pallas.triton import lowering
from jax._src.state import indexing


def block_pointers(ctx: lowering.LoweringRuleContext, ptr, indexers, op: str):
    """The pointers of ref[indexers] (ptr: the lowered ref; op names the primitive in errors)."""
    block_info, *_ = ctx.block_infos
    indexers = list(indexers)
    if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
        ref_aval = state.transform_type(indexers, ctx.avals_in[0])
        indexers.append(indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
    if len(indexers) != 1:
        raise NotImplementedError(f"{op}: only a single indexer is supported")
    return lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])

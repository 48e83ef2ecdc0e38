"""Pair-axis align for the MoE kernels: (token, slot) pairs grouped by expert into blocks of BM rows.

Pairs: p = m*k + slot is the (token, slot) pair index of topk_ids [M, k], P = M*k.

Align (one Pallas launch for P <= 64, `_align_kernel`; beyond, `_align_blocked`: two Pallas
launches, no sort; the reference backend's `_align_jnp` is a stable argsort, the same outputs,
except that on the GPU the blocked align orders an expert's pairs by the order in which their
blocks of pairs ran): pairs ordered by expert, each expert's run padded to a multiple of BM rows:
  sorted_pairs [S] int32  pair at each padded slot, P where the slot is padding (S > NB*BM),
  block_expert [NBP] int32 expert of block j (slots [j*BM, (j+1)*BM)), -1 for an unused block.
NB = n + (P - n) // BM with n = min(P, E) bounds the blocks any routing needs (NBP = next pow2).
The kernel ranks pairs against pairs ([PP, PP] comparisons, PP = pow2 >= P): rank in bucket,
bucket size, bucket block offset from the bucket representatives (rank 0); nothing grows with E.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve
from pallas_kernels.relaxed_atomic import relaxed_atomic_add

MAX_ALIGN_PAIRS = 64  # the pair-axis align kernel's limit: [64, 64] comparisons stay in registers


def next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class AlignSizes:
    p: int  # pairs
    bm: int  # block rows
    nb: int  # blocks any routing can need (the GEMM grid's first axis)
    nbp: int  # len(block_expert): next pow2 of nb
    pp: int  # the align kernel's pair vector: pow2 >= max(P, 16); also its slots per program
    n_slots: int  # len(sorted_pairs) > nb * bm


def align_sizes(p: int, e: int, bm: int) -> AlignSizes:
    n = min(p, e)
    nb = n + (p - n) // bm  # sum_e ceil(c_e / bm) <= n + (P - n) // bm (see the module doc)
    pp = max(16, next_pow2(p))
    # S > NB*BM: the last slot is never a pair's (the blocked align points masked-off lanes there)
    return AlignSizes(p, bm, nb, next_pow2(nb), pp, -(-(nb * bm + 1) // pp) * pp)


def _align_kernel(ids_ref, sorted_ref, blk_ref, *, s: AlignSizes, n_experts: int):
    """Program c writes slots [c*PP, (c+1)*PP) of sorted_pairs; program 0 also writes block_expert.

    Every program ranks all pairs ([PP, PP] in registers; cheaper than a second launch).
    """
    q = jnp.arange(s.pp, dtype=jnp.int32)
    ids = pltriton.load(ids_ref.at[pl.ds(0, s.pp)], mask=q < s.p, other=n_experts)  # [PP], pad: E
    valid = (q < s.p) & (ids < n_experts)  # ids >= E: skipped pairs, in no block
    ip, iq = ids[:, None], ids[None, :]  # rows: pair p, columns: pair q
    earlier = q[None, :] < q[:, None]
    same = iq == ip
    one = jnp.int32(1)
    zero = jnp.int32(0)
    within = jnp.sum(jnp.where(same & earlier, one, zero), axis=1)  # rank in its expert's bucket
    count = jnp.sum(jnp.where(same, one, zero), axis=1)  # its bucket's size
    nblk = jnp.where(valid, (count + (s.bm - 1)) // s.bm, 0)  # blocks of its bucket
    first = valid & (within == 0)  # one representative per bucket
    lower = first[None, :] & (iq < ip)
    bstart = jnp.sum(jnp.where(lower, nblk[None, :], zero), axis=1)  # first block of its bucket
    pos = bstart * s.bm + within  # its padded slot

    slot = pl.program_id(0) * s.pp + q  # [PP] the slots this program writes
    hit = (pos[None, :] == slot[:, None]) & valid[None, :]  # [slots, pairs]
    n_hit = jnp.sum(jnp.where(hit, one, zero), axis=1)
    pair = jnp.sum(jnp.where(hit, q[None, :], zero), axis=1)
    sorted_ref[pl.ds(pl.program_id(0) * s.pp, s.pp)] = jnp.where(n_hit > 0, pair, s.p)

    @pl.when(pl.program_id(0) == 0)
    def _():
        j = jnp.arange(s.nbp, dtype=jnp.int32)[:, None]  # [NBP, 1]
        own = first[None, :] & (bstart[None, :] <= j) & (j < (bstart + nblk)[None, :])  # [NBP, PP]
        owned = jnp.sum(jnp.where(own, one, zero), axis=1)
        expert = jnp.sum(jnp.where(own, iq, zero), axis=1)
        blk_ref[...] = jnp.where(owned > 0, expert, -1)


def _rank_kernel(ids_ref, _, off_ref, rep_ref, cnt_ref, *, p: int, pb: int, cb: int, n_experts: int,
                 interpret: bool):
    """Program b, pairs [b*PB, (b+1)*PB): each pair's rank among the block's earlier pairs of its
    expert and the block's first such pair (its lead), from [PB, CB] comparisons a step; each lead
    reserves its expert's pairs of the block with one atomic add on cnt (returning the expert's
    pairs in the blocks that reserved before). off: the lead's reservation, or the rank."""
    b = pl.program_id(0)
    q = b * pb + jnp.arange(pb, dtype=jnp.int32)  # [PB] pair indices
    ids = pltriton.load(ids_ref.at[pl.ds(b * pb, pb)], mask=q < p, other=n_experts)
    within = jnp.zeros((pb,), jnp.int32)
    n_same = jnp.zeros((pb,), jnp.int32)
    rep = q
    for c0 in range(0, pb, cb):  # columns: the block's pairs c0 .. c0 + CB
        qc = b * pb + c0 + jnp.arange(cb, dtype=jnp.int32)
        ic = pltriton.load(ids_ref.at[pl.ds(b * pb + c0, cb)], mask=qc < p, other=n_experts)
        same = ic[None, :] == ids[:, None]  # [PB, CB]
        within = within + jnp.sum((same & (qc[None, :] < q[:, None])).astype(jnp.int32), axis=1)
        n_same = n_same + jnp.sum(same.astype(jnp.int32), axis=1)
        rep = jnp.minimum(rep, jnp.min(jnp.where(same, qc[None, :], q[:, None]), axis=1))
    lead = (ids < n_experts) & (within == 0)
    # The interpreter has no masked atomics: its other lanes add 0 to the spare counter cnt[E]
    old = relaxed_atomic_add(cnt_ref, (jnp.where(lead, ids, n_experts),), jnp.where(lead, n_same, 0),
                             mask=None if interpret else lead)
    off_ref[pl.ds(b * pb, pb)] = jnp.where(lead, old, within)
    rep_ref[pl.ds(b * pb, pb)] = rep


def _place_kernel(ids_ref, off_ref, rep_ref, cnt_ref, sorted_ref, blk_ref, first_ref, *, p: int, pb: int,
                  jb: int, e_pow: int, n_experts: int, bm: int, interpret: bool):
    """Program b: from the experts' counts (complete: the rank launch has ended), each expert's
    first slot (exclusive cumsum of its padded blocks, recomputed by every program: [E] in
    registers); then block_expert and the padding of blocks [b*JB, (b+1)*JB), and the slot of
    each valid pair of block b: its expert's first slot + its lead's reservation + its rank."""
    b = pl.program_id(0)
    ev = jnp.arange(e_pow, dtype=jnp.int32)
    cnt = pltriton.load(cnt_ref.at[pl.ds(0, e_pow)], mask=ev < n_experts, other=0)  # [E_pow]
    nblk = (cnt + bm - 1) // bm
    bend = jnp.cumsum(nblk)  # [E_pow] one past each expert's last block
    first = (bend - nblk) * bm
    # A register vector cannot be gathered: this program's copy of `first`, read back by index
    # (its own row: no other program writes it; the barrier orders the threads' stores and loads).
    first_ref[b, :] = first
    if not interpret:
        pltriton.debug_barrier()

    j = b * jb + jnp.arange(jb, dtype=jnp.int32)  # [JB] blocks
    used = j < jnp.sum(nblk)
    e_j = jnp.where(used, jnp.sum((bend[None, :] <= j[:, None]).astype(jnp.int32), axis=1), -1)
    pltriton.store(blk_ref.at[pl.ds(b * jb, jb)], e_j, mask=j < blk_ref.shape[0])
    ec = jnp.where(used, e_j, 0)
    first_j = pltriton.load(first_ref.at[b, ec], mask=used, other=0)  # [JB]
    cnt_j = pltriton.load(cnt_ref.at[ec], mask=used, other=0)
    slot = j[:, None] * bm + jnp.arange(bm, dtype=jnp.int32)[None, :]  # [JB, BM]
    pad = (~used[:, None]) | (slot - first_j[:, None] >= cnt_j[:, None])
    n_slots = sorted_ref.shape[0]
    pad = (pad & (slot < n_slots)).reshape(jb * bm)
    pltriton.store(sorted_ref.at[pl.ds(b * jb * bm, jb * bm)], jnp.full((jb * bm,), p, jnp.int32), mask=pad)

    @pl.when(b * pb < p)  # programs past the pairs only place blocks
    def _():
        q = b * pb + jnp.arange(pb, dtype=jnp.int32)  # [PB] pairs
        ids = pltriton.load(ids_ref.at[pl.ds(b * pb, pb)], mask=q < p, other=n_experts)
        valid = ids < n_experts  # padding and skipped pairs (id >= E): in no block
        off = off_ref[pl.ds(b * pb, pb)]
        rep = rep_ref[pl.ds(b * pb, pb)]
        reserved = pltriton.load(off_ref.at[rep], mask=valid & (rep != q), other=0)  # the lead's; a lead: 0
        e = jnp.where(valid, ids, 0)
        dst = pltriton.load(first_ref.at[b, e], mask=valid, other=0) + reserved + off
        # Unmasked: the other lanes write P to the last slot, which is padding (S > NB*BM), so every
        # write there agrees (the interpreter's masked scatter would write back a stale value)
        pltriton.store(sorted_ref.at[jnp.where(valid, dst, n_slots - 1)], jnp.where(valid, q, p))


def _align_blocked(ids, s: AlignSizes, n_experts: int, interpret: bool):
    """The layout for any P without a sort, in two Pallas launches over blocks of PB pairs:
    (1) ranks within each block, and each block's pairs of an expert reserved with one atomic add
    on the expert's count; (2) from the counts, each expert's first slot, block_expert, the
    padding, and each pair's slot. An expert's pairs come in the order their blocks reserved:
    stable in p where the blocks run in order (interpret mode: `_align_jnp`'s output exactly), in
    any block order on the GPU. Every consumer reads a block's rows independently, so y does
    not depend on that order. Two launches where a histogram, XLA cumsums and
    a place launch took ten (bench/history/fused_moe.md)."""
    p, bm = s.p, s.bm
    # pairs a rank program (64: the H200's best, bench/history/fused_moe.md); blocks (of BM slots) a place program
    pb, jb = 64, 8
    nbk = -(-p // pb)
    n_place = max(nbk, -(-max(-(-s.n_slots // bm), s.nbp) // jb))  # every pair, every slot and block
    e_pow = next_pow2(n_experts)
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    off, rep, cnt = pl.pallas_call(
        functools.partial(_rank_kernel, p=p, pb=pb, cb=32, n_experts=n_experts, interpret=interpret),
        grid=(nbk,),
        out_shape=(i32(nbk * pb), i32(nbk * pb), i32(e_pow + 1)),
        input_output_aliases={1: 2},  # counts from 0; cnt[E]: the rank kernel's spare (E <= E_pow)
        compiler_params=params, interpret=interpret, name="moe_align_rank",
    )(ids, jnp.zeros((e_pow + 1,), jnp.int32))
    sorted_pairs, block_expert, _ = pl.pallas_call(
        functools.partial(_place_kernel, p=p, pb=pb, jb=jb, e_pow=e_pow, n_experts=n_experts, bm=bm,
                          interpret=interpret),
        grid=(n_place,),
        out_shape=(i32(s.n_slots), i32(s.nbp), i32(n_place, e_pow)),
        compiler_params=params, interpret=interpret, name="moe_align_place",
    )(ids, off, rep, cnt)
    return sorted_pairs, block_expert


def _align_jnp(ids, s: AlignSizes, n_experts: int):
    """The same outputs for any P, from a stable argsort (its work grows with E: bincount).
    Pairs with ids >= E sort last and are dropped (skipped pairs)."""
    p, bm = s.p, s.bm
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)  # [P]
    counts = jnp.zeros(n_experts, jnp.int32).at[ids].add(1, mode="drop")  # [E]
    nblk = (counts + bm - 1) // bm
    bend = jnp.cumsum(nblk)  # [E] one past each expert's last block
    cstart = jnp.cumsum(counts) - counts
    se = ids[order]
    pos = (bend - nblk)[se] * bm + jnp.arange(p, dtype=jnp.int32) - cstart[se]
    pos = jnp.where(se < n_experts, pos, s.n_slots)  # skipped pairs: out of bounds, dropped
    sorted_pairs = jnp.full((s.n_slots,), p, jnp.int32).at[pos].set(order, mode="drop")
    j = jnp.arange(s.nbp, dtype=jnp.int32)
    # compare_all: one fusion. The default method ("scan") is a while loop, which on the GPU
    # waits on the host once per step (~150 µs an align on the H200).
    expert = jnp.searchsorted(bend, j, side="right", method="compare_all").astype(jnp.int32)
    return sorted_pairs, jnp.where(j < bend[-1], expert, -1)


def moe_align(topk_ids, n_experts: int, block_m: int, *, backend="auto"):
    """(sorted_pairs [S], block_expert [NBP]) for topk_ids [M, k]; see the module docstring.
    Pairs whose id is >= n_experts are skipped: in no block (grouped_moe's skipped pairs)."""
    backend = resolve(backend)
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    s = align_sizes(ids.shape[0], n_experts, block_m)
    if backend == "reference":
        return _align_jnp(ids, s, n_experts)
    if s.p > MAX_ALIGN_PAIRS:
        return _align_blocked(ids, s, n_experts, backend == "interpret")
    return pl.pallas_call(
        functools.partial(_align_kernel, s=s, n_experts=n_experts),
        out_shape=(jax.ShapeDtypeStruct((s.n_slots,), jnp.int32),
                   jax.ShapeDtypeStruct((s.nbp,), jnp.int32)),
        grid=(s.n_slots // s.pp,),
        interpret=backend == "interpret",
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="moe_align",
    )(ids)

"""The router's selection in one launch: sigmoid scores, expert bias, group-limited top-k and the
renormalised weights (DeepSeek-V3 style), from the gate logits.

    s = σ(logits) [M, E];  b = s + expert_bias                       (fp32)
    group score = sum of the group's top 2 of b (G groups of E/G experts); the topk_group best
        groups are kept (higher score first, equal scores by lower group index);
    ids = the top_k of b among the kept experts (equal values by lower index, as lax.top_k);
    w = s[ids] / (Σ s[ids] + 1e-20) if norm_topk_prob else s[ids];  weights = w · scale.

Layouts: logits [M, E] fp32, expert_bias [E] fp32 -> (weights [M, k] fp32, ids [M, k] int32).
Kernel (Triton lowering): grid (M,), one program per token holding its [G, E/G] scores in
registers; the top k is k rounds of one argmax over the E scores (the lower index of equal values
first) with the pick masked, then the picks' scores in one reduction. G, E/G and k must be powers
of two (Ling: 8 x 64, k = 8); other shapes run the reference. Bytes: M·E·4 in, M·k·8 out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve


def reference(logits, expert_bias, *, top_k: int, n_group: int, topk_group: int, scale: float, norm: bool):
    """Plain jnp, sort-free up to one top_k (XLA fuses it into a few reductions)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + expert_bias.astype(jnp.float32)
    m, e = choice.shape
    if n_group > 1:
        grouped = choice.reshape(m, n_group, e // n_group)
        best = jnp.max(grouped, axis=-1)  # [M, G]
        first = jnp.argmax(grouped, axis=-1)  # the best's first position: a tied second still counts
        second = jnp.max(jnp.where(jnp.arange(e // n_group) == first[..., None], -jnp.inf, grouped), axis=-1)
        group_scores = best + second  # the sum of each group's top 2
        # Group g is kept when fewer than topk_group groups rank above it.
        g = jnp.arange(n_group)
        other, this = group_scores[:, None, :], group_scores[:, :, None]  # [M, G (this), G (other)]
        above = (other > this) | ((other == this) & (g[None, None, :] < g[None, :, None]))
        keep = jnp.sum(above, axis=-1) < topk_group  # [M, G]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(m, e)
    _, ids = jax.lax.top_k(choice, top_k)  # [M, k]
    w = jnp.take_along_axis(scores, ids, axis=1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, ids.astype(jnp.int32)


def _kept_groups(choice, topk_group):
    """choice [..., G, E/G] with the experts of every group outside the topk_group best set to -inf
    (a group's score: the sum of its top 2, a tied second included; equal scores rank by lower
    group index). Reductions along the last axis, for every leading index together."""
    *lead, g, eg = choice.shape
    if g == 1:
        return choice
    lead = tuple(lead)
    col = jax.lax.broadcasted_iota(jnp.int32, choice.shape, len(lead) + 1)
    best = jnp.max(choice, axis=-1)  # [..., G]
    first = jnp.min(jnp.where(choice == best[..., None], col, eg), axis=-1)
    second = jnp.max(jnp.where(col == first[..., None], -jnp.inf, choice), axis=-1)
    group_scores = best + second
    this = jax.lax.broadcasted_iota(jnp.int32, lead + (g, g), len(lead))
    other = jax.lax.broadcasted_iota(jnp.int32, lead + (g, g), len(lead) + 1)
    gs_this, gs_other = group_scores[..., :, None], group_scores[..., None, :]
    above = (gs_other > gs_this) | ((gs_other == gs_this) & (other < this))
    keep = jnp.sum(above.astype(jnp.int32), axis=-1) < topk_group  # [..., G]
    return jnp.where(keep[..., None], choice, -jnp.inf)


def _select(logits, bias, *, top_k, topk_group, scale, norm):
    """One token's selection in a program: logits, bias [G, E/G] fp32 -> (weights, ids) [k]."""
    scores = jax.nn.sigmoid(logits)  # [G, E/G]
    choice = _kept_groups(scores + bias, topk_group)
    g, eg = choice.shape
    # The top k: k rounds of one argmax over the flattened choice (a (value, index) reduction
    # that keeps the lower index of equal values, as lax.top_k), each pick masked for the next
    # round; then every pick's score in one [k, E] reduction.
    e = g * eg
    choice, scores = choice.reshape(e), scores.reshape(e)
    expert = jax.lax.broadcasted_iota(jnp.int32, (e,), 0)
    slot = jax.lax.broadcasted_iota(jnp.int32, (top_k,), 0)
    ids = jnp.zeros((top_k,), jnp.int32)
    for j in range(top_k):
        idx = jnp.argmax(choice).astype(jnp.int32)
        ids = jnp.where(slot == j, idx, ids)
        choice = jnp.where(expert == idx, -jnp.inf, choice)
    picked = expert[None, :] == ids[:, None]  # [k, E]
    ws = jnp.sum(jnp.where(picked, scores[None, :], 0.0), axis=1)
    if norm:
        ws = ws / (jnp.sum(ws) + 1e-20)
    return ws * scale, ids


def _select_kernel(logits_ref, bias_ref, w_ref, ids_ref, *, top_k, topk_group, scale, norm):
    w_ref[...], ids_ref[...] = _select(logits_ref[...], bias_ref[...], top_k=top_k, topk_group=topk_group,
                                       scale=scale, norm=norm)


GATE_ROWS = 4  # experts a program of the fused router computes the logits of
GATE_CHUNK = 512  # columns of D a load covers at most (the largest power of two dividing D, up to this)


def _route_kernel(x_ref, gate_ref, bias_ref, counters_ref_in, logits_ref, w_ref, ids_ref, counters_ref, *,
                  n_group, top_k, topk_group, scale, norm, chunk, interpret):
    """Program i: the token's logits of experts [4i, 4i + 4) (fp32 dot over D in chunks, every
    chunk's loads issued before the sums), stored; then a ticket; the last program reads all E
    logits back and selects (`_select`)."""
    del counters_ref_in  # aliased: the output ref is used
    i = pl.program_id(0)
    d = x_ref.shape[1]
    e = logits_ref.shape[1]
    rows = pl.ds(i * GATE_ROWS, GATE_ROWS)
    chunks = [pl.ds(c * chunk, chunk) for c in range(d // chunk)]
    ws = [gate_ref[rows, c] for c in chunks]  # [4, CHUNK] fp32 each
    xs = [x_ref[0, c].astype(jnp.float32) for c in chunks]
    acc = sum(w * xc[None, :] for w, xc in zip(ws, xs))  # [4, CHUNK]: the chunks added elementwise first
    logits_ref[0, rows] = jnp.sum(acc, axis=1)

    def barrier():  # the program's threads; the interpreter runs a program as one
        if not interpret:
            pltriton.debug_barrier()

    barrier()  # every thread's logits stored before the ticket (an acquire-release atomic)
    ticket = pltriton.atomic_add(counters_ref, jnp.int32(0), jnp.int32(1))
    barrier()

    @pl.when(ticket == pl.num_programs(0) - 1)
    def _():
        w, ids = _select(logits_ref[0, :].reshape(n_group, e // n_group), bias_ref[...].reshape(n_group, e // n_group),
                         top_k=top_k, topk_group=topk_group, scale=scale, norm=norm)
        w_ref[0, :] = w
        ids_ref[0, :] = ids
        counters_ref[jnp.int32(0)] = jnp.int32(0)  # zero again for the next ticket kernel


@functools.partial(jax.jit, static_argnames=("top_k", "n_group", "topk_group", "scale", "norm", "interpret"))
def _select_pallas(logits, expert_bias, *, top_k, n_group, topk_group, scale, norm, interpret):
    m, e = logits.shape
    eg = e // n_group
    kernel = functools.partial(_select_kernel, top_k=top_k, topk_group=topk_group, scale=scale, norm=norm)
    return pl.pallas_call(
        kernel,
        grid=(m,),
        in_specs=[pl.BlockSpec((None, n_group, eg), lambda i: (i, 0, 0)),
                  pl.BlockSpec((n_group, eg), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((None, top_k), lambda i: (i, 0)), pl.BlockSpec((None, top_k), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((m, top_k), jnp.float32), jax.ShapeDtypeStruct((m, top_k), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="router_select",
    )(logits.astype(jnp.float32).reshape(m, n_group, eg), expert_bias.astype(jnp.float32).reshape(n_group, eg))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.partial(jax.jit, static_argnames=("top_k", "n_group", "topk_group", "scale", "norm", "interpret"))
def _route_pallas(x, gate, expert_bias, counters, *, top_k, n_group, topk_group, scale, norm, interpret):
    d = x.shape[1]
    e = gate.shape[0]
    kernel = functools.partial(_route_kernel, n_group=n_group, top_k=top_k, topk_group=topk_group,
                               scale=scale, norm=norm, chunk=min(GATE_CHUNK, d & -d), interpret=interpret)
    whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    _, w, ids, counters = pl.pallas_call(
        kernel,
        grid=(e // GATE_ROWS,),
        in_specs=[whole(1, d), whole(e, d), whole(e), whole(*counters.shape)],
        out_specs=[whole(1, e), whole(1, top_k), whole(1, top_k), whole(*counters.shape)],
        out_shape=[jax.ShapeDtypeStruct((1, e), jnp.float32), jax.ShapeDtypeStruct((1, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((1, top_k), jnp.int32), jax.ShapeDtypeStruct(counters.shape, jnp.int32)],
        input_output_aliases={3: 3},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="router",
    )(x, gate.astype(jnp.float32), expert_bias.astype(jnp.float32), counters)
    return w, ids, counters


def gate_and_select(x, gate, expert_bias, counters, *, top_k: int, n_group: int, topk_group: int,
                    scale: float = 1.0, norm: bool = True, backend: str = "auto"):
    """One token's gate logits (x [1, D] @ gate [E, D]ᵀ in fp32) and selection in one launch, by a
    ticket (`pallas_kernels.tickets`): (weights [1, k], ids [1, k], the counters after it), or None
    where it does not apply (the reference backend; G, E/G or k not a power of two; D without a
    power-of-two factor of 16; more than one token: there the last program would select every
    token alone, while `select_experts` gives each token a program of its own). The logits are
    fp32 dots summed in their own order, so a near-tie may choose otherwise than XLA's dot would."""
    m, d = x.shape
    e = gate.shape[0]
    backend = resolve(backend)
    if (backend == "reference" or m != 1 or (d & -d) < 16 or e % GATE_ROWS
            or not all(map(_pow2, (n_group, e // n_group, top_k)))):
        return None
    return _route_pallas(x, gate, expert_bias, counters, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         scale=float(scale), norm=norm, interpret=backend == "interpret")


def select_experts(logits, expert_bias, *, top_k: int, n_group: int, topk_group: int, scale: float = 1.0,
                   norm: bool = True, backend: str = "auto"):
    """(weights [M, k] fp32, ids [M, k] int32) from logits [M, E]; see the module docstring."""
    m, e = logits.shape
    if e % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= e:
        raise ValueError(f"E={e} experts in n_group={n_group} groups, topk_group={topk_group}, top_k={top_k}: "
                         "groups must divide E, 1 <= topk_group <= n_group and 1 <= top_k <= E")
    backend = resolve(backend)
    opts = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scale=float(scale), norm=norm)
    if backend == "reference" or not all(map(_pow2, (n_group, e // n_group, top_k))):
        return reference(logits, expert_bias, **opts)
    return _select_pallas(logits, expert_bias, **opts, interpret=backend == "interpret")

"""Prefill, plain decode and NEXTN chain speculative decoding over B slots, as pure functions of
(model, slots) that compile into one program each.

Invariant between steps, per slot: the target state holds tokens 0..n-1 (n = lengths); `last_token`
is token n, already emitted but not yet in the target state; `last_hidden` is the target's final
hidden state at position n-1; the NEXTN cache holds the pairs (h_i, token_{i+1}) for i < n-1.

A speculative step (num_steps = S):
  draft    S chained NEXTN steps from (h_{n-1}, token_n), each feeding its own hidden state forward;
  verify   one target forward over [token_n, d_1 .. d_S] that keeps the KDA state after each position;
  accept   greedy: while d_j equals the target's argmax; sampled: rejection sampling, so the output
           distribution is the target's; then one bonus token from the target;
  commit   KDA state taken at the accepted position, MLA entries past it left behind the length
           (a slot that stops at EOS or max_new within the step keeps only its emitted tokens: its
           state then holds exactly prompt + output[:-1], which a prefix-cache checkpoint needs);
  extend   the NEXTN layer over the true pairs (h_{n-1+j}, token_{n+j}) of the verified positions.

With the DSpark block drafter (`BlockDrafter`, `ling.dspark`) the draft is one backbone forward
over the block [token_n, mask ...] plus its sequential head, and the extend writes the drafter's
context entries of the verified positions from the target layers it reads (`taps`); its cache
holds positions < n. Its confidence head may limit the drafts verified (`schedule`, `accept`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from ling.model import Batch, DraftBatch, LingModel
from ling.state import KDAState, State, commit, init_state
from spec.sampling import (MAX_TOP_LOGPROBS, SamplingParams, any_sampling, key_for, needs_sampling, penalize,
                           penalize_verify, probs, sample, token_logprobs)

# RNG purposes: one stream per use, so no two draws share a key.
_SAMPLE, _DRAFT, _ACCEPT, _BONUS = 0, 100, 200, 300


@struct.dataclass
class Slots:
    """The device-side state of B decoding slots."""

    model: State  # target layers (+ NEXTN cache), lengths [B]
    last_token: jnp.ndarray  # [B] int32
    last_hidden: jnp.ndarray  # [B, D]
    params: SamplingParams
    out: jnp.ndarray  # [B, N] int32 generated tokens
    n_out: jnp.ndarray  # [B] int32
    max_new: jnp.ndarray  # [B] int32
    eos: jnp.ndarray  # [B] int32, -1 for none
    done: jnp.ndarray  # [B] bool
    steps: jnp.ndarray  # [B] int32 decode/verify steps the slot was live in
    produced: jnp.ndarray  # [B] int32 tokens those steps emitted (mean accepted length = produced / steps)
    # The last call's emitted tokens, in emission order, when it was asked for them (`logprobs`):
    logprobs: jnp.ndarray  # [B, W, 1 + K] float32 (spec.sampling.token_logprobs); W = 0: never asked
    top_ids: jnp.ndarray  # [B, W, K] int32
    # For the penalties (spec.sampling.penalize), kept by every program whatever the slot asks for:
    counts: jnp.ndarray  # [B, V] int32 how often each token was emitted since the slot's reset
    seen: jnp.ndarray  # [B, V] bool the tokens of the slot's prompt


def new_slots(model: LingModel, batch: int, max_len: int, max_out: int, logprob_width: int = 0) -> Slots:
    """logprob_width: tokens a call can emit whose log-probabilities it can report (a speculative
    step's num_steps + 1; 0: none)."""
    cfg, dtype = model.cfg, model.embed_tokens.dtype
    z = lambda: jnp.zeros((batch,), jnp.int32)  # distinct buffers: the slots are donated
    k = min(MAX_TOP_LOGPROBS, cfg.vocab_size)
    return Slots(
        model=init_state(cfg, batch, max_len, dtype, nextn=model.nextn is not None,
                         dspark=None if model.dspark is None else model.dspark.cfg),
        last_token=z(), last_hidden=jnp.zeros((batch, cfg.hidden_size), dtype),
        params=SamplingParams.make(batch), out=jnp.zeros((batch, max_out), jnp.int32), n_out=z(),
        max_new=z(), eos=z() - 1, done=jnp.ones((batch,), bool), steps=z(), produced=z(),
        logprobs=jnp.zeros((batch, logprob_width, 1 + k), jnp.float32),
        top_ids=jnp.zeros((batch, logprob_width, k), jnp.int32),
        counts=jnp.zeros((batch, cfg.vocab_size), jnp.int32), seen=jnp.zeros((batch, cfg.vocab_size), bool))


def _record_logprobs(slots: Slots, logits, tokens) -> Slots:
    """Keeps the log-probabilities of tokens [B, W'] under logits [B, W', V] in the slots."""
    w = tokens.shape[1]
    if slots.logprobs.shape[1] < w:
        raise ValueError(f"the slots report log-probabilities of {slots.logprobs.shape[1]} tokens a call; this "
                         f"call emits up to {w} (new_slots(logprob_width=...))")
    lp, ids = token_logprobs(logits, tokens)
    return slots.replace(logprobs=slots.logprobs.at[:, :w].set(lp), top_ids=slots.top_ids.at[:, :w].set(ids))


def reset(slots: Slots, which, params: SamplingParams, max_new, eos, restored=None) -> Slots:
    """Empties the slots selected by `which` [B] bool for new requests (KDA state zeroed, lengths 0;
    MLA entries need no clearing: the causal mask hides everything past a slot's length).
    restored [B] bool (default none): slots whose model state and `seen` a prefix-cache restore
    has just written (`spec.prefix.restore`): those keep them and are reset otherwise."""
    sel = lambda new, old, w=which: jnp.where(w.reshape(w.shape + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    fresh = which if restored is None else which & ~restored
    empty = lambda new, old: sel(new, old, fresh)  # noqa: E731
    layers = tuple(jax.tree.map(lambda a: empty(0, a), c) if isinstance(c, KDAState) else c
                   for c in slots.model.layers)
    z = jnp.zeros_like(slots.n_out)
    return slots.replace(
        model=slots.model.replace(layers=layers, lengths=empty(z, slots.model.lengths)),
        params=jax.tree.map(sel, params, slots.params), n_out=sel(z, slots.n_out),
        max_new=sel(max_new, slots.max_new), eos=sel(eos, slots.eos), done=sel(False, slots.done),
        steps=sel(z, slots.steps), produced=sel(z, slots.produced), counts=sel(0, slots.counts),
        seen=empty(False, slots.seen))


def _emitted(slots: Slots, tokens, count, live):
    """(1 + the index of the first EOS among the first count[b] of tokens [B, E], else E + 1;
    how many of them `_emit` appends) for each slot."""
    e = tokens.shape[1]
    is_eos = (tokens == slots.eos[:, None]) & (jnp.arange(e)[None] < count[:, None])
    first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, e + 1)
    count = jnp.minimum(jnp.minimum(count, first_eos), slots.max_new - slots.n_out)
    return first_eos, jnp.where(live, jnp.maximum(count, 0), 0)


@jax.named_scope("emit")
def _emit(slots: Slots, tokens, count, live) -> Slots:
    """Appends tokens [B, E] (the first count[b] of them) to live slots, stopping at EOS and max_new,
    and counts them (`Slots.counts`)."""
    e = tokens.shape[1]
    idx = jnp.arange(e)[None]
    first_eos, count = _emitted(slots, tokens, count, live)
    pos = jnp.where(idx < count[:, None], slots.n_out[:, None] + idx, slots.out.shape[1])  # out of range: dropped
    out = slots.out.at[jnp.arange(tokens.shape[0])[:, None], pos].set(tokens, mode="drop")
    n_out = slots.n_out + count
    done = slots.done | (live & ((first_eos <= count) | (n_out >= slots.max_new)))
    rows = jnp.arange(tokens.shape[0])[:, None]
    counts = slots.counts.at[rows, jnp.where(idx < count[:, None], tokens, slots.counts.shape[1])].add(1, mode="drop")
    return slots.replace(out=out, n_out=n_out, done=done, counts=counts)


def _penalized(logits, slots: Slots, sampling: bool):
    """logits [B, V] with the slots' penalties applied (the sampling program only: the host picks
    it for any slot with a penalty, `spec.sampling.needs_sampling`)."""
    return penalize(logits, slots.counts, slots.seen, slots.params) if sampling else logits


def _dspark_taps(model: LingModel, slots: Slots) -> tuple[int, ...]:
    """The target layers whose outputs the block drafter's cache needs (none without the drafter)."""
    return () if model.dspark is None or slots.model.dspark is None else model.dspark.cfg.feature_layers


def last_at(x, n):
    """x [B, T, ...] at index n[b] - 1 (n >= 1) -> [B, ...]."""
    idx = jnp.maximum(n - 1, 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


# Step programs. Each step below is written once, as a generator that yields the model forwards
# it needs, in order: a target forward (`ling.model.Batch`) or a NEXTN one (`DraftBatch`), and is
# sent each one's result. `run` drives one program; `run_together` drives several in one traced
# program, each round's forwards of one kind as one grouped pass (`LingModel.forward`: every
# layer's attention per batch, its norms, projections and MLP over all their tokens) — the mixed
# iteration.


def run(model: LingModel, program):
    """Drives one step program to its end; returns its result."""
    return run_together(model, [program])[0]


def run_together(model: LingModel, programs: list) -> list:
    """Drives step programs side by side: each round takes every unfinished program's next
    forward, runs those of the first pending kind as one grouped pass in the order of `programs`
    (put decode steps before prefill chunks: the MoE then runs their tiles first), and sends each
    its result. Returns each program's result. The programs must touch disjoint slots."""
    results, pending = [None] * len(programs), {}

    def advance(i, value):
        try:
            pending[i] = programs[i].send(value)
        except StopIteration as stop:
            results[i] = stop.value

    for i in range(len(programs)):
        advance(i, None)
    while pending:
        kind = type(pending[min(pending)])
        ids = [i for i in sorted(pending) if type(pending[i]) is kind]
        requests = [pending.pop(i) for i in ids]
        outs = model.forward(requests) if kind is Batch else model.draft_forward(requests)
        for i, out in zip(ids, outs):
            advance(i, out)
    return results


def prefill_chunk(model: LingModel, slots: Slots, tokens, next_tokens, valid, ends, *, sampling: bool,
                  logprobs: bool = False) -> Slots:
    """One chunk of the prompts: tokens [B, C], next_tokens [B, C] (each token's successor in its
    prompt), valid [B] real tokens in this chunk (0 leaves a slot untouched), ends [B] whether a
    slot's prompt ends in this chunk: those sample their first token. sampling (static): whether
    any of them samples (False: all greedy, the cheaper program). logprobs (static): keep the
    first token's log-probabilities in `slots.logprobs[:, 0]`."""
    return run(model, prefill_program(model, slots, tokens, next_tokens, valid, ends, sampling=sampling,
                                      logprobs=logprobs))


def prefill_program(model: LingModel, slots: Slots, tokens, next_tokens, valid, ends, *, sampling: bool,
                    logprobs: bool = False):
    """`prefill_chunk` as a step program (`run_together`)."""
    lengths = slots.model.lengths
    taps = _dspark_taps(model, slots)
    _, hidden, state, *tapped = yield Batch(tokens, slots.model, valid, "prefill", logits=False, taps=taps)
    if taps:  # the block drafter's context: positions lengths .. lengths + valid - 1
        state = state.replace(dspark=model.dspark.extend(state.dspark, tapped[0], lengths))
    if model.nextn is not None and state.nextn is not None:
        # NEXTN pairs (h_i, token_{i+1}); the final pair waits for the sampled token
        _, _, cache = yield DraftBatch(hidden, next_tokens, state.nextn, lengths, "prefill", logits=False)
        state = state.replace(nextn=cache)
    rows = jnp.arange(tokens.shape[0])[:, None]
    in_chunk = jnp.arange(tokens.shape[1])[None] < valid[:, None]
    slots = slots.replace(seen=slots.seen.at[rows, jnp.where(in_chunk, tokens, slots.seen.shape[1])].set(
        True, mode="drop"))
    last_hidden = last_at(hidden, valid)  # [B, D]
    logits = model.logits(last_hidden)
    first, _ = sample(_penalized(logits, slots, sampling), slots.params,
                      key_for(slots.params, slots.n_out, _SAMPLE), sampling=sampling)
    if logprobs:
        slots = _record_logprobs(slots, logits[:, None], first[:, None])
    slots = slots.replace(model=state, last_hidden=jnp.where(ends[:, None], last_hidden, slots.last_hidden),
                          last_token=jnp.where(ends, first, slots.last_token))
    return _emit(slots, first[:, None], jnp.ones_like(valid), ends & ~slots.done)


def copy_slots(model: LingModel, slots: Slots, src, dst, count, seed):
    """Forks prompts prefilled once into further slots: for i < count, slot dst[i] becomes a copy
    of slot src[i] (every leaf of the slots, all batch-first, copied row by row in place), except
    that its seed is seed[i] and its first token is drawn again from the source's last logits
    under that seed, exactly as `prefill_chunk` draws a first token. src[i] must have just ended
    its prompt (its first token emitted, no step since); a copy's sampling must differ from its
    source's in seed only. src, dst [K] int32 (entries i >= count: padding, dst[i] >= B), count
    int32, seed [K] uint32. Returns (slots, first [K] the copies' first tokens, (log-probabilities
    [K, 1 + k], top ids [K, k]) of them, as `spec.sampling.token_logprobs`)."""
    b = slots.done.shape[0]
    leaves, treedef = jax.tree_util.tree_flatten(slots)
    # A loop over the copies (a while loop, count being dynamic: one program for any number of
    # them), each writing one row of every leaf in place.

    def one(i, leaves):  # no temporary larger than one slot's state
        return [jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src[i], 1, 0), dst[i], 0)
                for x in leaves]

    slots = jax.tree_util.tree_unflatten(treedef, jax.lax.fori_loop(0, count, one, leaves))
    # The first token again, for the copies' rows only (the model state is not needed for it).
    light = slots.replace(model=None)
    sub = jax.tree.map(lambda a: a[jnp.minimum(dst, b - 1)], light)  # [K] rows; padding reads a row, writes none
    z = jnp.zeros_like(sub.n_out)
    sub = sub.replace(params=sub.params.replace(seed=seed.astype(jnp.uint32)), n_out=z, done=z > 0,
                      counts=jnp.zeros_like(sub.counts))  # as after `reset`, before the first token
    logits = model.logits(sub.last_hidden)
    first, _ = sample(penalize(logits, sub.counts, sub.seen, sub.params), sub.params,
                      key_for(sub.params, sub.n_out, _SAMPLE), sampling=True)  # greedy rows: the argmax
    lp, ids = token_logprobs(logits[:, None], first[:, None])
    if sub.logprobs.shape[1]:
        sub = sub.replace(logprobs=sub.logprobs.at[:, :1].set(lp), top_ids=sub.top_ids.at[:, :1].set(ids))
    sub = _emit(sub.replace(last_token=first), first[:, None], jnp.ones_like(z), z == 0)
    light = jax.tree.map(lambda a, s: a.at[dst].set(s, mode="drop"), light, sub)
    return light.replace(model=slots.model), first, (lp[:, 0], ids[:, 0])


def decode_step(model: LingModel, slots: Slots, *, sampling: bool, logprobs: bool = False) -> Slots:
    """One token per live slot: the target over last_token, then sample (sampling, logprobs: as
    in `prefill_chunk`, over the live slots)."""
    return run(model, decode_program(model, slots, sampling=sampling, logprobs=logprobs))


def decode_program(model: LingModel, slots: Slots, *, sampling: bool, logprobs: bool = False):
    """`decode_step` as a step program (`run_together`)."""
    live = ~slots.done
    logits, hidden, state = yield Batch(slots.last_token[:, None], slots.model, live.astype(jnp.int32), "decode")
    nxt, _ = sample(_penalized(logits[:, 0], slots, sampling), slots.params,
                    key_for(slots.params, slots.n_out, _SAMPLE), sampling=sampling)
    if logprobs:
        slots = _record_logprobs(slots, logits, nxt[:, None])
    slots = slots.replace(model=state, last_token=jnp.where(live, nxt, slots.last_token),
                          last_hidden=jnp.where(live[:, None], hidden[:, 0], slots.last_hidden))
    before = slots.n_out
    slots = _emit(slots, nxt[:, None], jnp.ones_like(before), live)
    return slots.replace(steps=slots.steps + live, produced=slots.produced + slots.n_out - before)


# (model, slots, num_steps, *, sampling) -> (drafts [B, S], q [B, S, V] or None, NEXTN cache) or
# (drafts, q, NEXTN cache, limit [B]): verify only the first limit[b] drafts of slot b (`accept`).
Drafter = Callable[..., tuple]


def nextn_chain(model: LingModel, slots: Slots, num_steps: int, *, sampling: bool):
    """num_steps chained NEXTN steps from (last_hidden, last_token). Returns (drafts [B, S] int32,
    draft probabilities [B, S, V] for rejection sampling (None when not sampling), the NEXTN cache)."""
    h, tok = slots.last_hidden[:, None], slots.last_token[:, None]
    cache, pos = slots.model.nextn, slots.model.lengths - 1
    drafts, qs = [], []
    for j in range(num_steps):
        logits, h, cache = model.draft(h, tok, cache, pos + j, form="decode")
        d, q = sample(_penalized(logits[:, 0], slots, sampling), slots.params,
                      key_for(slots.params, slots.n_out, _DRAFT + j), sampling=sampling)
        tok = d[:, None]
        drafts.append(d)
        qs.append(q)
    return jnp.stack(drafts, 1), (jnp.stack(qs, 1) if sampling else None), cache


def schedule(survival, live, *, threshold: float = 0.0, budget: int = 0):
    """Confidence scheduling: how many drafts of each slot to verify, from survival [B, S] (the
    drafter's estimate that drafts 1..j are all accepted, non-increasing in j). A slot keeps the
    drafts whose survival is at least threshold; with budget > 0 the live slots share `budget`
    drafts a step, given to the most likely to survive over all slots (a prefix of each slot's
    drafts, survival being non-increasing; a padding row of `spec.stepper`'s batch buckets is
    done and takes no share). Returns limit [B] int32 in 0..S, on the device.
    The verify pass still runs all S drafts: limit masks acceptance, it does not shorten the pass."""
    b, s = survival.shape
    keep = survival >= threshold
    if budget > 0:
        score = jnp.where(keep & live[:, None], survival, -1.0).reshape(-1)
        order = jnp.argsort(-score, stable=True)  # ties: the earlier draft (and slot) first
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(b * s))
        keep = keep & (rank < budget).reshape(b, s) & live[:, None]
    return jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    """The DSpark drafter (`ling.dspark`) as a `Drafter`: one backbone forward over the block
    [last_token, mask ...] of num_steps positions, then the sequential head position by position
    (each draft sampled, or the argmax, from base logits + the Markov bias of the draft before;
    sequential False: base logits alone), and the confidence head. scheduled: return the number of
    drafts to verify (`schedule` with threshold and budget); else every draft is verified.
    Frozen and hashable: a static argument of the compiled step."""

    sequential: bool = True
    scheduled: bool = False
    threshold: float = 0.0
    budget: int = 0

    def __call__(self, model: LingModel, slots: Slots, num_steps: int, *, sampling: bool):
        d = model.dspark
        h = d.block(model.embed, slots.model.dspark, slots.model.lengths, slots.last_token, num_steps)  # [B, S, D]
        base = model.draft_logits(h)  # [B, S, V]
        prev, drafts, qs, conf = slots.last_token, [], [], []
        for j in range(num_steps):
            logits = base[:, j] + d.markov_bias(h[:, j], prev) if self.sequential else base[:, j]
            tok, q = sample(_penalized(logits, slots, sampling), slots.params,
                            key_for(slots.params, slots.n_out, _DRAFT + j), sampling=sampling)
            conf.append(jax.nn.sigmoid(d.confidence_logit(h[:, j], prev)))
            drafts.append(tok)
            qs.append(q)
            prev = tok
        drafts = jnp.stack(drafts, 1)
        q = jnp.stack(qs, 1) if sampling else None
        if not self.scheduled:
            return drafts, q, slots.model.nextn
        survival = jnp.cumprod(jnp.stack(conf, 1), axis=1)
        limit = schedule(survival, ~slots.done, threshold=self.threshold, budget=self.budget)
        return drafts, q, slots.model.nextn, limit


@jax.named_scope("accept")
def accept(logits, drafts, q, params: SamplingParams, keys_accept, keys_bonus, *, sampling: bool = True,
           limit=None):
    """logits [B, S+1, V] of the verify pass, drafts [B, S], draft probabilities q [B, S, V].
    Returns (accepted [B] in 0..S, bonus [B]): greedy slots accept while the draft equals the
    target's argmax; sampled slots accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) and draw
    the bonus from the residual max(p - q, 0), or from p after a full acceptance.
    sampling False (static: every slot greedy): the greedy rule alone; q and the keys are unused.
    limit [B] (None: S): slot b's drafts from index limit[b] on count as never proposed: accepted
    stops there and the bonus after accepting all limit[b] is drawn from p. The output keeps the
    target's distribution as long as limit depends on the draft side only."""
    b, s = drafts.shape
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, S+1]
    proposed = None if limit is None else jnp.arange(s)[None] < limit[:, None]  # [B, S]
    greedy_ok = drafts == argmax[:, :s]
    if proposed is not None:
        greedy_ok = greedy_ok & proposed
    if not sampling:
        accepted = jnp.sum(jnp.cumprod(greedy_ok, axis=1), axis=1).astype(jnp.int32)
        return accepted, jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]
    p = probs(logits, params)  # [B, S+1, V]
    p_d = jnp.take_along_axis(p[:, :s], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (s,)))(keys_accept)
    sampled_ok = u * q_d <= p_d
    if proposed is not None:
        sampled_ok = sampled_ok & proposed
        q = jnp.where(proposed[..., None], q, 0.0)  # a full acceptance of the proposed ones draws from p
    ok = jnp.where(params.greedy[:, None], greedy_ok, sampled_ok)
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_a = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)  # q is padded with zeros at S: a full acceptance draws from p
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_a)
    drawn = jax.vmap(lambda k, r: jax.random.categorical(k, jnp.log(r)))(keys_bonus, residual)
    target_argmax = jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]
    bonus = jnp.where(params.greedy, target_argmax, drawn).astype(jnp.int32)
    return accepted, bonus


def spec_step(model: LingModel, slots: Slots, num_steps: int, drafter: Drafter = nextn_chain, *,
              sampling: bool, logprobs: bool = False) -> Slots:
    """One draft -> verify -> accept -> commit -> extend step for every live slot (sampling,
    logprobs: as in `prefill_chunk`, over the live slots; an emitted token's log-probabilities are
    the verify pass's, the target's own distribution at its position)."""
    return run(model, spec_program(model, slots, num_steps, drafter, sampling=sampling, logprobs=logprobs))


def spec_program(model: LingModel, slots: Slots, num_steps: int, drafter: Drafter = nextn_chain, *,
                 sampling: bool, logprobs: bool = False):
    """`spec_step` as a step program (`run_together`): the drafts are made before its first
    forward (the verify pass), the NEXTN extend is its second."""
    live = ~slots.done
    drafts, q, cache, *limit = drafter(model, slots, num_steps, sampling=sampling)
    limit = limit[0] if limit else None
    verify_tokens = jnp.concatenate([slots.last_token[:, None], drafts], axis=1)  # [B, S+1]
    taps = _dspark_taps(model, slots)
    logits, hidden, pending, *tapped = yield Batch(verify_tokens, slots.model, None, "verify", taps=taps)
    target = penalize_verify(logits, slots.counts, slots.seen, drafts, slots.params) if sampling else logits
    accepted, bonus = accept(target, drafts, q, slots.params, key_for(slots.params, slots.n_out, _ACCEPT),
                             key_for(slots.params, slots.n_out, _BONUS), sampling=sampling, limit=limit)
    emitted = jnp.concatenate([drafts, bonus[:, None]], axis=1)  # d_1 .. d_a, then the bonus at index a
    emitted = jnp.where(jnp.arange(num_steps + 1)[None] == accepted[:, None], bonus[:, None], emitted)
    # last_token and the accepted drafts enter the state, up to the last token emitted
    _, kept = _emitted(slots, emitted, accepted + 1, live)
    state = commit(pending, kept)
    if taps:  # the block drafter's context entries of positions n .. n+S (those past n+kept masked)
        state = state.replace(dspark=model.dspark.extend(slots.model.dspark, tapped[0], slots.model.lengths))
    if model.nextn is not None and state.nextn is not None:
        pairs_h = jnp.concatenate([slots.last_hidden[:, None], hidden[:, :-1]], axis=1)  # h_{n-1} .. h_{n+S-1}
        _, _, cache = yield DraftBatch(pairs_h, verify_tokens, cache, slots.model.lengths - 1, "decode",
                                       logits=False)
        state = state.replace(nextn=cache)
    if logprobs:  # emitted[:, j] is the target's token at verify position j
        slots = _record_logprobs(slots, logits, emitted)
    last = jnp.take_along_axis(emitted, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]  # the bonus unless cut
    slots = slots.replace(model=state, last_token=jnp.where(live, last, slots.last_token),
                          last_hidden=jnp.where(live[:, None], last_at(hidden, kept), slots.last_hidden))
    before = slots.n_out
    slots = _emit(slots, emitted, accepted + 1, live)
    return slots.replace(steps=slots.steps + live, produced=slots.produced + slots.n_out - before)


def step_fn(speculative: bool, num_steps: int, sampling: bool, drafter: Drafter | None = None,
            logprobs: bool = False):
    """The step as a function of (model, slots); sampling and logprobs are static (see
    `prefill_chunk`)."""
    program = step_program(speculative, num_steps, sampling, drafter, logprobs)
    return lambda model, slots: run(model, program(model, slots))


def step_program(speculative: bool, num_steps: int, sampling: bool, drafter: Drafter | None = None,
                 logprobs: bool = False):
    """`step_fn`'s step as a step program of (model, slots) (`run_together`)."""
    if speculative:
        return lambda model, slots: spec_program(model, slots, num_steps, drafter or nextn_chain, sampling=sampling,
                                                 logprobs=logprobs)
    return lambda model, slots: decode_program(model, slots, sampling=sampling, logprobs=logprobs)


def live_sampling(slots: Slots) -> bool:
    """Whether any live slot needs the sampling program (it samples or has a penalty): reads the
    slots' parameters and done flags (a host sync)."""
    p, done = jax.device_get((slots.params, slots.done))
    return any_sampling(needs_sampling(p), ~done)


def check_model(model: LingModel, speculative: bool, drafter: Drafter | None = None):
    """Refuses a speculative step whose drafter the model lacks (drafter None: the NEXTN chain;
    other drafters than `BlockDrafter` bring their own drafts)."""
    if speculative and isinstance(drafter, BlockDrafter) and model.dspark is None:
        raise ValueError("the DSpark drafter needs a block drafter attached to the model "
                         "(ling.dspark.load, LingModel.attach_dspark)")
    if speculative and drafter is None and model.nextn is None:
        raise ValueError("speculative decoding needs a NEXTN layer; this model has none (pass speculative=False)")

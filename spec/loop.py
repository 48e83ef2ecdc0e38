"""Running the engine: `generate` (every step inside one `lax.while_loop`) and `Stepper` (one
compiled step at a time for the server, dispatched one step ahead of the host)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling.model import LingModel
from spec.engine import Drafter, Slots, decode_step, new_slots, nextn_chain, prefill_chunk, reset, spec_step
from spec.sampling import SamplingParams, any_sampling

PREFILL_CHUNK = 256
MAX_PREFILL_CHUNK = 8192


def chunk_for(prompts: Sequence[Sequence[int]]) -> int:
    """A prefill chunk for one batch of prompts: the longest prompt rounded up to a power of two,
    between 64 and MAX_PREFILL_CHUNK. Every chunk reads the routed experts its tokens touch — at a
    few hundred tokens nearly all of them, ~6 GB a layer at Ling's size — so a long prompt in
    small chunks re-reads them per chunk; powers of two bound the number of compiled widths."""
    longest = max(len(p) for p in prompts)
    return min(MAX_PREFILL_CHUNK, max(64, 1 << max(0, longest - 1).bit_length()))


def _pad_prompts(prompts: Sequence[Sequence[int]], chunk: int):
    """prompts -> (tokens [B, P], next_tokens [B, P], lengths [B]) with P a multiple of chunk."""
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    width = -(-int(lens.max()) // chunk) * chunk
    toks = np.zeros((len(prompts), width + 1), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    return toks[:, :-1], toks[:, 1:], lens


def prefill(model: LingModel, slots: Slots, prompts, which, params: SamplingParams, max_new, eos, *,
            chunk: int = PREFILL_CHUNK) -> Slots:
    """Resets the slots selected by `which` [B] and prefills their prompts (one list per slot; the
    others' entries are ignored) chunk by chunk; samples each one's first token."""
    tokens, next_tokens, lens = _pad_prompts(prompts, chunk)
    which = np.asarray(which, bool)
    lens = np.where(which, lens, 0)
    sampling = any_sampling(jax.device_get(params.temperature), which)
    graphdef, params_ = nnx.split(model)
    slots = _reset(slots, jnp.asarray(which), params, jnp.asarray(max_new, jnp.int32), jnp.asarray(eos, jnp.int32))
    n_chunks = tokens.shape[1] // chunk
    for c in range(n_chunks):
        sl = slice(c * chunk, (c + 1) * chunk)
        valid = np.clip(lens - c * chunk, 0, chunk).astype(np.int32)
        ends = (lens > c * chunk) & (lens <= (c + 1) * chunk)
        slots = _prefill_chunk(graphdef, params_, slots, jnp.asarray(tokens[:, sl]), jnp.asarray(next_tokens[:, sl]),
                               jnp.asarray(valid), jnp.asarray(ends), sampling=sampling)
    return slots


_reset = jax.jit(reset, donate_argnums=0)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames="slots")
def _prefill_chunk(graphdef, params, slots, tokens, next_tokens, valid, ends, *, sampling):
    return prefill_chunk(nnx.merge(graphdef, params), slots, tokens, next_tokens, valid, ends, sampling=sampling)


def _step_fn(speculative: bool, num_steps: int, sampling: bool, drafter: Drafter | None = None):
    """The step as a function of (model, slots); sampling is static (see `spec.engine.prefill_chunk`)."""
    if speculative:
        return lambda model, slots: spec_step(model, slots, num_steps, drafter or nextn_chain, sampling=sampling)
    return lambda model, slots: decode_step(model, slots, sampling=sampling)


def live_sampling(slots: Slots) -> bool:
    """Whether any live slot samples: reads the slots' temperatures and done flags (a host sync)."""
    temperature, done = jax.device_get((slots.params.temperature, slots.done))
    return any_sampling(temperature, ~done)


@functools.partial(jax.jit, static_argnames=("graphdef", "speculative", "num_steps", "max_iters", "drafter",
                                             "sampling"),
                   donate_argnames="slots")
def _run(graphdef, params, slots, *, speculative, num_steps, max_iters, sampling, drafter=None):
    step = _step_fn(speculative, num_steps, sampling, drafter)

    def body(carry):
        i, s = carry
        return i + 1, step(nnx.merge(graphdef, params), s)

    def cond(carry):
        i, s = carry
        return (i < max_iters) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), slots))[1]


def decode(model: LingModel, slots: Slots, *, speculative: bool, num_steps: int = 5, max_iters: int,
           drafter: Drafter | None = None) -> Slots:
    """Runs decode (or speculative) steps until every slot is done or max_iters steps, in one
    compiled `lax.while_loop`; nothing returns to the host in between."""
    graphdef, params = nnx.split(model)
    return _run(graphdef, params, slots, speculative=speculative, num_steps=num_steps, max_iters=max_iters,
                sampling=live_sampling(slots), drafter=drafter)


def check_model(model: LingModel, speculative: bool):
    if speculative and model.nextn is None:
        raise ValueError("speculative decoding needs a NEXTN layer; this model has none (pass speculative=False)")


def generate_batch(model: LingModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   speculative: bool = True, num_steps: int = 5, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                   eos_id: int | None = None, prefill_chunk: int | None = None, return_slots: bool = False,
                   drafter: Drafter | None = None):
    """Generates for several prompts at once (one slot each); the sampling arguments are scalars or
    one value per prompt. `drafter` replaces the NEXTN chain (tests force drafts with it).
    prefill_chunk None: `chunk_for(prompts)`.
    Returns one token list per prompt (and the final slots if asked)."""
    check_model(model, speculative and drafter is None)
    b = len(prompts)
    extra = num_steps + 1 if speculative else 1
    max_len = max(len(p) for p in prompts) + max_new_tokens + extra
    slots = new_slots(model, b, max_len, max_new_tokens + extra)
    params = SamplingParams.make(b, temperature, top_k, top_p, seed)
    eos = -1 if eos_id is None else eos_id
    slots = prefill(model, slots, prompts, np.ones(b, bool), params, np.full(b, max_new_tokens), np.full(b, eos),
                    chunk=prefill_chunk or chunk_for(prompts))
    slots = decode(model, slots, speculative=speculative, num_steps=num_steps, max_iters=max_new_tokens,
                   drafter=drafter)
    out, n = jax.device_get((slots.out, slots.n_out))
    result = [out[i, : n[i]].tolist() for i in range(b)]
    return (result, slots) if return_slots else result


def generate(model: LingModel, prompt_ids: Sequence[int], max_new_tokens: int, *, speculative: bool = True,
             num_steps: int = 5, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | None = None) -> list[int]:
    """Generates up to max_new_tokens after prompt_ids (stopping after eos_id), all decode steps in
    one compiled `lax.while_loop` with EOS and length checked on device."""
    return generate_batch(model, [list(prompt_ids)], max_new_tokens, speculative=speculative, num_steps=num_steps,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id)[0]


def mean_accepted_length(slots: Slots) -> float:
    """Tokens produced per verify (or decode) step over the live steps of all slots."""
    steps, produced = jax.device_get((slots.steps.sum(), slots.produced.sum()))
    return float(produced) / max(int(steps), 1)


def _flat_weights(model: LingModel):
    """(the weights as a flat list of arrays, merge: such a list -> the model, for use under jit).
    A list crosses the jit boundary flattened in C++; nnx's State flattens in Python."""
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return leaves, lambda ls: nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, ls))


class Stepper:
    """Steps the slots one compiled step at a time, dispatching step k+1 before it reads step k's
    results (JAX dispatch is asynchronous, so the device never waits for the host between steps).
    `step()` returns the previous step's new tokens: a list per slot (empty for idle slots) and the
    done flags [B], as host values — one step late.

    The step is compiled in two variants, all-greedy and sampling (`spec.engine.prefill_chunk`);
    `step(sampling=...)` picks one from what the host knows of its slots. Left out, `self.sampling`
    is used: set at construction from the slots (one read), kept by the owner when it changes.

    The weights and the slots cross the jit boundary as flat lists of arrays, which jit flattens
    in C++: nnx's State and flax dataclasses flatten in Python, about a millisecond a step for a
    16-layer model, which is host time the device waits for once a step is shorter than it."""

    def __init__(self, model: LingModel, slots: Slots, *, speculative: bool = True, num_steps: int = 5):
        check_model(model, speculative)
        self._params, merge = _flat_weights(model)
        self._slots, self._slot_def = jax.tree_util.tree_flatten(slots)
        self.sampling = live_sampling(slots)
        self.width = num_steps + 1 if speculative else 1
        slot_def = self._slot_def

        def run(param_leaves, slot_leaves, sampling):
            s = jax.tree_util.tree_unflatten(slot_def, slot_leaves)
            before = s.n_out
            s = _step_fn(speculative, num_steps, sampling)(merge(param_leaves), s)
            idx = jnp.minimum(before[:, None] + jnp.arange(self.width)[None], s.out.shape[1] - 1)
            new = jnp.take_along_axis(s.out, idx, axis=1)
            # One packed report [B, width + 2]: a fresh buffer, so donating the slots never frees it.
            report = jnp.concatenate([new, (s.n_out - before)[:, None], s.done[:, None].astype(jnp.int32)], axis=1)
            return jax.tree_util.tree_leaves(s), report

        self._step = jax.jit(run, donate_argnums=1, static_argnums=2)
        self._pending = None

    @property
    def slots(self) -> Slots:
        return jax.tree_util.tree_unflatten(self._slot_def, self._slots)

    @slots.setter
    def slots(self, slots: Slots) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(slots)
        if treedef != self._slot_def:
            raise ValueError("the new slots differ in structure from the ones the step was built for")
        self._slots = leaves

    def _unpack(self, report):
        if report is None:
            return None
        r = np.asarray(jax.device_get(report))
        tokens = [r[b, : r[b, self.width]].tolist() for b in range(r.shape[0])]
        return tokens, r[:, self.width + 1].astype(bool)

    def step(self, sampling: bool | None = None):
        sampling = self.sampling if sampling is None else sampling
        self._slots, report = self._step(self._params, self._slots, bool(sampling))
        previous, self._pending = self._pending, report
        return self._unpack(previous)

    def drain(self):
        """The results of the last dispatched step."""
        previous, self._pending = self._pending, None
        return self._unpack(previous)


def prefill_step(model: LingModel, slots: Slots, start, params: SamplingParams, max_new, eos, tokens, next_tokens,
                 valid, ends, *, sampling: bool):
    """One prefill chunk that decode steps may be interleaved with (the server's scheduler).

    start [B] bool: slots reset for a new request first (params, max_new, eos are taken for them
    only); tokens / next_tokens [B, C]: each slot's next chunk of its own prompt and the successors;
    valid [B]: real tokens in it (0: the slot is untouched); ends [B]: the prompt ends in this chunk.
    A slot whose prompt has not ended stays done, so interleaved decode/speculative steps skip it;
    its last_hidden / last_token hold the pair (h_{p-1}, token_p) of its last prefilled position,
    so the NEXTN entry that a speculative step rewrites at p-1 for a done slot keeps its true value.
    sampling (static): whether any slot in `ends` samples its first token.
    Returns (slots, first [B]): the sampled first token of the slots in `ends`, -1 elsewhere — a
    fresh buffer the host can read after dispatching the next step."""
    slots = reset(slots, start, params, max_new, eos)
    slots = slots.replace(done=(slots.done | start) & ~ends)
    slots = prefill_chunk(model, slots, tokens, next_tokens, valid, valid > 0, sampling=sampling)
    mid = (valid > 0) & ~ends
    slots = slots.replace(last_token=jnp.where(mid, _last_of(next_tokens, valid), slots.last_token))
    return slots, jnp.where(ends, slots.out[:, 0], -1)


def _last_of(x, n):
    """x [B, T] at index n[b] - 1 -> [B]."""
    return jnp.take_along_axis(x, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]


class ChunkPrefiller:
    """`prefill_step` compiled once for the slots' shapes (and each `sampling` variant); the
    arguments are host arrays ([B] and [B, C]). The slots are donated: pass the Stepper's current
    slots and put the result back. The weights cross the jit boundary as a flat list (`Stepper`)."""

    def __init__(self, model: LingModel):
        self._params, merge = _flat_weights(model)

        def run(param_leaves, slots, start, sampling_params, max_new, eos, tokens, next_tokens, valid, ends, sampling):
            return prefill_step(merge(param_leaves), slots, start, sampling_params, max_new, eos, tokens, next_tokens, valid, ends,
                                sampling=sampling)

        self._call = jax.jit(run, donate_argnums=1, static_argnums=10)

    def __call__(self, slots: Slots, *, start, params: SamplingParams, max_new, eos, tokens, next_tokens, valid,
                 ends, sampling: bool):
        i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))
        b = lambda a: jnp.asarray(np.asarray(a, bool))
        return self._call(self._params, slots, b(start), params, i32(max_new), i32(eos), i32(tokens), i32(next_tokens),
                          i32(valid), b(ends), bool(sampling))

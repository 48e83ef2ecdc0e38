"""Offline generation: `generate` and `generate_batch` prefill their prompts chunk by chunk and then
run every decode (or speculative) step inside one compiled `lax.while_loop`, nothing returning to
the host until all slots are done."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling.model import LingModel
from spec.sampling import SamplingParams, any_sampling, needs_sampling
from spec.step import Drafter, Slots, check_model, live_sampling, new_slots, prefill_chunk, reset, step_fn

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
    sampling = any_sampling(needs_sampling(jax.device_get(params)), which)
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


@functools.partial(jax.jit, static_argnames=("graphdef", "speculative", "num_steps", "max_iters", "drafter",
                                             "sampling"),
                   donate_argnames="slots")
def _run(graphdef, params, slots, *, speculative, num_steps, max_iters, sampling, drafter=None):
    step = step_fn(speculative, num_steps, sampling, drafter)

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


def generate_batch(model: LingModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   speculative: bool = True, num_steps: int = 5, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                   presence=0.0, frequency=0.0, repetition=1.0, eos_id: int | None = None,
                   prefill_chunk: int | None = None, return_slots: bool = False, drafter: Drafter | None = None):
    """Generates for several prompts at once (one slot each); the sampling arguments (and the
    penalties, `spec.sampling.penalize`) are scalars or one value per prompt. `drafter` replaces the
    NEXTN chain: `spec.step.BlockDrafter` (the model's DSpark drafter, num_steps its block) or a
    function (tests force drafts with it).
    prefill_chunk None: `chunk_for(prompts)`.
    Returns one token list per prompt (and the final slots if asked)."""
    check_model(model, speculative, drafter)
    b = len(prompts)
    extra = num_steps + 1 if speculative else 1
    max_len = max(len(p) for p in prompts) + max_new_tokens + extra
    slots = new_slots(model, b, max_len, max_new_tokens + extra)
    params = SamplingParams.make(b, temperature, top_k, top_p, seed, presence, frequency, repetition)
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

"""The server's stepping: `Stepper` runs one compiled decode (or speculative) step at a time,
dispatching step k+1 before it reads step k's tokens; `ChunkPrefiller` runs one prefill chunk
(`prefill_step`) that such steps may be interleaved with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling.model import LingModel
from spec.sampling import SamplingParams
from spec.step import Slots, check_model, last_at, live_sampling, prefill_chunk, reset, step_fn

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

    The step is compiled in two variants, all-greedy and sampling (`spec.step.prefill_chunk`);
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
            s = step_fn(speculative, num_steps, sampling)(merge(param_leaves), s)
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
    slots = slots.replace(last_token=jnp.where(mid, last_at(next_tokens, valid), slots.last_token))
    return slots, jnp.where(ends, slots.out[:, 0], -1)


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

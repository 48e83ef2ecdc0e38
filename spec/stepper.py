"""The server's stepping: `Stepper` runs one compiled decode (or speculative) step at a time,
dispatching step k+1 before it reads step k's tokens; `ChunkPrefiller` runs one prefill chunk
(`prefill_step`) that such steps may be interleaved with, or prepares one that a step carries
(the mixed iteration: `Stepper.dispatch(chunk=...)`, both in one program); `SlotCopier` copies
prefilled slots into others (`copy_slots`: a prompt prefilled once for several choices)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling.model import LingModel
from ling.state import MLACache, at_rows, from_rows
from pallas_kernels import slot_rows
from pallas_kernels.tickets import CAPACITY as TICKETS
from pallas_kernels.tickets import scope as ticket_scope
from spec.sampling import SamplingParams
from spec.step import (Slots, check_model, copy_slots, last_at, live_sampling, prefill_program, reset,
                       run_together, step_program)
from spec.step import run as run_program


def counted(counters, fn):
    """fn() with the ticket kernels it traces taking their tickets from `counters` (int32[CAPACITY]
    of zeros; None: no tickets); returns (fn's result, the counters given back zeroed)."""
    if counters is None:
        return fn(), None
    with ticket_scope(counters) as scope:
        out = fn()
    return out, scope.buffer


def _flat_weights(model: LingModel):
    """(the weights as a flat list of arrays, merge: such a list -> the model, for use under jit).
    A list crosses the jit boundary flattened in C++; nnx's State flattens in Python."""
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return leaves, lambda ls: nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, ls))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a server compiles its step for: powers of two below max_batch, and max_batch."""
    return tuple(1 << i for i in range(max(max_batch - 1, 0).bit_length()) if 1 << i < max_batch) + (max_batch,)


def bucket_rows(live, buckets: tuple[int, ...], batch: int, pad: int | None = None) -> np.ndarray | None:
    """The slot indices a call over the `live` [B] bool slots runs: the live ones, padded to the
    smallest bucket that holds them with `pad` (None: repeats of the first; B: padding rows in
    the sense of `pallas_kernels.slot_rows`). None: that bucket is the whole batch, run in place."""
    ids = np.flatnonzero(np.asarray(live, bool))
    k = next(b for b in buckets if b >= max(len(ids), 1))
    if k == batch:
        return None
    fill = (ids[0] if len(ids) else 0) if pad is None else pad
    return np.concatenate([ids, np.full(k - len(ids), fill)]).astype(np.int32)


def context_buckets(max_len: int, smallest: int = 256, factor: int = 4) -> tuple[int, ...]:
    """The cache lengths a server compiles its calls for: smallest, smallest * factor, ... below
    max_len, and max_len."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= factor
    return tuple(out) + (max_len,)


def cache_len(slots: Slots) -> int | None:
    """The positions each slot's MLA caches hold (None: the model has no MLA layer)."""
    caches = [c for c in (*slots.model.layers, slots.model.nextn) if isinstance(c, MLACache)]
    return caches[0].latent.shape[1] if caches else None


def pick_context(need, contexts: tuple[int, ...], length: int | None) -> int | None:
    """The smallest of `contexts` shorter than the cache (`length`) that holds `need` positions;
    None (the whole cache) when there is none, when need is None or when there is no cache."""
    if need is None or length is None:
        return None
    return next((c for c in contexts if need <= c < length), None)


def _is_cache(x) -> bool:
    return isinstance(x, MLACache)


def gather_rows(tree, rows, context: int | None = None):
    """Every leaf's rows `rows` (all leaves batch-first; `pallas_kernels.slot_rows.take`), the MLA
    caches' positions cut to the first `context` (static); the tree itself when both are None."""
    if rows is None and context is None:
        return tree
    r = (lambda a: slice(None)) if rows is None else (lambda a: slot_rows.slot(rows, a.shape[0]))  # noqa: E731

    def take(x):
        if _is_cache(x):
            return jax.tree.map(lambda a: a[r(a), :context], x)
        return x[r(x)]

    return jax.tree_util.tree_map(take, tree, is_leaf=_is_cache)


def scatter_rows(tree, rows, sub, context: int | None = None):
    """tree with its rows `rows` (and its MLA caches' first `context` positions) replaced by sub's
    (a padding row, `slot_rows`, writes nothing; a padded duplicate writes its row's own values)."""
    if rows is None and context is None:
        return sub
    r = slice(None) if rows is None else rows

    def put(x, s):
        if _is_cache(x):
            return jax.tree.map(lambda a, b: a.at[r, :context].set(b, mode="drop"), x, s)
        return s if rows is None else slot_rows.put(x, rows, s)

    return jax.tree_util.tree_map(put, tree, sub, is_leaf=_is_cache)


def view_rows(slots: Slots, rows) -> Slots:
    """The slots a step over rows [K] (`slot_rows`) runs: each row's bookkeeping taken from its
    slot, the model state left whole, marked with the rows (`ling.state.at_rows`): the attention
    kernels step those slots in place, and a slot no row names is not read."""
    light = gather_rows(slots.replace(model=None), rows)
    return light.replace(model=at_rows(slots.model, rows))


def unview_rows(slots: Slots, rows, sub: Slots) -> Slots:
    """`slots` after the step over `view_rows(slots, rows)` that returned `sub`."""
    light = scatter_rows(slots.replace(model=None), rows, sub.replace(model=None))
    return light.replace(model=from_rows(slots.model, rows, sub.model))


# A kept buffer's rewrite in place (the old buffer donated): one program a shape, for every
# `KeptBuffers`.
_rewrite = jax.jit(lambda old, new: old * 0 + new, donate_argnums=0)


class KeptBuffers:
    """Host arrays put on the device into one buffer kept per shape, rewritten in place by a small
    program when the values change: a program that reads them sees the same address every call
    (its CUDA graph is then replayed as recorded, `Stepper`). A shape's first buffer is made by
    that same program, so it is compiled when the shape first appears (at a server's warm-up),
    not at the first change of values (a request's)."""

    def __init__(self):
        self._held: dict[tuple, tuple[np.ndarray, jax.Array]] = {}

    def __call__(self, values: np.ndarray) -> jax.Array:
        key = (values.shape, values.dtype.str)
        held = self._held.get(key)
        if held is None or not np.array_equal(held[0], values):
            old = jnp.zeros(values.shape, values.dtype) if held is None else held[1]
            held = self._held[key] = (values.copy(), _rewrite(old, values))
        return held[1]

    def buffers(self) -> list[jax.Array]:
        return [buf for _, buf in self._held.values()]


class Report(NamedTuple):
    """A call's results on the host, per slot of the batch."""

    tokens: list[list[int]]  # the new tokens (empty: the slot was not stepped, or had finished)
    done: np.ndarray  # [B] bool: the device finished the slot (EOS or max tokens)
    logprobs: list | None  # None, or per new token (log-probabilities [1 + K], top ids [K])
    steps: np.ndarray  # [B] int: the call's steps in which the slot emitted tokens


class Stepper:
    """Steps the slots one compiled call at a time, dispatching call k+1 before it reads call k's
    results (JAX dispatch is asynchronous, so the device never waits for the host between calls).
    `step()` returns the previous call's `Report`: the new tokens (a list per slot, empty for slots
    not stepped), the done flags [B] and the steps each slot ran, as host values — one call late.

    Steps per call: a call runs `steps` decode (or speculative) steps back to back on the device
    (`steps_per_call` by default; a loop of known trip count in the program, no host round trip),
    each skipping the slots that finished (EOS or max tokens) in an earlier one, so the host's
    dispatch is paid once for `steps` steps, and the tokens arrive `steps` at a time. A call of
    more than one step neither reports log-probabilities nor carries a prefill chunk.

    Batch buckets: `step(live=mask)` steps only the slots the host marks live. The smallest bucket
    K >= their number is picked (`buckets`, default (B,): always every slot); the step's program
    for K runs a batch of K rows, the live slots padded with padding rows (`view_rows`, in the
    sense of `pallas_kernels.slot_rows`: marked done, they emit nothing and write no state; their
    tokens still run through the layers, the routed experts included). Each row's bookkeeping
    (tokens, sampling parameters, counts) is gathered and scattered back; the model state stays
    whole, and the attention kernels read and write the rows' slots in place
    (`ling.state.at_rows`), so an idle slot outside the bucket costs no expert reads, no attention
    and no state traffic, and a live one no copy of its state. (A done slot inside the bucket, or
    every slot with the one bucket B, still routes its rows: masking them would cost the step a
    launch a MoE layer.)

    Context buckets: `step(context=n)` says the live slots hold at most n positions once the step
    has run (lengths plus the step's width). Where the step's attention reads the whole cache (the
    reference backend: plain-jnp attention over [B, L] positions) the step runs over the MLA
    caches' first C positions only, C the smallest of `contexts` >= n: there a bucket's rows are
    gathered whole (states and caches cut to C) and scattered back. The kernels read only each
    slot's live positions (`mla_decode` sizes its work from the lengths), so with them the step
    ignores the context and is compiled once per bucket.

    The step is compiled in two variants, all-greedy and sampling (`spec.step.prefill_chunk`);
    `step(sampling=...)` picks one from what the host knows of its slots. Left out, `self.sampling`
    is used: set at construction from the slots (one read), kept by the owner when it changes.

    One CUDA graph a step, replayed as recorded: XLA replays a step's command buffer unchanged only
    while every buffer it touches keeps its address, and otherwise updates its several hundred
    nodes on the host first (one to two milliseconds). So the step's only outputs are the
    slots and `count` [B] (tokens each slot's last step emitted; with tickets, the counters too),
    donated and written in place, and a bucket's row indices live in a device buffer of their own
    that is rewritten only when they change. The tokens are read by a second, small program (`report`) queued behind the
    step, whose fresh output is copied to the host as soon as it is queued.

    The weights and the slots cross the jit boundary as flat lists of arrays, which jit flattens
    in C++: nnx's State and flax dataclasses flatten in Python, about a millisecond a step for a
    16-layer model, which is host time the device waits for once a step is shorter than it.

    drafter: the speculative step's drafter (None: the NEXTN chain; `spec.step.BlockDrafter`: the
    model's DSpark drafter, num_steps its block). tickets: sums across a kernel's programs finish in
    its own launch (`pallas_kernels.tickets`: the split-K matvecs, the router, the MoE at one
    token), over a counters buffer the step donates and gets back zeroed, like `count`."""

    def __init__(self, model: LingModel, slots: Slots, *, speculative: bool = True, num_steps: int = 5,
                 buckets=None, contexts=None, drafter=None, tickets: bool = False, steps_per_call: int = 1):
        check_model(model, speculative, drafter)
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be at least 1, got {steps_per_call}")
        self.steps_per_call = steps_per_call
        if tickets and getattr(model, "mesh", None) is not None:
            raise ValueError("tickets: the counters serve one device's kernels; this model is expert-parallel")
        self._params, merge = _flat_weights(model)
        paths, self._slot_def = jax.tree_util.tree_flatten_with_path(slots)
        self._slots = [leaf for _, leaf in paths]
        names = [jax.tree_util.keystr(p) for p, _ in paths]
        self._read = [names.index(f".{f}") for f in ("out", "n_out", "done", "logprobs", "top_ids")]
        self.batch = slots.done.shape[0]
        self.buckets = tuple(sorted(set(buckets or ()) | {self.batch}))
        if self.buckets[0] < 1 or self.buckets[-1] > self.batch:
            raise ValueError(f"batch buckets must lie in [1, {self.batch}], got {buckets}")
        self.cache_len = cache_len(slots)
        # The cache lengths a step is compiled for (only where its attention reads the whole cache).
        self.contexts = tuple(sorted(set(contexts or ()))) if model.kernels == "reference" else ()
        self.sampling = live_sampling(slots)
        self.width = width = num_steps + 1 if speculative else 1
        slot_def = self._slot_def
        cuts = bool(self.contexts)  # the step's attention reads a cache cut to the context

        def one_step(model, s, counters, sampling, logprobs):
            """One step over the slots s; returns (s, the counters given back zeroed)."""
            return counted(counters, lambda: run_program(
                model, step_program(speculative, num_steps, sampling, drafter, logprobs=logprobs)(model, s)))

        def run(param_leaves, slot_leaves, counts, rows, chunk, sampling, logprobs, context, chunk_logprobs,
                steps):
            count, counters = counts
            full = jax.tree_util.tree_unflatten(slot_def, slot_leaves)
            model = merge(param_leaves)
            # A bucket's rows step their slots in place (the context then only cuts a mixed
            # iteration's chunk); the reference attention's context buckets take the rows' caches
            # cut to the context instead.
            in_place = rows is not None and not cuts
            s = view_rows(full, rows) if in_place else gather_rows(full, rows, context)
            if rows is not None:  # a padding row is done: it emits nothing and writes no state
                s = s.replace(done=s.done | (rows >= full.done.shape[0]))
            before = s.n_out
            if chunk is not None:  # the mixed iteration: the chunk's rows beside the step's, one forward for both
                chunk_rows, packed = chunk
                p = gather_rows(full, chunk_rows, context)
                (s, p), counters = counted(counters, lambda: run_together(model, [
                    step_program(speculative, num_steps, sampling, drafter, logprobs=logprobs)(model, s),
                    prefill_step_program(model, p, *_unpack_chunk(packed, _chunk_width(packed)),
                                         sampling=sampling, logprobs=chunk_logprobs)]))
                ran = (s.n_out > before).astype(jnp.int32)
            elif steps == 1:
                s, counters = one_step(model, s, counters, sampling, logprobs)
                ran = (s.n_out > before).astype(jnp.int32)
            else:  # a loop of known trip count (a scan): no predicate read back by the host
                def body(_, carry):
                    s, counters, ran = carry
                    n = s.n_out
                    s, counters = one_step(model, s, counters, sampling, logprobs)
                    return s, counters, ran + (s.n_out > n)

                s, counters, ran = jax.lax.fori_loop(0, steps, body, (s, counters, jnp.zeros_like(before)))
            # in place: a use of count
            count = count.at[slice(None) if rows is None else rows].set(jnp.stack([s.n_out - before, ran], axis=1),
                                                                        mode="drop")
            full = unview_rows(full, rows, s) if in_place else scatter_rows(full, rows, s, context)
            if chunk is not None:  # after the step's rows: a step over every slot also ran the chunk's (done) rows
                full = scatter_rows(full, chunk[0], p, context)
            return jax.tree_util.tree_leaves(full), (count, counters)

        def report(out, n_out, done, lp, top_ids, count, rows, logprobs, steps):
            """[K, steps * width + 3]: the new tokens (padded), their number, the done flag and the
            steps run of the rows the call ran; with logprobs (one step) also (log-probabilities
            [K, width, 1 + k], ids [K, width, k])."""
            out, n_out, done, lp, top_ids, count = gather_rows((out, n_out, done, lp, top_ids, count), rows)
            idx = jnp.minimum((n_out - count[:, 0])[:, None] + jnp.arange(steps * width)[None], out.shape[1] - 1)
            r = jnp.concatenate([jnp.take_along_axis(out, idx, axis=1), count[:, :1], done[:, None].astype(jnp.int32),
                                 count[:, 1:]], axis=1)
            return (r, lp[:, :width] + 0, top_ids[:, :width] + 0) if logprobs else r

        self._step = jax.jit(run, donate_argnums=(1, 2), static_argnums=(5, 6, 7, 8, 9))
        # The report is a program of its own: as an output of the step's program it would get a new
        # address every step, XLA would update the step's CUDA graph before each launch, and the
        # launch would wait for the previous step to finish (host and device no longer overlap).
        self._report = jax.jit(report, static_argnums=(7, 8))
        # Placed as the slots are: a first step that met an uncommitted count would compile a
        # program of its own that no later step (whose count is the committed output) runs.
        # count [B, 2]: the tokens each slot's last call emitted, and the steps in which it emitted.
        count = jax.device_put(np.zeros((self.batch, 2), np.int32), slots.done.sharding)
        self._counts = (count, jax.device_put(np.zeros(TICKETS, np.int32), slots.done.sharding) if tickets else None)
        self._kept = KeptBuffers()  # each bucket's rows
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

    def lower(self, platforms=None, live=None, chunk: PreparedChunk | None = None):
        """The program `dispatch(live=live, chunk=chunk, steps=1 with a chunk)` would run, lowered
        for the current slots, for inspecting its HLO; platforms (e.g. ("cuda",)) lowers for another
        machine's backend."""
        _, args = self._call_args(None, live, False, None, chunk, 1 if chunk is not None else None)
        return self._step.trace(*args).lower(lowering_platforms=platforms)

    def rows(self, live) -> np.ndarray | None:
        """The slot indices a step over `live` [B] bool runs (`bucket_rows`, padded with padding
        rows, `slot_rows`; None: every slot)."""
        return bucket_rows(np.ones(self.batch, bool) if live is None else live, self.buckets, self.batch,
                           pad=self.batch)

    def context(self, need: int | None) -> int | None:
        """The cache length a step whose live slots hold at most `need` positions runs over (None:
        the whole cache)."""
        return pick_context(need, self.contexts, self.cache_len) if self.contexts else None

    def dispatch(self, sampling: bool | None = None, live=None, logprobs: bool = False, context=None,
                 chunk: PreparedChunk | None = None, steps: int | None = None) -> None:
        """Queues a call of `steps` steps (None: `steps_per_call`) over the `live` slots (None: all
        of them) and its report, whose copy to the host starts at once; `step` and `drain` read it.
        context: at most this many positions in any live slot after the call (None: unknown).
        chunk: a prefill chunk (`ChunkPrefiller.prepare`)
        over slots that are not live, run in the same program (the mixed iteration: one forward
        for the step's tokens and the chunk's, `spec.step.run_together`); its first tokens are
        read with `ChunkPrefiller.report`. The program then runs at the chunk's context, and in
        the sampling variant if either part asks for it."""
        rows, args = self._call_args(sampling, live, logprobs, context, chunk, steps)
        self._slots, self._counts = self._step(*args)
        _, _, _, on_device, _, _, logprobs, _, _, steps = args
        report = self._report(*(self._slots[i] for i in self._read), self._counts[0], on_device, logprobs, steps)
        for a in jax.tree_util.tree_leaves(report):
            a.copy_to_host_async()
        self._pending = (report, rows)

    def _call_args(self, sampling, live, logprobs, context, chunk, steps) -> tuple:
        """(the rows, the step program's arguments) of `dispatch`'s call; ValueError for a call it
        cannot run."""
        sampling = self.sampling if sampling is None else sampling
        steps = self.steps_per_call if steps is None else steps
        if steps < 1 or (steps > 1 and (logprobs or chunk is not None)):
            raise ValueError(f"a call of {steps} steps: at least one, and only one with log-probabilities or a "
                             "prefill chunk")
        rows = self.rows(live)
        on_device = None if rows is None else self._kept(rows)
        if chunk is None:
            context, extra, chunk_logprobs = self.context(context), None, False
        else:
            if chunk.rows is None or (rows is not None and np.isin(chunk.rows, rows).any()):
                raise ValueError("a mixed iteration's chunk must name its rows, and run over slots the step does not")
            context, extra, chunk_logprobs = chunk.context, (chunk.rows_on_device, chunk.packed), chunk.logprobs
            sampling = sampling or chunk.sampling
        return rows, (self._params, self._slots, self._counts, on_device, extra, bool(sampling), bool(logprobs),
                      context, chunk_logprobs, steps)

    def step(self, sampling: bool | None = None, live=None, logprobs: bool = False, context=None,
             chunk: PreparedChunk | None = None, steps: int | None = None) -> Report | None:
        """Dispatches a call over the `live` slots (None: all of them); returns the previous one's
        `Report` (None: there was none). logprobs: report the new tokens' log-probabilities (a
        program of its own, compiled at first use; the slots need a logprob_width of at least the
        step's width); context, chunk, steps: as in `dispatch`."""
        previous = self._pending
        self.dispatch(sampling, live, logprobs, context, chunk, steps)
        return self._unpack(previous)

    def drain(self) -> Report | None:
        """The results of the last dispatched call."""
        previous, self._pending = self._pending, None
        return self._unpack(previous)

    def _unpack(self, pending) -> Report | None:
        if pending is None:
            return None
        report, rows = pending
        report = jax.device_get(report)
        r, lp, ids = (report if isinstance(report, tuple) else (report, None, None))
        r = np.asarray(r)
        w = r.shape[1] - 3  # steps * width
        rows = range(r.shape[0]) if rows is None else rows
        tokens, done, ran = [[] for _ in range(self.batch)], np.zeros(self.batch, bool), np.zeros(self.batch, int)
        logprobs = None if lp is None else [[] for _ in range(self.batch)]
        for i, b in enumerate(rows):
            if b >= self.batch:  # a padding row
                continue
            n = r[i, w]
            tokens[b], done[b], ran[b] = r[i, :n].tolist(), bool(r[i, w + 1]), r[i, w + 2]
            if logprobs is not None:
                logprobs[b] = [(lp[i, j], ids[i, j]) for j in range(n)]
        return Report(tokens, done, logprobs, ran)


def prefill_step(model: LingModel, slots: Slots, start, params: SamplingParams, max_new, eos, tokens, next_tokens,
                 valid, ends, *, sampling: bool, logprobs: bool = False):
    """One prefill chunk that decode steps may be interleaved with (the server's scheduler).

    start [B] bool, or int32 0 / 1 / 2: slots reset for a new request first (params, max_new, eos
    are taken for them only); 2: a request whose prompt prefix a prefix-cache restore has just
    written into the slot (`spec.prefix.restore`): its model state and `seen` are kept; tokens / next_tokens [B, C]: each slot's next chunk of its own prompt and the successors;
    valid [B]: real tokens in it (0: the slot is untouched); ends [B]: the prompt ends in this chunk.
    A slot whose prompt has not ended stays done, so interleaved decode/speculative steps skip it;
    its last_hidden / last_token hold the pair (h_{p-1}, token_p) of its last prefilled position,
    so the NEXTN entry that a speculative step rewrites at p-1 for a done slot keeps its true value.
    sampling (static): whether any slot in `ends` samples its first token; logprobs (static): keep
    the first tokens' log-probabilities in `slots.logprobs[:, 0]`.
    Returns the slots; the sampled first token of a slot in `ends` is its `out[:, 0]`."""
    return run_program(model, prefill_step_program(model, slots, start, params, max_new, eos, tokens, next_tokens, valid,
                                           ends, sampling=sampling, logprobs=logprobs))


def prefill_step_program(model: LingModel, slots: Slots, start, params: SamplingParams, max_new, eos, tokens,
                         next_tokens, valid, ends, *, sampling: bool, logprobs: bool = False):
    """`prefill_step` as a step program (`spec.step.run_together`)."""
    start = jnp.asarray(start)
    slots = reset(slots, start > 0, params, max_new, eos, restored=start == 2)
    start = start > 0
    slots = slots.replace(done=(slots.done | start) & ~ends)
    slots = yield from prefill_program(model, slots, tokens, next_tokens, valid, valid > 0, sampling=sampling,
                                       logprobs=logprobs)
    mid = (valid > 0) & ~ends
    return slots.replace(last_token=jnp.where(mid, last_at(next_tokens, valid), slots.last_token))


# The columns of a prefill chunk's packed arguments (`ChunkPrefiller`), after tokens and next_tokens
# [K, C] each: int32 flags and limits, then the sampling parameters (float32 and uint32 bits).
_INT_ARGS = ("start", "valid", "ends", "max_new", "eos", "top_k", "seed")
_FLOAT_ARGS = ("temperature", "top_p", "presence", "frequency", "repetition")


def _unpack_chunk(packed, c: int):
    """packed [K, 2C + 12] int32 (`ChunkPrefiller._pack`) -> (start, params, max_new, eos, tokens,
    next_tokens, valid, ends) as `prefill_step` takes them."""
    tokens, next_tokens, rest = packed[:, :c], packed[:, c:2 * c], packed[:, 2 * c:]
    ints = dict(zip(_INT_ARGS, (rest[:, i] for i in range(len(_INT_ARGS)))))
    floats = {n: jax.lax.bitcast_convert_type(rest[:, len(_INT_ARGS) + i], jnp.float32)
              for i, n in enumerate(_FLOAT_ARGS)}
    params = SamplingParams(floats["temperature"], ints["top_k"], floats["top_p"],
                            jax.lax.bitcast_convert_type(ints["seed"], jnp.uint32), floats["presence"],
                            floats["frequency"], floats["repetition"])
    return (ints["start"], params, ints["max_new"], ints["eos"], tokens, next_tokens, ints["valid"],
            ints["ends"] > 0)


def _chunk_width(packed) -> int:
    """C of a packed chunk [K, 2C + 12]."""
    return (packed.shape[1] - len(_INT_ARGS) - len(_FLOAT_ARGS)) // 2


@dataclasses.dataclass(frozen=True)
class PreparedChunk:
    """A prefill chunk's arguments on the device (`ChunkPrefiller.prepare`)."""

    packed: jax.Array  # [K, 2C + 12] int32 (`ChunkPrefiller._pack`)
    rows: np.ndarray | None  # [K] the slots it runs (None: all of them)
    rows_on_device: jax.Array | None
    sampling: bool
    logprobs: bool
    context: int | None  # the MLA caches' positions it runs over (None: all)


class ChunkPrefiller:
    """`prefill_step` compiled once for the slots' shapes (and each batch bucket); the arguments
    are host arrays, [K] and [K, C] for the K slots `rows` names (all B slots when rows is None):
    those rows of the slots are gathered, prefilled and scattered back, so the slots a chunk does
    not touch cost nothing. The slots are donated: pass the Stepper's current slots and put the
    result back. The weights cross the jit boundary as a flat list (`Stepper`). Returns (slots,
    first [K]), and with logprobs (slots, first [K], (log-probabilities [K, 1 + top], top ids
    [K, top]) of the first tokens).

    A chunk alone always runs the sampling variant of `prefill_step`, whose greedy rows take the
    argmax as the all-greedy variant's do: its sampling is of K first tokens beside a forward over
    K x C, and one program a bucket and cache length is compiled instead of two. (Beside a step,
    in the mixed iteration, the chunk's `sampling` picks the step's variant.)

    As the `Stepper`'s step, the chunk's program touches only buffers that keep their address, so
    that its CUDA graph is replayed as recorded: the per-chunk arguments are packed into one int32
    array [K, 2C + 12] (`_pack`) written into a buffer kept per shape, the rows into one kept per
    bucket (`KeptBuffers`), and its one output is the slots, written in place; the first tokens
    are read from them by a small program of their own (`report`), whose output is fresh.

    Context buckets: `context=n` says the chunk's slots hold at most n positions once it has run;
    the chunk then runs over the MLA caches' first C positions only, C the smallest of `contexts`
    >= n (the prefix part of its attention loops over the cache it is given on every backend,
    `pallas_kernels.mla_prefill`: a short prompt does not expand the whole cache)."""

    def __init__(self, model: LingModel, contexts=None):
        self._params, merge = _flat_weights(model)
        self._kept = KeptBuffers()
        self.contexts = tuple(sorted(set(contexts or ())))

        def run(param_leaves, slots, rows, packed, sampling, logprobs, context):
            model = merge(param_leaves)
            sub = run_program(model, prefill_step_program(model, gather_rows(slots, rows, context),
                                                          *_unpack_chunk(packed, _chunk_width(packed)),
                                                          sampling=sampling, logprobs=logprobs))
            return scatter_rows(slots, rows, sub, context)

        def report(out, logprobs_buf, top_ids, rows, packed, logprobs):
            """The first tokens [K] of the rows whose prompt ended in the chunk (-1 elsewhere); with
            logprobs also their (log-probabilities [K, 1 + top], top ids [K, top])."""
            out, logprobs_buf, top_ids = gather_rows((out, logprobs_buf, top_ids), rows)
            ends = packed[:, -len(_FLOAT_ARGS) - len(_INT_ARGS) + _INT_ARGS.index("ends")] > 0
            first = jnp.where(ends, out[:, 0], -1)
            return (first, (logprobs_buf[:, 0] + 0, top_ids[:, 0] + 0)) if logprobs else first

        self._call = jax.jit(run, donate_argnums=1, static_argnums=(4, 5, 6))
        self._report = jax.jit(report, static_argnums=5)

    @staticmethod
    def _pack(start, params: SamplingParams, max_new, eos, tokens, next_tokens, valid, ends) -> np.ndarray:
        """The chunk's arguments as one int32 array [K, 2C + 12] (`_unpack_chunk` reads it), from
        host arrays only: TypeError names a device array (reading it back would wait for every
        step queued before it, and the host could no longer run ahead of the device)."""
        given = dict(start=start, max_new=max_new, eos=eos, tokens=tokens, next_tokens=next_tokens, valid=valid,
                     ends=ends, **{f"params.{f.name}": getattr(params, f.name) for f in dataclasses.fields(params)})
        on_device = [name for name, a in given.items() if isinstance(a, jax.Array)]
        if on_device:
            raise TypeError(f"a prefill chunk's arguments are host arrays; {', '.join(on_device)} on the device "
                            f"(SamplingParams.make(..., on_host=True) makes host parameters)")
        host = lambda a, dt: np.asarray(a, dt).reshape(-1)  # noqa: E731
        ints = dict(start=host(start, np.int32), valid=host(valid, np.int32), ends=host(ends, np.int32),
                    max_new=host(max_new, np.int32), eos=host(eos, np.int32), top_k=host(params.top_k, np.int32),
                    seed=host(params.seed, np.uint32).view(np.int32))
        floats = [host(getattr(params, n), np.float32).view(np.int32) for n in _FLOAT_ARGS]
        return np.concatenate([np.asarray(tokens, np.int32), np.asarray(next_tokens, np.int32),
                               np.stack([ints[n] for n in _INT_ARGS] + floats, axis=1)], axis=1)

    def prepare(self, slots: Slots, *, start, params: SamplingParams, max_new, eos, tokens, next_tokens, valid,
                ends, sampling: bool, rows=None, logprobs: bool = False, context: int | None = None) -> PreparedChunk:
        """The chunk's arguments on the device, for `__call__` or a mixed iteration (`Stepper.dispatch`)."""
        packed = self._kept(self._pack(start, params, max_new, eos, tokens, next_tokens, valid, ends))
        on_device = None if rows is None else self._kept(np.asarray(rows, np.int32))
        context = pick_context(context, self.contexts, cache_len(slots)) if self.contexts else None
        return PreparedChunk(packed, None if rows is None else np.asarray(rows), on_device, bool(sampling),
                             bool(logprobs), context)

    def lower(self, slots: Slots, chunk: PreparedChunk, platforms=None):
        """The program `__call__` runs for a prepared chunk, lowered for `slots` (platforms: as
        `Stepper.lower`)."""
        return self._call.trace(*self._call_args(slots, chunk)).lower(lowering_platforms=platforms)

    def _call_args(self, slots: Slots, chunk: PreparedChunk) -> tuple:
        """The chunk program's arguments: always its sampling variant (see the class doc)."""
        return self._params, slots, chunk.rows_on_device, chunk.packed, True, chunk.logprobs, chunk.context

    def report(self, slots: Slots, chunk: PreparedChunk):
        """Queues the read of a dispatched chunk's first tokens (and their log-probabilities, if it
        asked): first [K], or (first [K], (log-probabilities [K, 1 + top], top ids [K, top])); their
        copy to the host starts at once."""
        first = self._report(slots.out, slots.logprobs, slots.top_ids, chunk.rows_on_device, chunk.packed,
                             chunk.logprobs)
        for a in jax.tree_util.tree_leaves(first):
            a.copy_to_host_async()
        return first

    def __call__(self, slots: Slots, *, start, params: SamplingParams, max_new, eos, tokens, next_tokens, valid,
                 ends, sampling: bool, rows=None, logprobs: bool = False, context: int | None = None):
        chunk = self.prepare(slots, start=start, params=params, max_new=max_new, eos=eos, tokens=tokens,
                             next_tokens=next_tokens, valid=valid, ends=ends, sampling=sampling, rows=rows,
                             logprobs=logprobs, context=context)
        slots = self._call(*self._call_args(slots, chunk))
        first = self.report(slots, chunk)
        return (slots, *first) if logprobs else (slots, first)


class SlotCopier:
    """`copy_slots` compiled once for the slots' shapes: the slots are donated and written in place
    (pass the Stepper's current slots and put the result back); the pairs are host arrays padded
    to the batch, so one program serves any number of copies. The weights cross the jit boundary
    as a flat list (`Stepper`)."""

    def __init__(self, model: LingModel):
        self._params, merge = _flat_weights(model)

        def run(param_leaves, slots, src, dst, count, seed):
            return copy_slots(merge(param_leaves), slots, src, dst, count, seed)

        self._call = jax.jit(run, donate_argnums=1)

    def __call__(self, slots: Slots, pairs, seeds):
        """pairs: (source slot, copy slot) each; seeds: the copies' seeds. Returns (slots, first [B],
        (log-probabilities [B, 1 + k], top ids [B, k])): entry i is pair i's copy (B rows, the
        first len(pairs) real)."""
        b = slots.done.shape[0]
        if len(pairs) >= b:
            raise ValueError(f"at most {b - 1} copies fit {b} slots, got {len(pairs)}")
        src, dst, seed = np.zeros(b, np.int32), np.full(b, b, np.int32), np.zeros(b, np.uint32)
        for i, ((s, d), x) in enumerate(zip(pairs, seeds)):
            src[i], dst[i], seed[i] = s, d, x
        return self._call(self._params, slots, jnp.asarray(src), jnp.asarray(dst), jnp.int32(len(pairs)),
                          jnp.asarray(seed))

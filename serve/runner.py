"""The device side of the server: the slots, the compiled prefill chunk and decode step, and the
pairing of each step's results with the requests that owned the slots when it was dispatched.

Every call here only dispatches: JAX runs it asynchronously. Results come back one step late
(`spec.stepper.Stepper`): step k's tokens are read after step k+1 is queued, so the device never
waits for the host."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from serve.scheduler import PrefillChunk


@dataclasses.dataclass
class StepResult:
    owners: list  # [B] the request each slot decoded for when the step was dispatched (None: none)
    tokens: list[list[int]]  # [B] the new tokens of each slot
    done: np.ndarray  # [B] bool: the device finished the slot (EOS or max_tokens)
    # None when no slot asked; else [B] per new token (log-probabilities [1 + K], top ids [K])
    logprobs: list | None = None
    steps: np.ndarray | None = None  # [B] the device steps in which each slot emitted (None: one each)


class Runner:
    def __init__(self, model, *, max_batch: int, max_seq_len: int, speculative_steps: int, buckets=None,
                 contexts=(), prefix_entries: int = 0, prefix_interval: int = 0, drafter=None, mixed: bool = False,
                 steps_per_call: int = 1, tickets: bool = False):
        """buckets: the batch sizes the step is compiled for (`spec.stepper.Stepper`; None: the
        powers of two up to max_batch); a step runs the smallest that holds the decoding slots.
        contexts: the cache lengths the prefill chunk and the step are compiled for (`Stepper`,
        `ChunkPrefiller`; empty: the whole cache always); a call runs the shortest that holds its
        slots' positions, which the runner bounds from the host's side (`_length`).
        prefix_entries, prefix_interval: the prefix cache's pool (`spec.prefix.PrefixPool`; 0
        entries: no cache); the slots' caches are then a whole number of intervals long.
        drafter: the speculative step's drafter (None: NEXTN; `spec.step.BlockDrafter`: DSpark).
        mixed: run a chunk of one prompt and the step of the slots decoding beside it as one
        program (`mixed`; its variants are compiled by `warmup_mixed`).
        steps_per_call: decode (or speculative) steps a call runs on the device when no prompt is
        being prefilled and no decoding request asks for log-probabilities (`Stepper`); else one.
        The host's dispatch is then paid once for that many steps, the tokens stream that many
        steps at a time, and a prompt that arrives waits for the call in flight.
        tickets: the step's split sums finish in their kernels' own launches (`Stepper`)."""
        from spec.prefix import PrefixPool
        from spec.stepper import ChunkPrefiller, SlotCopier, Stepper, batch_buckets

        self.model = model
        self.mixing = mixed and max_batch > 1
        self.max_batch, self.max_seq_len, self.speculative_steps = max_batch, max_seq_len, speculative_steps
        self.prefix_interval = prefix_interval if prefix_entries > 0 else 0
        self.stepper = Stepper(model, self._new_slots(), speculative=speculative_steps > 0,
                               num_steps=max(speculative_steps, 1),
                               buckets=batch_buckets(max_batch) if buckets is None else buckets, contexts=contexts,
                               drafter=drafter, steps_per_call=steps_per_call, tickets=tickets)
        self.prefiller = ChunkPrefiller(model, contexts=contexts)
        self.pool = (PrefixPool(model, self.stepper.slots, prefix_entries, prefix_interval)
                     if self.prefix_interval else None)
        self.copier = SlotCopier(model)
        self._owners = collections.deque()  # owners of the dispatched, not yet read steps
        # Whether each slot's request (as last set by a prefill chunk) samples or has a penalty: the
        # host's copy, from which it picks the all-greedy or the sampling variant of a step without
        # asking the device.
        self._sampling = np.zeros(max_batch, bool)
        self._logprobs = np.zeros(max_batch, bool)  # and whether its request asks for log-probabilities
        # An upper bound on the positions in each slot's state once every dispatched call has run:
        # a prefill chunk adds its tokens, a step its width (tightened to the tokens it emitted once
        # read, unless the slot was started again since: `_epoch` counts its starts).
        self._length = np.zeros(max_batch, np.int64)
        self._epoch = np.zeros(max_batch, np.int64)

    def prefill(self, chunk: PrefillChunk, context: int | None = None):
        """Dispatches one prefill chunk over the slots it touches (in the smallest batch bucket
        that holds them), then the copies it names (`PrefillChunk.copies`: the prefilled slot's
        state into each copy's slot, one program for all); returns what `read_first` turns into
        the first tokens [B] (-1 where the prompt does not end; a copy's own first token at its
        slot), to be read after the next step is dispatched. context: the cache length to run at
        (default: the shortest compiled one that holds the chunk's slots)."""
        prepared, rows = self._prepare(chunk, self.stepper.buckets, context)
        self.stepper.slots, first, *lp = self.prefiller(self.stepper.slots, **prepared)
        return self._after_chunk(chunk, first, lp, rows)

    def iterate(self, chunk: PrefillChunk | None, owners: list):
        """One engine iteration's device work: the chunk (if any) and a step over the decoding
        slots `owners` (if any; else the last step's result is drained), as one mixed program
        where `mixable`, else as two. Returns (what `read_first` takes, or None without a chunk;
        the previous step's result, or None)."""
        mixed = None if chunk is None else self.mixable(chunk, owners)
        if mixed is not None:
            return self.mixed(chunk, mixed)
        first = self.prefill(chunk) if chunk is not None else None
        return first, self.step(owners, several=chunk is None) if any(r is not None for r in owners) else self.drain()

    def mixable(self, chunk: PrefillChunk, owners: list) -> list | None:
        """The owners a mixed iteration of this chunk would step (`mixed`): the decoding slots
        that the chunk neither prefills nor copies into (those decode from the next iteration
        on). None when there is no mixed iteration to run: mixing is off, the chunk prefills
        more than one slot (the mixed programs are compiled for one), or nothing else decodes."""
        if not self.mixing:
            return None
        busy = (np.asarray(chunk.start) > 0) | (np.asarray(chunk.valid) > 0)
        if busy.sum() != 1:
            return None
        busy[[d for _, d in chunk.copies]] = True
        owners = [None if busy[b] else r for b, r in enumerate(owners)]
        return owners if any(r is not None for r in owners) else None

    def mixed(self, chunk: PrefillChunk, owners: list):
        """One program for the step over `owners` (from `mixable`) and the chunk over its one slot
        (`spec.stepper.Stepper.dispatch` with a chunk): their attention apart, one MLP (the
        tile-scheduled MoE) over both kinds of tokens. Returns (what `read_first` takes, the
        previous step's result)."""
        from spec.sampling import any_sampling

        live = np.array([r is not None for r in owners])
        self._length[live] += self.stepper.width
        prepared, rows = self._prepare(chunk, (1,), int(self._length[live].max(initial=1)))
        self._owners.append((owners, live, self._epoch.copy(), self.stepper.width))
        chunk_call = self.prefiller.prepare(self.stepper.slots, **prepared)
        report = self.stepper.step(sampling=any_sampling(self._sampling, live), live=live,
                                   logprobs=bool(np.any(self._logprobs & live)), chunk=chunk_call, steps=1)
        first = self.prefiller.report(self.stepper.slots, chunk_call)
        first, lp = (first if chunk_call.logprobs else (first, None))
        return self._after_chunk(chunk, first, [] if lp is None else [lp], rows), self._result(report)

    def _prepare(self, chunk: PrefillChunk, buckets, need: int):
        """The chunk's bookkeeping (slots started, restores, lengths, what each slot samples) and
        its arguments for `ChunkPrefiller` (host arrays over the rows of the smallest of `buckets`
        that holds the slots it touches, at a context that holds them and `need`); returns
        (arguments, rows)."""
        from spec.sampling import SamplingParams, any_sampling, needs_sampling
        from spec.stepper import bucket_rows

        start = np.asarray(chunk.start) > 0
        touched = start | (np.asarray(chunk.valid) > 0)
        self._length[start], self._epoch[start] = 0, self._epoch[start] + 1
        for slot, path, n, prompt in chunk.restores:  # before the chunk, which goes on from n
            self.stepper.slots = self.pool.restore(self.stepper.slots, slot, path, n, prompt)
            self._length[slot] = n
        self._length += np.asarray(chunk.valid)
        self._sampling[start] = needs_sampling(chunk)[start]
        self._logprobs[start] = False if chunk.logprobs is None else np.asarray(chunk.logprobs, bool)[start]
        rows = bucket_rows(touched, buckets, self.max_batch)
        pick = (lambda a: np.asarray(a)) if rows is None else (lambda a: np.asarray(a)[rows])
        params = SamplingParams(pick(chunk.temperature), pick(chunk.top_k), pick(chunk.top_p), pick(chunk.seed),
                                pick(chunk.presence), pick(chunk.frequency), pick(chunk.repetition))  # host arrays
        logprobs = bool(np.any(self._logprobs & np.asarray(chunk.ends, bool)))
        need = max(need or 1, int(self._length[touched].max(initial=1)))
        return dict(start=pick(chunk.start), params=params, max_new=pick(chunk.max_new), eos=pick(chunk.eos),
                    tokens=pick(chunk.tokens), next_tokens=pick(chunk.next_tokens), valid=pick(chunk.valid),
                    ends=pick(chunk.ends), sampling=any_sampling(self._sampling, chunk.ends), rows=rows,
                    logprobs=logprobs, context=need), rows

    def _after_chunk(self, chunk: PrefillChunk, first, lp, rows):
        """The chunk's checkpoints and copies, dispatched after it; returns what `read_first` takes."""
        from spec.sampling import needs_sampling

        for slot, entry, row0 in chunk.saves:
            self.pool.save(self.stepper.slots, slot, entry, row0)
        copied = None
        if chunk.copies:
            at = np.array([d for _, d in chunk.copies])
            self._length[at] = self._length[[s for s, _ in chunk.copies]]
            self._epoch[at] += 1
            self._sampling[at] = needs_sampling(chunk)[at]
            self._logprobs[at] = False if chunk.logprobs is None else np.asarray(chunk.logprobs, bool)[at]
            self.stepper.slots, copy_first, copy_lp = self.copier(self.stepper.slots, chunk.copies,
                                                                  np.asarray(chunk.seed)[at])
            copied = (copy_first, copy_lp, at)
        return first, (lp[0] if lp else None), rows, copied

    def save_finished(self, saves) -> None:
        """Checkpoints a slot the device finished (`serve.scheduler.Scheduler.finished`: (slot,
        entry, first row of the page) each, one slot): its NEXTN row at its length - 1 completed,
        then its state into the pool entries."""
        if saves:
            self.stepper.slots = self.pool.complete(self.stepper.slots, saves[0][0])
        for slot, entry, row0 in saves:
            self.pool.save(self.stepper.slots, slot, entry, row0)

    def step(self, owners: list, several: bool = False) -> StepResult | None:
        """Dispatches a decode (or speculative) call for the slots: `steps_per_call` steps if
        `several` and no decoding request asks for log-probabilities, else one; returns the
        previous call's result."""
        from spec.sampling import any_sampling

        live = np.array([r is not None for r in owners])
        logprobs = bool(np.any(self._logprobs & live))
        steps = self.stepper.steps_per_call if several and not logprobs else 1
        width = self.stepper.width * steps
        self._length[live] += width
        self._owners.append((owners, live, self._epoch.copy(), width))
        return self._result(self.stepper.step(sampling=any_sampling(self._sampling, live), live=live,
                                              logprobs=logprobs, context=int(self._length[live].max(initial=1)),
                                              steps=steps))

    def drain(self) -> StepResult | None:
        """The last dispatched step's result (None if every step was read)."""
        return self._result(self.stepper.drain())

    @property
    def pending(self) -> bool:
        """A dispatched step's result is still unread."""
        return bool(self._owners)

    def reset(self) -> None:
        """Fresh slots after a failure (the old ones may have been donated to a step that failed)."""
        try:
            self.stepper.drain()  # forgets the pending report even if reading it fails
        except Exception:
            pass
        self._owners.clear()
        self.stepper.slots = self._new_slots()
        if self.pool is not None:
            self.pool.clear()
        self._length[:] = 0
        self._epoch += 1
        self._sampling[:] = False
        self._logprobs[:] = False

    def _new_slots(self):
        import jax

        from spec.step import new_slots

        # A verify pass writes num_steps + 1 positions past the slot's length: room for them beyond
        # the longest sequence the server admits.
        width = self.speculative_steps + 1
        length = self.max_seq_len + width
        if self.prefix_interval:  # a checkpoint's page is a whole interval of rows
            length = -(-length // self.prefix_interval) * self.prefix_interval
        slots = new_slots(self.model, self.max_batch, length, self.max_seq_len, logprob_width=width)
        # Committed to the device(s) like every step's output, so the first real call finds the
        # programs the warm-up compiled (an uncommitted input is another cache key). An
        # expert-parallel model keeps the slots replicated over its mesh.
        from moe.parallel import replicate

        mesh = self.model.mesh
        return replicate(slots, mesh) if mesh is not None else jax.device_put(slots, jax.devices()[0])

    def _result(self, report) -> StepResult | None:
        if report is None:
            return None
        owners, live, epoch, width = self._owners.popleft()
        for b in np.flatnonzero(live & ~report.done & (epoch == self._epoch)):  # its state grew by what it emitted
            self._length[b] -= width - len(report.tokens[b])
        return StepResult(owners, report.tokens, report.done, report.logprobs, report.steps)

    def read_first(self, dispatched):
        """(first tokens [B], their log-probabilities: None, or [B] (log-probabilities [1 + K],
        top ids [K])) of a dispatched prefill chunk (a host sync)."""
        first, lp, rows, copied = dispatched
        first = np.asarray(first)
        if lp is not None:
            lp = [np.asarray(a) for a in lp]
        rows = np.arange(self.max_batch) if rows is None else rows
        out = np.full(self.max_batch, -1, first.dtype)
        out[rows[::-1]] = first[::-1]  # a padded duplicate repeats its slot's value
        logprobs = None
        if lp is not None:
            logprobs = [None] * self.max_batch
            for i, b in reversed(list(enumerate(rows))):
                logprobs[b] = (lp[0][i], lp[1][i])
        if copied is not None:
            copy_first, (copy_lp, copy_ids), at = copied
            copy_first, copy_lp, copy_ids = np.asarray(copy_first), np.asarray(copy_lp), np.asarray(copy_ids)
            out[at] = copy_first[:len(at)]
            logprobs = [None] * self.max_batch if logprobs is None else logprobs
            for i, b in enumerate(at):
                logprobs[b] = (copy_lp[i], copy_ids[i])
        return out, logprobs

    def warmup_prefill(self, chunk_size: int) -> None:
        """Compiles the prefill chunk for every batch bucket and cache length (one program serves
        greedy and sampling rows, `ChunkPrefiller`; with JAX's persistent cache, a restart loads
        them instead), by prefilling one token into the first k slots with max_tokens 1, which
        leaves them done."""
        b = self.max_batch
        for k, context in itertools.product(self.stepper.buckets, self._warm_contexts()):
            chunk = self._warm_chunk(np.arange(b) < k, chunk_size, 0.0)
            self.read_first(self.prefill(chunk, context))
        self._sampling[:] = False
        self._length[:] = 0

    def warmup_mixed(self, chunk_size: int) -> None:
        """Compiles the mixed iteration (`mixed`) for every batch bucket of the step and cache
        length, all-greedy and sampling, by prefilling one token into slot 0 with max_tokens 1
        beside a step over slots that are all done: nothing changes but slot 0, left done."""
        if not self.mixing:
            return
        b = self.max_batch
        for k, context, temperature in itertools.product(self.stepper.buckets, self._warm_contexts(), (0.0, 1.0)):
            chunk = self._warm_chunk(np.arange(b) < 1, chunk_size, temperature)
            # the step's rows: slots 1..k, or every slot (the chunk's among them: allowed, `Stepper`)
            slot = np.arange(b)
            live = (slot >= 1) & (slot <= k) if k < b else slot >= 0
            prepared, rows = self._prepare(chunk, (1,), context)
            call = self.prefiller.prepare(self.stepper.slots, **prepared)
            self.stepper.step(sampling=temperature > 0, live=live, chunk=call)
            np.asarray(self.prefiller.report(self.stepper.slots, call))
            self.stepper.drain()
        self._sampling[:] = False
        self._length[:] = 0

    def _warm_chunk(self, some, chunk_size: int, temperature: float) -> PrefillChunk:
        """A chunk that prefills one token into the `some` slots with max_tokens 1 (leaves them done)."""
        b = self.max_batch
        return PrefillChunk(start=some, tokens=np.zeros((b, chunk_size), np.int32),
                            next_tokens=np.zeros((b, chunk_size), np.int32), valid=some.astype(np.int32),
                            ends=some, owners=[None] * b, temperature=np.full(b, temperature, np.float32),
                            top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
                            seed=np.zeros(b, np.uint32), presence=np.zeros(b, np.float32),
                            frequency=np.zeros(b, np.float32), repetition=np.ones(b, np.float32),
                            max_new=np.ones(b, np.int32), eos=np.full(b, -1, np.int32))

    def warmup_copy(self) -> None:
        """Compiles the slot copy (`spec.stepper.SlotCopier`) by running it with no copies, which
        changes nothing."""
        if self.max_batch > 1:
            self.stepper.slots, first, _ = self.copier(self.stepper.slots, [], [])
            np.asarray(first)

    def warmup_prefix(self) -> None:
        """Compiles the prefix cache's programs (`spec.prefix.PrefixPool`) by saving slot 0 into
        entry 0 and restoring it, then completing slot 0's NEXTN row: slot 0 is done and free, and
        a request started there resets it; entry 0 is not in any index yet."""
        if self.pool is not None:
            self.save_finished([(0, 0, 0)])
            self.stepper.slots = self.pool.restore(self.stepper.slots, 0, [0], 1, [0])
            np.asarray(self.stepper.slots.model.lengths)

    def warmup_step(self) -> None:
        """Compiles the decode (or speculative) call for every batch bucket and cache length (where
        the step has them), all-greedy and sampling, of one step and of `steps_per_call`; every
        slot is done, so nothing changes."""
        contexts = self._warm_contexts() if self.stepper.contexts else (None,)
        for k, context, sampling, steps in itertools.product(self.stepper.buckets, contexts, (False, True),
                                                             sorted({1, self.stepper.steps_per_call})):
            live = np.arange(self.max_batch) < k
            self._owners.append(([None] * self.max_batch, np.zeros_like(live), self._epoch.copy(), 0))
            self._result(self.stepper.step(sampling=sampling, live=live, context=context, steps=steps))
        self.drain()

    def _warm_contexts(self) -> tuple:
        """The cache lengths the calls are compiled for: the compiled ones below the cache's, and it."""
        length = self.stepper.cache_len
        return tuple(c for c in self.prefiller.contexts if length is not None and c < length) + (length,)

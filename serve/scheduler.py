"""Which request runs in which slot, and what the next prefill chunk holds. Host bookkeeping only:
no JAX here.

A request waits in a FIFO queue until a slot is free. Admitted, it prefills one chunk per engine
iteration (all prefilling slots share one [B, C] chunk call), each iteration also running one
decode step for the slots already decoding: chunked prefill interleaved with decode. After its last
chunk the slot decodes until the request finishes; then the slot is free again.

With `mixed` (the runner runs a chunk of one prompt and the step in one program) a chunk beside
decoding slots holds one prompt: a request is not admitted while another prefills beside them,
and of prompts admitted together (when none decoded) the one with the fewest tokens left goes
on while the others pause. Every iteration then stays one program, and prompts prefill one after
another, the first starting to decode soonest.

A group of n choices (`Request.copies`) is admitted whole, once n slots are free together (the
queue stays FIFO: a group at its head waits for them, and since n never exceeds the slots it
gets them as running requests end). Choice 0 prefills; the others hold their slots, neither
prefilling nor decoding, until its last chunk, which names them in `PrefillChunk.copies`: the
runner copies the prefilled slot into theirs and they decode from the next step on.

Chunk width. Fixed (`chunk`) by default. With a `sizer` (moe.tiles.ChunkSizer, built from a fitted
tile model and a TPOT budget) each iteration's width is the largest the model predicts to fit
the budget next to the decode step: the widest when no slot decodes, narrower while slots do.
The step's MoE work is taken as decode_width tokens a decoding slot (the step runs the live
slots, `spec.stepper.Stepper`'s batch buckets), the chunk's as its width for each prompt
prefilling, in one launch a layer when the iteration is mixed. A chunk whose prompts have less
left than that width takes the narrowest of the sizer's widths that holds them: its padding rows
would otherwise run through every layer, and the MoE's experts take them as tokens.

Prefix cache (`prefix`, a `serve.prefix_cache.PrefixIndex`). An admitted request takes the longest
checkpoint of its prompt: the chunk names it in `restores` (the runner copies it into the slot
before the chunk) and starts the slot with `start` 2, and its prefill goes on from there. While
the cache is on, no chunk crosses a grid point (a multiple of the interval): a chunk that ends on
one before the prompt's end names a checkpoint to write in `saves` (the runner copies the slot
into the pool after the chunk). A finished request whose slot the device stopped (EOS, max_tokens)
is checkpointed where its state stands (`finished`)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from serve.request import Request


@dataclasses.dataclass
class PrefillChunk:
    """The arguments of one `spec.stepper.ChunkPrefiller` call (host arrays, B slots, C tokens)."""

    start: np.ndarray  # [B] int32: 1 a slot reset for a newly admitted request, 2 one restored first
    tokens: np.ndarray  # [B, C] int32
    next_tokens: np.ndarray  # [B, C] int32
    valid: np.ndarray  # [B] int32
    ends: np.ndarray  # [B] bool: the prompt's last chunk
    owners: list  # [B] the request of each slot whose prompt ends here, else None
    temperature: np.ndarray  # [B] per-slot sampling parameters (used for the started slots only)
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    presence: np.ndarray  # [B] float32 penalties (spec.sampling.penalize)
    frequency: np.ndarray
    repetition: np.ndarray
    max_new: np.ndarray
    eos: np.ndarray
    logprobs: np.ndarray | None = None  # [B] bool: the started slots' requests ask for log-probabilities
    # (source slot, copy slot): after this chunk the source's state is copied into the copy slot
    # (`spec.step.copy_slots`); the copy's sampling parameters are in the [B] arrays at its slot.
    copies: list = dataclasses.field(default_factory=list)
    # Prefix cache: (slot, pool entries of the checkpoint's pages, n, prompt) restored before the
    # chunk; (slot, entry, first row of the page) written after it; (prompt tokens, hit tokens)
    # of each request admitted here.
    restores: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    lookups: list = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, num_slots: int, chunk: int, eos_id: int | None, *, sizer=None, decode_width: int = 1,
                 prefix=None, mixed: bool = False):
        """sizer: None (every chunk is `chunk` wide) or a callable (decode tokens, prompts
        prefilling, mixed) -> chunk width (`moe.tiles.ChunkSizer`); decode_width: tokens per slot
        in a decode step (speculative: draft steps + 1); prefix: None (no prefix cache) or a
        serve.prefix_cache.PrefixIndex; mixed: the runner runs a chunk of one prompt and the
        step beside it as one program (`serve.runner.Runner.mixable`)."""
        self.num_slots, self.chunk, self.eos_id, self.mixed = num_slots, chunk, eos_id, mixed
        self.sizer, self.decode_width, self.prefix = sizer, decode_width, prefix
        self.node: list = [None] * num_slots  # the pinned prefix-cache node of each prefilling slot
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.prefilled: list[int | None] = [None] * num_slots  # prompt tokens done; None once decoding
        self.slot_of: dict[int, int] = {}  # request id -> slot
        self.copies_of: dict[int, list[int]] = {}  # prefilling slot -> the slots of its group's other choices
        self.awaiting: set[int] = set()  # those slots: waiting for their source's last chunk

    # -- bookkeeping ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Takes a finished or cancelled request out of the queue or its slot (the slot is free
        from now on; whatever the device still computes for it is ignored, and the next request
        there resets it). The group's other choices that were not yet copied from it go on as a
        group of their own, the first of them prefilling the prompt."""
        slot = self.slot_of.pop(request.id, None)
        if slot is not None:
            self._release(slot)
            self.slots[slot] = None
            self.prefilled[slot] = None
            self.awaiting.discard(slot)
            for copies in self.copies_of.values():
                if slot in copies:
                    copies.remove(slot)
            waiting = [self.slots[c] for c in self.copies_of.pop(slot, ())]
            for c in waiting:  # its copies, not yet copied: queued again as a group of their own
                self.remove(c)
            if waiting:
                waiting[0].copies = tuple(waiting[1:])
                self.waiting.appendleft(waiting[0])
        elif request in self.waiting:
            at = self.waiting.index(request)
            del self.waiting[at]
            copies = [c for c in request.copies if not c.finished]
            if copies:  # the rest of its group keeps its place
                copies[0].copies = tuple(copies[1:])
                self.waiting.insert(at, copies[0])

    def flush(self, index) -> None:
        """Replaces the prefix index by `index` (empty): the old one's checkpoints are forgotten,
        and the requests prefilling now write none into the new one."""
        self.prefix, self.node = index, [None] * self.num_slots

    def _release(self, slot: int) -> None:
        if self.node[slot] is not None:
            self.prefix.unpin(self.node[slot])
            self.node[slot] = None

    def finished(self, request: Request, output: list[int]) -> list[tuple[int, int, int]]:
        """A checkpoint of a request the device finished (before `remove`): its slot's state holds
        prompt + output[:-1], and output[-1] is the slot's last token, so the checkpoint at
        n = len(prompt + output) - 1, keyed on prompt + output, lets a next turn that resends them
        hit. Its page and those of missing grid nodes above it (page-only: the slot's state at
        them is gone) come from the slot's rows. Returns (slot, entry, first row of its page) of
        each entry for the runner to write, the checkpoint's last (none: no cache, no room, or
        already there)."""
        slot = self.slot_of.get(request.id)
        if self.prefix is None or slot is None or not output:
            return []
        tokens = list(request.prompt_ids) + list(output)
        n, i = len(tokens) - 1, self.prefix.interval
        made = self.prefix.insert_chain(self.prefix.grid_node(tokens, n - 1), tokens, n)
        return [(slot, node.entry, (node.n - 1) // i * i) for node in made or ()]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.slot_of)

    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self.slot_of)

    def decoding(self) -> list[Request | None]:
        """Per slot, the request it decodes for (None: idle or still prefilling)."""
        return [r if r is not None and self.prefilled[b] is None and b not in self.awaiting else None
                for b, r in enumerate(self.slots)]

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.slot_of)

    # -- planning ------------------------------------------------------------------------------

    def chunk_width(self, rows: int) -> int:
        """This iteration's chunk width, from the slots decoding before it and the `rows` prompts it
        prefills (a prompt that ends in this chunk decodes in this iteration already, under the
        width chosen without it; in a mixed iteration, from the next one)."""
        if self.sizer is None:
            return self.chunk
        decoding = sum(r is not None for r in self.decoding())
        return self.sizer(decoding * self.decode_width, rows, self.mixed and rows == 1 and decoding > 0)

    def _fitted(self, c: int, chunked: list[int]) -> int:
        """Width c, or the narrowest of the sizer's widths that holds what the chunked prompts
        have left (up to their next checkpoint) when that is narrower: a prompt's last chunk runs
        no padding rows through the layers, whose experts would take them as tokens."""
        widths = getattr(self.sizer, "candidates", ())
        rest = max(self._take(b, c) for b in chunked)
        return min([c] + [w for w in widths if w >= rest])

    def _take(self, slot: int, c: int) -> int:
        """The tokens a chunk of width c prefills into the slot: up to its prompt's end and, with
        the prefix cache, its next grid point."""
        done = self.prefilled[slot]
        n = min(c, len(self.slots[slot].prompt_ids) - done)
        if self.prefix is not None:  # no chunk crosses a grid point
            n = min(n, (done // self.prefix.interval + 1) * self.prefix.interval - done)
        return n

    def _chunked(self) -> list[int]:
        """The prefilling slots the next chunk goes on with: all of them, or with `mixed` beside
        decoding slots the one with the fewest prompt tokens left (the module's docstring)."""
        prefilling = [b for b, done in enumerate(self.prefilled) if done is not None]
        if self.mixed and len(prefilling) > 1 and any(self.decoding()):
            return [min(prefilling, key=lambda b: len(self.slots[b].prompt_ids) - self.prefilled[b])]
        return prefilling

    def next_chunk(self) -> PrefillChunk | None:
        """Admits waiting requests into free slots, then the next chunk of the prefilling slots
        (`_chunked`)."""
        b = self.num_slots
        start = np.zeros(b, np.int32)
        free = [slot for slot in range(b) if self.slots[slot] is None]
        restores, lookups = [], []
        while self.waiting:
            if self.mixed and any(p is not None for p in self.prefilled) and any(self.decoding()):
                break  # one prompt at a time beside the decoding slots (the module's docstring)
            r = self.waiting[0]
            copies = [c for c in r.copies if not c.finished]  # a copy aborted while queued takes no slot
            if 1 + len(copies) > len(free):
                break
            self.waiting.popleft()
            slot, taken = free[0], free[1:1 + len(copies)]
            del free[:1 + len(copies)]
            self.slots[slot], self.prefilled[slot], self.slot_of[r.id] = r, 0, slot
            start[slot] = 1
            if self.prefix is not None:
                hit = self.prefix.match(r.prompt_ids)
                self.prefix.pin(hit)
                self.node[slot] = hit
                restores.append((slot, hit.path(), hit.n, r.prompt_ids))
                lookups.append((len(r.prompt_ids), hit.n))
                if hit.n:
                    self.prefilled[slot], start[slot] = hit.n, 2
                    if hit.n % self.prefix.interval:  # a leaf between grid points: the next
                        self.prefix.pin(hit.parent)  # checkpoint hangs from its grid parent
                        self.prefix.unpin(hit)
                        self.node[slot] = hit.parent
            for copy, at in zip(copies, taken):
                self.slots[at], self.slot_of[copy.id] = copy, at
                self.awaiting.add(at)
            if taken:
                self.copies_of[slot] = taken
        if all(p is None for p in self.prefilled):
            return None
        chunked = self._chunked()
        c = self._fitted(self.chunk_width(len(chunked)), chunked)
        p = PrefillChunk(start=start, tokens=np.zeros((b, c), np.int32), next_tokens=np.zeros((b, c), np.int32),
                         valid=np.zeros(b, np.int32), ends=np.zeros(b, bool), owners=[None] * b,
                         temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32),
                         top_p=np.ones(b, np.float32), seed=np.zeros(b, np.uint32), presence=np.zeros(b, np.float32),
                         frequency=np.zeros(b, np.float32), repetition=np.ones(b, np.float32),
                         max_new=np.zeros(b, np.int32),
                         eos=np.full(b, -1, np.int32), logprobs=np.zeros(b, bool),
                         restores=[x for x in restores if x[2]], lookups=lookups)
        for slot in chunked:
            done, r = self.prefilled[slot], self.slots[slot]
            prompt = r.prompt_ids
            n = self._take(slot, c)
            p.tokens[slot, :n] = prompt[done:done + n]
            # Each token's successor in the prompt (the NEXTN pairs); the last one's is sampled later.
            succ = prompt[done + 1:done + n + 1]
            p.next_tokens[slot, :len(succ)] = succ
            p.valid[slot] = n
            self.prefilled[slot] = done + n
            end = done + n
            if self.node[slot] is not None and end % self.prefix.interval == 0 and end < len(prompt):
                node, fresh = self.prefix.insert(self.node[slot], prompt, end)
                self.prefix.unpin(self.node[slot])
                self.node[slot] = node  # None (no room): this request writes no further checkpoint
                if node is not None:
                    self.prefix.pin(node)
                    if fresh:
                        p.saves.append((slot, node.entry, end - self.prefix.interval))
            if done + n == len(prompt):
                self._release(slot)
                p.ends[slot], p.owners[slot] = True, r
                self.prefilled[slot] = None  # decoding from the next step on
                for at in self.copies_of.pop(slot, ()):  # and so do its copies
                    self.awaiting.discard(at)
                    p.copies.append((slot, at))
                    p.owners[at] = self.slots[at]
                    self._parameters(p, at)
            if start[slot]:
                self._parameters(p, slot)
        return p

    def _parameters(self, p: PrefillChunk, slot: int) -> None:
        """The slot's request's sampling parameters into the chunk's [B] arrays."""
        s = self.slots[slot].sampling
        p.temperature[slot], p.top_k[slot], p.top_p[slot] = s.temperature, s.top_k, s.top_p
        p.seed[slot], p.max_new[slot] = s.seed, s.max_tokens
        p.presence[slot], p.frequency[slot], p.repetition[slot] = s.presence, s.frequency, s.repetition
        p.eos[slot] = -1 if s.ignore_eos or self.eos_id is None else self.eos_id
        p.logprobs[slot] = s.logprobs is not None

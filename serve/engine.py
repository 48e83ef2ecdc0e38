"""The engine thread: takes requests from the HTTP side, runs the scheduler's plan on the device,
and turns each step's tokens into text events for the requests.

One iteration: admit requests and dispatch the next prefill chunk (if any slot is prefilling);
dispatch the next decode step (if any slot is decoding), which returns the PREVIOUS step's tokens;
deliver those; then read the first tokens of the prompts this chunk completed. The host reads
results only after the next piece of device work is queued, so the device never idles on it.
With the mixed iteration on (`Runner.mixable`), a chunk of one prompt and the step of the other
decoding slots are one program instead of two; the prompt's slot decodes from the next iteration.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import traceback

from serve.iterations import IterationLog
from serve.metrics import Metrics
from serve.output import TextOutput
from serve.request import Delta, Failed, Finished, Request, TokenLogprob
from serve.runner import Runner, StepResult
from serve.scheduler import PrefillChunk, Scheduler
from serve.tokenizer import Tokenizer

log = logging.getLogger("serve.engine")

_ADD, _ABORT, _FLUSH = "add", "abort", "flush"


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, metrics: Metrics, *, chunk: int, eos_id: int | None,
                 stop_ids: set[int], sizer=None, iterations: IterationLog | None = None):
        """sizer: None (fixed chunk) or a moe.tiles.ChunkSizer whose candidates were compiled;
        iterations: where each step read back is logged (`serve.iterations`), closed at shutdown."""
        self.runner, self.tokenizer, self.metrics = runner, tokenizer, metrics
        self.iterations = iterations
        self.scheduler = Scheduler(runner.max_batch, chunk, eos_id, sizer=sizer, decode_width=runner.stepper.width,
                                   prefix=self._new_index(), mixed=runner.mixing)
        self.stop_ids = set(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.outputs: dict[int, TextOutput] = {}
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: str | None = None  # set when the device failed and could not be recovered
        self._stop = threading.Event()
        self._unread = None  # (chunk, what runner.read_first takes) of a chunk whose first tokens wait
        self._thread = threading.Thread(target=self._run, name="ling-engine", daemon=True)

    def _new_index(self):
        from serve.prefix_cache import PrefixIndex

        pool = self.runner.pool
        index = None if pool is None else PrefixIndex(pool.entries, pool.interval)
        if index is not None:
            self.metrics.prefix_entries.set(index.entries)
        return index

    # -- the HTTP side (any thread) ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put((None, None))  # wakes the idle wait
        self._thread.join(timeout=30)

    def submit(self, request: Request) -> None:
        """Queues a request, with its copies (`Request.copies`) when it has some."""
        self.inbox.put((_ADD, request))

    def abort(self, request: Request) -> None:
        """The client went away: free the request's slot (or queue place) at the next iteration."""
        self.inbox.put((_ABORT, request))

    def flush_prefix_cache(self) -> concurrent.futures.Future:
        """Empties the prefix cache at the next iteration; the future is done once it is."""
        done = concurrent.futures.Future()
        self.inbox.put((_FLUSH, done))
        return done

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": s.num_running, "waiting": s.num_waiting, "free_slots": s.free_slots,
                "max_batch": s.num_slots}

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iteration()
            except Exception as e:  # a device or engine failure: fail the requests in flight, keep serving
                log.error("engine iteration failed:\n%s", traceback.format_exc())
                self._fail_all(f"internal engine error: {type(e).__name__}: {e}")
                if self.iterations is not None:
                    self.iterations.forget()
                try:
                    self.runner.reset()
                    if self.scheduler.prefix is not None:
                        self.scheduler.flush(self._new_index())
                except Exception:
                    log.error("could not reset the device slots; the server stops generating:\n%s",
                              traceback.format_exc())
                    self.error = f"engine failed: {type(e).__name__}: {e}"
                    return
        self._fail_all("the server is shutting down")
        if self.iterations is not None:
            self.iterations.close()

    def _iteration(self) -> None:
        idle = not self.scheduler.has_work() and not self.runner.pending and self._unread is None
        self._read_inbox(block=idle)
        chunk, owners = self.scheduler.next_chunk(), self.scheduler.decoding()
        start = time.perf_counter()
        first, result = self.runner.iterate(chunk, owners)
        if self.iterations is not None:
            mixed = None if chunk is None else self.runner.mixable(chunk, owners)
            self.iterations.record(chunk, owners if mixed is None else mixed, mixed=mixed is not None,
                                   stepped=any(r is not None for r in owners), read=result is not None,
                                   host_s=time.perf_counter() - start)
        if chunk is not None and chunk.lookups:
            self.metrics.record_prefix(chunk.lookups, self.scheduler.prefix.used)
        # First tokens are read one iteration late, as the steps' tokens are: the read waits for
        # the chunk's program (in a mixed iteration, for the whole iteration), so reading them at
        # once would leave the device idle while the host ran its loop. They go out before the
        # step result read now, which may hold the same slots' next tokens (two programs: the
        # step beside a chunk already decodes the slots whose prompt that chunk ended). A chunk
        # that ends no prompt (and makes no copy) has nothing to read.
        if self._unread is not None:
            self._on_first_tokens(self._unread[0], *self.runner.read_first(self._unread[1]))
        self._unread = (chunk, first) if chunk is not None and any(r is not None for r in chunk.owners) else None
        if result is not None:
            self._on_step(result)
        self.metrics.waiting.set(self.scheduler.num_waiting)
        self.metrics.running.set(self.scheduler.num_running)

    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, request = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block and not self._stop.is_set():
                    continue
                return
            block = False
            if kind == _ADD:
                for r in (request, *request.copies):
                    self.outputs[r.id] = TextOutput(self.tokenizer, r, self.stop_ids)
                self.scheduler.add(request)
            elif kind == _ABORT and not request.finished and request.id in self.outputs:
                self._finish(request, "abort")
            elif kind == _FLUSH:
                self.scheduler.flush(self._new_index())
                self.metrics.prefix_used.set(0)
                request.set_result(None)

    def _on_step(self, result: StepResult) -> None:
        steps = tokens = 0
        for b, r in enumerate(result.owners):
            if r is None or r.finished:  # an idle slot, or output of a request already ended here
                continue
            new = result.tokens[b]
            ran = bool(new) if result.steps is None else int(result.steps[b])
            steps, tokens = steps + ran, tokens + len(new)
            self._deliver(r, new, device_done=bool(result.done[b]),
                          logprobs=None if result.logprobs is None else result.logprobs[b])
        self.metrics.record_steps(steps, tokens)

    def _on_first_tokens(self, chunk: PrefillChunk, first, logprobs) -> None:
        for b, r in enumerate(chunk.owners):
            if r is not None and not r.finished:
                if chunk.valid[b] > 0:  # prefilled here, not copied
                    self.metrics.prompt_tokens.inc(len(r.prompt_ids))
                self._deliver(r, [int(first[b])], device_done=False,
                              logprobs=None if logprobs is None else [logprobs[b]])

    def _deliver(self, r: Request, tokens: list[int], device_done: bool, logprobs=None) -> None:
        """logprobs: None, or per token (log-probabilities [1 + K], top ids [K]) from the device."""
        out = self.outputs[r.id]
        before = out.tokens
        used = out.add(tokens)
        if device_done and used == len(tokens) and self.scheduler.prefix is not None:
            # The device stopped the slot at the last of these tokens: its state is prompt +
            # output[:-1] (the host may have ended the request earlier, at a stop string).
            saved = self.scheduler.finished(r, out.ids)
            if saved:
                self.runner.save_finished(saved)
                self.metrics.prefix_used.set(self.scheduler.prefix.used)
        entries = None
        if r.sampling.logprobs is not None and logprobs is not None:
            n = r.sampling.logprobs
            entries = [TokenLogprob(t, float(lp[0]), tuple(zip(ids[:n].tolist(), lp[1:n + 1].tolist())))
                       for t, (lp, ids) in zip(tokens[:used], logprobs[:used])]
        if device_done:
            out.finish("length")  # no-op when the host already saw why (EOS is a stop id)
        if out.tokens > before:
            now = time.perf_counter()
            if r.first_token_time is None:
                r.first_token_time = now
                self.metrics.ttft.observe(now - r.arrival)
            else:
                self.metrics.itl.observe(now - r.last_token_time)
            r.last_token_time = now
            self.metrics.generation_tokens.inc(out.tokens - before)
        text = out.take()
        if text or out.tokens > before:
            r.send(Delta(text, out.tokens, entries))
        if out.reason is not None:
            self._finish(r, out.reason)

    def _finish(self, r: Request, reason: str) -> None:
        r.finished = True
        self.scheduler.remove(r)
        out = self.outputs.pop(r.id)
        self.metrics.requests.labels(reason).inc()
        if reason == "abort":
            return
        now = time.perf_counter()
        self.metrics.e2e.observe(now - r.arrival)
        if out.tokens > 1 and r.first_token_time is not None:
            self.metrics.tpot.observe((r.last_token_time - r.first_token_time) / (out.tokens - 1))
        r.send(Finished(reason, len(r.prompt_ids), out.tokens))

    def _fail_all(self, message: str) -> None:
        self._unread = None  # its requests fail below
        queued = list(self.scheduler.waiting)
        while True:  # requests still in the inbox
            try:
                kind, r = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == _ADD:
                queued.append(r)
            elif kind == _FLUSH:
                r.set_result(None)
        pending = [x for r in queued for x in (r, *r.copies)] + [r for r in self.scheduler.slots if r is not None]
        for r in pending:
            if not r.finished:
                r.finished = True
                self.scheduler.remove(r)
                self.outputs.pop(r.id, None)
                self.metrics.requests.labels("abort").inc()
                r.send(Failed(message))

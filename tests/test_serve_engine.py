"""The server's device loop without HTTP: the scheduler's chunked prefills interleaved with
speculative (or plain) decode steps, slots reused by queued requests, requests arriving mid-run — each greedy output
equals plain greedy decoding of the prompt alone (`spec.generate.generate_batch`), and a seeded sampled
request gives the same tokens alone and in company."""

import asyncio
import dataclasses
import json
from functools import partial

import numpy as np
import pytest

import ling
from serve.request import Request, Sampling
from serve.runner import Runner
from serve.scheduler import Scheduler
from spec.generate import generate_batch

SLOTS, CHUNK, STEPS, CONTEXT = 3, 16, 3, 160


@pytest.fixture(scope="module")
def model():
    return ling.load("ling-tiny", dtype="float32", seed=1)


def make_runner(model, steps, contexts=(), mixed=False, steps_per_call=1, buckets=None):
    r = Runner(model, max_batch=SLOTS, max_seq_len=CONTEXT, speculative_steps=steps, contexts=contexts, mixed=mixed,
               steps_per_call=steps_per_call, buckets=buckets)
    r.warmup_prefill(CHUNK)
    r.warmup_step()
    r.warmup_mixed(CHUNK)
    return r


@pytest.fixture(scope="module")
def runner(model):
    return make_runner(model, STEPS, buckets=(SLOTS,))  # one bucket: the mixed runner crosses their edges


@pytest.fixture(scope="module")
def mixed_runner(model):
    return make_runner(model, STEPS, mixed=True)


def counting_mixed(runner, monkeypatch) -> tuple[list, list]:
    """Counts the runner's mixed iterations, and the iterations that ran a chunk and a step of
    slots decoding before it as two programs (two lists that grow by one each)."""
    mixes, apart, mixed, iterate = [], [], runner.mixed, runner.iterate

    def counted_iterate(chunk, owners):
        if chunk is not None:
            busy = (np.asarray(chunk.start) > 0) | (np.asarray(chunk.valid) > 0)  # the chunk's own slots
            others = any(r is not None and not busy[b] for b, r in enumerate(owners))
            if others and runner.mixable(chunk, owners) is None:
                apart.append(1)
        return iterate(chunk, owners)

    monkeypatch.setattr(runner, "mixed", lambda chunk, owners: mixes.append(1) or mixed(chunk, owners))
    monkeypatch.setattr(runner, "iterate", counted_iterate)
    return mixes, apart


def serve(runner, requests, arrivals, check=None):
    """Runs the engine's iteration (admit + chunk, step, deliver one step late) until every request
    has max_tokens tokens; request i joins at iteration arrivals[i]; check(sched) after each
    iteration. Returns the token lists (a group's copies after their request)."""
    sched = Scheduler(SLOTS, CHUNK, eos_id=None, mixed=runner.mixing)  # as `serve.engine.Engine` builds it
    everyone = [x for r in requests for x in (r, *r.copies)]
    out = {r.id: [] for r in everyone}

    def take(r, tokens):
        if r is not None and not r.finished:
            out[r.id] += tokens
            if len(out[r.id]) >= r.sampling.max_tokens:
                r.finished = True
                sched.remove(r)

    for it in range(10_000):
        for r, at in zip(requests, arrivals):
            if at == it:
                sched.add(r)
        chunk = sched.next_chunk()
        first, result = runner.iterate(chunk, sched.decoding())
        if result is not None:
            for b, r in enumerate(result.owners):
                take(r, result.tokens[b])
        if chunk is not None:
            first, _ = runner.read_first(first)
            for b, r in enumerate(chunk.owners):
                take(r, [int(first[b])])
        if check is not None:
            check(sched)
        if all(r.finished for r in everyone) and not runner.pending:
            break
    return [out[r.id][: r.sampling.max_tokens] for r in everyone]


@pytest.mark.parametrize("speculative,mixed", [(True, False), (False, False), (True, True), (False, True)])
def test_interleaved_serving_equals_plain_greedy(model, runner, mixed_runner, speculative, mixed, monkeypatch):
    """Also with the mixed iteration: a chunk of one prompt and the other slots' step as one
    program (one MoE call over both kinds of tokens) gives the same outputs, and with it no
    iteration runs a chunk beside decoding slots as two programs (prompts that arrive while
    another prefills wait for its last chunk)."""
    if speculative:
        runner = mixed_runner if mixed else runner
    else:  # plain: models without a NEXTN layer
        runner = make_runner(model, 0, mixed=mixed, buckets=(SLOTS,))
    mixes, apart = counting_mixed(runner, monkeypatch)
    rng = np.random.default_rng(0)
    lengths, max_new = (40, 7, 50, 23, 33, 3), (30, 24, 12, 30, 20, 25)
    prompts = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in lengths]
    reference = generate_batch(model, prompts, max(max_new), speculative=False, prefill_chunk=CHUNK)
    requests = [Request(p, Sampling(max_tokens=n, temperature=0.0)) for p, n in zip(prompts, max_new)]
    got = serve(runner, requests, arrivals=(0, 0, 2, 3, 9, 10))  # 6 requests, 3 slots: queueing and reuse
    assert got == [ref[:n] for ref, n in zip(reference, max_new)]
    assert (len(mixes) >= 5 and not apart) if mixed else (not mixes and apart)


def test_mixed_iterations_compile_nothing_after_warm_up(model, mixed_runner):
    """Every mixed program a run needs (each step bucket, both sampling variants) was compiled by
    `warmup_mixed`, greedy and sampled requests arriving while others decode."""
    compiled = mixed_runner.stepper._step._cache_size()
    rng = np.random.default_rng(6)
    requests = [Request(rng.integers(2, model.cfg.vocab_size, n).tolist(),
                        Sampling(max_tokens=12, temperature=t, seed=n)) for n, t in ((5, 0.0), (40, 0.7), (30, 0.0))]
    serve(mixed_runner, requests, arrivals=(0, 1, 3))
    assert mixed_runner.stepper._step._cache_size() == compiled


def record_step_calls(runner):
    """Wraps the stepper's step program so that every call's positional arguments are kept;
    returns the program and the list they go to."""
    real, calls = runner.stepper._step, []

    def recording(*args):
        calls.append(args)
        return real(*args)

    runner.stepper._step = recording
    return real, calls


def bound_holds_device(runner, sched):
    """The runner's bound on each busy slot's positions is never below the device's lengths."""
    device = np.asarray(runner.stepper.slots.model.lengths)
    busy = [b for b, r in enumerate(sched.slots) if r is not None]
    assert np.all(runner._length[busy] >= device[busy]), (runner._length, device)


@pytest.mark.parametrize("speculative", [True, False])
def test_context_buckets_and_calls_of_several_steps_change_no_output(model, speculative):
    """With cache lengths 32 and 64 compiled beside the whole 160 (+ width), the calls run the
    shortest that holds their slots as the requests grow across both edges; speculative, a call
    runs 4 steps while no prompt is prefilling (`Runner(steps_per_call=4)`). The outputs are plain
    greedy's, calls of 4 steps did run, the runner's bound on each busy slot's positions never
    falls below the device's, and every program they run was compiled by the warm-up. (One batch
    bucket: `test_buckets` crosses their edges.)"""
    steps_per_call = 4 if speculative else 1
    runner = make_runner(model, STEPS if speculative else 0, contexts=(32, 64), steps_per_call=steps_per_call,
                         buckets=(SLOTS,))
    compiled = runner.stepper._step._cache_size(), runner.prefiller._call._cache_size()
    assert runner.stepper.contexts == runner.prefiller.contexts == (32, 64)  # the reference attention
    rng = np.random.default_rng(5)
    lengths, max_new = (20, 7, 50, 23, 90), (30, 40, 12, 50, 20)
    prompts = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in lengths]
    reference = generate_batch(model, prompts, max(max_new), speculative=False, prefill_chunk=CHUNK)
    requests = [Request(p, Sampling(max_tokens=n, temperature=0.0)) for p, n in zip(prompts, max_new)]
    real, calls = record_step_calls(runner)
    got = serve(runner, requests, arrivals=(0, 0, 1, 4, 6), check=partial(bound_holds_device, runner))
    assert got == [ref[:n] for ref, n in zip(reference, max_new)]
    assert {args[7] for args in calls} == {32, 64, None}  # the context
    steps = [args[9] for args in calls]
    assert set(steps) == {1, steps_per_call} and steps.count(steps_per_call) >= 5
    assert (real._cache_size(), runner.prefiller._call._cache_size()) == compiled


@pytest.mark.parametrize("mixed", [False, True])
def test_seeded_sampling_does_not_depend_on_company(model, runner, mixed_runner, mixed):
    runner = mixed_runner if mixed else runner
    rng = np.random.default_rng(1)
    prompt = rng.integers(2, model.cfg.vocab_size, 37).tolist()
    sampled = lambda: Request(prompt, Sampling(max_tokens=25, temperature=0.8, top_p=0.9, seed=11))
    (alone,) = serve(runner, [sampled()], arrivals=(0,))
    others = [Request(rng.integers(2, model.cfg.vocab_size, n).tolist(), Sampling(max_tokens=20, temperature=1.0,
                                                                                   seed=n)) for n in (45, 9)]
    together = serve(runner, [others[0], sampled(), others[1]], arrivals=(0, 1, 1))
    assert together[1] == alone


def group(prompt, sampling, seeds):
    """A request of len(seeds) choices, choice i sampled with seeds[i]."""
    first, *rest = [Request(prompt, dataclasses.replace(sampling, seed=s), choice=i) for i, s in enumerate(seeds)]
    first.copies = tuple(rest)
    return first


def test_n_choices_prefill_once_and_equal_separate_requests(model, runner, monkeypatch):
    """A request of 3 choices prefills its prompt once (3 chunks); each choice's tokens equal
    those of a separate request with its seed (penalties on: the copies' token counts start
    afresh), queued behind a running request so that the group waits for its 3 slots."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(2, model.cfg.vocab_size, 2 * CHUNK + 5).tolist()
    sampling = Sampling(max_tokens=20, temperature=0.9, top_p=0.95, presence=0.4, frequency=0.2)
    seeds = (21, 22, 23)
    alone = [serve(runner, [Request(prompt, dataclasses.replace(sampling, seed=s))], arrivals=(0,))[0]
             for s in seeds]
    assert len({tuple(a) for a in alone}) == 3  # the seeds matter

    prefilled = []
    real = runner.prefiller.__call__
    monkeypatch.setattr(runner, "prefiller", lambda slots, **kw: prefilled.append(np.asarray(kw["valid"]).sum())
                        or real(slots, **kw))
    busy = Request(rng.integers(2, model.cfg.vocab_size, 5).tolist(), Sampling(max_tokens=6, temperature=0.0))
    got = serve(runner, [busy, group(prompt, sampling, seeds)], arrivals=(0, 1))
    assert got[1:] == alone
    assert sum(prefilled) == len(busy.prompt_ids) + len(prompt)


def test_a_copied_slot_equals_its_source_leaf_by_leaf(model, runner):
    """With the source's own seed, the copy redraws the source's first token: every leaf of the
    copied slots equals the source's, the model state (KDA, MLA, NEXTN caches, lengths), the
    token counts and the log-probability buffers included."""
    import jax

    rng = np.random.default_rng(4)
    prompt = rng.integers(2, model.cfg.vocab_size, CHUNK + 9).tolist()
    g = group(prompt, Sampling(max_tokens=8, temperature=1.0, logprobs=2), (5, 5, 5))
    sched = Scheduler(SLOTS, CHUNK, eos_id=None)
    sched.add(g)
    while True:
        chunk = sched.next_chunk()
        first, _ = runner.read_first(runner.prefill(chunk))
        if chunk.copies:
            break
    src = sched.slot_of[g.id]
    assert sorted(d for _, d in chunk.copies) == sorted(sched.slot_of[c.id] for c in g.copies)
    assert len(set(first.tolist())) == 1
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.stepper.slots)[0]:
        leaf = np.asarray(leaf)
        for _, d in chunk.copies:
            np.testing.assert_array_equal(leaf[d], leaf[src], err_msg=jax.tree_util.keystr(path))


def test_a_paused_prefill_keeps_its_nextn_cache(model, runner):
    """Speculative steps of other slots run between a prompt's chunks and rewrite the paused slot's
    NEXTN entry at its last prefilled position: with the true pair (prefill_step's job), so the
    cache below the prompt's end equals that of one uninterrupted prefill."""
    from spec.step import new_slots
    from spec.generate import prefill
    from spec.sampling import SamplingParams

    rng = np.random.default_rng(2)
    prompt = rng.integers(2, model.cfg.vocab_size, 3 * CHUNK + 5).tolist()
    busy = Request(rng.integers(2, model.cfg.vocab_size, 5).tolist(), Sampling(max_tokens=60, temperature=0.0))
    target = Request(prompt, Sampling(max_tokens=2, temperature=0.0))
    serve(runner, [busy, target], arrivals=(0, 1))  # slot 0 decodes while slot 1 prefills 4 chunks
    got = np.asarray(runner.stepper.slots.model.nextn.latent[1, : len(prompt) - 1])
    ref = prefill(model, new_slots(model, 1, CONTEXT + STEPS + 1, CONTEXT), [prompt], [True], SamplingParams.make(1),
                  [1], [-1], chunk=CHUNK)
    np.testing.assert_allclose(got, np.asarray(ref.model.nextn.latent[0, : len(prompt) - 1]), rtol=1e-4, atol=1e-5)


def make_engine(runner, iterations=None):
    from serve.engine import Engine
    from serve.metrics import Metrics
    from serve.run import DEFAULT_MODEL
    from serve.tokenizer import Tokenizer

    return Engine(runner, Tokenizer(DEFAULT_MODEL), Metrics("test"), chunk=CHUNK, eos_id=None, stop_ids=set(),
                  iterations=iterations)


async def serve_one(engine, prompt, sampling: Sampling, delay: float = 0.0):
    """Submits a request (after `delay` seconds) and returns its last event (Finished or Failed)."""
    from serve.request import Failed, Finished

    await asyncio.sleep(delay)
    r = Request(prompt, sampling, loop=asyncio.get_running_loop())
    engine.submit(r)
    while not isinstance(ev := (await asyncio.wait_for(r.events.get(), 300))[1], (Finished, Failed)):
        pass
    return ev


def test_engine_fails_the_requests_of_a_failed_step_and_keeps_serving(runner, monkeypatch, tmp_path):
    from serve.iterations import IterationLog
    from serve.request import Failed, Finished

    while runner.pending:  # a step an earlier test's engine left unread
        runner.drain()
    engine = make_engine(runner, IterationLog(str(tmp_path / "iterations.jsonl")))
    real_step, calls = runner.step, []

    def failing_once(owners, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected device failure")
        return real_step(owners, **kwargs)

    monkeypatch.setattr(runner, "step", failing_once)

    async def requests():
        engine.start()
        try:
            sampling = Sampling(max_tokens=10, temperature=0.0)
            return await serve_one(engine, [5, 6, 7], sampling), await serve_one(engine, [5, 6, 7], sampling)
        finally:
            engine.shutdown()

    failed, served = asyncio.run(requests())
    assert isinstance(failed, Failed) and "injected device failure" in failed.message
    assert isinstance(served, Finished) and served.completion_tokens == 10 and engine.error is None
    assert engine.stats()["free_slots"] == SLOTS
    # the log waits for the steps the runner waits for: the one lost in the failure was forgotten
    assert len(engine.iterations._pending) == len(runner._owners)


def test_a_group_removed_mid_prefill_or_queued_leaves_no_slot_taken():
    """Scheduler bookkeeping of an n-choice request: its source removed mid-prefill puts the
    choices not yet copied back at the head of the queue as a group of their own (the first
    prefilling again), and removing everything, queued or running, frees every slot."""
    sched = Scheduler(SLOTS, CHUNK, eos_id=None)
    g = group(list(range(2, 2 + 2 * CHUNK + 3)), Sampling(max_tokens=4, temperature=0.5), (1, 2, 3))
    sched.add(g)
    assert sched.next_chunk() is not None and sched.free_slots == 0 and sched.decoding() == [None] * SLOTS
    g.finished = True
    sched.remove(g)  # mid-prefill: its two copies were never copied
    assert sched.free_slots == SLOTS and sched.num_waiting == 1
    head = sched.waiting[0]
    assert head is g.copies[0] and head.copies == (g.copies[1],)
    chunk = sched.next_chunk()  # the rest of the group, admitted again: prefilled from its first token
    assert chunk.valid.sum() == CHUNK and sched.free_slots == SLOTS - 2
    for r in g.copies:
        r.finished = True
        sched.remove(r)
    assert sched.free_slots == SLOTS and not sched.has_work() and not sched.copies_of and not sched.awaiting

    queued = group([5, 6, 7], Sampling(max_tokens=4), (1, 2))
    busy = [Request([5], Sampling(max_tokens=4)) for _ in range(SLOTS)]
    for r in busy + [queued]:
        sched.add(r)
    sched.next_chunk()
    assert sched.num_waiting == 1  # no two slots free
    queued.copies[0].finished = queued.finished = True  # the API aborts every choice
    sched.remove(queued.copies[0])
    sched.remove(queued)
    for r in busy:
        sched.remove(r)
    assert sched.free_slots == SLOTS and not sched.has_work()


@pytest.mark.parametrize("mixed", [False, True])
def test_engine_reads_a_chunks_first_tokens_only_where_a_prompt_ends(runner, mixed_runner, monkeypatch, mixed):
    """Reading a chunk's first tokens waits for the chunk's program (in a mixed iteration, for the
    whole iteration): the engine reads them only after a chunk that ends a prompt, so the host
    runs ahead of the device through a long prompt's other chunks, and every request is served."""
    from serve.request import Finished

    runner = mixed_runner if mixed else runner
    engine = make_engine(runner)
    reads, read_first = [], runner.read_first
    monkeypatch.setattr(runner, "read_first", lambda first: reads.append(1) or read_first(first))
    prompts = [[5, 6, 7], list(range(3, 3 + 5 * CHUNK + 2))]  # the second prefills in 6 chunks

    async def requests():
        engine.start()
        try:
            sampling = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
            return await asyncio.gather(serve_one(engine, prompts[0], sampling),
                                        serve_one(engine, prompts[1], sampling, 0.05))
        finally:
            engine.shutdown()

    done = asyncio.run(requests())
    assert all(isinstance(ev, Finished) and ev.completion_tokens == 24 for ev in done), done
    assert len(reads) == len(prompts)  # one read a prompt: at its last chunk


@pytest.mark.parametrize("mixed", [False, True])
def test_the_iteration_log_says_what_ran_beside_each_step(runner, mixed_runner, monkeypatch, mixed, tmp_path):
    """`--iteration-log`: a line per step read back. Two prompts admitted together share the first
    chunk; the long one's 5 other chunks then run beside the short one's steps, each logged with
    that step (one program in a mixed iteration), the last as ending a prompt; `summary` groups
    the lines by what ran in them."""
    from serve.iterations import IterationLog, summary
    from serve.request import Failed, Finished

    runner = mixed_runner if mixed else runner
    while runner.pending:  # a step an earlier test's engine left unread: not this engine's to log
        runner.drain()
    path = str(tmp_path / "iterations.jsonl")
    engine = make_engine(runner, IterationLog(path, decode_width=runner.stepper.width))
    results, result = [], runner._result
    monkeypatch.setattr(runner, "_result", lambda report: results.append(report is not None) or result(report))
    long = list(range(3, 3 + 5 * CHUNK + 2))

    async def requests():
        loop = asyncio.get_running_loop()
        rs = [Request(p, Sampling(max_tokens=n, temperature=0.0, ignore_eos=True), loop=loop)
              for p, n in (([5, 6, 7], 40), (long, 4))]
        for r in rs:  # both in the inbox before the engine's first iteration: one chunk admits both
            engine.submit(r)
        engine.start()
        try:
            for r in rs:
                while not isinstance((await asyncio.wait_for(r.events.get(), 300))[1], (Finished, Failed)):
                    pass
        finally:
            engine.shutdown()

    asyncio.run(requests())
    lines = [json.loads(x) for x in open(path)]
    assert len(lines) == sum(results) and all(x["decoding"] >= 1 for x in lines)
    beside = [x for x in lines if x["prompts"] == 1]  # the long prompt's chunks after the first
    assert [x["chunk"] for x in beside] == [CHUNK] * 4 + [2] and [x["ended"] for x in beside] == [0] * 4 + [1]
    assert all(x["mixed"] == mixed and x["width"] == CHUNK for x in beside)
    assert lines[0]["gap_ms"] is None and all(x["gap_ms"] >= 0 and x["predicted_ms"] is None for x in lines[1:])
    assert all(x["gc_ms"] >= 0 and x["gc_full"] >= 0 for x in lines)
    over = summary(path, over_ms=-1.0)["over"]
    assert sum(g["count"] for g in over.values()) == len(lines) - 1
    assert over[("mixed" if mixed else "step + chunk") + ", ending a prompt"]["count"] == 1


def test_the_iteration_log_predicts_each_iteration_by_the_tile_model(tmp_path):
    """With a chunk sizer, each line carries the tile model's iteration for the work logged: the
    step's decode tokens (slots x the step's width) and the chunk's prompts, width and prompt
    tokens (its padding takes no routed expert), in one program or two."""
    from moe.tiles import ChunkSizer, TileModel, predicted_iteration_us
    from serve.iterations import IterationLog

    model = TileModel.load("bench/tile_model_h100_int4_grouped.json")
    sizer = ChunkSizer(model, budget_us=33e3, candidates=(64, 256), rows=4, layers=14)
    path = str(tmp_path / "iterations.jsonl")
    log = IterationLog(path, sizer, decode_width=STEPS + 1)
    chunk = dataclasses.make_dataclass("Chunk", ["valid", "tokens", "ends"])(
        np.array([0, 200, 0, 0]), np.zeros((4, 256), np.int32), np.array([False, True, False, False]))
    owners = ["a", None, "b", "c"]
    log.record(chunk, owners, mixed=True, stepped=True, read=False, host_s=0.0)
    log.record(None, owners, mixed=False, stepped=True, read=True, host_s=0.0)
    log.record(None, owners, mixed=False, stepped=False, read=True, host_s=0.0)
    log.close()
    lines = [json.loads(x) for x in open(path)]
    want = [predicted_iteration_us(model, 256, rows=1, layers=14, decode_tokens=3 * (STEPS + 1), mixed=True,
                                   real_tokens=200),
            predicted_iteration_us(model, 0, rows=1, layers=14, decode_tokens=3 * (STEPS + 1))]
    assert [x["predicted_ms"] for x in lines] == [round(w / 1e3, 3) for w in want]
    assert lines[0]["chunk"] == 200 and lines[0]["ended"] == 1 and lines[0]["mixed"] and not lines[1]["chunk"]


def test_the_iteration_log_times_the_garbage_collections_between_reads(tmp_path):
    """A full collection between two reads is in the second line (gc_ms, gc_full), and only
    there; closing the log stops its timing; `serve.run.freeze_heap` moves the objects alive to
    the permanent generation."""
    import gc

    from serve.iterations import IterationLog, summary
    from serve.run import freeze_heap

    path = str(tmp_path / "iterations.jsonl")
    log = IterationLog(path, decode_width=1)
    owners = ["a", None]
    gc.disable()  # no collection but the test's own
    try:
        log.record(None, owners, mixed=False, stepped=True, read=False, host_s=0.0)
        log.record(None, owners, mixed=False, stepped=True, read=True, host_s=0.0)
        gc.collect()
        log.record(None, owners, mixed=False, stepped=False, read=True, host_s=0.0)
    finally:
        gc.enable()
    log.close()
    assert log._on_gc not in gc.callbacks
    first, second = [json.loads(x) for x in open(path)]
    assert second["gc_full"] >= 1 and second["gc_ms"] > 0 and first["gc_full"] == 0
    assert summary(path, over_ms=-1.0)["full_gc"] >= 1
    try:
        assert freeze_heap() > 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_tile_model_refits_to_a_logs_mixed_iterations(tmp_path, capsys):
    """`python -m serve.iterations LOG --refit MODEL --out NEW`: mixed iterations whose gaps are a
    known line outside the model's own MoE launches give that line back (two widths; a prompt's
    last chunk, mostly padding, counts its padding in the line and its prompt tokens alone in the
    MoE); lines without a chunk or in two programs do not count; a log without the MoE layers, and
    a file that is not a log, are refused with the reason."""
    from moe.tiles import TileModel, predicted_iteration_us
    from serve.iterations import main

    model = TileModel.load("bench/tile_model_h100_int4_grouped.json")
    fitted_like = dataclasses.replace(model, step_overhead_us=16_000.0, chunk_us_per_token=20.0)
    path, out = tmp_path / "iterations.jsonl", tmp_path / "fitted.json"
    lines = []
    for decoding, prompts, width, mixed, real in [(16, 1, 128, True, 128), (16, 1, 256, True, 256),
                                                  (17, 1, 256, True, 40), (16, 2, 128, True, 256),
                                                  (16, 0, 0, False, 0), (16, 1, 256, False, 256)]:
        us = predicted_iteration_us(fitted_like, width, rows=max(prompts, 1), layers=14, decode_tokens=decoding * 6,
                                    mixed=mixed, real_tokens=real if prompts else None)
        if not mixed and width:
            us += 9e3  # two programs: not what the mixed line is fitted to
        lines.append(dict(decoding=decoding, decode_tokens=decoding * 6, chunk=real, width=width,
                          prompts=prompts, ended=0, mixed=mixed and width > 0, predicted_ms=None, moe_layers=14,
                          t=0.0, gap_ms=us / 1e3, host_ms=1.0))
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    main([str(path), "--refit", "bench/tile_model_h100_int4_grouped.json", "--out", str(out)])
    fitted = TileModel.load(str(out))
    assert fitted.step_overhead_us == pytest.approx(16_000.0) and fitted.chunk_us_per_token == pytest.approx(20.0)
    assert fitted.moe == model.moe and fitted.info["step_overhead"]["iterations"] == 4
    assert fitted.info["step_overhead"]["held_out_mean_rel_err"] == pytest.approx(0.0, abs=1e-9)  # the 4th point
    assert "4 mixed iterations" in capsys.readouterr().out
    for x in lines:
        del x["moe_layers"]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(SystemExit, match="do not name the MoE layers"):
        main([str(path), "--refit", "bench/tile_model_h100_int4_grouped.json", "--out", str(out)])
    with pytest.raises(SystemExit):
        main([str(path)])  # neither --over-ms nor --refit
    path.write_text('{"t": 1.0}\n')
    with pytest.raises(SystemExit, match="not an iteration log"):
        main([str(path), "--refit", "bench/tile_model_h100_int4_grouped.json", "--out", str(out)])

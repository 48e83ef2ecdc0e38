"""Batch buckets (`spec.stepper.Stepper`): a step over the live slots runs the smallest compiled
batch that holds them, their slots stepped where they are. Outputs are those of plain
greedy decoding whatever the bucket, as the live set grows and shrinks across bucket edges; a slot
left out is untouched; an idle slot adds no (token, expert) pair to the step."""

import numpy as np
import pytest

import ling
from spec.generate import generate_batch, prefill
from spec.sampling import SamplingParams
from spec.step import new_slots
from serve.run import parse_args
from spec.stepper import Stepper, batch_buckets, context_buckets, pick_context

S, NEW = 3, 24


@pytest.fixture(scope="module")
def model():
    return ling.load("ling-tiny", dtype="float32", seed=2, progress=False)


def test_bucket_ladder():
    assert batch_buckets(1) == (1,) and batch_buckets(5) == (1, 2, 4, 5) and batch_buckets(16) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("speculative", [True, False])
def test_outputs_equal_plain_greedy_as_the_live_set_crosses_bucket_edges(model, speculative):
    rng = np.random.default_rng(0)
    p = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in (9, 17, 12, 30, 5)]
    b, width = len(p), S + 1 if speculative else 1
    reference = generate_batch(model, p, NEW, speculative=False)
    slots = new_slots(model, b, 30 + NEW + width + 1, NEW + width)
    slots = prefill(model, slots, p, np.ones(b, bool), SamplingParams.make(b), np.full(b, NEW), np.full(b, -1))
    stepper = Stepper(model, slots, speculative=speculative, num_steps=S, buckets=batch_buckets(b))
    assert stepper.buckets == (1, 2, 4, 5)
    out = [[int(t)] for t in np.asarray(slots.out[:, 0])]
    # Live sets of 1, 3, 5, 2, 4 and 0..5 slots in turn: buckets 1, 4, 5, 2, 4, ...
    schedule = [[0], [1, 2, 4], [0, 1, 2, 3, 4], [3, 1], [4, 0, 2, 3]]
    seen = set()
    for i in range(400):
        live = np.zeros(b, bool)
        live[schedule[i % len(schedule)]] = True
        live &= np.array([len(o) < NEW for o in out])
        if not live.any():
            live = np.array([len(o) < NEW for o in out])
            if not live.any():
                break
        seen.add(len(stepper.rows(live)) if stepper.rows(live) is not None else b)
        report = stepper.step(live=live)
        if report is not None:
            for j, tokens in enumerate(report[0]):
                out[j] += tokens
    tokens = stepper.drain().tokens
    for j in range(b):
        out[j] += tokens[j]
    assert seen == {1, 2, 4, 5}
    assert [o[:NEW] for o in out] == reference


def test_a_slot_left_out_is_untouched_and_idle_slots_add_no_expert_pairs(model, monkeypatch):
    import jax
    import jax.numpy as jnp

    import moe.block

    b = 4
    slots = new_slots(model, b, 64, 16)
    slots = prefill(model, slots, [[5, 6, 7]] * b, np.ones(b, bool), SamplingParams.make(b), np.full(b, 16),
                    np.full(b, -1))
    stepper = Stepper(model, slots, speculative=True, num_steps=S, buckets=(1, 2))
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(stepper.slots)]  # the step donates them
    pairs = []
    routed = moe.block.routed_experts

    def counting(x, topk_ids, *args, **kwargs):
        pairs.append(topk_ids.shape)
        return routed(x, topk_ids, *args, **kwargs)

    monkeypatch.setattr(moe.block, "routed_experts", counting)
    stepper.step(live=np.array([False, False, True, False]))  # traced now: bucket 1
    stepper.drain()
    after = jax.tree_util.tree_leaves(stepper.slots)
    for x, y in zip(before, after):  # rows 0, 1, 3 keep every value; row 2 moved on
        keep = np.array([0, 1, 3])
        np.testing.assert_array_equal(x[keep], np.asarray(y)[keep])
    assert int(stepper.slots.n_out[2]) > 1 and jnp.all(stepper.slots.n_out[jnp.array([0, 1, 3])] == 1)
    k = model.cfg.num_experts_per_tok
    assert pairs and all(shape[0] * shape[1] <= (S + 1) * k for shape in pairs), pairs  # one slot's tokens only


def test_server_defaults_by_platform_and_bucket_flags():
    from serve.run import StartupError, platform_defaults

    args = parse_args([])
    assert platform_defaults(args, "cpu") == 1024 and (args.max_batch, args.prefill_chunk) == (4, 64)
    args = parse_args([])
    assert platform_defaults(args, "gpu") == 8192 and (args.max_batch, args.prefill_chunk) == (16, 256)
    args = parse_args(["--max-batch", "8", "--prefill-chunk", "128"])
    platform_defaults(args, "cpu")
    assert (args.max_batch, args.prefill_chunk) == (8, 128)
    with pytest.raises(StartupError, match="--batch-buckets 1,8"):
        platform_defaults(parse_args(["--batch-buckets", "1,8"]), "cpu")  # the CPU's 4 slots
    with pytest.raises(SystemExit):
        parse_args(["--batch-buckets", "1,x"])
    with pytest.raises(SystemExit):
        parse_args(["--batch-buckets", "4,32", "--max-batch", "16"])


def test_context_ladders_and_flag():
    from serve.run import context_ladder

    assert context_buckets(1030) == (256, 1024, 1030) and context_buckets(200) == (200,)
    # rungs at or past the cache's length are never picked: the whole cache runs in place
    assert [pick_context(n, (16, 64), 60) for n in (1, 16, 17, 60, None)] == [16, 16, None, None, None]
    auto = parse_args([])
    assert context_ladder(auto, "cpu", 1024) == () and context_ladder(auto, "cpu", 32768) == (4096, 16384)
    assert context_ladder(auto, "gpu", 8192) == (2048,) and context_ladder(auto, "gpu", 1024) == ()
    assert context_ladder(parse_args(["--context-buckets", "off"]), "cpu", 8192) == ()
    assert context_ladder(parse_args(["--context-buckets", "100,5000,50"]), "cpu", 1024) == (50, 100)
    for bad in ("1,x", "0,8"):
        with pytest.raises(SystemExit):
            parse_args(["--context-buckets", bad])


@pytest.mark.parametrize("speculative", [False, True])
def test_the_kernels_step_a_buckets_slots_within_the_whole_state(model, speculative):
    """Through the Pallas kernels (interpret mode), where the attention reads and writes the rows'
    slots of the whole state (`pallas_kernels.slot_rows`): two steps of slots 1 and 3 in bucket 2
    leave their state and tokens as the same steps over all four slots do, and slots 0 and 2
    exactly as they were."""
    import jax

    kernels = ling.use_kernels(model, "interpret")
    b, new = 4, 8
    p = [[3, 4, 5, 6], [7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]
    live = np.array([False, True, False, True])

    def two_steps(buckets):
        slots = new_slots(kernels, b, 32, new + S + 1)
        slots = prefill(kernels, slots, p, np.ones(b, bool), SamplingParams.make(b), np.full(b, new), np.full(b, -1))
        stepper = Stepper(kernels, slots, speculative=speculative, num_steps=S, buckets=buckets)
        before = [np.asarray(x) for x in jax.tree_util.tree_leaves(slots)]
        stepper.step(live=live)
        stepper.step(live=live)
        stepper.drain()
        return before, [np.asarray(x) for x in jax.tree_util.tree_leaves(stepper.slots)]

    before, bucketed = two_steps((2,))
    _, whole = two_steps(None)
    for x, y, z in zip(before, bucketed, whole):
        np.testing.assert_array_equal(y[[0, 2]], x[[0, 2]])
        np.testing.assert_allclose(y[[1, 3]].astype(np.float64), z[[1, 3]].astype(np.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tickets", [False, True])
def test_a_step_keeps_every_buffer_it_touches_in_place(model, tickets):
    """The step writes the slots, the emitted counts (and the ticket counters) and a bucket's rows
    where they are (donated and aliased), so its CUDA graph is replayed without an update: no
    argument of the step moves."""
    b = 4
    p = [[3, 4, 5, 6], [7, 8, 9]]
    slots = new_slots(model, b, 40, 16)
    slots = prefill(model, slots, p + p, np.ones(b, bool), SamplingParams.make(b), np.full(b, 12), np.full(b, -1))
    stepper = Stepper(model, slots, speculative=False, buckets=batch_buckets(b), tickets=tickets)
    where = lambda: [a.unsafe_buffer_pointer() for a in (*stepper._slots, *stepper._counts)  # noqa: E731
                     if a is not None and a.size] + [buf.unsafe_buffer_pointer() for buf in stepper._kept.buffers()]
    for live in ([True] * 4, [True, False, True, False], [False, True, True, False]):
        stepper.step(live=np.array(live))
        before = where()
        stepper.step(live=np.array(live))
        assert where() == before
    assert stepper.drain() is not None


def test_a_prefill_chunk_keeps_every_buffer_it_touches_in_place(model):
    """As the step: a prefill chunk's program reads its arguments from buffers kept per shape and
    writes the slots in place, so chunk after chunk no argument of it moves (its CUDA graph is
    replayed as recorded); its first tokens come from the report program."""
    from spec.stepper import ChunkPrefiller

    b, c = 4, 8
    stepper = Stepper(model, new_slots(model, b, 40, 16), speculative=False, buckets=batch_buckets(b))
    prefiller = ChunkPrefiller(model)
    rng = np.random.default_rng(0)

    def chunk(rows, ends):
        k = b if rows is None else len(rows)
        first = prefiller(stepper.slots, start=np.zeros(k, bool), params=SamplingParams.make(k, on_host=True),
                          max_new=np.full(k, 12), eos=np.full(k, -1), tokens=rng.integers(2, 50, (k, c)),
                          next_tokens=rng.integers(2, 50, (k, c)), valid=np.full(k, c), ends=np.asarray(ends),
                          sampling=False, rows=rows)
        stepper.slots, first = first
        return np.asarray(first)

    where = lambda: [a.unsafe_buffer_pointer() for a in (*stepper._slots, *prefiller._kept.buffers()) if a.size]  # noqa: E731
    for rows, ends in ((None, [False] * 4), (np.array([1, 3], np.int32), [False, True])):
        chunk(rows, ends)
        before = where()
        first = chunk(rows, ends)
        assert where() == before
    assert first[0] == -1 and first[1] >= 0  # the prompt that ended has its first token


def test_ticket_sums_flag():
    """--ticket-sums: auto takes them only for one device's Pallas kernels; on is refused, with the
    flag named, with --ep-size > 1 (before any model is loaded)."""
    from types import SimpleNamespace

    from serve.run import ticket_sums

    one, parallel = SimpleNamespace(kernels="pallas", mesh=None), SimpleNamespace(kernels="pallas", mesh=object())
    reference = SimpleNamespace(kernels="reference", mesh=None)
    auto, on, off = (parse_args(["--ticket-sums", v]) for v in ("auto", "on", "off"))
    assert [ticket_sums(auto, m) for m in (one, parallel, reference)] == [True, False, False]
    assert ticket_sums(on, one) and ticket_sums(on, reference) and not ticket_sums(off, one)
    assert ticket_sums(parse_args([]), one) and not ticket_sums(parse_args([]), reference)  # default auto
    with pytest.raises(SystemExit):
        parse_args(["--ticket-sums", "on", "--ep-size", "2"])
    assert parse_args(["--ticket-sums", "auto", "--ep-size", "2"]).ep_size == 2


def test_kept_buffers_compile_their_rewrite_when_a_shape_first_appears():
    """A shape's first buffer is made by the rewrite program, so a later change of its values (a
    request after a server's warm-up) compiles nothing; one program a shape for every owner."""
    from spec.stepper import KeptBuffers, _rewrite

    first, second = KeptBuffers(), KeptBuffers()
    where = first(np.array([1, 2, 3], np.int32)).unsafe_buffer_pointer()
    compiled = _rewrite._cache_size()
    b = first(np.array([4, 5, 6], np.int32))
    c = second(np.array([7, 8, 9], np.int32))
    assert _rewrite._cache_size() == compiled
    assert b.unsafe_buffer_pointer() == where  # rewritten in place
    assert np.asarray(b).tolist() == [4, 5, 6] and np.asarray(c).tolist() == [7, 8, 9]

"""The prefix cache: a checkpoint restored into a slot and the rest of the prompt prefilled equals a
full prefill bit for bit (`spec.prefix`); the radix index (`serve.prefix_cache`): longest match,
LRU eviction of leaves only, pinned nodes kept, the entry budget; through the engine's device loop,
outputs with and without a hit are identical (greedy and seeded sampling, speculative and plain)."""

import jax
import numpy as np
import pytest

import ling
from serve.prefix_cache import PrefixIndex
from spec.prefix import PrefixPool
from spec.sampling import SamplingParams
from spec.step import new_slots
from spec.stepper import ChunkPrefiller

I = 16  # the checkpoint interval, and the prefill chunk


@pytest.fixture(scope="module")
def model():
    return ling.load("ling-tiny", dtype="float32", seed=1, progress=False)


def test_restore_then_prefill_the_rest_equals_a_full_prefill_bit_for_bit(model):
    """Slot 0 prefills a prompt chunk by chunk, checkpointing at 16 and 32; slot 1 restores the
    checkpoint at 32 and prefills the rest; every leaf of the two slots' model state (KDA conv and
    recurrent, MLA latent and rope rows < length, NEXTN rows < length), lengths, seen, the last
    token and hidden state and the first token are equal."""
    b, length = 3, 80
    slots = new_slots(model, b, length, 8, logprob_width=1)
    prefiller, pool = ChunkPrefiller(model), PrefixPool(model, slots, 4, I)
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, model.cfg.vocab_size, 45).tolist()

    def chunk(slots, slot, lo, start):
        hi = min(lo + I, len(prompt))
        tokens, succ = np.zeros((b, I), np.int32), np.zeros((b, I), np.int32)
        tokens[slot, :hi - lo] = prompt[lo:hi]
        succ[slot, :len(prompt[lo + 1:hi + 1])] = prompt[lo + 1:hi + 1]
        valid, ends, st = np.zeros(b, np.int32), np.zeros(b, bool), np.zeros(b, np.int32)
        valid[slot], ends[slot], st[slot] = hi - lo, hi == len(prompt), start
        slots, _ = prefiller(slots, start=st, params=SamplingParams.make(b, on_host=True), max_new=np.full(b, 8),
                             eos=np.full(b, -1), tokens=tokens, next_tokens=succ, valid=valid, ends=ends,
                             sampling=False)
        return slots

    for lo in range(0, len(prompt), I):  # slot 1 first holds another prompt's state: restore overwrites it
        slots = chunk(slots, 1, lo, lo == 0)
    for lo in range(0, len(prompt), I):
        slots = chunk(slots, 0, lo, lo == 0)
        if lo + I < len(prompt):
            pool.save(slots, 0, lo // I, lo)  # entry k: the page of rows [16k, 16k + 16)
    prompt_1 = prompt
    prompt = prompt_1[:33] + rng.integers(2, model.cfg.vocab_size, 30).tolist()
    for lo in range(0, len(prompt), I):
        slots = chunk(slots, 1, lo, lo == 0)
    prompt = prompt_1
    slots = pool.restore(slots, 1, [0, 1], 32, prompt)
    slots = chunk(slots, 1, 32, 2)

    s = jax.device_get(slots)
    n = len(prompt)
    assert s.model.lengths[0] == s.model.lengths[1] == n
    for c in (*s.model.layers, s.model.nextn):
        for name, a in c.__dict__.items() if not hasattr(c, "recurrent") else (("recurrent", c.recurrent),):
            if a is not None:  # an MLA cache's rows (`ling.state.at_rows`) are None between steps
                np.testing.assert_array_equal(a[1, :n], a[0, :n], err_msg=name)
        if hasattr(c, "recurrent"):
            for a in c.conv:
                np.testing.assert_array_equal(a[1], a[0])
    for name in ("seen", "last_token", "last_hidden", "out", "n_out", "counts"):
        np.testing.assert_array_equal(getattr(s, name)[1], getattr(s, name)[0], err_msg=name)


def test_index_longest_match_and_nextn_key():
    idx = PrefixIndex(8, 4)
    t = list(range(100, 120))
    a, fresh = idx.insert(idx.root, t, 4)
    assert fresh and a.n == 4 and idx.insert(idx.root, t, 4) == (a, False)
    b, _ = idx.insert(a, t, 8)
    assert idx.match(t) is b and idx.match(t[:9]) is b
    assert idx.match(t[:8]) is a  # a hit leaves one token to prefill
    assert idx.match(t[:8] + [0]) is a  # token 8 differs: the NEXTN row 7 of b is not this prompt's
    assert idx.match([0] + t[1:]) is idx.root
    assert b.path() == [a.entry, b.entry]
    leaf, _ = idx.insert(a, t, 6)  # between grid points (a finished request)
    assert idx.match(t[:7] + [1, 2]) is leaf and idx.match(t) is b
    with pytest.raises(ValueError):
        idx.insert(leaf, t, 8)


def test_index_evicts_the_least_recently_used_unpinned_leaf_within_its_budget():
    idx = PrefixIndex(3, 2)
    x, y = [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]
    a, _ = idx.insert(idx.root, x, 2)
    a2, _ = idx.insert(a, x, 4)
    c, _ = idx.insert(idx.root, y, 2)
    assert idx.used == 3
    idx.match(x)  # x's path is now the most recent: c is the LRU leaf
    d, fresh = idx.insert(a2, x, 6)
    assert fresh and d.entry == c.entry and idx.match(y) is idx.root and idx.used == 3 and idx.evictions == 1
    idx.pin(d)  # d pinned: its ancestors are not leaves, so nothing can go
    assert idx.insert(idx.root, y, 2) == (None, False)
    idx.unpin(d)
    e, fresh = idx.insert(idx.root, y, 2)
    assert fresh and e.entry == d.entry and idx.match(x) is a2


SLOTS, STEPS, CONTEXT = 3, 3, 160


def serve(runner, sched, requests):
    """The engine's loop (as tests/test_serve_engine.py's, all requests at once) with the prefix
    cache's finished-request checkpoints; returns the token lists and the (prompt, hit) lookups."""
    out = {r.id: [] for r in requests}
    lookups = []
    for r in requests:
        sched.add(r)

    def take(r, tokens, device_done):
        if r is not None and not r.finished:
            out[r.id] += tokens
            if len(out[r.id]) >= r.sampling.max_tokens:
                if device_done:
                    runner.save_finished(sched.finished(r, out[r.id]))
                r.finished = True
                sched.remove(r)

    for _ in range(10_000):
        chunk = sched.next_chunk()
        if chunk is not None:
            lookups += chunk.lookups
        first, result = runner.iterate(chunk, sched.decoding())
        if result is not None:
            for b, r in enumerate(result.owners):
                take(r, result.tokens[b], bool(result.done[b]))
        if chunk is not None:
            first, _ = runner.read_first(first)
            for b, r in enumerate(chunk.owners):
                take(r, [int(first[b])], False)
        if all(r.finished for r in requests) and not runner.pending:
            break
    return [out[r.id][: r.sampling.max_tokens] for r in requests], lookups


@pytest.fixture(scope="module", params=[STEPS, 0], ids=["speculative", "plain"])
def runners(model, request):
    from serve.runner import Runner

    made = []
    for entries in (0, 12):
        # the cached runner runs mixed iterations: restores, checkpoints and a mixed program together;
        # one batch bucket (the programs to compile: a third)
        r = Runner(model, max_batch=SLOTS, max_seq_len=CONTEXT, speculative_steps=request.param,
                   prefix_entries=entries, prefix_interval=I, mixed=entries > 0, buckets=(SLOTS,))
        r.warmup_prefill(I)
        r.warmup_mixed(I)
        r.warmup_prefix()
        made.append(r)
    return made


def test_outputs_with_and_without_a_hit_are_identical(model, runners):
    """Greedy and seeded sampling with a penalty (which reads `seen`), speculative and plain: a first turn
    fills the cache; a prompt that shares 40 tokens with it hits the checkpoint at 32, and the next
    turn (first prompt + its output + new tokens) hits the first turn's finished checkpoint; each
    output equals the same request's on a runner without the cache."""
    from serve.request import Request, Sampling
    from serve.scheduler import Scheduler

    plain, cached = runners
    rng = np.random.default_rng(5)
    new = lambda n: rng.integers(2, model.cfg.vocab_size, n).tolist()  # noqa: E731
    first = new(50)
    greedy, sampled = Sampling(max_tokens=20, temperature=0.0), Sampling(max_tokens=20, temperature=0.9, top_p=0.95,
                                                                           presence=0.5, seed=7)
    sched = Scheduler(SLOTS, I, eos_id=None, prefix=PrefixIndex(cached.pool.entries, I))
    (turn1,), looked = serve(cached, sched, [Request(first, greedy)])
    assert looked == [(50, 0)] and sched.prefix.used == 5  # at 16, 32, 48; 64 (a page) and 69 (finished)
    # The finished slot holds prompt + output[:-1], whatever the last step accepted beyond max_tokens.
    assert int(cached.stepper.slots.model.lengths[0]) == 50 + 20 - 1
    prompts = [first[:40] + new(9), first + turn1 + new(7)]
    for sampling, hits in ((greedy, [(49, 32), (77, 69)]), (sampled, [(49, 48), (77, 69)])):  # 48: the first's
        want = [serve(plain, Scheduler(SLOTS, I, eos_id=None), [Request(p, sampling)])[0][0] for p in prompts]
        got, looked = serve(cached, sched, [Request(p, sampling) for p in prompts])
        assert got == want
        assert looked == hits


def test_index_page_only_nodes_of_a_finished_checkpoint():
    """A finished request's checkpoint at 11 (interval 4) below the grid node at 4: page-only grid
    nodes at 8 fill the gap; a match never stops at one, and a later checkpoint there gives it
    its state."""
    idx = PrefixIndex(8, 4)
    t = list(range(50, 70))
    a, _ = idx.insert(idx.root, t, 4)
    assert idx.grid_node(t, 10) is a
    made = idx.insert_chain(a, t, 11)
    assert [(x.n, x.state) for x in made] == [(8, False), (11, True)]
    assert idx.match(t[:10]) is a and idx.match(t[:12] + [0]) is made[1] and made[1].path() == [a.entry] + [
        x.entry for x in made]
    assert idx.insert_chain(a, t, 11) == []  # already there
    node, fresh = idx.insert(a, t, 8)
    assert node is made[0] and fresh and node.state and idx.match(t[:10]) is node

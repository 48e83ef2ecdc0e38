"""The engine: greedy speculative decoding equals plain greedy decoding token for token, forced
drafts exercise every acceptance length, slots are reusable, sampling is the target's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling
from spec.step import accept, new_slots
from spec.generate import decode, generate, generate_batch, mean_accepted_length, prefill
from spec.sampling import SamplingParams, probs

from drafts import forced

S = 5  # draft steps


@pytest.fixture(scope="module", params=[1, 2])
def model(request):
    return ling.load("ling-tiny", dtype="float32", seed=request.param)


def prompts(seed, lengths, vocab):
    r = np.random.default_rng(seed)
    return [r.integers(2, vocab, n).tolist() for n in lengths]


def test_greedy_speculative_equals_plain_greedy(model):
    """256 new tokens; three slots of different prompt lengths (one spans KDA chunks)."""
    ps = prompts(0, (70, 5, 131), model.cfg.vocab_size)
    plain = generate_batch(model, ps, 256, speculative=False, prefill_chunk=128)
    spec = generate_batch(model, ps, 256, speculative=True, num_steps=S, prefill_chunk=128)
    assert all(len(p) == 256 for p in plain)
    assert spec == plain
    single = generate(model, ps[0], 256, speculative=True)  # batch of one, default chunking
    assert single == plain[0]


@pytest.mark.parametrize("mistake_at", [None, 0, 1, 2, 3, 4])
def test_forced_drafts_accept_exactly_up_to_the_mistake(model, mistake_at):
    ps = prompts(1, (66, 9), model.cfg.vocab_size)
    n_new = 61
    plain = generate_batch(model, ps, n_new + S + 1, speculative=False)
    out, slots = generate_batch(model, ps, n_new, speculative=True, num_steps=S, return_slots=True,
                                drafter=forced(np.asarray(plain), mistake_at))
    assert out == [p[:n_new] for p in plain]
    per_step = S + 1 if mistake_at is None else mistake_at + 1  # accepted drafts + the bonus
    steps = np.asarray(slots.steps)
    assert (steps == -(-(n_new - 1) // per_step)).all()  # the first token comes from the prefill
    # The reported mean accepted length is committed tokens over verify steps.
    assert mean_accepted_length(slots) == pytest.approx(2 * (n_new - 1) / steps.sum())


def test_penalties_equal_greedy_over_a_full_forward(model, request):
    """Presence, frequency and repetition penalties, different per slot (one slot boosts a token's
    first repeat and suppresses the second, so a verify position's counts must include the drafts
    before it): plain and speculative greedy decoding (NEXTN drafts, and drafts forced to the
    reference, all accepted) equal greedy decoding over one full forward a token with the penalties
    applied on the host. One model suffices."""
    from flax import nnx

    from ling.state import init_state

    if request.node.callspec.params["model"] != 1:
        pytest.skip("the first model covers it")
    v, n = model.cfg.vocab_size, 16
    ps = prompts(3, (9, 14, 6), v)
    pen = dict(presence=[0.0, 0.8, -3.0], frequency=[1.5, 0.0, 2.0], repetition=[1.0, 1.4, 0.9])
    graphdef, weights = nnx.split(model)

    @jax.jit
    def last_logits(tokens, lens):  # one full forward of each row from an empty state
        m = nnx.merge(graphdef, weights)
        logits, _, _ = m(tokens, init_state(m.cfg, len(ps), tokens.shape[1], jnp.float32), valid=lens, form="prefill")
        return logits[jnp.arange(len(ps)), lens - 1]

    ids = [list(p) for p in ps]
    counts = np.zeros((len(ps), v))
    seen = np.stack([np.isin(np.arange(v), p) for p in ps])
    for _ in range(n):
        width = max(map(len, ps)) + n
        x = np.asarray(last_logits(jnp.asarray([r + [0] * (width - len(r)) for r in ids]),
                                   jnp.asarray([len(r) for r in ids])), np.float64)
        rep = np.asarray(pen["repetition"])[:, None]
        x = np.where(seen | (counts > 0), np.where(x > 0, x / rep, x * rep), x)
        x = x - np.asarray(pen["presence"])[:, None] * (counts > 0) - np.asarray(pen["frequency"])[:, None] * counts
        for b, t in enumerate(np.argmax(x, axis=1)):
            ids[b].append(int(t))
            counts[b, t] += 1
    ref = [r[len(p):] for r, p in zip(ids, ps)]
    assert any(r[i] == r[i + 1] for r in ref for i in range(n - 1))  # repeats inside a step's window
    assert generate_batch(model, ps, n, speculative=False, **pen) == ref
    assert generate_batch(model, ps, n, speculative=True, num_steps=S, **pen) == ref
    padded = np.asarray([r + r[-1:] * (S + 1) for r in ref])
    assert generate_batch(model, ps, n, speculative=True, num_steps=S, drafter=forced(padded, None), **pen) == ref


def test_slot_reuse_greedy_sampled_greedy(model):
    """Greedy, then a sampled request in the same slot, then greedy again: equal greedy outputs."""
    p = prompts(2, (40,), model.cfg.vocab_size)
    slots = new_slots(model, 1, 40 + 48 + S + 1, 48 + S + 1)
    outs = []
    for temperature in (0.0, 1.0, 0.0):
        params = SamplingParams.make(1, temperature, 0, 1.0, 7)
        slots = prefill(model, slots, p, [True], params, [48], [-1])
        slots = decode(model, slots, speculative=True, num_steps=S, max_iters=48)
        outs.append(np.asarray(slots.out[0, : slots.n_out[0]]).tolist())
    assert outs[0] == outs[2] and len(outs[0]) == 48
    assert outs[1] != outs[0]


def test_sampling_is_reproducible_per_seed_and_stops_at_eos(model):
    p = prompts(3, (30,), model.cfg.vocab_size)[0]
    a = generate(model, p, 40, temperature=0.8, top_k=50, top_p=0.9, seed=11)
    b = generate(model, p, 40, temperature=0.8, top_k=50, top_p=0.9, seed=11)
    c = generate(model, p, 40, temperature=0.8, top_k=50, top_p=0.9, seed=12)
    assert a == b and a != c
    greedy = generate(model, p, 40, speculative=False)
    eos = greedy[9]
    cut = greedy[: greedy.index(eos) + 1]
    assert generate(model, p, 40, eos_id=eos) == cut
    assert generate(model, p, 40, speculative=False, eos_id=eos) == cut


def test_rejection_sampling_gives_the_target_distribution():
    """The first token a speculative step emits is distributed as the target's p_0, whatever the
    draft distribution q."""
    n, s, v = 40000, 3, 6
    r = np.random.default_rng(0)
    target_logits = jnp.asarray(np.broadcast_to(r.normal(size=(1, s + 1, v)) * 1.5, (n, s + 1, v)), jnp.float32)
    q_rows = jax.nn.softmax(jnp.asarray(r.normal(size=(s, v)) * 1.5, jnp.float32))
    q = jnp.broadcast_to(q_rows, (n, s, v))
    keys = jax.random.split(jax.random.PRNGKey(0), (3, n))
    drafts = jax.vmap(lambda k: jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(
        jax.random.split(k, s), q_rows))(keys[0])
    params = SamplingParams.make(n, temperature=1.0)
    accepted, bonus = accept(target_logits, drafts, q, params, keys[1], keys[2])
    first = np.where(np.asarray(accepted) > 0, np.asarray(drafts[:, 0]), np.asarray(bonus))
    empirical = np.bincount(first, minlength=v) / n
    p0 = np.asarray(probs(target_logits[:1, 0], SamplingParams.make(1, temperature=1.0)))[0]
    assert np.abs(empirical - p0).max() < 0.01, (empirical, p0)
    # Greedy rows accept exactly while the draft equals the argmax.
    greedy = SamplingParams.make(n, temperature=0.0)
    a, b = accept(target_logits, drafts, q, greedy, keys[1], keys[2])
    best = np.asarray(jnp.argmax(target_logits[0], -1))
    ok = np.asarray(drafts) == best[None, :s]
    expect = np.cumprod(ok, axis=1).sum(1)
    assert (np.asarray(a) == expect).all() and (np.asarray(b) == best[expect]).all()


def test_top_k_top_p_filtering():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 3))
    p = SamplingParams.make(3, 1.0, [0, 2, 0], [1.0, 1.0, 0.7])
    np.testing.assert_allclose(probs(logits, p), [[0.5, 0.3, 0.15, 0.05], [0.625, 0.375, 0, 0], [0.625, 0.375, 0, 0]],
                               atol=1e-6)


def test_top_p_at_zero_keeps_the_top_token():
    """top_p that float32 flushes to 0 (1e-44) still samples: the most likely token only."""
    logits = jnp.log(jnp.asarray([[0.2, 0.5, 0.3]] * 2))
    p = SamplingParams.make(2, 1.0, 0, [0.0, 1e-44])
    np.testing.assert_array_equal(probs(logits, p), [[0, 1, 0], [0, 1, 0]])


def test_speculative_needs_a_nextn_layer():
    m = ling.load("kimi-tiny", dtype="float32")
    with pytest.raises(ValueError, match="NEXTN"):
        generate(m, [1, 2, 3], 4)
    assert len(generate(m, [1, 2, 3], 4, speculative=False)) == 4


def test_stepper_runs_one_step_ahead_and_matches_decode(model):
    from spec.stepper import Stepper

    p = prompts(4, (20, 33), model.cfg.vocab_size)
    params = SamplingParams.make(2)

    def fresh():
        slots = new_slots(model, 2, 33 + 30 + S + 1, 30 + S + 1)
        return prefill(model, slots, p, [True, True], params, [30, 30], [-1, -1])

    reference = decode(model, fresh(), speculative=True, num_steps=S, max_iters=30)
    first = np.asarray(fresh().out[:, :1])  # the token each prefill sampled
    stepper = Stepper(model, fresh(), speculative=True, num_steps=S)
    assert stepper.step() is None  # nothing to report before the second dispatch
    streamed = [list(first[b]) for b in range(2)]
    while True:
        tokens, done = stepper.step()[:2]
        for b in range(2):
            streamed[b] += tokens[b]
        if done.all():
            break
    tokens = stepper.drain().tokens  # the last dispatched step ran on finished slots: nothing new
    assert tokens == [[], []]
    for b in range(2):
        assert streamed[b] == np.asarray(reference.out[b, : reference.n_out[b]]).tolist()


@pytest.mark.parametrize("speculative,temperature", [(False, 0.0), (True, 0.0), (True, 0.8)])
def test_calls_of_several_steps_equal_one_step_calls(model, speculative, temperature):
    """A call of 4 steps (`Stepper(steps_per_call=4)`) streams the tokens one-step calls stream
    (greedy, and seeded sampling), the slots finishing inside a call (max tokens 13 and 30) emit
    nothing after it, and each slot's reported steps are the steps in which it emitted; a call of
    one step (`steps=1`) between them changes nothing."""
    from spec.stepper import Stepper

    p = prompts(5, (11, 26), model.cfg.vocab_size)
    width = S + 1 if speculative else 1

    steppers = {}  # by steps_per_call: a stepper handed new slots keeps its compiled calls

    def stream(steps_per_call, ones=()):
        slots = new_slots(model, 2, 26 + 30 + width + 1, 30 + width)
        slots = prefill(model, slots, p, [True, True], SamplingParams.make(2, temperature=temperature, seed=3),
                        [13, 30], [-1, -1])
        if steps_per_call in steppers:
            stepper = steppers[steps_per_call]
            stepper.slots = slots
        else:
            stepper = steppers[steps_per_call] = Stepper(model, slots, speculative=speculative, num_steps=S,
                                                         steps_per_call=steps_per_call)
        assert stepper.sampling == (temperature > 0)
        out, ran, calls = [[int(t)] for t in np.asarray(slots.out[:, 0])], np.zeros(2, int), 0
        while True:
            report = stepper.step(steps=1 if calls in ones else None)
            calls += 1
            if report is None:
                continue
            for b in range(2):
                out[b] += report.tokens[b]
                assert report.steps[b] <= steps_per_call and (report.steps[b] > 0) == bool(report.tokens[b])
            ran += report.steps
            if report.done.all():
                break
        assert stepper.drain().tokens == [[], []]
        return out, ran, calls

    one, ran_one, calls_one = stream(1)
    four, ran_four, calls_four = stream(4)
    assert [len(o) for o in one] == [13, 30]
    assert four == one and (ran_four == ran_one).all()
    assert calls_four < calls_one
    assert stream(4, ones=(1, 3))[0] == one
    with pytest.raises(ValueError, match="one with log-probabilities"):
        Stepper(model, new_slots(model, 2, 64, 16, logprob_width=width), speculative=speculative, num_steps=S,
                steps_per_call=2).step(logprobs=True)


def test_roofline_counts_the_model_parameters():
    """A decode step's weight bytes equal the model's own parameter bytes, less the embedding and
    the experts a token does not route to."""
    from flax import nnx

    from ling.model import LingModel
    from ling.roofline import distinct_experts, step_bytes

    cfg = ling.preset("ling-3-flash")
    abstract = nnx.eval_shape(lambda: LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), nextn=False))
    total = experts = 0
    for path, var in nnx.to_flat_state(nnx.split(abstract)[1]):
        v = var.get_value()
        nbytes = np.prod(v.shape) * jnp.dtype(v.dtype).itemsize
        if path[-1] in ("w13", "w2") and v.shape[0] == cfg.num_experts:  # routed; MLPs are one expert
            experts += nbytes
        elif path[0] != "embed_tokens":
            total += nbytes
    expected = total + experts * cfg.num_experts_per_tok / cfg.num_experts
    got = step_bytes(cfg, 1).weights
    assert abs(got - expected) / expected < 1e-3  # norms and small vectors are left out of the count
    assert distinct_experts(cfg, 1) == pytest.approx(8) and 45 < distinct_experts(cfg, 6) < 47
    assert step_bytes(cfg, 1, weight_bits=4).weights < step_bytes(cfg, 1).weights / 3.5

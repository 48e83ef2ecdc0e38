"""The DSpark block drafter: greedy speculative output equals plain greedy at every block length,
forced drafts accept exactly up to a mistake at every position, confidence scheduling never
verifies more than the block and never changes the output, and the drafter's files round-trip."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ling
from ling import dspark
from spec.generate import generate_batch, mean_accepted_length
from spec.step import BlockDrafter, schedule

from drafts import forced


@pytest.fixture(scope="module")
def model():
    m = ling.load("ling-tiny", dtype="float32", seed=1)
    cfg = dspark.default_config(m.cfg, block_size=16, num_layers=1, num_heads=2, head_dim=16, intermediate_size=64,
                                markov_rank=8)
    d = dspark.DSparkDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    # Random, non-zero heads: the Markov bias and the confidence both change from draft to draft.
    d.markov_out.set_value(0.5 * jax.random.normal(jax.random.PRNGKey(4), d.markov_out[...].shape))
    d.conf_w.set_value(0.5 * jax.random.normal(jax.random.PRNGKey(5), d.conf_w[...].shape))
    d.conf_b.set_value(jnp.full((1,), 2.0))
    return m.attach_dspark(d)


def prompts(seed, lengths, vocab):
    r = np.random.default_rng(seed)
    return [r.integers(2, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("block", [1, 3, 8, 16])
def test_greedy_block_drafting_equals_plain_greedy(model, block):
    ps = prompts(0, (70, 5, 131), model.cfg.vocab_size)
    plain = generate_batch(model, ps, 64, speculative=False, prefill_chunk=128)
    for drafter in (BlockDrafter(), BlockDrafter(sequential=False)):
        out = generate_batch(model, ps, 64, speculative=True, num_steps=block, prefill_chunk=128, drafter=drafter)
        assert out == plain


def test_block_drafting_over_a_token_map_equals_plain_greedy(model):
    """The block drafter's base logits go through the model's draft vocabulary too
    (`ling.draft_vocab`): its drafts stay in the map, and the output is plain greedy's."""
    ps = prompts(4, (40, 9), model.cfg.vocab_size)
    plain = generate_batch(model, ps, 32, speculative=False)
    ids = np.arange(0, model.cfg.vocab_size, 3)
    try:
        out, slots = generate_batch(model.attach_draft_vocab(ids), ps, 32, speculative=True, num_steps=8,
                                    drafter=BlockDrafter(), return_slots=True)
        drafts = BlockDrafter()(model, slots, 8, sampling=False)[0]
    finally:
        model.attach_draft_vocab(None)
    assert out == plain
    assert np.isin(np.asarray(drafts), ids).all()


def test_the_block_drafter_depends_on_its_context(model):
    """The drafts of a slot come from its own cached context: two prompts with the same last token
    draft differently, and a slot's first block equals the drafter run over a fresh cache."""
    from spec.generate import prefill
    from spec.sampling import SamplingParams
    from spec.step import new_slots

    ps = prompts(5, (40, 40), model.cfg.vocab_size)
    ps[1][-1] = ps[0][-1]
    slots = new_slots(model, 2, 64, 8)
    slots = prefill(model, slots, ps, [True, True], SamplingParams.make(2), [8, 8], [-1, -1], chunk=64)
    drafts, _, _ = BlockDrafter()(model, slots, 6, sampling=False)
    assert (np.asarray(slots.model.lengths) == 40).all()
    assert not np.array_equal(drafts[0], drafts[1])


B = 8


@pytest.mark.parametrize("mistake_at", [None, *range(B)])
def test_forced_block_accepts_exactly_up_to_the_mistake(model, mistake_at):
    """The DSpark cache stays right through partial acceptance at every position: after the forced
    steps, the model's own block drafter still gives plain greedy output."""
    ps = prompts(1, (66, 9), model.cfg.vocab_size)
    n_new = 41
    plain = generate_batch(model, ps, n_new + B + 1, speculative=False)
    out, slots = generate_batch(model, ps, n_new, speculative=True, num_steps=B, return_slots=True,
                                drafter=forced(np.asarray(plain), mistake_at))
    assert out == [p[:n_new] for p in plain]
    per_step = B + 1 if mistake_at is None else mistake_at + 1
    assert (np.asarray(slots.steps) == -(-(n_new - 1) // per_step)).all()
    # A verify limit below the mistake caps the accepted drafts at the limit.
    limit = 3
    out, slots = generate_batch(model, ps, n_new, speculative=True, num_steps=B, return_slots=True,
                                drafter=forced(np.asarray(plain), mistake_at, limit))
    assert out == [p[:n_new] for p in plain]
    per_step = min(limit, B if mistake_at is None else mistake_at) + 1
    assert (np.asarray(slots.steps) == -(-(n_new - 1) // per_step)).all()


def test_forced_steps_keep_the_dspark_cache_right(model):
    """Steps of forced drafts with mistakes (partial acceptance), then the drafter's own block: its
    drafts equal those over a cache built by one prefill of the same tokens."""
    from spec.generate import decode, prefill
    from spec.sampling import SamplingParams
    from spec.step import new_slots

    p = prompts(2, (30,), model.cfg.vocab_size)
    plain = generate_batch(model, p, 40, speculative=False)[0]
    slots = new_slots(model, 1, 128, 64)
    slots = prefill(model, slots, p, [True], SamplingParams.make(1), [60], [-1], chunk=64)
    slots = decode(model, slots, speculative=True, num_steps=B, max_iters=6,
                   drafter=forced(np.asarray([plain]), 2))
    n = int(slots.n_out[0])  # the last emitted token is last_token, not yet in the state
    assert np.asarray(slots.out[0, :n]).tolist() == plain[:n] and n == 1 + 6 * 3
    drafts, _, _ = BlockDrafter()(model, slots, B, sampling=False)
    fresh = new_slots(model, 1, 128, 64)
    fresh = prefill(model, fresh, [p[0] + plain[:n - 1]], [True], SamplingParams.make(1), [20], [-1], chunk=64)
    assert int(fresh.last_token[0]) == int(slots.last_token[0])
    assert int(fresh.model.lengths[0]) == int(slots.model.lengths[0])
    fresh_drafts, _, _ = BlockDrafter()(model, fresh, B, sampling=False)
    np.testing.assert_array_equal(drafts, fresh_drafts)


def test_rejection_sampling_with_a_verify_limit_keeps_the_target_distribution():
    """With drafts past a limit counted as never proposed, the first two emitted tokens still follow
    the target: the first p_0 and, given it, the second p_1 (drafts fixed, the target at every
    position the same p here, so the second token is p-distributed too)."""
    from spec.sampling import SamplingParams, probs
    from spec.step import accept

    n, s, v = 40000, 3, 6
    r = np.random.default_rng(1)
    row = r.normal(size=(v,)) * 1.5
    target = jnp.asarray(np.broadcast_to(row, (n, s + 1, v)), jnp.float32)
    q_rows = jax.nn.softmax(jnp.asarray(r.normal(size=(s, v)) * 1.5, jnp.float32))
    keys = jax.random.split(jax.random.PRNGKey(2), (3, n))
    drafts = jax.vmap(lambda k: jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(
        jax.random.split(k, s), q_rows))(keys[0])
    params = SamplingParams.make(n, temperature=1.0)
    p = np.asarray(probs(target[:1, 0], SamplingParams.make(1, temperature=1.0)))[0]
    for lim in (0, 1, 2):
        limit = jnp.full((n,), lim, jnp.int32)
        accepted, bonus = accept(target, drafts, jnp.broadcast_to(q_rows, (n, s, v)), params, keys[1], keys[2],
                                 limit=limit)
        a = np.asarray(accepted)
        assert (a <= lim).all()
        first = np.where(a > 0, np.asarray(drafts[:, 0]), np.asarray(bonus))
        assert np.abs(np.bincount(first, minlength=v) / n - p).max() < 0.01, lim
        if lim >= 1:  # the second emitted token: draft 2 if accepted, else the bonus after draft 1
            second = np.where(a > 1, np.asarray(drafts[:, 1]), np.asarray(bonus))[a >= 1]
            assert np.abs(np.bincount(second, minlength=v) / len(second) - p).max() < 0.015, lim


def test_schedule_never_exceeds_the_block_and_respects_the_budget():
    r = np.random.default_rng(0)
    for _ in range(50):
        b, s = r.integers(1, 6), r.integers(1, 17)
        surv = np.cumprod(r.uniform(0.3, 1.0, (b, s)), axis=1)
        live = r.uniform(size=b) < 0.8
        th, budget = float(r.uniform(0, 0.9)), int(r.integers(0, 3 * s))
        lim = np.asarray(schedule(jnp.asarray(surv), jnp.asarray(live), threshold=th, budget=budget))
        assert ((0 <= lim) & (lim <= s)).all()
        assert (lim <= (surv >= th).sum(1)).all()
        if budget:
            assert lim[live].sum() <= budget and (lim[~live] == 0).all()
            # The admitted drafts are the most likely to survive over all slots.
            admitted = [surv[i, j] for i in range(b) for j in range(lim[i])]
            rest = [surv[i, j] for i in range(b) if live[i] for j in range(lim[i], s) if surv[i, j] >= th]
            if admitted and rest and lim[live].sum() == budget:
                assert min(admitted) >= max(rest)


@pytest.mark.parametrize("block", [4, 16])
def test_confidence_scheduling_never_changes_the_output(model, block):
    ps = prompts(3, (50, 12, 90), model.cfg.vocab_size)
    plain = generate_batch(model, ps, 64, speculative=False, prefill_chunk=128)
    full, s_full = generate_batch(model, ps, 64, speculative=True, num_steps=block, prefill_chunk=128,
                                  drafter=BlockDrafter(), return_slots=True)
    for drafter in (BlockDrafter(scheduled=True, threshold=0.5), BlockDrafter(scheduled=True, budget=block),
                    BlockDrafter(scheduled=True, threshold=0.95, budget=2)):
        out, slots = generate_batch(model, ps, 64, speculative=True, num_steps=block, prefill_chunk=128,
                                    drafter=drafter, return_slots=True)
        assert out == plain
        assert mean_accepted_length(slots) <= block + 1
    assert full == plain


def test_sampled_block_drafting_is_reproducible(model):
    ps = prompts(4, (30,), model.cfg.vocab_size)
    kw = dict(speculative=True, num_steps=8, drafter=BlockDrafter(), temperature=0.8, top_k=50, seed=5)
    a, b = generate_batch(model, ps, 40, **kw), generate_batch(model, ps, 40, **kw)
    assert a == b and len(a[0]) == 40


def test_drafter_files_round_trip(model, tmp_path):
    dspark.save(model.dspark, str(tmp_path), dtype=jnp.float32, meta={"note": "test"})
    back = dspark.load(str(tmp_path), model.cfg, dtype=jnp.float32)
    assert back.cfg == model.dspark.cfg
    for (pa, a), (pb, b) in zip(nnx.to_flat_state(nnx.split(model.dspark, nnx.Param)[1]),
                                nnx.to_flat_state(nnx.split(back, nnx.Param)[1])):
        assert pa == pb
        np.testing.assert_array_equal(a.get_value(), b.get_value())
    other = dataclasses.replace(model.cfg, hidden_size=model.cfg.hidden_size * 2)
    with pytest.raises(ValueError, match="hidden"):
        dspark.load(str(tmp_path), other)


def test_block_drafter_needs_an_attached_drafter():
    m = ling.load("ling-tiny", dtype="float32")
    with pytest.raises(ValueError, match="block drafter"):
        generate_batch(m, [[1, 2, 3]], 4, drafter=BlockDrafter())


# ----------------------------------------------------------------------------------------------
# The server: --speculative-algorithm dspark


def test_serve_flags_are_checked():
    from serve.run import parse_args

    for bad in (["--speculative-confidence-threshold", "0.5"],  # dspark only
                ["--speculative-algorithm", "dspark", "--speculative-confidence-threshold", "1.5"],
                ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"],
                ["--speculative-algorithm", "dspark", "--speculative-verify-budget", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    a = parse_args(["--speculative-algorithm", "dspark", "--speculative-num-draft-tokens", "8"])
    assert a.speculative_algorithm == "dspark" and a.speculative_num_draft_tokens == 8


def test_serve_refuses_a_missing_or_unfitting_drafter(tmp_path):
    from serve.run import StartupError, _attach_dspark, parse_args

    m = ling.load("ling-tiny", dtype="float32")
    args = parse_args(["--model", str(tmp_path), "--speculative-algorithm", "dspark", "--dtype", "float32"])
    with pytest.raises(StartupError, match="dspark.json"):
        _attach_dspark(args, m, None)
    cfg = dspark.default_config(m.cfg, block_size=4, num_layers=1, num_heads=2, head_dim=16, intermediate_size=32,
                                markov_rank=4)
    dspark.save(dspark.DSparkDrafter(cfg, dtype=jnp.float32), str(tmp_path), dtype=jnp.float32)
    with pytest.raises(StartupError, match="blocks of 1 to 4"):
        _attach_dspark(args, m, 5)
    drafter, block = _attach_dspark(args, m, None)
    assert block == 4 and m.dspark is not None and m.nextn is None and drafter == BlockDrafter()


def test_served_dspark_greedy_equals_plain_greedy(tmp_path):
    """The shipped model served in float32 with a (random) DSpark drafter and confidence scheduling:
    greedy completions equal plain greedy decoding, and /metrics reports the accepted length."""
    import httpx

    from serve.run import DEFAULT_MODEL, DEFAULT_MODEL_NAME
    from serve.tokenizer import Tokenizer
    from serving import Server

    target = ling.load(DEFAULT_MODEL, dtype="float32", progress=False)
    cfg = dspark.default_config(target.cfg, block_size=8, num_layers=1, num_heads=2, head_dim=32,
                                intermediate_size=64, markov_rank=8)
    dspark.save(dspark.DSparkDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1)), str(tmp_path / "drafter"),
                dtype=jnp.float32)
    tok = Tokenizer(DEFAULT_MODEL)
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n"]
    refs = [tok.decode(generate_batch(target, [tok.encode(p)], 24, speculative=False)[0]) for p in prompts]
    s = Server(["--max-batch", "2", "--max-seq-len", "256", "--prefill-chunk", "32", "--dtype", "float32",
                "--speculative-algorithm", "dspark", "--speculative-num-draft-tokens", "6",
                "--speculative-draft-model-path", str(tmp_path / "drafter"),
                "--speculative-confidence-threshold", "0.3", "--batch-buckets", "off"], tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=300) as c:
            for p, ref in zip(prompts, refs):
                r = c.post("/v1/completions", json={"model": DEFAULT_MODEL_NAME, "prompt": p, "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == ref
            metrics = c.get("/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("ling:spec_accept_length"))
        assert float(line.split()[-1]) >= 1.0
    finally:
        s.stop()


def test_drafter_training_learns_a_fixed_batch():
    """offline.train_dspark's step on a tiny target: the block loss falls on a batch it sees again
    and again, and the confidence head's calibration never raises its cross-entropy."""
    from offline.train_dspark import DrafterTrainer, target_taps

    target = ling.load("ling-tiny", dtype="float32", seed=2)
    cfg = dspark.default_config(target.cfg, block_size=4, num_layers=1, num_heads=2, head_dim=16,
                                intermediate_size=64, markov_rank=8)
    r = np.random.default_rng(0)
    seqs = r.integers(2, 40, (4, 40)).astype(np.int32)  # a small alphabet: learnable in a few steps
    taps = target_taps(target, seqs, cfg.feature_layers, 4)
    assert taps.shape == (4, 40, len(cfg.feature_layers) * target.cfg.hidden_size)
    tr = DrafterTrainer(target, cfg, lr=3e-3, warmup=2, block=4, anchors=6, prompt_len=8, decay=4.0,
                        base_weight=0.3, conf_weight=0.2, seed=0)
    anchors = tr.anchors_for(r, 4, 40)
    assert anchors.min() >= 7 and anchors.max() <= 40 - 4 - 1
    first = tr.evaluate(taps, seqs, anchors)["loss"]
    for i in range(40):
        tr.step(taps, seqs, anchors, i, 40)
    assert tr.evaluate(taps, seqs, anchors)["loss"] < first - 0.5
    c = tr.calibrate(taps, seqs, anchors)
    assert c["bce_after"] <= c["bce_before"] + 1e-9


def test_training_blocks_equal_the_decoding_block(model):
    """`train_blocks` (many anchors of a sequence at once, the context from one prefill) gives the
    hidden states `block` gives at decode time over the cache the prefill wrote."""
    from spec.generate import prefill
    from spec.sampling import SamplingParams
    from spec.step import new_slots

    d, block = model.dspark, 6
    seq = prompts(6, (50,), model.cfg.vocab_size)[0]
    state = ling.init_state(model.cfg, 1, 50, jnp.float32)
    _, _, _, taps = model(jnp.asarray([seq]), state, form="prefill", logits=False, taps=d.cfg.feature_layers)
    anchors = jnp.asarray([[20, 33, 41]], jnp.int32)
    h_train = d.train_blocks(model.embed, taps, anchors, jnp.asarray(seq)[anchors], block)  # [1, 3, block, D]
    for a, n in enumerate(np.asarray(anchors[0])):
        slots = new_slots(model, 1, 64, 8)
        slots = prefill(model, slots, [seq[:n]], [True], SamplingParams.make(1), [8], [-1], chunk=64)
        h = d.block(model.embed, slots.model.dspark, slots.model.lengths, jnp.asarray([seq[n]]), block)
        np.testing.assert_allclose(h[0], h_train[0, a], rtol=2e-4, atol=2e-4)

"""The reduced draft vocabulary: its logits are the lm_head's at its ids (bf16 and int4 heads, tied
or not), speculative greedy output with it equals plain greedy, drafts and their probabilities stay
inside it, and token map files are read or refused with the reason."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling
from ling.draft_vocab import load_token_map, most_frequent
from ling.quantize import quantize_model
from spec.generate import generate_batch, prefill
from spec.sampling import SamplingParams
from spec.step import nextn_chain, new_slots


@pytest.fixture(scope="module")
def model():
    return ling.load("ling-tiny", dtype="float32", seed=3)


def _ids(v, n, seed=0):
    return np.sort(np.random.default_rng(seed).choice(v, n, replace=False)).astype(np.int32)


def _check_logits(model, ids, **tol):
    hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 3, model.cfg.hidden_size), model.embed_tokens.dtype)
    full = np.asarray(model.logits(hidden))
    got = np.asarray(model.attach_draft_vocab(ids).draft_logits(hidden))
    model.attach_draft_vocab(None)
    assert got.shape == full.shape and got.dtype == np.float32
    np.testing.assert_allclose(got[..., ids], full[..., ids], **tol)
    outside = np.setdiff1d(np.arange(model.cfg.vocab_size), ids)
    assert np.all(got[..., outside] == -np.inf)


def test_logits_are_the_heads_at_the_ids(model):
    ids = _ids(model.cfg.vocab_size, 37)
    _check_logits(model, ids, rtol=1e-6, atol=1e-6)
    tied = ling.load("ling-tiny", dtype="float32", seed=3)
    tied.lm_head = None  # the embedding's transpose
    _check_logits(tied, ids, rtol=1e-6, atol=1e-6)


def test_quantised_head_takes_its_rows_exactly():
    """From an int4 lm_head the draft head holds the same codes, so its logits match the full head's
    to the kernels' summation order (on the reference backend: exactly the same arithmetic)."""
    m = quantize_model(ling.load("ling-tiny", dtype="float32", seed=4), bits=4, group_size=32, lm_head=True)
    ids = _ids(m.cfg.vocab_size, 150, seed=1)  # two tiles of rows, the last one ragged
    _check_logits(m, ids, rtol=1e-5, atol=1e-5)


def test_greedy_speculative_with_a_draft_vocab_equals_plain_greedy(model):
    ps = [np.random.default_rng(5).integers(2, model.cfg.vocab_size, n).tolist() for n in (40, 9)]
    plain = generate_batch(model, ps, 48, speculative=False)
    hot = np.unique(np.concatenate([np.asarray(p) for p in plain] + [_ids(model.cfg.vocab_size, 16)]))
    try:
        model.attach_draft_vocab(hot)  # every token greedy decoding emits: drafts can all be right
        out, slots = generate_batch(model, ps, 48, speculative=True, num_steps=4, return_slots=True)
        model.attach_draft_vocab(_ids(model.cfg.vocab_size, 5))  # drafts mostly wrong: the target decides
        few = generate_batch(model, ps, 48, speculative=True, num_steps=4)
    finally:
        model.attach_draft_vocab(None)
    assert out == plain and few == plain
    assert np.asarray(slots.steps).sum() < 2 * 47  # drafts were accepted


def test_sampled_drafts_and_their_probabilities_stay_in_the_vocab(model):
    ids = _ids(model.cfg.vocab_size, 23, seed=2)
    slots = new_slots(model, 2, 64, 16)
    slots = prefill(model, slots, [[5, 6, 7, 8], [9, 10]], [True, True], SamplingParams.make(2, 1.0, seed=3),
                    [16, 16], [-1, -1])
    try:
        drafts, q, _ = nextn_chain(model.attach_draft_vocab(ids), slots, 3, sampling=True)
    finally:
        model.attach_draft_vocab(None)
    assert np.isin(np.asarray(drafts), ids).all()
    q = np.asarray(q)
    outside = np.setdiff1d(np.arange(model.cfg.vocab_size), ids)
    assert np.all(q[..., outside] == 0) and np.allclose(q.sum(-1), 1, atol=1e-5)


def test_attach_refuses_ids_it_cannot_use(model):
    for bad in ([3, 3, 4], [5, 2], [], [0, model.cfg.vocab_size]):
        with pytest.raises(ValueError, match="sorted, unique"):
            model.attach_draft_vocab(np.asarray(bad, np.int32))
    assert model.draft_vocab is None


def test_token_map_files(tmp_path):
    want = np.array([2, 7, 11], np.int32)
    np.save(tmp_path / "m.npy", np.array([11, 2, 7, 2]))
    (tmp_path / "m.json").write_text(json.dumps([7, 11, 2]))
    (tmp_path / "m.txt").write_text("11 2\n7\n")
    for name in ("m.npy", "m.json", "m.txt"):
        got = load_token_map(str(tmp_path / name), 12)
        assert got.dtype == np.int32 and (got == want).all(), name
    with pytest.raises(ValueError, match="id 11 is outside"):
        load_token_map(str(tmp_path / "m.npy"), 11)
    (tmp_path / "f.json").write_text("[1.5, 2]")
    (tmp_path / "e.json").write_text("[]")
    (tmp_path / "w.txt").write_text("1 two")
    (tmp_path / "m.csv").write_text("1,2")
    for name, why in (("f.json", "integer"), ("e.json", "non-empty"), ("w.txt", "two"), ("m.csv", "suffix")):
        with pytest.raises(ValueError, match=why):
            load_token_map(str(tmp_path / name), 12)
    with pytest.raises(OSError, match="no such file"):
        load_token_map(str(tmp_path / "none.npy"), 12)


def test_most_frequent():
    counts = np.array([5, 0, 9, 5, 1, 9])
    assert most_frequent(counts, 3).tolist() == [0, 2, 5]  # ties: the lower id
    with pytest.raises(ValueError, match="size"):
        most_frequent(counts, 7)


def test_draft_vocab_in_a_jitted_split_model(model):
    """The ids and slot map travel as state: a jitted function of the split model sees them."""
    from flax import nnx

    ids = _ids(model.cfg.vocab_size, 10)
    graphdef, state = nnx.split(model.attach_draft_vocab(ids))
    try:
        h = jnp.ones((1, 1, model.cfg.hidden_size), jnp.float32)
        out = jax.jit(lambda s: nnx.merge(graphdef, s).draft_logits(h))(state)
    finally:
        model.attach_draft_vocab(None)
    assert np.isfinite(np.asarray(out)).sum() == 10


def test_token_map_tool_counts_a_corpus(tmp_path, capsys):
    """`python -m offline.token_map` over files and a directory: the map is the most frequent ids
    of the corpus's encoding, written in the suffix's format; bad arguments are refused by name."""
    from offline import data
    from offline.token_map import main
    from serve.run import DEFAULT_MODEL

    texts = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n", "x = [i * i for i in range(9)]\n"]
    (tmp_path / "a.py").write_text(texts[0])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.py").write_text(texts[1])
    (tmp_path / "docs" / "c.py").write_text(texts[2])
    (tmp_path / "docs" / "skip.md").write_text("not python " * 50)
    out = tmp_path / "map.json"
    assert main(["--tokenizer", DEFAULT_MODEL, "--corpus", str(tmp_path / "a.py"), str(tmp_path / "docs"),
                 "--pattern", "*.py", "--size", "12", "--out", str(out)]) == 0
    tok = data.load_tokenizer(DEFAULT_MODEL)
    counts = np.zeros(tok.get_vocab_size(), np.int64)
    for t in texts:
        np.add.at(counts, tok.encode(t, add_special_tokens=False).ids, 1)
    assert json.loads(out.read_text()) == most_frequent(counts, 12).tolist()
    assert load_token_map(str(out), tok.get_vocab_size()).size == 12
    for argv, why in ((["--corpus", str(tmp_path / "none")], "no such file"), (["--corpus", str(tmp_path / "a.py"),
                      "--out", "m.csv"], "suffix"), ([], "--corpus"), (["--corpus", str(tmp_path / "a.py"),
                      "--size", "99999"], "exceeds")):
        with pytest.raises(SystemExit):
            main(["--tokenizer", DEFAULT_MODEL, "--size", "12", *argv])
        assert why in capsys.readouterr().err

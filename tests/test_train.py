"""Training (issue 8): corpus split, tokenizer, losses and gradients, hub saving, evaluation; and,
that the shipped checkpoint (serve/default_model) reproduces its figures."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import ling
import oracle
from ling import checkpoint
from ling.convert import main as convert_main
from ling.model import LingModel
from offline import data, routing
from offline import eval as ling_eval
from offline import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = [os.path.join(ROOT, "serve", "default_model")]


# ----------------------------------------------------------------------------------------------
# Corpus and tokenizer


def test_split_is_deterministic_disjoint_and_by_file():
    files = data.stdlib_files()
    train_files, held = data.split(files)
    assert set(train_files).isdisjoint(held) and set(train_files) | set(held) == set(files)
    assert 0.02 < len(held) / len(files) < 0.1
    # The same files in another order (another machine's walk) split the same way.
    t2, h2 = data.split(list(reversed(files)))
    assert set(t2) == set(train_files) and set(h2) == set(held)
    # Membership is a fixed function of the relative path (SHA-256), not of the run.
    assert data.is_heldout("chunk.py", 0.05) and data.is_heldout("copyreg.py", 0.05)
    assert not data.is_heldout("os.py", 0.05) and not data.is_heldout("typing.py", 0.05)
    assert all(not f.startswith(("encodings/", "pydoc_data/")) and "site-packages" not in f for f in files)


def test_tokenizer_round_trips_text():
    train_files, held = data.split(data.stdlib_files())
    tok = data.train_tokenizer(data.read_texts(train_files, max_bytes=100_000), 512)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2]
    texts = data.read_texts(held[:3]) + ["déjà vu — ünïcödé ✓ 漢字\n\tdef f(x):\n        return x ** 2\n"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    stream = data.encode(tok, texts)
    assert (stream == data.EOT_ID).sum() == len(texts) and stream[-1] == data.EOT_ID
    seqs = data.pack(stream, 64)
    assert seqs.shape == (len(stream) // 64, 64) and np.array_equal(seqs.reshape(-1), stream[: seqs.size])
    batch = next(data.Batches(stream, 3, 16, seed=0))
    assert batch.shape == (3, 16) and batch.dtype == np.int32


# ----------------------------------------------------------------------------------------------
# Gradients


def test_chunked_kda_gradients_equal_the_recurrences():
    """Training differentiates the chunked form (lax.scan over chunks, solve_triangular inside);
    the token-by-token recurrence is the same function, so their gradients must agree."""
    from pallas_kernels.kda_reference import chunked, l2_normalize, recurrent

    rng = np.random.default_rng(0)
    b, t, h, k = 2, 80, 2, 16  # two chunks, the second one padded
    q = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32)) * k**-0.5
    kk = l2_normalize(jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32)
    g = -5 * jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32))
    s0 = jnp.asarray(0.1 * rng.standard_normal((b, h, k, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, h, k)), jnp.float32)  # a random linear read-out of o

    def loss(form, *args):
        o, s = form(*args)
        final = s if form is chunked else s[:, -1]
        return jnp.sum(o * w) + jnp.sum(final * s0)

    with jax.default_matmul_precision("highest"):
        gc = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=range(6)))(q, kk, v, g, beta, s0)
        gr = jax.jit(jax.grad(lambda *a: loss(recurrent, *a), argnums=range(6)))(q, kk, v, g, beta, s0)
    for name, x, y in zip(("q", "k", "v", "g", "beta", "state"), gc, gr):
        assert np.isfinite(np.asarray(x)).all() and np.abs(np.asarray(y)).max() > 0, name
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-3, atol=2e-4 * float(np.abs(y).max()),
                                   err_msg=name)


def test_training_moe_equals_the_block():
    """Training runs the routed experts as dense GEMMs over all experts (offline.routing); it must be
    the MoE block's function, swiglu limit and shared expert included."""
    from moe.block import MoE

    for limit in (None, 0.5):
        moe = MoE(32, num_experts=8, top_k=2, inter=16, num_shared=1, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=limit, shared_swiglu_limit=None,
                  dtype=jnp.float32, rngs=nnx.Rngs(0))
        moe.expert_bias.set_value(jnp.linspace(-0.05, 0.05, 8))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50, 32)), jnp.float32)  # > 64 pairs too
        want = jax.jit(lambda x: moe(x))(x)
        got = jax.jit(lambda x: routing.dense_experts_moe(moe, x))(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Saving in hub layout


def test_save_hub_round_trip_and_hub_compatibility(tmp_path):
    cfg = train.toy_config(512)
    model = LingModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    for moe in [l.mlp for l in model.layers[1:]] + [model.nextn.layer.mlp]:  # non-trivial biases
        moe.expert_bias.set_value(jnp.linspace(-0.1, 0.1, cfg.num_experts))
    out = str(tmp_path / "hub")
    checkpoint.save_hub(model, out)
    back = ling.load(out, dtype="float32", progress=False)
    assert back.cfg == cfg and back.nextn is not None
    a, b = nnx.to_flat_state(nnx.split(model)[1]), dict(nnx.to_flat_state(nnx.split(back)[1]))
    for path, var in a:
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(b[path][...]), err_msg=str(path))
    tokens = np.arange(70) % 512
    np.testing.assert_array_equal(ling.forward(model, tokens), ling.forward(back, tokens))
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in names
    assert f"model.layers.{cfg.num_hidden_layers}.mlp.experts.7.down_proj.weight" in names

    # transformers reads it as its own (it ignores the NEXTN layer) and computes the same logits.
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert oracle.rel_err(ling.forward(model, tokens), oracle.logits(hf, tokens)) < 1e-4

    # bf16: stored in bf16 except what the model keeps in fp32; the converter reads it.
    out16 = str(tmp_path / "hub16")
    checkpoint.save_hub(model, out16, dtype=jnp.bfloat16)
    t16 = load_file(os.path.join(out16, "model.safetensors"))
    assert t16["model.layers.1.mlp.gate.weight"].dtype == np.float32
    assert t16["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == jnp.bfloat16
    assert convert_main(["--hf", out16, "--out", str(tmp_path / "conv")]) == 0
    m16 = ling.load(out16, dtype="bfloat16", progress=False)
    np.testing.assert_array_equal(ling.forward(m16, tokens), ling.forward(ling.load(str(tmp_path / "conv")), tokens))


# ----------------------------------------------------------------------------------------------
# The command end to end at toy size


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("train") / "ling-toy")
    assert train.main(["--preset", "toy", "--steps", "10", "--lr", "1e-2", "--warmup", "2",
                       "--max-train-bytes", "200000", "--out", out, "--quiet"]) == 0
    return out


def test_training_runs_the_reference_kernels_whatever_the_environment(monkeypatch):
    """The trainer builds its model with the plain-jnp kernels (the Pallas kernels define no VJP),
    router included: LING_KERNELS naming a Pallas backend, as "auto" is on a GPU, changes nothing."""
    monkeypatch.setenv("LING_KERNELS", "interpret")
    trainer = train.Trainer(ling.preset("ling-tiny"), seed=0, lr=1e-3, warmup=1)
    metrics = trainer.step(np.random.default_rng(0).integers(0, 256, (1, 16)), 0, 10)
    assert np.isfinite(float(metrics["loss"]))


def test_train_loss_and_mtp_loss_fall(toy_dir):
    log = [json.loads(line) for line in open(os.path.join(toy_dir, "train_log.jsonl"))]
    steps = [r for r in log if "loss" in r]
    first, last = steps[0], steps[-1]
    assert first["step"] == 1 and last["step"] == 10
    assert last["loss"] < first["loss"] - 0.4, (first["loss"], last["loss"])
    assert last["mtp_loss"] < first["mtp_loss"] - 0.4, (first["mtp_loss"], last["mtp_loss"])
    # Every part of the model got a gradient: KDA (chunked scan), MLA, the router through the
    # routing weights, the routed and shared experts, the NEXTN layer.
    for part in ("kda", "mla", "router", "experts", "shared_expert", "dense_mlp", "nextn", "embed_head"):
        norms = [r[f"grad_norm/{part}"] for r in steps]
        assert all(np.isfinite(norms)) and min(norms) > 0, part
    held = [r for r in log if "heldout_loss" in r]
    assert held[0]["step"] == 0 and held[-1]["step"] == 10
    assert held[-1]["heldout_loss"] < held[0]["heldout_loss"] - 0.4
    meta = json.load(open(os.path.join(toy_dir, "train_meta.json")))
    assert meta["steps_done"] == 10 and meta["heldout_loss"] == held[-1]["heldout_loss"]


def test_train_writes_a_loadable_checkpoint_with_its_tokenizer(toy_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", data.HELDOUT_FILE, "README.md"):
        assert os.path.exists(os.path.join(toy_dir, name)), name
    model = ling.load(toy_dir, progress=False)
    tok = data.load_tokenizer(toy_dir)
    assert model.cfg.vocab_size == tok.get_vocab_size() and model.nextn is not None
    assert "chat_template" in json.load(open(os.path.join(toy_dir, "tokenizer_config.json")))
    tensors = load_file(os.path.join(toy_dir, "model.safetensors"))
    bias = tensors["model.layers.1.mlp.gate.expert_bias"]
    assert bias.dtype == np.float32 and np.abs(bias).max() > 0  # the balancing moved it
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == jnp.bfloat16


def test_eval_runs_end_to_end(toy_dir, tmp_path):
    assert ling_eval.main(["--model", toy_dir, "--seqs", "8", "--num-steps", "2", "--prompts", "2",
                           "--prompt-len", "16", "--new-tokens", "8"]) == 0
    result = json.load(open(os.path.join(toy_dir, "eval.json")))
    assert set(result["perplexity"]) == set(ling_eval.VARIANTS)
    for r in result["perplexity"].values():
        assert np.isfinite(r["nll"]) and 1 < r["ppl"] < 512
    (row,) = result["speculative"]
    assert row["num_steps"] == 2 and 1 <= row["accepted_length"] <= 3
    assert row["matches_greedy"] and row["samples"] > 0
    k, e = result["routing"]["top_k"], result["routing"]["num_experts"]
    assert k <= row["union"] <= min(e, 3 * k) and 0 < row["jaccard"] <= 1 and np.isfinite(row["rho"])
    assert np.isfinite(result["check"]["nll"])
    path = tmp_path / "RESULTS.md"
    ling_eval.record(result, str(path))
    assert "| 2 |" in path.read_text() and "int4+experts" in path.read_text()


# ----------------------------------------------------------------------------------------------
# The shipped checkpoint: serve/default_model, trained by `python -m offline.train --preset small` on the H200


@pytest.mark.parametrize("model_dir", SHIPPED)
def test_shipped_checkpoint_reproduces_its_perplexity(model_dir):
    size = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir))
    assert size <= 40e6, f"{model_dir} holds {size / 1e6:.1f} MB, over the 40 MB limit"
    recorded = json.load(open(os.path.join(model_dir, "eval.json")))  # written by `python -m offline.eval`
    check = recorded["check"]
    seqs = ling_eval.heldout_sequences(model_dir)[: check["seqs"]]
    nll = ling_eval.mean_nll(ling.load(model_dir, dtype="bfloat16", progress=False), seqs, check["batch"])
    assert abs(math.exp(nll) / math.exp(check["nll"]) - 1) < 0.01, (nll, check["nll"])


@pytest.mark.parametrize("model_dir", SHIPPED)
def test_shipped_checkpoint_greedy_speculative_equals_plain(model_dir):
    from spec.generate import generate_batch

    # fp32: in bf16 the verify pass (S+1 tokens at once) and the decode step round differently,
    # and a near-tie of the top two logits may then flip over hundreds of tokens.
    model = ling.load(model_dir, dtype="float32", progress=False)
    seqs = ling_eval.heldout_sequences(model_dir)
    for prompt in (seqs[0, :64].tolist(), seqs[len(seqs) // 2, :32].tolist()):
        plain = generate_batch(model, [prompt], 256, speculative=False)[0]
        spec = generate_batch(model, [prompt], 256, speculative=True, num_steps=4)[0]
        assert len(plain) == 256 and spec == plain

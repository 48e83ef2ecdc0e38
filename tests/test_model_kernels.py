"""The model's prefill, decode and verify paths through the Pallas kernels (interpret mode on CPU)
agree with its plain-jnp path: the KDA prefill and verify kernels and the MLA decode kernel wired
in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ling
import oracle
from ling.state import commit, init_state


def run(model, monkeypatch, kernels, prompt, steps, verify):
    monkeypatch.setenv("LING_KERNELS", kernels)
    cfg = model.cfg
    state = init_state(cfg, 2, 40, jnp.float32)
    _, _, state = model(jnp.asarray(prompt), state, valid=jnp.asarray([20, 13]), form="prefill")
    out = []
    for tok in steps.T:  # one token per step; slot 1 sits out the second step (valid 0)
        valid = jnp.asarray([1, 0 if len(out) == 1 else 1])
        logits, _, state = model(jnp.asarray(tok)[:, None], state, valid=valid, form="decode")
        out.append(np.asarray(logits[:, 0]))
    logits, _, pending = model(jnp.asarray(verify), state, form="verify")
    out.append(np.asarray(logits))
    state = commit(pending, jnp.asarray([4, 1]))
    logits, _, _ = model(jnp.asarray(verify[:, :1]), state, form="decode")
    out.append(np.asarray(logits))
    return out


@pytest.mark.parametrize("name", ["ling-tiny", "kimi-tiny"])
def test_kernel_path_matches_jnp_path(name, monkeypatch):
    model = ling.load(name, dtype="float32", seed=3)
    r = np.random.default_rng(0)
    prompt = r.integers(0, model.cfg.vocab_size, (2, 20))
    steps = r.integers(0, model.cfg.vocab_size, (2, 3))
    verify = r.integers(0, model.cfg.vocab_size, (2, 6))
    ref = run(model, monkeypatch, "reference", prompt, steps, verify)
    got = run(model, monkeypatch, "interpret", prompt, steps, verify)
    for a, b in zip(got, ref):
        assert oracle.rel_err(a, b) < 1e-4


@pytest.mark.parametrize("name", ["ling-tiny", "kimi-tiny"])
def test_prefill_kernel_matches_jnp_path(name, monkeypatch):
    """A ragged prefill over two KDA chunks (64 tokens each): the prefill kernel's logits and the
    state it leaves (every layer's conv and recurrent state, MLA caches) match the jnp path."""
    model = ling.load(name, dtype="float32", seed=5)
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 70)))
    valid = jnp.asarray([70, 41])
    outs = {}
    for kernels in ("reference", "interpret"):
        monkeypatch.setenv("LING_KERNELS", kernels)
        state = init_state(model.cfg, 2, 72, jnp.float32)
        outs[kernels] = model(prompt, state, valid=valid, form="prefill")
    (ref_logits, _, ref_state), (got_logits, _, got_state) = outs["reference"], outs["interpret"]
    for b, n in enumerate(np.asarray(valid)):
        assert oracle.rel_err(got_logits[b, :n], ref_logits[b, :n]) < 1e-4
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(ref_state)):
        assert a.shape == b.shape and oracle.rel_err(a, b) < 1e-4

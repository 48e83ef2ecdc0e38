"""The model against transformers' own BailingHybrid and KimiLinear, on tiny random checkpoints."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ling
import oracle
from ling.config import KDA, MLA, MOE
from ling.model import apply
from ling.state import init_state

TOL = 1e-4  # fp32, relative to the largest logit; measured ~1e-6
PROMPT = 75  # > one KDA chunk of 64
STEPS = 6

CASES = [("bailing", s) for s in (0, 1, 2)] + [("kimi", s) for s in (0, 1)]


def make(family, seed, tmp_path):
    cfg = oracle.random_bailing_config(seed) if family == "bailing" else oracle.random_kimi_config(seed)
    hf = oracle.build(cfg, seed)
    directory = oracle.save(hf, str(tmp_path / f"{family}{seed}"))
    return hf, directory


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}{s}" for f, s in CASES])
def case(request, tmp_path_factory):
    family, seed = request.param
    hf, directory = make(family, seed, tmp_path_factory.mktemp("ckpt"))
    model = ling.load(directory, dtype="float32", progress=False)
    tokens = np.random.default_rng(100 + seed).integers(0, model.cfg.vocab_size, PROMPT + STEPS)
    return hf, model, tokens


def test_every_layer_kind_is_present(case):
    _, model, _ = case
    cfg = model.cfg
    assert {KDA, MLA} <= set(cfg.layer_types) and MOE in cfg.mlp_types and "dense" in cfg.mlp_types
    if cfg.model_type == "bailing_hybrid":
        assert cfg.n_group > 1 and cfg.topk_group < cfg.n_group  # group-limited routing is active


def test_prefill_logits_match_transformers(case):
    hf, model, tokens = case
    err = oracle.rel_err(ling.forward(model, tokens), oracle.logits(hf, tokens))
    print(f"{model.cfg.model_type} prefill rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("form", ["prefill", "decode"])
def test_steps_after_prefill_match_transformers_cached_decode(case, form):
    """Prefill the prompt, then one token per step ("decode": recurrent KDA + absorbed MLA; "prefill":
    the chunked and plain forms on one-token inputs): the logits of transformers' cached decoding."""
    hf, model, tokens = case
    prompt, cont = tokens[:PROMPT], tokens[PROMPT:]
    ref = oracle.cached_decode(hf, prompt, cont)
    state = init_state(model.cfg, 1, PROMPT + STEPS, jnp.float32)
    _, _, state = apply(model, jnp.asarray(prompt)[None], state, form="prefill")
    steps = []
    for tok in cont:
        logits, _, state = apply(model, jnp.asarray([[tok]]), state, form=form)
        steps.append(np.asarray(logits[0, -1]))
    err = oracle.rel_err(np.stack(steps), ref)
    print(f"{model.cfg.model_type} {form} steps rel err {err:.2e}")
    assert err <= TOL


def test_batched_slots_of_different_lengths(case):
    """Two slots at different positions in one batch give each sequence's own logits."""
    import jax

    _, model, tokens = case
    other = np.random.default_rng(7).integers(0, model.cfg.vocab_size, PROMPT + STEPS)
    cap = PROMPT + STEPS + 4
    _, _, ahead = apply(model, jnp.asarray(tokens[None, :4]), init_state(model.cfg, 1, cap, jnp.float32), form="prefill")
    fresh = init_state(model.cfg, 1, cap, jnp.float32)
    state = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ahead, fresh)  # slot 0 at 4, slot 1 at 0
    for form in ("prefill", "decode"):
        logits, _, _ = apply(model, jnp.asarray(np.stack([tokens[4:40], other[:36]])), state, form=form)
        assert oracle.rel_err(logits[0], ling.forward(model, tokens[:40])[4:]) <= TOL
        assert oracle.rel_err(logits[1], ling.forward(model, other[:36])) <= TOL


def test_chunked_and_recurrent_kda_agree():
    from pallas_kernels.kda_reference import chunked, l2_normalize, recurrent

    r = np.random.default_rng(3)
    b, t, h, k, v = 2, 130, 2, 8, 12
    q = l2_normalize(jnp.asarray(r.normal(size=(b, t, h, k)), jnp.float32)) * k**-0.5
    kk = l2_normalize(jnp.asarray(r.normal(size=(b, t, h, k)), jnp.float32))
    vv = jnp.asarray(r.normal(size=(b, t, h, v)), jnp.float32)
    g = -jnp.asarray(r.uniform(0, 4, size=(b, t, h, k)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(b, t, h)), jnp.float32)
    s0 = jnp.asarray(r.normal(size=(b, h, k, v)), jnp.float32)
    o1, states = recurrent(q, kk, vv, g, beta, s0)
    o2, s2 = chunked(q, kk, vv, g, beta, s0)
    assert oracle.rel_err(o2, o1) < 1e-5
    assert oracle.rel_err(s2, states[:, -1]) < 1e-5


def test_absorbed_and_plain_mla_agree():
    model = ling.load("ling-tiny", dtype="float32")
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 20))
    a, _, _ = apply(model, jnp.asarray(tokens), init_state(model.cfg, 2, 24, jnp.float32), form="prefill")
    b, _, _ = apply(model, jnp.asarray(tokens), init_state(model.cfg, 2, 24, jnp.float32), form="decode")
    assert oracle.rel_err(b, a) < 1e-5


def test_bf16_forward_stays_close_to_fp32():
    m32 = ling.load("ling-tiny", dtype="float32", seed=1)
    m16 = ling.load("ling-tiny", dtype=jnp.bfloat16, seed=1)
    tokens = np.random.default_rng(0).integers(0, m32.cfg.vocab_size, 40)
    err = oracle.rel_err(ling.forward(m16, tokens), ling.forward(m32, tokens))
    assert err < 0.1, err


def test_swiglu_limits_clamp_when_configured():
    """The per-layer limits change the output only through the clamp, and only where set."""
    from moe.nn import swiglu

    g = jnp.asarray([-10.0, 0.5, 3.0, 12.0])
    u = jnp.asarray([9.0, -9.0, 2.0, 1.0])
    np.testing.assert_allclose(swiglu(g, u, 4.0), np.minimum(np.asarray(jax_silu(g)), 4.0) * np.clip(u, -4, 4), rtol=1e-6)
    cfg = ling.preset("ling-3-flash")
    assert cfg.swiglu_limit(35, False) == 4.0 and cfg.swiglu_limit(34, False) is None
    assert cfg.swiglu_limit(34, True) == 5.0 and cfg.swiglu_limit(41, True) == 7.0


def jax_silu(x):
    import jax

    return jax.nn.silu(x)


def test_routing_matches_transformers_router():
    from transformers import BailingHybridConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridTopkRouter

    from moe.router import route

    cfg = BailingHybridConfig(hidden_size=32, num_local_experts=64, n_group=8, topk_group=3, num_experts_per_tok=6,
                              routed_scaling_factor=2.5, pad_token_id=0, vocab_size=16)
    router = BailingHybridTopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(50, 32)
    _, w_ref, ids_ref = router(x)
    w, ids = route(jnp.asarray(x.numpy()), jnp.asarray(router.weight.detach().numpy()),
                   jnp.asarray(router.e_score_correction_bias.numpy()), top_k=6, n_group=8, topk_group=3,
                   routed_scaling_factor=2.5, norm_topk_prob=True)
    ids, w = np.asarray(ids), np.asarray(w)
    for i in range(50):  # same experts and weights, whatever the order
        ref = dict(zip(ids_ref[i].tolist(), w_ref[i].detach().tolist()))
        got = dict(zip(ids[i].tolist(), w[i].tolist()))
        assert ref.keys() == got.keys()
        np.testing.assert_allclose([got[e] for e in ref], list(ref.values()), rtol=1e-5)


def test_gathered_and_grouped_expert_paths_agree():
    """The experts' reference in its two forms, skipped pairs (id E) included."""
    from pallas_kernels.experts import reference

    r = np.random.default_rng(0)
    m, k, e, d, i = 5, 3, 8, 16, 12
    x = jnp.asarray(r.normal(size=(m, d)), jnp.float32)
    ids = np.stack([r.choice(e, k, replace=False) for _ in range(m)])
    ids[1, 2] = ids[3, 0] = e  # skipped: adds nothing
    w = jnp.asarray(r.uniform(size=(m, k)), jnp.float32)
    w13 = jnp.asarray(r.normal(size=(e, d, 2 * i)), jnp.float32)
    w2 = jnp.asarray(r.normal(size=(e, i, d)), jnp.float32)
    live = ids < e
    for limit in (None, 2.0):
        a = reference(x, jnp.asarray(ids), w, w13, w2, swiglu_limit=limit, form="gathered")
        b = reference(x, jnp.asarray(ids), w, w13, w2, swiglu_limit=limit, form="grouped")
        assert oracle.rel_err(a, b) < 1e-5
        # A skipped pair equals a pair of weight 0 on any expert.
        c = reference(x, jnp.asarray(np.where(live, ids, 0)), jnp.where(live, w, 0.0), w13, w2, swiglu_limit=limit)
        assert oracle.rel_err(a, c) < 1e-6

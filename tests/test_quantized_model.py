"""A model with grouped low-bit projections: close to its full-precision logits, the same whether
quantised at load or at conversion, and the same through the qmatvec kernel (interpret mode)."""

import jax.numpy as jnp
import numpy as np
import pytest

import ling
import oracle
from ling.quantize import QLinear
from ling.state import init_state
from moe.block import MoE, QExperts
from moe.nn import Linear
from backends import KERNELS

TOKENS = np.random.default_rng(0).integers(0, 256, 40)


@pytest.fixture(scope="module")
def full():
    return ling.forward(ling.load("ling-tiny", dtype="float32", seed=1), TOKENS)


def cosine(a, b):
    a, b = np.ravel(a), np.ravel(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("scheme, max_rel, min_cos", [("int8", 0.1, 0.999), ("int4", 1.0, 0.8)])
def test_quantised_logits_stay_close(full, scheme, max_rel, min_cos):
    """Bounds for this random tiny model (hidden 64, groups of 32); measured: int8 rel 0.059 /
    cos 0.9995, int4 rel 0.76 / cos 0.88 (bf16 alone: rel 0.078). A random 4-layer net amplifies
    weight noise; the trained model's perplexities are the quality figure that matters."""
    model = ling.load("ling-tiny", dtype="float32", seed=1, quantize=scheme, group_size=32)
    q = ling.forward(model, TOKENS)
    assert oracle.rel_err(q, full) <= max_rel and cosine(q, full) >= min_cos


def test_what_is_quantised():
    model = ling.load("ling-tiny", dtype="bfloat16", quantize="int4", group_size=32)
    layer = model.layers[0]
    assert isinstance(layer.attention.in_proj, QLinear) and isinstance(layer.mlp.w2, QExperts)  # dense MLP
    mla = model.layers[2].attention
    assert isinstance(mla.kv_b_proj, Linear)  # used as a tensor by the absorbed form
    moe = model.layers[1].mlp
    assert isinstance(moe.shared_experts.w13, QExperts) and moe.gate_weight[...].dtype == jnp.float32
    assert not isinstance(moe.w13, QExperts)  # the routed experts only with quantize_experts
    assert not isinstance(model.lm_head, QLinear)
    with_head = ling.load("ling-tiny", dtype="bfloat16", quantize="int8", group_size=32, quantize_lm_head=True)
    assert isinstance(with_head.lm_head, QLinear)


def test_bad_scheme_is_named():
    with pytest.raises(ValueError, match="quantize must be one of"):
        ling.load("ling-tiny", quantize="int3")
    with pytest.raises(ValueError, match="group_size"):
        ling.load("ling-tiny", quantize="int4", group_size=48)


def test_converted_quantised_checkpoint_serves_the_same_model(tmp_path):
    from ling.convert import main as convert_main

    hf = oracle.build(oracle.random_bailing_config(0, hidden_size=64, moe_intermediate_size=32), 0)
    hub = oracle.save(hf, str(tmp_path / "hub"))
    out = str(tmp_path / "q")
    assert convert_main(["--hf", hub, "--out", out, "--quantize", "int4", "--group-size", "32"]) == 0
    a = ling.forward(ling.load(hub, quantize="int4", group_size=32, progress=False), TOKENS % 90)
    b = ling.forward(ling.load(out), TOKENS % 90)
    np.testing.assert_array_equal(a, b)
    assert isinstance(ling.load(out).layers[0].attention.in_proj, QLinear)


def decode_logits(model):
    """Logits [2, vocab] of decode steps 21 and 22 of TOKENS, after a prefill of the first 20."""
    state = init_state(model.cfg, 1, 22, jnp.float32)
    _, _, state = model(jnp.asarray(TOKENS[None, :20]), state, form="prefill")
    steps = []
    for tok in TOKENS[20:22]:
        logits, _, state = model(jnp.asarray([[tok]]), state, form="decode")
        steps.append(np.asarray(logits[0, 0]))
    return np.stack(steps)


@pytest.mark.parametrize("backend", KERNELS)
def test_decode_through_qmatvec_kernel_matches_prefill(backend):
    """Decode steps (qmatvec, interpret mode) give the logits of one prefill (dequantise + dot)."""
    model = ling.load("ling-tiny", dtype="float32", seed=2, quantize="int8", group_size=32, kernels=backend)
    full = ling.forward(model, TOKENS[:22])
    assert oracle.rel_err(decode_logits(model), full[20:]) < 2e-2  # qmatvec rounds its output to bf16


# ----------------------------------------------------------------------------------------------
# Routed experts in the fused MoE kernel's grouped format (quantize_experts)


def _dequantised_experts_model(q_model, seed):
    """The same model with full-precision routed experts equal to q_model's dequantised ones."""
    from moe.block import _dense

    model = ling.load("ling-tiny", dtype="float32", seed=seed, quantize="int8", group_size=32)
    for layer, q_layer in zip(model.layers, q_model.layers):
        if isinstance(q_layer.mlp, MoE):
            w13, w2 = q_layer.mlp.expert_weights()
            layer.mlp.w13[...] = _dense(w13).astype(jnp.float32)
            layer.mlp.w2[...] = _dense(w2).astype(jnp.float32)
    return model


def test_quantised_experts_compute_their_dequantised_weights(full):
    """The quantised-expert model (reference kernels: experts dequantised where used) gives the
    logits of a model holding those dequantised experts in full precision, up to the bf16
    rounding of the experts' input and h that low-bit experts take (`experts.reference`, as the
    kernels), and stays close to the full-precision model (int8; measured rel 0.059 / cos
    0.99946, as with only the projections quantised)."""
    model = ling.load("ling-tiny", dtype="float32", seed=1, quantize="int8", group_size=32, quantize_experts=True)
    moe = model.layers[1].mlp
    assert isinstance(moe.w13, QExperts) and isinstance(moe.w2, QExperts)
    assert moe.w13.weight.words.shape[0] == model.cfg.num_experts
    q = ling.forward(model, TOKENS)
    assert oracle.rel_err(q, ling.forward(_dequantised_experts_model(model, 1), TOKENS)) <= 2e-3
    assert oracle.rel_err(q, full) <= 0.1 and cosine(q, full) >= 0.999


@pytest.mark.parametrize("backend", KERNELS)
def test_decode_through_fused_moe_int4_experts_matches_prefill(backend):
    """Decode steps through the fused MoE kernel on int4 experts (interpret mode) give the logits
    of one reference prefill of the same model."""
    model = ling.load("ling-tiny", dtype="float32", seed=3, quantize="int4", group_size=32, quantize_experts=True)
    full = ling.forward(model, TOKENS[:22])
    ling.use_kernels(model, backend)
    assert oracle.rel_err(decode_logits(model), full[20:]) < 2e-2  # the kernels round h and outputs to bf16


def test_converted_checkpoint_keeps_quantised_experts(tmp_path):
    from ling.convert import main as convert_main

    hf = oracle.build(oracle.random_bailing_config(0, hidden_size=64, moe_intermediate_size=32), 0)
    hub = oracle.save(hf, str(tmp_path / "hub"))
    out = str(tmp_path / "q")
    args = ["--quantize", "int4", "--group-size", "32", "--quantize-experts"]
    assert convert_main(["--hf", hub, "--out", out, *args]) == 0
    loaded = ling.load(out)
    assert all(isinstance(layer.mlp.w13, QExperts) for layer in loaded.layers if isinstance(layer.mlp, MoE))
    a = ling.forward(ling.load(hub, quantize="int4", group_size=32, quantize_experts=True, progress=False),
                     TOKENS % 90)
    np.testing.assert_array_equal(a, ling.forward(loaded, TOKENS % 90))


def test_quantised_experts_errors_are_named():
    with pytest.raises(ValueError, match="quantize_experts needs quantize"):
        ling.load("ling-tiny", quantize_experts=True)
    with pytest.raises(ValueError, match="int4 or int8"):
        ling.load("ling-tiny", quantize="int2", group_size=32, quantize_experts=True)
    from ling import build
    from ling.quantize import Quantization
    from moe.parallel import make_mesh

    with pytest.raises(ValueError, match="expert parallelism"):
        build.plan(ling.preset("ling-tiny"), dtype=jnp.float32, quant=Quantization(4, 32, experts=True),
                   mesh=make_mesh(1))


def test_row_layout_serves_the_tile_layouts_model(tmp_path):
    """int4 in the row layout (the tensor-core kernels'): projections, lm_head, dense MLP and
    experts, quantised at load or re-laid out from a checkpoint converted in the tile layout: the
    same weights, and so the same logits."""
    from ling.convert import main as convert_main

    cfg = oracle.random_bailing_config(0, hidden_size=128, intermediate_size=128, moe_intermediate_size=128)
    hub = oracle.save(oracle.build(cfg, 0), str(tmp_path / "hub"))
    out = str(tmp_path / "q")
    assert convert_main(["--hf", hub, "--out", out, "--quantize", "int4", "--quantize-lm-head",
                         "--quantize-experts"]) == 0
    tokens = TOKENS % 90
    kw = dict(quantize="int4", quantize_lm_head=True, quantize_experts=True, progress=False)
    tiles = ling.forward(ling.load(hub, **kw), tokens)
    rows_out = str(tmp_path / "rows")
    assert convert_main(["--hf", hub, "--out", rows_out, "--quantize", "int4", "--quantize-lm-head",
                         "--quantize-experts", "--quantize-layout", "rows"]) == 0
    for model in (ling.load(hub, quantize_layout="rows", **kw), ling.load(out, quantize_layout="rows", **kw),
                  ling.load(rows_out, progress=False)):
        proj, moe = model.layers[0].attention.in_proj, model.layers[1].mlp
        assert isinstance(proj, QLinear) and proj.weight.layout == "rows" and model.lm_head.weight.layout == "rows"
        assert isinstance(moe.w13, QExperts) and moe.w13.weight.layout == "rows"
        assert moe.shared_experts.w2.weight.layout == "rows" and model.layers[0].mlp.w13.weight.layout == "rows"
        np.testing.assert_array_equal(ling.forward(model, tokens), tiles)
    with pytest.raises(ValueError, match="row layout"):
        ling.load(hub, quantize="int2", quantize_layout="rows", progress=False)


@pytest.mark.parametrize("backend", KERNELS)
def test_ticket_sums_serve_the_same_tokens(backend, speculative=True):
    """The speculative Stepper with tickets (split-K matvecs summed in their own launch at one
    token and at the verify's, the router's gate and selection in one, the MoE at one token;
    interpret mode) emits the greedy tokens it emits without them, and hands back its counters
    all zero."""
    from spec.generate import prefill
    from spec.sampling import SamplingParams
    from spec.step import new_slots
    from spec.stepper import Stepper

    model = ling.load("ling-tiny", dtype="float32", seed=3, quantize="int4", group_size=32, quantize_experts=True,
                      kernels=backend)
    prompts = [TOKENS[:9], TOKENS[3:14]]

    def run(tickets):
        slots = new_slots(model, 2, 48, 24)
        slots = prefill(model, slots, prompts, np.ones(2, bool), SamplingParams.make(2), np.full(2, 12),
                        np.full(2, -1))
        stepper = Stepper(model, slots, speculative=speculative, num_steps=2, tickets=tickets)
        tokens = [[], []]
        for _ in range(3):
            out = stepper.step()
            for b, t in enumerate(out[0] if out else [[], []]):
                tokens[b] += t
        for b, t in enumerate(stepper.drain()[0]):
            tokens[b] += t
        return tokens, stepper._counts[1]

    plain, _ = run(False)
    with_tickets, counters = run(True)
    assert with_tickets == plain and sum(map(len, plain)) > 0
    assert not np.asarray(counters).any()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m", [16, 24, 32, 33, 64])
def test_a_projection_of_up_to_32_rows_runs_qmatvec_in_calls_of_16(backend, m, monkeypatch):
    """QLinear over m rows: x @ W̃ᵀ of the dequantised weight (qmatvec rounds through bf16), through
    the qmatvec kernel in calls of at most 16 rows up to 32 rows, and by dequantising the weight
    beyond (and beyond 16 rows on the reference backend, whose float32 models keep their rounding)."""
    import ling.quantize as lq
    from pallas_kernels.quant import dequantize, quantize

    calls = []
    monkeypatch.setattr(lq, "qmatvec", lambda x, w, **kw: calls.append(x.shape[0]) or qmatvec(x, w, **kw))
    from pallas_kernels.qmatvec import qmatvec

    rng = np.random.default_rng(m)
    w = quantize(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32), bits=4, group_size=32)
    x = jnp.asarray(rng.standard_normal((m, 128)), jnp.float32)
    got = np.asarray(QLinear(w, kernels=backend)(x))
    want = np.asarray(x @ dequantize(w).T)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    assert calls == ([] if m > 32 else [m] if m <= 16 else [m // -(-m // 16)] * -(-m // 16))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m", [17, 96, 97])
def test_a_projection_of_17_to_96_rows_runs_the_dense_gemm(backend, m, monkeypatch):
    """QLinear over m rows with groups of 128 (the dense kernel's K): one call of the grouped
    GEMM's dense entry up to 96 rows, x @ W̃ᵀ of the dequantised weight rounded once; beyond, the
    dequantised weight's product."""
    import ling.quantize as lq
    from pallas_kernels import grouped_gemm as gg
    from pallas_kernels.quant import dequantize, quantize

    calls = []
    monkeypatch.setattr(lq, "dense", lambda x, w, **kw: calls.append(x.shape[0]) or gg.dense(x, w, **kw))
    rng = np.random.default_rng(m)
    w = quantize(jnp.asarray(rng.standard_normal((200, 256)), jnp.float32), bits=4, group_size=128)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    got = np.asarray(QLinear(w, kernels=backend)(x), np.float32)
    want = np.asarray(x.astype(jnp.float32) @ dequantize(w).T)
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=2.0**-8 * np.abs(want).max())
    assert calls == ([m] if m <= 96 else [])

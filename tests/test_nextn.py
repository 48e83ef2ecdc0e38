"""The NEXTN draft layer against a composition of transformers' own modules holding the same weights."""

import jax.numpy as jnp
import numpy as np
import torch
from safetensors.numpy import load_file
from torch import nn

import ling
import oracle
from ling.state import mla_cache


def test_nextn_matches_transformers_modules(tmp_path):
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridRMSNorm

    n = 4
    # A model with one more layer, MLA + MoE: its layer n is the NEXTN decoder layer, saved in hub layout.
    big_cfg = oracle.random_bailing_config(5, num_hidden_layers=n + 1,
                                           layer_types=["linear_attention", "linear_attention", "full_attention",
                                                        "linear_attention", "full_attention"])
    big = oracle.build(big_cfg, 5)
    big_dir = oracle.save(big, str(tmp_path / "big"))
    tensors = load_file(f"{big_dir}/model.safetensors")

    d = big_cfg.hidden_size
    g = torch.Generator().manual_seed(9)
    enorm, hnorm, final = (BailingHybridRMSNorm(d, big_cfg.rms_norm_eps) for _ in range(3))
    eh_proj = nn.Linear(2 * d, d, bias=False)
    with torch.no_grad():
        for norm in (enorm, hnorm, final):
            norm.weight.add_(0.2 * torch.randn(d, generator=g))
        eh_proj.weight.normal_(std=0.1, generator=g)
    pre = f"model.layers.{n}."
    extra = {pre + "enorm.weight": enorm.weight, pre + "hnorm.weight": hnorm.weight,
             pre + "final_layernorm.weight": final.weight, pre + "eh_proj.weight": eh_proj.weight}
    extra = {k: v.detach().numpy() for k, v in extra.items()}

    # The target checkpoint: the first n layers, plus the big model's layer n as the MTP layer.
    target_dir = oracle.save(big, str(tmp_path / "target"))
    oracle.add_tensors(target_dir, {**tensors, **extra}, config_updates={
        "num_hidden_layers": n, "layer_types": big_cfg.layer_types[:n], "mlp_layer_types": big_cfg.mlp_layer_types[:n],
        "num_nextn_predict_layers": 1})
    model = ling.load(target_dir, dtype="float32", progress=False)
    assert model.nextn is not None

    t = 12
    r = np.random.default_rng(0)
    hidden = r.normal(size=(1, t, d)).astype(np.float32)
    next_tokens = r.integers(0, big_cfg.vocab_size, (1, t))
    cache = mla_cache(model.cfg, 1, t, jnp.float32)
    logits, h, _ = model.draft(jnp.asarray(hidden), jnp.asarray(next_tokens), cache, jnp.zeros((1,), jnp.int32))

    with torch.no_grad():
        emb = big.model.embed_tokens(torch.tensor(next_tokens))
        x = eh_proj(torch.cat([enorm(emb), hnorm(torch.tensor(hidden))], dim=-1))
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = big.model.layers[n](x, attention_mask=mask, position_ids=pos,
                                position_embeddings=big.model.rotary_emb(x, pos))
        ref_h = final(x)
        ref_logits = big.lm_head(ref_h)
    assert oracle.rel_err(h[0], ref_h[0].numpy()) < 1e-4
    assert oracle.rel_err(logits[0], ref_logits[0].numpy()) < 1e-4

    # The target itself is unchanged by the MTP tensors (transformers ignores them).
    tokens = r.integers(0, big_cfg.vocab_size, 70)
    hf_target = oracle.build(oracle.random_bailing_config(5), 5)
    hf_target.load_state_dict({k: v for k, v in big.state_dict().items() if f"layers.{n}." not in k}, strict=True)
    assert oracle.rel_err(ling.forward(model, tokens), oracle.logits(hf_target, tokens)) < 1e-4


def test_checkpoint_without_mtp_tensors_loads_without_nextn(tmp_path):
    hf = oracle.build(oracle.random_bailing_config(1), 1)
    model = ling.load(oracle.save(hf, str(tmp_path / "m")), dtype="float32", progress=False)
    assert model.cfg.num_nextn_layers == 1 and model.nextn is None

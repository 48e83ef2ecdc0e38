"""ModelConfig: presets with the real shapes, hub configs, and errors that name the field."""

import json
import os

import pytest

from ling.config import KDA, MLA, ConfigError, ModelConfig, from_hub_config, load_config, preset


def test_ling_3_flash_preset_has_the_real_shapes():
    c = preset("ling-3-flash")
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (2560, 42, 157184)
    assert c.layer_types.count(KDA) == 35 and c.mla_layers == tuple(range(5, 42, 6))
    assert c.mlp_types[:2] == ("dense", "dense") and c.mlp_types[2:] == ("moe",) * 40
    assert (c.num_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (512, 8, 8, 4)
    assert (c.moe_intermediate_size, c.intermediate_size, c.routed_scaling_factor) == (768, 6144, 2.5)
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_gate, c.kda_lower_bound) == (32, 128, "safe", -5.0)
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (512, 128, 64, 128)
    assert c.softmax_scale == pytest.approx(192**-0.5) and c.num_nextn_layers == 1
    assert (c.eos_token_id, c.pad_token_id) == (156895, 156892)


def test_kimi_linear_preset_has_the_real_shapes():
    c = preset("kimi-linear-48b")
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (2304, 27, 163840)
    assert [i + 1 for i in c.mla_layers] == [4, 8, 12, 16, 20, 24, 27]
    assert (c.num_experts, c.moe_intermediate_size, c.n_group, c.kda_gate) == (256, 1024, 1, "softplus")
    assert not c.mla_rope and not c.mla_output_gate and c.mlp_types[0] == "dense"


def test_kimi_hub_config_with_linear_attn_config():
    d = {"model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
         "intermediate_size": 64, "num_attention_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
         "qk_rope_head_dim": 8, "v_head_dim": 8, "num_experts": 8, "num_experts_per_token": 2,
         "moe_intermediate_size": 16, "num_shared_experts": 1, "first_k_dense_replace": 1,
         "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 2,
                                "short_conv_kernel_size": 4}}
    c = from_hub_config(d)
    assert c.layer_types == (KDA, MLA, KDA, MLA) and c.kda_head_dim == 16 and c.num_experts == 8


def test_round_trip_through_json(tmp_path):
    c = preset("ling-3-flash")
    p = tmp_path / "ling_config.json"
    p.write_text(json.dumps(c.to_json()))
    assert load_config(str(p)) == c


@pytest.mark.parametrize("change, field", [
    (dict(n_group=3), "n_group"),
    (dict(topk_group=9), "topk_group"),
    (dict(num_experts_per_tok=600), "num_experts_per_tok"),
    (dict(layer_types=("kda",) * 41), "layer_types"),
    (dict(layer_types=("kda",) * 41 + ("gqa",)), "layer_types"),
    (dict(kda_gate="relu"), "kda_gate"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(expert_swiglu_limits=(1.0,)), "expert_swiglu_limits"),
])
def test_inconsistent_field_is_named(change, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        preset("ling-3-flash").replace(**change)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(model_type="llama"), "model_type"),
    (lambda d: d.pop("hidden_size"), "hidden_size"),
    (lambda d: d.update(q_lora_rank=64), "q_lora_rank"),
    (lambda d: d.update(layer_types=["full_attention", "sliding"]), "layer_types"),
])
def test_bad_hub_config_is_named(edit, field):
    d = {"model_type": "bailing_hybrid", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
         "intermediate_size": 64, "num_attention_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
         "qk_rope_head_dim": 8, "v_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "num_expert_group": 2,
         "topk_group": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1}
    from_hub_config(d)  # valid as given
    edit(d)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        from_hub_config(d)


def test_unknown_preset_and_path():
    with pytest.raises(ConfigError, match="unknown preset|neither a preset"):
        load_config("ling-9-huge")


def test_unknown_field_in_converted_config():
    with pytest.raises(ConfigError, match="unknown field"):
        ModelConfig.from_json({**preset("ling-tiny").to_json(), "bogus": 1})


def test_first_layers_cuts_a_preset_and_keeps_the_nextn_limits():
    import ling

    full = ling.preset("ling-3-flash")
    cut = full.first_layers(16)
    assert cut.num_hidden_layers == 16 and cut.layer_types == full.layer_types[:16]
    assert cut.swiglu_limit(16, False) == full.swiglu_limit(42, False)  # the NEXTN entry follows the layers
    assert len(cut.shared_swiglu_limits) == 17
    m = ling.load("ling-tiny", num_layers=2, dtype="float32")
    assert len(m.layers) == 2 and m.nextn is not None
    with pytest.raises(ValueError, match="cannot cut 4 layers to 9"):
        ling.load("ling-tiny", num_layers=9)
    with pytest.raises(ValueError, match="preset"):
        ling.load(os.path.join(os.path.dirname(__file__), "..", "serve", "default_model"), num_layers=2)

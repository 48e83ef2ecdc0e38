"""Tiny random transformers models (`BailingHybrid`, `KimiLinear`) written by `save_pretrained`:
checkpoints in the real hub layout, and the reference implementation nobody here wrote."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.numpy import load_file, save_file


def random_bailing_config(seed: int, **overrides):
    from transformers import BailingHybridConfig

    r = np.random.default_rng(seed)
    heads = int(r.choice([2, 4]))
    n_group = int(r.choice([2, 4]))
    per_group = int(r.choice([2, 4]))
    kw = dict(
        vocab_size=int(r.choice([96, 160])), hidden_size=int(r.choice([32, 48])), intermediate_size=64,
        moe_intermediate_size=int(r.choice([16, 24])), num_hidden_layers=4, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=int(r.choice([16, 32])), qk_nope_head_dim=int(r.choice([8, 16])),
        qk_rope_head_dim=int(r.choice([4, 8])), v_head_dim=int(r.choice([8, 16])),
        head_dim=int(r.choice([8, 16])),  # the KDA head dim
        n_group=n_group, topk_group=max(1, n_group // 2), num_local_experts=n_group * per_group,
        num_experts_per_tok=min(int(r.choice([2, 3])), max(1, n_group // 2) * per_group), first_k_dense_replace=1, layer_group_size=3,
        rope_theta=float(r.choice([1e4, 6e6])), routed_scaling_factor=float(r.uniform(1.0, 3.0)),
        kda_safe_gate=True, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
    )
    kw.update(overrides)
    return BailingHybridConfig(**kw)


def random_kimi_config(seed: int, **overrides):
    from transformers import KimiLinearConfig

    r = np.random.default_rng(seed)
    heads = int(r.choice([2, 4]))
    kw = dict(
        vocab_size=int(r.choice([96, 160])), hidden_size=int(r.choice([32, 48])), intermediate_size=64,
        moe_intermediate_size=int(r.choice([16, 24])), num_hidden_layers=4, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=int(r.choice([16, 32])), qk_nope_head_dim=int(r.choice([8, 16])),
        qk_rope_head_dim=int(r.choice([4, 8])), v_head_dim=int(r.choice([8, 16])),
        linear_head_dim=int(r.choice([8, 16])), linear_num_heads=heads,
        num_local_experts=int(r.choice([4, 8])), num_experts_per_tok=2, n_group=1, topk_group=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        routed_scaling_factor=float(r.uniform(1.0, 3.0)), pad_token_id=0, eos_token_id=1, bos_token_id=2,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def build(config, seed: int):
    """A transformers model with random weights, its small vectors (norm weights, expert bias, gate
    biases) perturbed too so that a mis-mapped vector shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "A_log" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    return model


def save(model, directory: str) -> str:
    model.save_pretrained(directory)
    return directory


def add_tensors(directory: str, tensors: dict[str, np.ndarray], config_updates: dict | None = None) -> None:
    """Adds tensors to a saved single-file checkpoint (and updates its config.json)."""
    path = os.path.join(directory, "model.safetensors")
    data = load_file(path)
    data.update(tensors)
    save_file(data, path, metadata={"format": "pt"})
    if config_updates:
        cfg_path = os.path.join(directory, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.update(config_updates)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)


@torch.no_grad()
def logits(model, tokens) -> np.ndarray:
    return model(torch.tensor(np.asarray(tokens))[None]).logits[0].numpy()


@torch.no_grad()
def cached_decode(model, prompt, continuation) -> np.ndarray:
    """transformers' own cached decoding: prefill the prompt, then one token per step.
    Returns the logits of each step [len(continuation), V]."""
    out = model(torch.tensor(np.asarray(prompt))[None], use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    steps = []
    for tok in continuation:
        out = model(torch.tensor([[int(tok)]]), cache=cache, use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        steps.append(out.logits[0, -1].numpy())
    return np.stack(steps)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())

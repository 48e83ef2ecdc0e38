"""The model configuration: one frozen dataclass, built from a hub `config.json` or a preset name.

Both families the project serves are described by the same fields:
- `bailing_hybrid` (Ling-3.0-flash): KDA with the bounded "safe" gate, MLA with interleaved RoPE and
  a head-wise sigmoid output gate, a group-limited sigmoid router.
- `kimi_linear` (Kimi-Linear): KDA with the softplus gate and low-rank gate projections, MLA
  without RoPE and without an output gate, a single expert group.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"
MODEL_TYPES = ("bailing_hybrid", "kimi_linear")


class ConfigError(ValueError):
    """A config field is missing, unknown or inconsistent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # KDA or MLA, one per layer
    mlp_types: tuple[str, ...]  # DENSE or MOE, one per layer
    intermediate_size: int  # dense SwiGLU MLP
    rms_norm_eps: float
    # KDA (linear attention)
    kda_num_heads: int
    kda_head_dim: int
    conv_size: int
    kda_gate: str  # "safe" (Ling: lower_bound * sigmoid) or "softplus" (Kimi)
    kda_lower_bound: float
    # MLA (full attention)
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_rope: bool  # Kimi-Linear's MLA uses no positional encoding
    mla_output_gate: bool  # Ling's head-wise sigmoid gate
    rope_theta: float
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    # SwiGLU clamps `min(silu(g), L) * clamp(u, -L, L)` per layer (None: no clamp). The hub
    # reference ignores them; Ling-3.0-flash's serving stacks apply them on its last layers.
    expert_swiglu_limits: tuple[float | None, ...] = ()
    shared_swiglu_limits: tuple[float | None, ...] = ()
    num_nextn_layers: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None

    def __post_init__(self):
        _validate(self)

    # Derived sizes, named once.
    @property
    def kda_dim(self) -> int:  # H * K channels of each of q, k, v
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)

    def swiglu_limit(self, layer: int, shared: bool) -> float | None:
        limits = self.shared_swiglu_limits if shared else self.expert_swiglu_limits
        return limits[layer] if layer < len(limits) else None

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def first_layers(self, n: int) -> "ModelConfig":
        """The model cut to its first n decoder layers (the NEXTN layer kept): a preset that fits
        one device for benchmarks. The per-layer SwiGLU limits keep their layers and the NEXTN entry."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"num_hidden_layers: cannot cut {self.num_hidden_layers} layers to {n} "
                              f"(1..{self.num_hidden_layers})")
        cut = lambda limits: limits[:n] + limits[self.num_hidden_layers:] if limits else limits  # noqa: E731
        return self.replace(num_hidden_layers=n, layer_types=self.layer_types[:n], mlp_types=self.mlp_types[:n],
                            expert_swiglu_limits=cut(self.expert_swiglu_limits),
                            shared_swiglu_limits=cut(self.shared_swiglu_limits))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        """Reads back what `to_json` wrote (the project's own format, as in converted checkpoints)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown field(s) in model config: {', '.join(unknown)}")
        tuples = {"layer_types", "mlp_types", "expert_swiglu_limits", "shared_swiglu_limits"}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items()})


def _validate(c: ModelConfig) -> None:
    def need(ok: bool, field: str, why: str):
        if not ok:
            raise ConfigError(f"config field {field!r}: {why}")

    need(c.model_type in MODEL_TYPES, "model_type", f"unknown model type {c.model_type!r}; expected one of {MODEL_TYPES}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim", "conv_size",
                 "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
        need(int(getattr(c, name)) > 0, name, f"must be a positive integer, got {getattr(c, name)!r}")
    need(len(c.layer_types) == c.num_hidden_layers, "layer_types",
         f"has {len(c.layer_types)} entries for num_hidden_layers={c.num_hidden_layers}")
    need(set(c.layer_types) <= {KDA, MLA}, "layer_types", f"entries must be {KDA!r} or {MLA!r}, got {c.layer_types}")
    need(len(c.mlp_types) == c.num_hidden_layers, "mlp_layer_types",
         f"has {len(c.mlp_types)} entries for num_hidden_layers={c.num_hidden_layers}")
    need(set(c.mlp_types) <= {DENSE, MOE}, "mlp_layer_types", f"entries must be {DENSE!r} or {MOE!r}, got {c.mlp_types}")
    need(c.kda_gate in ("safe", "softplus"), "kda_gate", f"must be 'safe' or 'softplus', got {c.kda_gate!r}")
    need(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even for RoPE pairs, got {c.qk_rope_head_dim}")
    if MOE in c.mlp_types:
        need(c.num_experts > 0, "num_experts", "must be positive when a layer is MoE")
        need(0 < c.num_experts_per_tok <= c.num_experts, "num_experts_per_tok",
             f"must be in 1..num_experts={c.num_experts}, got {c.num_experts_per_tok}")
        need(c.n_group > 0 and c.num_experts % c.n_group == 0, "n_group",
             f"must divide num_experts={c.num_experts}, got {c.n_group}")
        need(0 < c.topk_group <= c.n_group, "topk_group", f"must be in 1..n_group={c.n_group}, got {c.topk_group}")
        need(c.num_experts // c.n_group >= 2, "n_group", "each group needs at least 2 experts (group score = top-2 sum)")
        need(c.num_experts_per_tok <= c.topk_group * (c.num_experts // c.n_group), "num_experts_per_tok",
             f"{c.num_experts_per_tok} exceeds the experts of the kept groups ({c.topk_group} x {c.num_experts // c.n_group})")
        need(c.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive when a layer is MoE")
    for name in ("expert_swiglu_limits", "shared_swiglu_limits"):
        limits = getattr(c, name)
        need(len(limits) in (0, c.num_hidden_layers + c.num_nextn_layers), name,
             f"has {len(limits)} entries; expected 0 or {c.num_hidden_layers + c.num_nextn_layers} (layers + NEXTN)")


# ----------------------------------------------------------------------------------------------
# Hub config.json


def from_hub_config(d: dict[str, Any]) -> ModelConfig:
    """Builds the config from a hub `config.json` dict (`bailing_hybrid` or `kimi_linear`).

    Accepts both the canonical transformers names and the aliases real checkpoints use
    (`num_experts` for `num_local_experts`, `num_expert_group` for `n_group`, ...).
    """
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config field 'model_type': unknown model type {model_type!r}; expected one of {MODEL_TYPES}")

    def get(*names, default=_REQUIRED):
        for n in names:
            if n in d and d[n] is not None:
                return d[n]
        if default is _REQUIRED:
            raise ConfigError(f"config field {names[0]!r} is missing")
        return default

    if get("hidden_act", default="silu") != "silu":
        raise ConfigError(f"config field 'hidden_act': only 'silu' is supported, got {d['hidden_act']!r}")
    if get("q_lora_rank", default=None) is not None:
        raise ConfigError("config field 'q_lora_rank': low-rank query projections are not supported (both model "
                          "families use a plain q_proj; expected null)")
    n_layers = int(get("num_hidden_layers"))
    kimi = model_type == "kimi_linear"
    linear_cfg = d.get("linear_attn_config") or {}

    if "layer_types" in d and d["layer_types"] is not None:
        names = {"full_attention": MLA, "linear_attention": KDA}
        bad = [t for t in d["layer_types"] if t not in names]
        if bad:
            raise ConfigError(f"config field 'layer_types': unknown layer type(s) {sorted(set(bad))}")
        layer_types = tuple(names[t] for t in d["layer_types"])
    elif kimi and "full_attn_layers" in linear_cfg:
        full = {int(i) - 1 for i in linear_cfg["full_attn_layers"]}  # 1-based in the checkpoint
        layer_types = tuple(MLA if i in full else KDA for i in range(n_layers))
    elif kimi:
        layer_types = tuple(MLA if i and i % 4 == 0 else KDA for i in range(n_layers))
    else:
        group = int(get("layer_group_size", default=6))
        layer_types = tuple(MLA if (i + 1) % group == 0 else KDA for i in range(n_layers))

    if "mlp_layer_types" in d and d["mlp_layer_types"] is not None:
        names = {"dense": DENSE, "sparse": MOE}
        bad = [t for t in d["mlp_layer_types"] if t not in names]
        if bad:
            raise ConfigError(f"config field 'mlp_layer_types': unknown type(s) {sorted(set(bad))}")
        mlp_types = tuple(names[t] for t in d["mlp_layer_types"])
    else:
        k = int(get("first_k_dense_replace", default=1 if kimi else 2))
        mlp_types = tuple(DENSE if i < k else MOE for i in range(n_layers))

    attn_heads = int(get("num_attention_heads"))
    if kimi:
        kda_heads = int(linear_cfg.get("num_heads", get("linear_num_heads", default=attn_heads)))
        kda_head_dim = int(linear_cfg.get("head_dim", get("linear_head_dim", default=128)))
        conv = int(linear_cfg.get("short_conv_kernel_size", get("linear_conv_kernel_dim", default=4)))
    else:
        # transformers overwrites `head_dim` with the rope dim on save and keeps the KDA one in
        # `linear_head_dim`; the original hub config has only `head_dim`.
        kda_heads = int(get("linear_num_heads", default=attn_heads))
        kda_head_dim = int(get("linear_head_dim", "head_dim", default=128))
        conv = int(get("short_conv_kernel_size", "linear_conv_kernel_dim", default=4))

    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not kimi and rope_type != "default":
        raise ConfigError(f"config field 'rope_parameters': rope_type {rope_type!r} is not supported (only 'default')")
    n_mtp = int(get("num_nextn_predict_layers", "num_mtp_layers", default=0)) if not kimi else 0

    def limits(name):
        v = d.get(name)
        if v is None:
            return ()
        if isinstance(v, (int, float)):
            return (float(v),) * (n_layers + n_mtp)
        return tuple(None if x in (None, 0) else float(x) for x in v)

    eos = get("eos_token_id", default=None)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        mlp_types=mlp_types,
        intermediate_size=int(get("intermediate_size")),
        rms_norm_eps=float(get("rms_norm_eps", default=1e-5 if kimi else 1e-6)),
        kda_num_heads=kda_heads,
        kda_head_dim=kda_head_dim,
        conv_size=conv,
        kda_gate="softplus" if kimi or not get("kda_safe_gate", default=True) else "safe",
        kda_lower_bound=float(get("kda_lower_bound", default=-5.0)),
        num_attention_heads=attn_heads,
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
        mla_rope=not kimi,
        mla_output_gate=not kimi,
        rope_theta=float(rope.get("rope_theta", get("rope_theta", default=6e6))),
        num_experts=int(get("num_local_experts", "num_experts", "n_routed_experts", default=0)),
        num_experts_per_tok=int(get("num_experts_per_tok", "num_experts_per_token", default=0)),
        moe_intermediate_size=int(get("moe_intermediate_size", default=0)),
        num_shared_experts=int(get("n_shared_experts", "num_shared_experts", default=0)),
        n_group=int(get("n_group", "num_expert_group", default=1)),
        topk_group=int(get("topk_group", default=1)),
        routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", "moe_renormalize", default=True)),
        expert_swiglu_limits=limits("expert_swiglu_limit_list"),
        shared_swiglu_limits=limits("share_expert_swiglu_limit_list"),
        num_nextn_layers=n_mtp,
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        max_position_embeddings=int(get("max_position_embeddings", "model_max_length", default=262144)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=get("pad_token_id", default=None),
        bos_token_id=get("bos_token_id", default=None),
    )


_REQUIRED = object()


# ----------------------------------------------------------------------------------------------
# Presets


def _ling_3_flash() -> ModelConfig:
    n = 42
    # SGLang's loader: routed experts clamp at 4.0 on layers 35-41, shared experts at 5.0 on 34-39
    # and 7.0 on 40-41; the NEXTN layer (index 42) is left unclamped.
    expert = tuple(4.0 if 35 <= i <= 41 else None for i in range(n + 1))
    shared = tuple(5.0 if 34 <= i <= 39 else 7.0 if i in (40, 41) else None for i in range(n + 1))
    return ModelConfig(
        model_type="bailing_hybrid", vocab_size=157184, hidden_size=2560, num_hidden_layers=n,
        layer_types=tuple(MLA if (i + 1) % 6 == 0 else KDA for i in range(n)),
        mlp_types=tuple(DENSE if i < 2 else MOE for i in range(n)),
        intermediate_size=6144, rms_norm_eps=1e-6,
        kda_num_heads=32, kda_head_dim=128, conv_size=4, kda_gate="safe", kda_lower_bound=-5.0,
        num_attention_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_rope=True, mla_output_gate=True, rope_theta=6e6,
        num_experts=512, num_experts_per_tok=8, moe_intermediate_size=768, num_shared_experts=1,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        expert_swiglu_limits=expert, shared_swiglu_limits=shared, num_nextn_layers=1,
        max_position_embeddings=262144, eos_token_id=156895, pad_token_id=156892,
    )


def _kimi_linear_48b() -> ModelConfig:
    n = 27
    full = {4, 8, 12, 16, 20, 24, 27}  # 1-based, as in the checkpoint's linear_attn_config
    return ModelConfig(
        model_type="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=n,
        layer_types=tuple(MLA if i + 1 in full else KDA for i in range(n)),
        mlp_types=tuple(DENSE if i < 1 else MOE for i in range(n)),
        intermediate_size=9216, rms_norm_eps=1e-5,
        kda_num_heads=32, kda_head_dim=128, conv_size=4, kda_gate="softplus", kda_lower_bound=-5.0,
        num_attention_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_rope=False, mla_output_gate=False, rope_theta=10000.0,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024, num_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        max_position_embeddings=1048576, eos_token_id=163586, pad_token_id=163839, bos_token_id=163584,
    )


def _tiny(model_type: str) -> ModelConfig:
    """Every layer kind at a size that runs in milliseconds on CPU: KDA, MLA, dense, MoE, NEXTN."""
    ling = model_type == "bailing_hybrid"
    return ModelConfig(
        model_type=model_type, vocab_size=256, hidden_size=64, num_hidden_layers=4,
        layer_types=(KDA, KDA, MLA, KDA), mlp_types=(DENSE, MOE, MOE, MOE),
        intermediate_size=96, rms_norm_eps=1e-6,
        kda_num_heads=2, kda_head_dim=16, conv_size=4, kda_gate="safe" if ling else "softplus", kda_lower_bound=-5.0,
        num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mla_rope=ling, mla_output_gate=ling, rope_theta=10000.0,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
        n_group=4 if ling else 1, topk_group=2 if ling else 1, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_nextn_layers=1 if ling else 0, eos_token_id=1, pad_token_id=0,
    )


PRESETS = {
    "ling-3-flash": _ling_3_flash,
    "kimi-linear-48b": _kimi_linear_48b,
    "ling-tiny": lambda: _tiny("bailing_hybrid"),
    "kimi-tiny": lambda: _tiny("kimi_linear"),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def load_config(path_or_preset: str | os.PathLike) -> ModelConfig:
    """A preset name, a hub directory (config.json), a converted directory, or a config.json file."""
    p = os.fspath(path_or_preset)
    if p in PRESETS:
        return preset(p)
    if os.path.isdir(p):
        for name in ("ling_config.json", "config.json"):
            if os.path.exists(os.path.join(p, name)):
                return load_config(os.path.join(p, name))
        raise ConfigError(f"{p}: no config.json in this directory")
    if not os.path.exists(p):
        raise ConfigError(f"{p!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing path")
    with open(p) as f:
        d = json.load(f)
    if os.path.basename(p) == "ling_config.json":
        return ModelConfig.from_json(d)
    return from_hub_config(d)

"""The bytes a decode or verify step must read and the floor time they give.

At batch 1 a step is bandwidth bound: it reads every active weight once (at its stored width), the
KDA recurrent state (read and written back, fp32), and each MLA layer's latent cache up to the
context. A step over T tokens (verify) reads the union of the experts its tokens route to: under
uniform routing E (1 - (1 - k/E)^T) distinct experts per MoE layer.

    python -m ling.roofline --model ling-3-flash --tokens 1 6 --context 8192 [--bits 4]
"""

from __future__ import annotations

import argparse
import dataclasses

from ling.config import DENSE, KDA, ModelConfig, load_config


@dataclasses.dataclass(frozen=True)
class StepBytes:
    weights: float
    experts: float  # routed expert weights, included in `weights`
    kda_state: float
    mla_cache: float

    @property
    def total(self) -> float:
        return self.weights + self.kda_state + self.mla_cache

    def per_device(self, ep: int = 1) -> float:
        """Bytes each of ep expert-parallel devices reads: everything replicated, 1/ep of the
        routed experts (assuming the step's experts spread evenly)."""
        return self.total - self.experts * (1 - 1 / ep)

    def floor_seconds(self, bandwidth: float, ep: int = 1) -> float:
        return self.per_device(ep) / bandwidth


def distinct_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts per MoE layer for `tokens` tokens under uniform routing."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)


def attention_weights(cfg: ModelConfig) -> tuple[int, int]:
    """Weights of one KDA layer's and one MLA layer's projections (each used once per token)."""
    d, c, h = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads
    nh = cfg.num_attention_heads
    kda = d * c * 5 + d * h + c * d  # q, k, v, f, g projections, b_proj, o_proj
    if cfg.kda_gate == "softplus":  # Kimi: f and g through the head dim
        kda = d * c * 3 + 2 * (d * cfg.kda_head_dim + cfg.kda_head_dim * c) + d * h + c * d
    mla = (d * nh * cfg.qk_head_dim + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
           + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) + nh * cfg.v_head_dim * d
           + (d * nh if cfg.mla_output_gate else 0))
    return kda, mla


def step_bytes(cfg: ModelConfig, tokens: int = 1, context: int = 0, *, weight_bits: float = 16,
               group_size: int = 128, batch: int = 1, nextn: bool = False) -> StepBytes:
    """Bytes one step over `tokens` tokens per slot (batch slots) must move. weight_bits 16 is bf16;
    lower widths pay a 16-bit scale per group_size weights. Router weights stay fp32."""
    bpw = 2.0 if weight_bits >= 16 else (weight_bits + 16 / group_size) / 8  # bytes per weight
    d, h = cfg.hidden_size, cfg.kda_num_heads
    kda, mla = attention_weights(cfg)
    dense = 3 * d * cfg.intermediate_size
    expert = 3 * d * cfg.moe_intermediate_size
    shared = expert * cfg.num_shared_experts
    routed = distinct_experts(cfg, tokens * batch) * expert if cfg.num_experts else 0.0

    weights = experts = 0.0
    layers = [(cfg.layer_types[i], cfg.mlp_types[i]) for i in range(cfg.num_hidden_layers)]
    if nextn:
        layers.append(("mla", "moe"))
        weights += 2 * d * d * bpw  # eh_proj
    for attn, mlp in layers:
        weights += (kda if attn == KDA else mla) * bpw
        if mlp == DENSE:
            weights += dense * bpw
        else:
            weights += (shared + routed) * bpw + cfg.num_experts * d * 4  # fp32 router
            experts += routed * bpw
    weights += cfg.vocab_size * d * bpw  # lm_head (embedding reads are a few rows)
    n_kda = cfg.layer_types.count(KDA)
    n_mla = len(layers) - n_kda
    kda_state = batch * n_kda * 2 * h * cfg.kda_head_dim * cfg.kda_head_dim * 4  # fp32, read + write
    mla_cache = batch * n_mla * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    return StepBytes(weights=weights, experts=experts, kda_state=kda_state, mla_cache=mla_cache)


def prefill_flops(cfg: ModelConfig, tokens: int, *, nextn: bool = False, kda_chunk: int = 64) -> float:
    """Useful FLOPs of prefilling one prompt of `tokens` tokens from an empty state: every
    projection once per token (MLA's kv_b_proj expands each latent once), the routed top-k and
    shared experts, causal MLA attention (2·H·(qk + v) per visible pair), the chunked KDA delta
    rule (per token and head ~4·C·K + 2·C·V + 6·K·V, C = kda_chunk: the intra-chunk products, the
    triangular solve and the state terms) and the lm_head for the one sampled position."""
    d, n = cfg.hidden_size, tokens
    kda, mla = attention_weights(cfg)
    kd = cfg.kda_head_dim
    kda_rule = cfg.kda_num_heads * (4 * kda_chunk * kd + 2 * kda_chunk * kd + 6 * kd * kd)
    pairs = n * (n + 1) / 2
    mla_attn = 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * pairs
    moe = cfg.num_experts * d + 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.num_shared_experts)
    layers = [(cfg.layer_types[i], cfg.mlp_types[i]) for i in range(cfg.num_hidden_layers)]
    total = 0.0
    if nextn:
        layers.append(("mla", "moe"))
        total += 2 * n * 2 * d * d  # eh_proj
    for attn, mlp in layers:
        total += 2 * n * kda + n * kda_rule if attn == KDA else 2 * n * mla + mla_attn
        total += 2 * n * (3 * d * cfg.intermediate_size if mlp == DENSE else moe)
    return total + 2 * d * cfg.vocab_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ling.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ling-3-flash", help="preset or directory with a config")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6], help="tokens per step (1: decode)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--bits", type=float, default=16, help="stored weight width (16: bf16)")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (default 4.3e12, H200 copy)")
    args = ap.parse_args(argv)
    cfg = load_config(args.model)
    print(f"{args.model}: context {args.context}, {args.bits:g}-bit weights, {args.bandwidth / 1e12:.2f} TB/s")
    print(f"{'tokens':>6} {'experts/layer':>13} {'weights GB':>10} {'state+cache GB':>14} {'floor us':>9}")
    for t in args.tokens:
        sb = step_bytes(cfg, t, args.context, weight_bits=args.bits)
        print(f"{t:>6} {distinct_experts(cfg, t):>13.1f} {sb.weights / 1e9:>10.3f} "
              f"{(sb.kda_state + sb.mla_cache) / 1e9:>14.3f} {sb.floor_seconds(args.bandwidth) * 1e6:>9.1f}")


if __name__ == "__main__":
    main()

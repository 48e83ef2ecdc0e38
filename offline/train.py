"""Train a small Ling-architecture model from scratch on the Python standard library's sources.

    python -m offline.train --preset small --out serve/default_model          # the shipped model (H200)
    python -m offline.train --preset toy --steps 50 --out /tmp/ling-toy          # a few minutes on CPU

What it builds (`offline.data` has the corpus, split and tokenizer): a `bailing_hybrid` model with
KDA and MLA layers, a dense first layer, MoE layers (sigmoid router, shared expert, group-limited
routing: n_group > 1, topk_group < n_group) and one NEXTN (MTP) layer. It is trained with
- next-token cross-entropy of the target, plus `--mtp-weight` (0.3) x the MTP loss: the NEXTN
  layer predicts token t+2 from the target's final hidden state at t (after its norm) and the
  embedding of token t+1, exactly as `LingModel.draft` runs at decode time. Gradients of the MTP
  loss also reach the target (DeepSeek-V3's MTP).
- the model's own prefill form (`model(tokens, init_state(...), form="prefill")`: chunked KDA
  through `lax.scan` and `solve_triangular`, plain MLA), traced with the plain-jnp kernels (the
  Pallas ones have no VJP). Only the MoE blocks are swapped, inside the trace, for the same
  function in a differentiable, GEMM-only form (`offline.routing.dense_experts_moe`: same router,
  all experts computed, each token's output weighted by its routing weights, zero for unchosen
  experts). The router learns through the routing weights (renormalised sigmoid scores of the
  chosen experts); the top-k choice itself has no gradient.
- load balancing without an auxiliary loss (DeepSeek-V3): after each step every MoE block's
  `expert_bias` (which steers the choice, never the weights) moves by `--bias-rate` towards the
  experts picked less than the mean in that batch, away from those picked more.
- AdamW (optax: clip 1.0, b2 0.95, decoupled weight decay 0.1 on matrices), linear warmup then
  cosine decay to 10 % of --lr. fp32 parameters; `--compute-dtype bfloat16` runs the forward and
  backward on bf16 copies (the parameters the model keeps in fp32 stay fp32).

Output directory: the checkpoint in hub layout (config.json + model.safetensors, bf16, the NEXTN
layer as model.layers.{n}; `ling.load(dir)` and `python -m ling.convert` read it), the tokenizer
(tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json), the
held-out sequences the figures are measured on (heldout_tokens.npy), train_log.jsonl (one JSON
line per logged step and per held-out evaluation), train_meta.json and a README.md.

Time at the `small` preset: 15.3 M parameters (30.8 MB of bf16 safetensors). Training FLOPs per
token (`flops_per_token`: target + NEXTN, backward = 2x forward, KDA chunk and MLA score terms
included, 512-token sequences): 51 M as the model routes, 101 M as training executes it (routed
experts dense over all 32, `offline.routing.dense_experts_moe`). Measured on this project's CPU
machine (2 cores, fp32, 4 x 512 tokens a step, `--estimate`): 110 tokens/s, 1.1e10 FLOP/s
executed (XLA:CPU's batched triangular solve in the chunked KDA dominates). One H200 at a
pessimistic 5 % MFU of 1e15 FLOP/s: 5e13 / 1.01e8 = 5.0e5 tokens/s, so the preset's 2000 steps of
64 x 512 tokens (65.5 M tokens, ~8 epochs of the 8.4 M-token train split) take ~130 s. As that
MFU is a guess for such small matrices, `--time-budget` (the preset sets 330 s, compilation
included) measures the real step time after warm-up and shortens the run if needed, the cosine
schedule refitted to the steps that fit. One device call: ~20-40 s of corpus and tokenizer, at
most ~365 s of training (budget + 10 % hard stop), seconds to save: under 9 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from ling import checkpoint
from ling.config import DENSE, KDA, MLA, MOE, ModelConfig
from ling.model import LingModel
from ling.state import init_state, mla_cache
from offline import data
from offline.routing import expert_load, moe_blocks, tap_moe


# ----------------------------------------------------------------------------------------------
# Presets


def toy_config(vocab_size: int) -> ModelConfig:
    """Every component at CPU-test size; every projection's input a multiple of 32 (int4 group)."""
    return ModelConfig(
        model_type="bailing_hybrid", vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3,
        layer_types=(KDA, KDA, MLA), mlp_types=(DENSE, MOE, MOE), intermediate_size=128,
        rms_norm_eps=1e-6, kda_num_heads=2, kda_head_dim=32, conv_size=4, kda_gate="safe", kda_lower_bound=-5.0,
        num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mla_rope=True, mla_output_gate=True, rope_theta=10000.0,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_layers=1,
        max_position_embeddings=4096, eos_token_id=data.EOT_ID, pad_token_id=data.EOT_ID,
    )


def small_config(vocab_size: int) -> ModelConfig:
    """Ling's shape at 1/10 the width: KDA:MLA 2:1, a dense first layer, 32 experts in 4 groups
    (keep 2) with top-4 and a shared expert, one NEXTN layer. Every projection's input is a
    multiple of 128, so int8/int4 at group 128 cover all of them."""
    return ModelConfig(
        model_type="bailing_hybrid", vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6,
        layer_types=(KDA, KDA, MLA, KDA, KDA, MLA), mlp_types=(DENSE,) + (MOE,) * 5, intermediate_size=768,
        rms_norm_eps=1e-6, kda_num_heads=4, kda_head_dim=64, conv_size=4, kda_gate="safe", kda_lower_bound=-5.0,
        num_attention_heads=4, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        mla_rope=True, mla_output_gate=True, rope_theta=10000.0,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64, num_shared_experts=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_layers=1,
        max_position_embeddings=4096, eos_token_id=data.EOT_ID, pad_token_id=data.EOT_ID,
    )


@dataclasses.dataclass(frozen=True)
class Preset:
    config: object  # vocab_size -> ModelConfig
    vocab_size: int
    batch: int
    seq_len: int
    steps: int
    lr: float
    warmup: int
    max_train_bytes: int | None  # None: the whole train split
    heldout_seqs: int  # held-out sequences stored with the checkpoint (perplexity set)
    eval_every: int
    log_every: int
    time_budget: float | None
    int_group: int  # the quantisation group eval uses


PRESETS = {
    "toy": Preset(toy_config, vocab_size=512, batch=8, seq_len=64, steps=40, lr=3e-3, warmup=5,
                  max_train_bytes=400_000, heldout_seqs=16, eval_every=20, log_every=5, time_budget=None,
                  int_group=32),
    "small": Preset(small_config, vocab_size=4096, batch=64, seq_len=512, steps=1000, lr=2e-3, warmup=100,
                    max_train_bytes=None, heldout_seqs=128, eval_every=50, log_every=10, time_budget=330.0,
                    int_group=128),
}


# ----------------------------------------------------------------------------------------------
# FLOP count


def flops_per_token(cfg: ModelConfig, seq_len: int, *, executed: bool = False) -> float:
    """Training FLOPs per token (3x the forward: backward = 2x forward) of the target and the
    NEXTN layer in the prefill form at sequence length seq_len. Counts every matmul with its
    weights (lm_head included, embedding lookups not), MLA's scores and values over the whole
    cache (the plain form computes them masked), and KDA's chunked terms. executed: the routed
    experts as training runs them (`offline.routing.dense_experts_moe`: all E, not the top k)."""
    d, h, kd, c = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim
    kda = 5 * d * c + c * d + d * h + h * (4 * 64 * kd + 3 * kd * kd + 64 * kd)  # projections + chunk/state
    nh = cfg.num_attention_heads
    mla = (d * nh * cfg.qk_head_dim + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
           + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) + d * nh + nh * cfg.v_head_dim * d
           + nh * seq_len * (cfg.qk_head_dim + cfg.v_head_dim))
    dense = 3 * d * cfg.intermediate_size
    routed = cfg.num_experts if executed else cfg.num_experts_per_tok
    moe = 3 * d * cfg.moe_intermediate_size * (routed + cfg.num_shared_experts) + d * cfg.num_experts
    macs = sum(kda if t == KDA else mla for t in cfg.layer_types)
    macs += sum(dense if t == DENSE else moe for t in cfg.mlp_types)
    macs += d * cfg.vocab_size
    if cfg.num_nextn_layers:
        macs += 2 * d * d + mla + moe + d * cfg.vocab_size
    return 3 * 2 * macs


# ----------------------------------------------------------------------------------------------
# Environment


CPU_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cpu_deadlock_workaround() -> None:
    """XLA:CPU in jax 0.10 sometimes hangs for good (every thread asleep) running the backward of
    a KDA layer at head dim 64 under its concurrency-optimised scheduler; the default scheduler
    runs it. Set before JAX starts its CPU backend, and only where no GPU is in sight (an XLA that
    does not know the flag refuses to start)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    nvidia = (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
              or shutil.which("nvidia-smi") is not None)
    gpu = platforms != "cpu" and (any(p in platforms for p in ("cuda", "gpu", "rocm")) or nvidia)
    flags = os.environ.get("XLA_FLAGS", "")
    if not gpu and CPU_XLA_FLAG.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + CPU_XLA_FLAG).strip()


# ----------------------------------------------------------------------------------------------
# Losses and the step


def _nll(logits, targets):
    """Mean cross-entropy of logits [B, T, V] fp32 against targets [B, T]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


def forward_losses(model: LingModel, tokens):
    """tokens [B, T] -> (next-token loss, MTP loss, expert loads [n_moe, E]) of one prefill from an
    empty state. `model` must be a throw-away copy (its MoE blocks get tapped)."""
    cfg = model.cfg
    b, t = tokens.shape
    dtype = model.embed_tokens[...].dtype
    taps = tap_moe(model, dense_experts=True)
    logits, hidden, _ = model(tokens, init_state(cfg, b, t, dtype), form="prefill")
    main = _nll(logits[:, :-1], tokens[:, 1:])
    mtp = jnp.float32(0.0)
    if model.nextn is not None:
        # Pair i = (h_i, token_{i+1}) at NEXTN position i predicts token i+2.
        draft_logits, _, _ = model.draft(hidden[:, :-1], tokens[:, 1:], mla_cache(cfg, b, t - 1, dtype),
                                         jnp.zeros((b,), jnp.int32), form="prefill")
        mtp = _nll(draft_logits[:, :-1], tokens[:, 2:])
    loads = jnp.stack([expert_load(moe, inputs) for moe, inputs in taps]) if taps else jnp.zeros((0, 1))
    return main, mtp, loads


def fp32_paths(cfg: ModelConfig, nextn: bool) -> set:
    """Parameters the model keeps in fp32 whatever its dtype (router, expert bias, KDA decay/conv)."""
    abstract = nnx.eval_shape(lambda: LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), nextn=nextn))
    return {p for p, v in nnx.to_flat_state(nnx.split(abstract)[1]) if v.dtype == jnp.float32}


def _path_of(key_path) -> tuple:
    out = []
    for k in key_path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if name != "value":
            out.append(name)
    return tuple(out)


def _decay_mask(params):
    """Weight decay on matrices, not on norms, biases, decay parameters or conv taps."""
    def keep(kp, leaf):
        path = _path_of(kp)
        return leaf.ndim >= 2 and not any(str(p).endswith("_conv") for p in path)
    return jax.tree_util.tree_map_with_path(keep, params)


def _group_of(cfg: ModelConfig, path: tuple) -> str:
    """Which part of the model a parameter belongs to, for the per-part gradient norms in the log."""
    if path[0] == "nextn":
        return "nextn"
    if path[0] != "layers":
        return "embed_head"  # embeddings, final norm, lm_head
    if path[2] == "attention":
        return cfg.layer_types[path[1]]  # "kda" or "mla"
    if path[2] == "mlp" and cfg.mlp_types[path[1]] == DENSE:
        return "dense_mlp"
    if path[2] == "mlp":
        return {"gate_weight": "router", "w13": "experts", "w2": "experts", "expert_bias": "router",
                "shared_experts": "shared_expert"}[path[3]]
    return "norms"


def make_optimizer(weight_decay: float = 0.1):
    """AdamW without the learning rate: the step multiplies by the scheduled rate itself, so the
    schedule's length is a traced value (a shortened run needs no recompilation)."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, mask=_decay_mask))


def lr_at(step, total, *, peak: float, warmup: int, final_frac: float = 0.1):
    step = step.astype(jnp.float32)
    warm = peak * (step + 1) / max(warmup, 1)
    progress = jnp.clip((step - warmup) / jnp.maximum(total.astype(jnp.float32) - warmup, 1.0), 0.0, 1.0)
    cos = peak * (final_frac + (1 - final_frac) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < warmup, warm, cos)


class Trainer:
    """Holds the split model (graphdef + fp32 params), the optimizer state and the compiled step."""

    def __init__(self, cfg: ModelConfig, *, seed: int, lr: float, warmup: int, mtp_weight: float = 0.3,
                 bias_rate: float = 1e-2, weight_decay: float = 0.1, compute_dtype=jnp.float32):
        self.cfg = cfg
        # The plain-jnp kernels: the Pallas kernels define no VJP (the MoE's grouped GEMM would be
        # picked on a GPU at training sizes).
        model = LingModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed), kernels="reference")
        self.graphdef, self.params = nnx.split(model)
        self.tx = make_optimizer(weight_decay)
        self.opt_state = self.tx.init(self.params)
        self.mtp_weight, self.bias_rate = mtp_weight, bias_rate
        keep32 = fp32_paths(cfg, model.nextn is not None)
        compute_dtype = jnp.dtype(compute_dtype)

        def cast(params):
            if compute_dtype == jnp.float32:
                return params
            return jax.tree_util.tree_map_with_path(
                lambda kp, a: a if _path_of(kp) in keep32 else a.astype(compute_dtype), params)

        def loss_fn(params, tokens):
            main, mtp, loads = forward_losses(nnx.merge(self.graphdef, cast(params)), tokens)
            return main + self.mtp_weight * mtp, (main, mtp, loads)

        def train_step(params, opt_state, tokens, step, total):
            (loss, (main, mtp, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
            rate = lr_at(step, total, peak=lr, warmup=warmup)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: (p - rate * u).astype(p.dtype), params, updates)
            # Auxiliary-loss-free balancing: nudge each block's bias towards its under-used experts.
            model = nnx.merge(self.graphdef, params)
            for moe, load in zip(moe_blocks(model), loads):
                moe.expert_bias.set_value(moe.expert_bias[...] + self.bias_rate * jnp.sign(jnp.mean(load) - load))
            params = nnx.split(model)[1]
            e = loads.shape[-1]
            metrics = {"loss": main, "mtp_loss": mtp, "lr": rate, "grad_norm": optax.tree.norm(grads),
                       "max_load": jnp.mean(jnp.max(loads, axis=-1)) * e if loads.size else jnp.float32(1.0),
                       **{f"grad_norm/{k}": v for k, v in group_grad_norms(grads).items()}}
            return params, opt_state, metrics

        def group_grad_norms(grads):
            squares: dict[str, jnp.ndarray] = {}
            for kp, g in jax.tree_util.tree_leaves_with_path(grads):
                k = _group_of(cfg, _path_of(kp))
                squares[k] = squares.get(k, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
            return {k: jnp.sqrt(v) for k, v in sorted(squares.items())}

        def eval_step(params, tokens):
            main, mtp, _ = forward_losses(nnx.merge(self.graphdef, cast(params)), tokens)
            return main, mtp

        self._step = jax.jit(train_step, donate_argnums=(0, 1))
        self._eval = jax.jit(eval_step)

    def step(self, tokens: np.ndarray, step: int, total: int) -> dict:
        self.params, self.opt_state, metrics = self._step(self.params, self.opt_state, jnp.asarray(tokens),
                                                          jnp.int32(step), jnp.int32(total))
        return metrics

    def evaluate(self, seqs: np.ndarray, batch: int) -> tuple[float, float]:
        """Mean next-token and MTP losses over held-out sequences [N, T] (full batches only)."""
        n = max(len(seqs) // batch, 1)
        tot = np.zeros(2)
        for i in range(n):
            tot += np.asarray(jax.device_get(self._eval(self.params, jnp.asarray(seqs[i * batch:(i + 1) * batch]))))
        return float(tot[0] / n), float(tot[1] / n)

    def model(self) -> LingModel:
        return nnx.merge(self.graphdef, self.params)

    def n_params(self) -> int:
        return sum(int(x.size) for x in jax.tree_util.tree_leaves(self.params))


# ----------------------------------------------------------------------------------------------
# The command


def _readme(meta: dict) -> str:
    cfg = meta["config"]
    return f"""# {meta['name']}: a small Ling-architecture model trained by `python -m offline.train`

- Architecture: `bailing_hybrid` (Ling-3.0-flash's), {cfg['num_hidden_layers']} layers
  ({', '.join(cfg['layer_types'])}; MLP {', '.join(cfg['mlp_types'])}), hidden {cfg['hidden_size']},
  {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} in {cfg['n_group']} groups (keep
  {cfg['topk_group']}) + {cfg['num_shared_experts']} shared, one NEXTN (MTP) layer; vocab {cfg['vocab_size']};
  {meta['n_params'] / 1e6:.2f} M parameters, stored in bfloat16 (router, expert bias, KDA decay and conv in fp32).
- Data: the Python standard library's own .py sources (Python {meta['python']}; Python Software
  Foundation License, PSF-2.0), split by file (`offline.data.split`, {meta['heldout_files']} held-out files).
  Tokenizer: byte-level BPE trained on the train split (tokenizer.json; ChatML template in
  tokenizer_config.json; <|endoftext|> = 0 ends every document).
- Training: {meta['steps_done']} steps x {meta['batch']} x {meta['seq_len']} tokens ({meta['tokens_seen'] / 1e6:.1f} M), AdamW, peak lr {meta['lr']},
  MTP weight {meta['mtp_weight']}, auxiliary-loss-free expert balancing, {meta['train_seconds']:.0f} s on {meta['device']}.
  Kept the parameters of step {meta['kept_step']} (lowest loss on {meta['validation_files']} validation files of the
  train split: {meta['val_loss']:.4f}). Held-out loss {meta['heldout_loss']:.4f} (perplexity {math.exp(meta['heldout_loss']):.2f}), MTP {meta['heldout_mtp_loss']:.4f}.
- Command: `{meta['command']}`. Figures: `python -m offline.eval --model DIR` (eval.json).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offline.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: the preset's)")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the NEXTN (MTP) loss")
    ap.add_argument("--bias-rate", type=float, default=1e-2, help="expert-bias step of the load balancing "
                    "(1e-2 balances the toy in ~50 steps, 1e-3 had not in 150)")
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of forward and backward (parameters and optimizer stay fp32)")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--time-budget", type=float, default=-1,
                    help="seconds for the training loop, compilation included: after warm-up the step time "
                         "is measured and the run shortened to fit (default: the preset's; 0 = none)")
    ap.add_argument("--max-train-bytes", type=int, default=-1, help="cap on the train text (default: the preset's)")
    ap.add_argument("--out", required=True, help="output directory (created or overwritten)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--estimate", action="store_true",
                    help="time a few steps on this machine, print tokens/s and the FLOP rate, and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    cpu_deadlock_workaround()
    p = PRESETS[args.preset]
    steps = args.steps or p.steps
    batch, seq_len = args.batch or p.batch, args.seq_len or p.seq_len
    lr, warmup = args.lr or p.lr, min(args.warmup if args.warmup is not None else p.warmup, max(steps - 1, 0))
    budget = p.time_budget if args.time_budget < 0 else (args.time_budget or None)
    max_bytes = p.max_train_bytes if args.max_train_bytes < 0 else (args.max_train_bytes or None)
    t_start = time.perf_counter()

    # Data: split, tokenizer on the train split, token streams.
    files = data.stdlib_files()
    train_files, held_files = data.split(files)
    train_files, val_files = data.validation_split(train_files)
    train_texts = data.read_texts(train_files, max_bytes=max_bytes)
    tok = data.train_tokenizer(train_texts, p.vocab_size)
    vocab = tok.get_vocab_size()
    stream = data.encode(tok, train_texts)
    held_stream = data.encode(tok, data.read_texts(held_files))
    held = data.pack(held_stream, seq_len, p.heldout_seqs)
    val = data.pack(data.encode(tok, data.read_texts(val_files)), seq_len, p.heldout_seqs)
    print(f"data: {len(train_texts)}/{len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB, "
          f"{len(stream) / 1e6:.2f} M tokens), {len(held_files)} held-out files ({len(held_stream) / 1e3:.0f} k tokens, "
          f"{len(held)} x {seq_len} kept), {len(val_files)} validation files ({len(val)} x {seq_len}), vocab {vocab}, {time.perf_counter() - t_start:.1f} s", flush=True)

    cfg = p.config(vocab)
    trainer = Trainer(cfg, seed=args.seed, lr=lr, warmup=warmup, mtp_weight=args.mtp_weight,
                      bias_rate=args.bias_rate, compute_dtype=args.compute_dtype)
    fpt, fpt_run = flops_per_token(cfg, seq_len), flops_per_token(cfg, seq_len, executed=True)
    print(f"model: {trainer.n_params() / 1e6:.2f} M parameters, {fpt / 1e6:.1f} MFLOP per trained token "
          f"({fpt_run / 1e6:.1f} executed, all experts dense); device {jax.devices()[0].device_kind}", flush=True)
    batches = data.Batches(stream, batch, seq_len, args.seed)

    if args.estimate:
        jax.block_until_ready(trainer.step(next(batches), 0, steps))  # compile
        n = 3
        t0 = time.perf_counter()
        for i in range(n):
            m = trainer.step(next(batches), i + 1, steps)
        jax.block_until_ready(m)
        tps = n * batch * seq_len / (time.perf_counter() - t0)
        h200 = 5e13 / fpt_run
        print(f"estimate: {tps:.0f} tokens/s, {tps * fpt_run:.3g} FLOP/s executed on {jax.devices()[0].device_kind}; "
              f"an H200 at 5% MFU of 1e15 FLOP/s: {h200:.3g} tokens/s, so the preset's {p.steps} steps x "
              f"{p.batch * p.seq_len} tokens take {p.steps * p.batch * p.seq_len / h200:.0f} s")
        return 0

    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "train_log.jsonl")
    log = open(log_path, "w")

    def write(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    total = steps
    eval_batch = min(batch, len(held))
    t_loop = time.perf_counter()
    calib = (min(5, steps), min(25, steps))
    t_calib = None
    hl, hm = trainer.evaluate(held, eval_batch)  # the untrained baseline; compiles the evaluation up front
    write({"step": 0, "heldout_loss": hl, "heldout_mtp_loss": hm})
    # The shipped parameters are those with the lowest validation loss: a small corpus is learnt
    # by heart in a few epochs, after which held-out loss rises while train loss keeps falling.
    best = {"val_loss": math.inf, "step": 0, "params": None}

    def keep_best(step):
        vl, _ = trainer.evaluate(val, eval_batch)
        if vl < best["val_loss"]:
            best.update(val_loss=vl, step=step, params=jax.tree.map(jnp.copy, trainer.params))
        return vl
    bar = tqdm(total=total, desc=f"train {args.preset}", unit="step", disable=args.quiet, dynamic_ncols=True)
    step = 0
    last = {}
    while step < total:
        metrics = trainer.step(next(batches), step, total)
        step += 1
        bar.update(1)
        if budget and step == calib[0]:
            jax.block_until_ready(metrics)
            t_calib = time.perf_counter()
        if budget and step == calib[1] and t_calib is not None and calib[1] > calib[0]:
            jax.block_until_ready(metrics)
            per_step = (time.perf_counter() - t_calib) / (calib[1] - calib[0])
            left = budget - (time.perf_counter() - t_loop)
            fit = step + int(0.95 * left / per_step)
            if fit < total:
                total = max(fit, step + 1)
                bar.total = total
                bar.refresh()
                write({"event": "time_budget", "step": step, "step_seconds": per_step, "steps": total})
                print(f"\ntime budget {budget:.0f} s: {per_step * 1e3:.1f} ms/step -> {total} steps", flush=True)
        if step % p.log_every == 0 or step == total or step == 1:
            last = {k: float(v) for k, v in jax.device_get(metrics).items()}
            elapsed = time.perf_counter() - t_loop
            rec = {"step": step, **last, "tokens": step * batch * seq_len, "elapsed_s": round(elapsed, 2)}
            write(rec)
            bar.set_postfix(loss=f"{last['loss']:.3f}", mtp=f"{last['mtp_loss']:.3f}")
        if step % p.eval_every == 0 or step == total:
            hl, hm = trainer.evaluate(held, eval_batch)
            vl = keep_best(step)
            write({"step": step, "heldout_loss": hl, "heldout_mtp_loss": hm, "val_loss": vl})
            bar.write(f"step {step}: train {last.get('loss', float('nan')):.4f}  val {vl:.4f}  held-out {hl:.4f} "
                      f"(ppl {math.exp(hl):.2f})  mtp {hm:.4f}")
        if budget and time.perf_counter() - t_loop > budget * 1.1:  # hard stop, whatever the estimate said
            write({"event": "hard_stop", "step": step})
            keep_best(step)
            break
    bar.close()
    if best["params"] is not None:
        trainer.params = best["params"]
    hl, hm = trainer.evaluate(held, eval_batch)
    write({"event": "kept", "step": best["step"], "val_loss": best["val_loss"], "heldout_loss": hl,
           "heldout_mtp_loss": hm})
    train_seconds = time.perf_counter() - t_loop
    log.close()

    model = trainer.model()
    checkpoint.save_hub(model, args.out, dtype=jnp.dtype(args.save_dtype))
    data.save_tokenizer(tok, args.out, max_length=cfg.max_position_embeddings)
    np.save(os.path.join(args.out, data.HELDOUT_FILE), held.astype(np.uint16 if vocab <= 65536 else np.int32))
    meta = {
        "name": os.path.basename(os.path.normpath(args.out)), "preset": args.preset, "config": cfg.to_json(),
        "n_params": trainer.n_params(), "python": sys.version.split()[0], "device": jax.devices()[0].device_kind,
        "train_files": len(train_texts), "heldout_files": len(held_files), "train_tokens": int(len(stream)),
        "heldout_seqs": int(len(held)), "seq_len": seq_len, "batch": batch, "steps": steps, "steps_done": step, "kept_step": best["step"], "val_loss": best["val_loss"],
        "validation_files": len(val_files),
        "tokens_seen": step * batch * seq_len, "lr": lr, "warmup": warmup, "mtp_weight": args.mtp_weight,
        "bias_rate": args.bias_rate, "compute_dtype": args.compute_dtype, "seed": args.seed,
        "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start,
        "heldout_loss": hl, "heldout_mtp_loss": hm, "final_train_loss": last.get("loss"),
        "flops_per_token": fpt, "flops_per_token_executed": fpt_run, "int_group": p.int_group,
        "command": "python -m offline.train " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    with open(os.path.join(args.out, "train_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(_readme(meta))
    size = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(f"wrote {args.out}: {step} steps in {train_seconds:.0f} s, kept step {best['step']} "
          f"(validation loss {best['val_loss']:.4f}), held-out loss {hl:.4f} "
          f"(ppl {math.exp(hl):.2f}), MTP {hm:.4f}; {size / 1e6:.1f} MB; total {meta['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kimi Delta Attention (KDA): gated delta-rule linear attention with per-channel decay.

Per head (K = V = head dim), for token t:
  q, k, v = SiLU(causal depthwise conv_W(W_{q,k,v} x))          conv state: the last W-1 inputs
  q̂ = K^-1/2 q / ||q||, k̂ = k / ||k||                            (L2 norm with eps 1e-6 under the sqrt)
  β = σ(W_b x);   g = gate(W_f x) ∈ R^K, g ≤ 0                    (log-decay per key channel)
  S' = diag(exp g) S_{t-1};   S_t = S' + β k̂ (v - S'ᵀ k̂)ᵀ          S [K, V] fp32
  o = S_tᵀ q̂;   y = W_o [rmsnorm(o) * w * σ(W_g x)]
Two forms that agree, both specified once in `pallas_kernels.kda_reference`: the recurrent one
(one token at a time: decode and verify, `kda_verify`) and the chunked WY form (prefill,
`kda_prefill`). The layer runs them through the kernels' entries, whose "reference" backend is
that specification in plain jnp (the CPU's path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling.config import ModelConfig
from moe.nn import Linear, param
from pallas_kernels import kda as kda_kernel
from pallas_kernels import slot_rows
from pallas_kernels.backend import resolve
from pallas_kernels.kda_prefill import kda_prefill


class KDAttention(nnx.Module):
    """The KDA layer. The hub's q, k, v, f (Kimi: f_a), g (Kimi: g_a) and b projections of the
    layer input are one matmul, in_proj.kernel [D, 3C + 2F + H] (F = C, Kimi: K), columns in that
    order; conv weights of q, k and v stay separate, as in the checkpoint."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, kernels: str = "auto"):
        d, h, kd, c = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim
        self.kernels = resolve(kernels)  # the kernel backend (pallas_kernels.backend), fixed at build
        self.num_heads, self.head_dim, self.eps = h, kd, cfg.rms_norm_eps
        self.gate_kind, self.lower_bound = cfg.kda_gate, cfg.kda_lower_bound
        f = c if cfg.kda_gate == "safe" else kd  # Kimi: low-rank gates through the head dim
        self.widths = (c, c, c, f, f, h)  # q, k, v, f, g, b columns of in_proj
        self.in_proj = Linear(d, sum(self.widths), ("embed", "heads"), dtype=dtype, rngs=rngs)
        # Ling keeps the conv in fp32; Kimi's checkpoint stores it in the model dtype.
        conv_dtype = jnp.float32 if cfg.model_type == "bailing_hybrid" else dtype
        self.q_conv = param(rngs, (c, cfg.conv_size), ("heads", "conv"), conv_dtype, std=0.3)
        self.k_conv = param(rngs, (c, cfg.conv_size), ("heads", "conv"), conv_dtype, std=0.3)
        self.v_conv = param(rngs, (c, cfg.conv_size), ("heads", "conv"), conv_dtype, std=0.3)
        if cfg.kda_gate != "safe":
            self.f_b_proj = Linear(kd, c, ("norm", "heads"), dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(kd, c, ("norm", "heads"), dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, h, dtype=jnp.float32)), logical_axes=("heads",))
        self.dt_bias = param(rngs, (c,), ("heads",), jnp.float32, std=0.5)
        self.o_norm = param(rngs, (kd,), ("norm",), dtype, init="ones")
        self.o_proj = Linear(c, d, ("heads", "embed"), dtype=dtype, rngs=rngs)

    def inputs(self, proj) -> kda_kernel.KdaInputs:
        """in_proj's output [B, T, 3C + 2F + H] -> the kernel's inputs: `Columns` of it (Kimi's f
        and g through their second projections)."""
        starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
        q, k, v, f, g, b_in = (kda_kernel.Columns(proj, s, w) for s, w in zip(starts, self.widths))
        if self.gate_kind != "safe":
            f, g = self.f_b_proj(f.value()), self.g_b_proj(g.value())
        return kda_kernel.KdaInputs(q, k, v, f, b_in, g)

    def __call__(self, x, conv_state, rec_state, valid, *, form: str, rows=None):
        """y = o_proj(core(in_proj(x))): x [B, T, D] -> (y [B, T, D], conv, rec), as `core`."""
        o, conv, rec = self.core(self.in_proj(x), conv_state, rec_state, valid, form=form, rows=rows)
        return self.o_proj(o), conv, rec

    @jax.named_scope("kda")
    def core(self, proj, conv_state, rec_state, valid, *, form: str, rows=None):
        """The attention between the two projections (the decoder runs them once over the rows of
        several batches): proj [B, T, 3C + 2F + H] (in_proj's output); conv_state (q, k, v) each
        [B, W-1, C]; rec_state [B, H, K, V] fp32; valid [B]: tokens of each slot that are real
        (the rest is padding and must not touch the state). form "chunked" (prefill), "decode"
        or "recurrent" (verify). Returns (o [B, T, C], o_proj's input; conv, rec): for "chunked"
        and "decode" the state after the valid tokens: conv states (q, k, v) each [B, W-1, C]
        and the recurrent state [B, H, K, V]; for "recurrent" the conv windows (q, k, v) each
        [B, W-1+T, C] and the recurrent state after each position [B, T, H, K, V], from which
        `ling.state.commit` takes any prefix without recomputation. rows [B] int32
        (`pallas_kernels.slot_rows`): the states hold every slot (any number) and row b is slot
        rows[b]; "chunked" and "decode" then return the whole states, the rows' slots advanced
        (decode in place, in the kernels)."""
        b, t, _ = proj.shape
        h, kd = self.num_heads, self.head_dim
        inputs = self.inputs(proj)
        weights = kda_kernel.KdaWeights(self.q_conv[...], self.k_conv[...], self.v_conv[...], self.A_log[...],
                                        self.dt_bias[...], self.o_norm[...])
        state = kda_kernel.KdaState(*conv_state, rec_state)
        kernels = self.kernels
        if form == "decode":  # committed in the kernel, the recurrent state written in place
            o, new = kda_kernel.kda_decode(inputs, weights, state, valid, gate=self.gate_kind, eps=self.eps,
                                           lower_bound=self.lower_bound, rows=rows,
                                           backend=kernels if t <= kda_kernel.MAX_T else "reference")
            return o.reshape(b, t, h * kd), (new.conv_q, new.conv_k, new.conv_v), new.recurrent
        if form == "recurrent":
            out = kda_kernel.kda_verify(inputs, weights, state, all_states=True, gate=self.gate_kind, eps=self.eps,
                                        lower_bound=self.lower_bound, rows=rows,
                                        backend=kernels if t <= kda_kernel.MAX_T else "reference")
            return out.o.reshape(b, t, h * kd), (out.window_q, out.window_k, out.window_v), out.states
        mine = state if rows is None else slot_rows.take(state, rows)
        o, new = kda_prefill(kda_kernel.materialize(inputs), weights, mine, valid, gate=self.gate_kind, eps=self.eps,
                             lower_bound=self.lower_bound, backend=kernels)
        if rows is not None:
            new = slot_rows.put(state, rows, new)
        return o.reshape(b, t, h * kd), (new.conv_q, new.conv_k, new.conv_v), new.recurrent

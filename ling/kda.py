"""Kimi Delta Attention (KDA): gated delta-rule linear attention with per-channel decay.

Per head (K = V = head dim), for token t:
  q, k, v = SiLU(causal depthwise conv_W(W_{q,k,v} x))          conv state: the last W-1 inputs
  q̂ = K^-1/2 q / ||q||, k̂ = k / ||k||                            (L2 norm with eps 1e-6 under the sqrt)
  β = σ(W_b x);   g = gate(W_f x) ∈ R^K, g ≤ 0                    (log-decay per key channel)
  S' = diag(exp g) S_{t-1};   S_t = S' + β k̂ (v - S'ᵀ k̂)ᵀ          S [K, V] fp32
  o = S_tᵀ q̂;   y = W_o [rmsnorm(o) * w * σ(W_g x)]
Two forms that agree: `recurrent` (one token at a time: decode and verify) and `chunked` (the WY
form over chunks of 64: prefill).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling.config import ModelConfig
from ling.layers import gated_rms_norm
from pallas_kernels import kda as kda_kernel
from pallas_kernels.backend import resolve as resolve_kernels
from moe.nn import Linear, param

CHUNK = 64


def causal_conv(x, conv_state, weight):
    """Depthwise causal conv + SiLU over new tokens, continuing from the conv state.

    x [B, T, C]; conv_state [B, W-1, C] (the last W-1 inputs, oldest first); weight [C, W].
    Returns (y [B, T, C] in x's dtype, window [B, W-1+T, C]): the conv state after the first n
    new tokens is window[:, n : n + W-1] (`conv_state_after`).
    """
    w = weight.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    t = x.shape[1]
    xf = window.astype(jnp.float32)
    y = sum(xf[:, j : j + t] * weight[:, j].astype(jnp.float32) for j in range(w))
    return jax.nn.silu(y).astype(x.dtype), window.astype(conv_state.dtype)


def conv_state_after(window, n, state_len: int):
    """window [B, W-1+T, C], n [B] new tokens kept -> conv state [B, W-1, C] (state_len = W-1)."""
    return jax.vmap(lambda w, i: jax.lax.dynamic_slice_in_dim(w, i, state_len, axis=0))(window, n)


def l2_normalize(x, eps: float = 1e-6):
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def decay_gate(f, A_log, dt_bias, *, kind: str, lower_bound: float):
    """Log-decay g [B, T, H, K] fp32 from the gate projection f [B, T, H, K].

    safe (Ling):     g = lower_bound * σ(exp(A_log) (f + dt_bias))   ∈ (lower_bound, 0)
    softplus (Kimi): g = -exp(A_log) softplus(f + dt_bias)
    """
    h, k = f.shape[-2:]
    z = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(h, k)
    a = jnp.exp(A_log.astype(jnp.float32)).reshape(h, 1)
    if kind == "safe":
        return lower_bound * jax.nn.sigmoid(a * z)
    return -a * jax.nn.softplus(z)


def recurrent(q, k, v, g, beta, state):
    """Token-by-token delta rule. q, k [B, T, H, K] (normalised, q scaled); v [B, T, H, V];
    g [B, T, H, K]; beta [B, T, H]; state [B, H, K, V] fp32.
    Returns (o [B, T, H, V] fp32, states after each token [B, T, H, K, V] fp32)."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, *]
        s = s * jnp.exp(g_t)[..., None]
        delta = b_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., None] * delta[..., None, :]
        return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t), s)

    xs = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence over chunks, in the WY form. Shapes as `recurrent`.
    Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32).

    Within a chunk with cumulative log-decay G_t = Σ_{s≤t} g_s, write the state as
      S_t = D_t (S_0 + Σ_{s≤t} D_s⁻¹ k_s u_sᵀ),  D_t = diag(exp G_t),
    where u_s = β_s (v_s - S'_sᵀ k_s) is the applied correction. Substituting gives the unit
    lower-triangular system (I + diag(β) A) u = diag(β) (v - (k ⊙ e^G) S_0) with
    A[t, s] = Σ_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]} (s < t); then
      o = (q ⊙ e^G) S_0 + Bu,  B[t, s] = Σ_c q_t[c] k_s[c] e^{G_t[c] - G_s[c]} (s ≤ t),
      S_C = D_C S_0 + Σ_s (k_s ⊙ e^{G_C - G_s}) u_sᵀ.
    Every exponent is ≤ 0 (masked before exp), so nothing overflows.
    """
    b, t, h, kd = k.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def prep(a):  # [B, T, H, (X)] -> [N, B, H, C, (X)]; zero padding leaves the state unchanged (β = 0, g = 0)
        a = jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, chunk, *a.shape[2:])
        return a.transpose(1, 0, 3, 2, 4) if a.ndim == 5 else a.transpose(1, 0, 3, 2)

    qc, kc, vc, gc = (prep(a) for a in (q, k, v, g))
    bc = prep(beta)  # [N, B, H, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)

    def step(s0, xs):
        q_c, k_c, v_c, g_c, b_c = xs  # [B, H, C, X]
        G = jnp.cumsum(g_c, axis=-2)  # [B, H, C, K]
        diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, C(t), C(s), K]
        decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
        A = jnp.einsum("bhtc,bhsc,bhtsc->bhts", k_c, k_c, decay) * strict
        Bm = jnp.einsum("bhtc,bhsc,bhtsc->bhts", q_c, k_c, decay)
        eG = jnp.exp(G)
        rhs = b_c[..., None] * (v_c - jnp.einsum("bhtk,bhkv->bhtv", k_c * eG, s0))
        lhs = jnp.eye(chunk) + b_c[..., None] * A
        u = jax.scipy.linalg.solve_triangular(lhs, rhs, lower=True, unit_diagonal=True)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_c * eG, s0) + jnp.einsum("bhts,bhsv->bhtv", Bm, u)
        tail = jnp.exp(G[..., -1:, :] - G)  # [B, H, C, K]
        s1 = jnp.exp(G[..., -1, :])[..., None] * s0 + jnp.einsum("bhsk,bhsv->bhkv", k_c * tail, u)
        return s1, o

    with jax.default_matmul_precision("highest"):  # fp32 state math, also on GPUs that default to tf32
        s, o = jax.lax.scan(step, state.astype(jnp.float32), (qc, kc, vc, gc, bc))
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, V]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n * chunk, h, -1)[:, :t]
    return o, s


class KDAttention(nnx.Module):
    """The KDA layer. Parameters follow the hub names (q_proj, ..., o_proj; conv weights of q, k, v
    concatenated along channels)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d, h, kd, c = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim
        self.num_heads, self.head_dim, self.eps = h, kd, cfg.rms_norm_eps
        self.gate_kind, self.lower_bound = cfg.kda_gate, cfg.kda_lower_bound
        self.q_proj = Linear(d, c, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, c, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, c, ("embed", "heads"), dtype=dtype, rngs=rngs)
        # Ling keeps the conv in fp32; Kimi's checkpoint stores it in the model dtype. q, k and v
        # have their own buffers (as in the checkpoint), so the fused kernel never needs a slice.
        conv_dtype = jnp.float32 if cfg.model_type == "bailing_hybrid" else dtype
        self.q_conv = param(rngs, (c, cfg.conv_size), ("heads", "conv"), conv_dtype, std=0.3)
        self.k_conv = param(rngs, (c, cfg.conv_size), ("heads", "conv"), conv_dtype, std=0.3)
        self.v_conv = param(rngs, (c, cfg.conv_size), ("heads", "conv"), conv_dtype, std=0.3)
        if cfg.kda_gate == "safe":
            self.f_proj = Linear(d, c, ("embed", "heads"), dtype=dtype, rngs=rngs)
            self.g_proj = Linear(d, c, ("embed", "heads"), dtype=dtype, rngs=rngs)
        else:  # Kimi: low-rank gate and output-gate projections through the head dim
            self.f_a_proj = Linear(d, kd, ("embed", "norm"), dtype=dtype, rngs=rngs)
            self.f_b_proj = Linear(kd, c, ("norm", "heads"), dtype=dtype, rngs=rngs)
            self.g_a_proj = Linear(d, kd, ("embed", "norm"), dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(kd, c, ("norm", "heads"), dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, h, dtype=jnp.float32)), logical_axes=("heads",))
        self.dt_bias = param(rngs, (c,), ("heads",), jnp.float32, std=0.5)
        self.b_proj = Linear(d, h, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.o_norm = param(rngs, (kd,), ("norm",), dtype, init="ones")
        self.o_proj = Linear(c, d, ("heads", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x, conv_state, rec_state, valid, *, form: str):
        """x [B, T, D]; conv_state (q, k, v) each [B, W-1, C]; rec_state [B, H, K, V] fp32; valid [B]:
        tokens of each slot that are real (the rest is padding and must not touch the state).
        form "chunked" (prefill) or "recurrent" (decode, verify). Returns (y [B, T, D], the conv
        windows (q, k, v) each [B, W-1+T, C], and the recurrent state: for "chunked" the state after
        the valid tokens [B, H, K, V]; for "recurrent" the state after each position [B, T, H, K, V],
        from which `ling.state.commit` takes any prefix without recomputation)."""
        b, t, _ = x.shape
        h, kd = self.num_heads, self.head_dim
        pre = (self.q_proj(x), self.k_proj(x), self.v_proj(x))  # [B, T, C] each, before the conv
        f = self.f_proj(x) if self.gate_kind == "safe" else self.f_b_proj(self.f_a_proj(x))
        gate = self.g_proj(x) if self.gate_kind == "safe" else self.g_b_proj(self.g_a_proj(x))
        b_in = self.b_proj(x)  # [B, T, H]
        weights = (self.q_conv[...], self.k_conv[...], self.v_conv[...])
        kernels = resolve_kernels()
        if form == "recurrent" and kernels != "reference" and t <= kda_kernel.MAX_T:
            out = kda_kernel.kda_verify(
                kda_kernel.KdaInputs(*pre, f.reshape(b, t, h, kd), b_in, gate),
                kda_kernel.KdaWeights(*weights, self.A_log[...], self.dt_bias[...], self.o_norm[...]),
                kda_kernel.KdaState(*conv_state, rec_state), gate=self.gate_kind, eps=self.eps,
                lower_bound=self.lower_bound, all_states=True, backend=kernels)
            o, rec, windows = out.o, out.states, (out.window_q, out.window_k, out.window_v)
        else:
            convs = [causal_conv(a, s, w) for a, s, w in zip(pre, conv_state, weights)]
            windows = tuple(w for _, w in convs)
            q, k, v = (a.reshape(b, t, h, kd) for a, _ in convs)
            q = l2_normalize(q) * kd**-0.5
            k = l2_normalize(k)
            g = decay_gate(f.reshape(b, t, h, kd), self.A_log[...], self.dt_bias[...], kind=self.gate_kind,
                           lower_bound=self.lower_bound)
            beta = jax.nn.sigmoid(b_in.astype(jnp.float32))  # [B, T, H]
            if form == "chunked":
                # Padding positions: no decay (g = 0) and no write (β = 0) leave the state as it was.
                real = jnp.arange(t)[None, :] < valid[:, None]  # [B, T]
                g = jnp.where(real[..., None, None], g, 0.0)
                beta = jnp.where(real[..., None], beta, 0.0)
                o, rec = chunked(q, k, v, g, beta, rec_state)
            else:
                o, rec = recurrent(q, k, v, g, beta, rec_state)
            o = gated_rms_norm(o.astype(x.dtype), gate.reshape(b, t, h, kd), self.o_norm[...], self.eps)
        return self.o_proj(o.reshape(b, t, h * kd)), windows, rec

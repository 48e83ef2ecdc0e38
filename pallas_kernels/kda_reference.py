"""KDA's maths in plain jnp: the one specification that the kernels' references (`kda.reference`,
`kda_prefill.reference`) are built from and their tests check, and that the model's reference
path runs through them.

Per head (K = V = head dim), token t:
  q, k, v = SiLU(causal depthwise conv_W(x_{q,k,v}))             `causal_conv`, `conv_state_after`
  q̂ = K^-1/2 q / ||q||,  k̂ = k / ||k||                           `l2_normalize` (eps 1e-6 under the sqrt)
  g = gate(x_f) ∈ R^K, g ≤ 0;  β = σ(x_b)                         `decay_gate`
  S' = diag(exp g) S_{t-1};  S_t = S' + β k̂ (v - S'ᵀ k̂)ᵀ;  o = S_tᵀ q̂   `recurrent`, `chunked` (WY form)
  y = rmsnorm(o) · w · σ(x_gate)                                  `gated_norm`
The state S [K, V] and every reduction are fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


SELECT_MAX_T = 16  # windows of at most this many new tokens are cut by selects, not a gather


def conv_state_after(window, n, state_len: int):
    """window [B, W-1+T, C], n [B] new tokens kept, 0..T -> conv state [B, W-1, C]
    (state_len = W-1). Up to SELECT_MAX_T new tokens (decode, verify) the T + 1 candidate states
    are static slices picked by selects, one elementwise fusion; longer windows (prefill) take
    each slot's slice by a gather."""
    t = window.shape[1] - state_len
    if t > SELECT_MAX_T:
        return jax.vmap(lambda w, i: jax.lax.dynamic_slice_in_dim(w, i, state_len, axis=0))(window, n)
    n = jnp.asarray(n)[:, None, None]
    out = window[:, :state_len]
    for i in range(1, t + 1):
        out = jnp.where(n >= i, window[:, i:i + state_len], out)
    return out


def state_after(states, n, initial):
    """states [B, T, H, K, V] (the state after each position), n [B] tokens kept, 0..T, initial
    [B, H, K, V] -> the state after token n[b] of each slot, the initial one where n[b] = 0."""
    n = jnp.asarray(n)
    picked = states[:, 0] if states.shape[1] == 1 else \
        jnp.take_along_axis(states, jnp.maximum(n - 1, 0)[:, None, None, None, None], axis=1)[:, 0]
    return jnp.where((n > 0)[:, None, None, None], picked, initial)


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


def chunked(q, k, v, g, beta, state, chunk: int = 32):
    """The delta rule over chunks, in the WY form. q, k [B, T, H, K] (normalised, q scaled);
    v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H]; state [B, H, K, V] fp32.
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


def recurrent(q, k, v, g, beta, state):
    """Token-by-token delta rule. q, k [B, T, H, K] (normalised, q scaled); v [B, T, H, V];
    g [B, T, H, K]; beta [B, T, H]; state [B, H, K, V] fp32.
    Returns (o [B, T, H, V] fp32, states after each token [B, T, H, K, V] fp32). Reductions are
    multiply + sum, not dots, so that no backend rounds them through tf32."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, *]
        s = s * jnp.exp(g_t)[..., None]
        delta = b_t[..., None] * (v_t - jnp.sum(s * k_t[..., None], axis=-2))  # S'ᵀ k̂  [B, H, V]
        s = s + k_t[..., None] * delta[..., None, :]
        return s, (jnp.sum(s * q_t[..., None], axis=-2), s)  # Sᵀ q̂

    xs = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def gated_norm(o, gate_in, weight, eps):
    """o [..., V] fp32 -> rmsnorm(o) · weight · σ(gate_in), fp32."""
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    return o * weight.astype(jnp.float32) * jax.nn.sigmoid(gate_in.astype(jnp.float32))

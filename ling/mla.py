"""Multi-head latent attention (MLA) with a latent cache.

  q = W_q x -> [H, nope | rope];  [c | k_r] = W_kva x;  c = rmsnorm(c)  (the latent, R)
  [k_nope | v]_h = W_kvb,h c;   q_r, k_r rotated (Ling; Kimi uses no RoPE)
  o_h = softmax(scale (q_nope·k_nope + q_r·k_r)) v;   Ling: o_h *= σ(W_g x)_h;   y = W_o o
The cache holds, per position, only the normalised latent c [R] and the rotated k_r [P].
Two forms that agree: `plain` expands the cached latents to keys and values (prefill); `absorbed`
folds W_UK into the query and W_UV into the output so attention runs over the latent itself
(decode: R + P numbers read per cached position, shared by all heads).
Kernels (pallas_kernels.backend): `plain` runs `mla_prefill.prefill_attention` (cuDNN flash
attention on the GPU, blockwise jnp in interpret mode: the chunk causally over itself plus the
cached prefix block by block, never [T, L] scores), `absorbed` the split-cache decode kernel; the
reference backend keeps the plain-jnp forms below (the whole cache expanded, [B, H, T, L] scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling.config import ModelConfig
from ling.layers import RMSNorm, apply_rope_interleaved, rope_angles
from moe.nn import Linear
from pallas_kernels import slot_rows
from pallas_kernels.backend import resolve
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_prefill import prefill_attention

LATENT_NORM_EPS = 1e-6


def write_cache(cache, new, lengths, rows=None):
    """Writes new [B, T, X] into cache [B, L, X] at positions lengths[b] .. lengths[b] + T - 1.
    Writes past L are dropped (a scatter, not a clamped slice that would overwrite earlier entries);
    padding and rejected draft positions land past the slot's length, where the causal mask hides
    them until real tokens overwrite them. rows [B] (`pallas_kernels.slot_rows`): the cache holds
    every slot and row b writes slot rows[b] (a padding row nothing)."""
    b, t = new.shape[:2]
    pos = lengths[:, None] + jnp.arange(t)  # [B, T]
    slots = jnp.arange(b) if rows is None else rows
    return cache.at[slots[:, None], pos].set(new.astype(cache.dtype), mode="drop")


def causal_mask(positions, cache_len: int):
    """[B, T, L]: query at positions[b, t] sees cache slots 0..positions[b, t]."""
    return jnp.arange(cache_len)[None, None, :] <= positions[:, :, None]


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None, kernels: str = "auto"):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.kernels = resolve(kernels)  # the kernel backend (pallas_kernels.backend), fixed at build
        self.h, self.nope, self.rope, self.vd = h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.r = cfg.kv_lora_rank
        self.use_rope, self.theta, self.scale = cfg.mla_rope, cfg.rope_theta, cfg.softmax_scale
        # The hub's q_proj, kv_a_proj_with_mqa and g_proj (if gated) as one matmul of the layer
        # input: in_proj.kernel [D, H·(nope + rope) + R + rope (+ H)], columns in that order.
        self.widths = (h * cfg.qk_head_dim, self.r + self.rope) + ((h,) if cfg.mla_output_gate else ())
        self.in_proj = Linear(d, sum(self.widths), ("embed", "heads"), dtype=dtype, rngs=rngs)
        # The latent norm's eps is 1e-6 in both families, whatever rms_norm_eps says (as transformers).
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS, dtype=dtype, rngs=rngs, axis_name="kv_lora",
                                      kernels=self.kernels)
        self.kv_b_proj = Linear(self.r, h * (self.nope + self.vd), ("kv_lora", "heads"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * self.vd, d, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.mesh = mesh  # the model's device mesh (its cuDNN prefill pins its inputs replicated on it)

    def __call__(self, x, positions, latent_cache, rope_cache, lengths, *, form: str, valid=None, rows=None,
                 prefill: bool = False):
        """y = o_proj(core(in_proj(x))): x [B, T, D] -> (y [B, T, D], latent_cache, rope_cache), as `core`."""
        o, latent_cache, rope_cache = self.core(self.in_proj(x), positions, latent_cache, rope_cache, lengths,
                                                form=form, valid=valid, rows=rows, prefill=prefill)
        return self.o_proj(o), latent_cache, rope_cache

    @jax.named_scope("mla")
    def core(self, proj, positions, latent_cache, rope_cache, lengths, *, form: str, valid=None, rows=None,
             prefill: bool = False):
        """The attention between the two projections (the decoder runs them once over the rows of
        several batches): proj [B, T, H·(nope + rope) + R + rope (+ H)] (in_proj's output);
        positions [B, T] = lengths[:, None] + arange(T); caches [B, L, R], [B, L, P]; valid [B]
        (optional): real tokens per slot. Returns (o [B, T, H·V], o_proj's input; latent_cache,
        rope_cache) with the T new entries written. prefill: the rows are a prefill chunk (either
        form); on the kernel paths the rows of its slots with valid 0 are then garbage (nobody
        reads them: the engine interleaves idle and decoding slots into a prefill chunk this
        way, and their cached prefixes are not worth attending to); otherwise every row is
        computed as if real. rows [B] int32 (`pallas_kernels.slot_rows`): the caches hold every
        slot (any number) and row b is slot rows[b]; the whole caches are returned, the rows'
        entries written."""
        b, t, _ = proj.shape
        dtype = proj.dtype
        nq, nkv = self.widths[:2]
        q = proj[..., :nq].reshape(b, t, self.h, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        kv = proj[..., nq : nq + nkv]
        latent, k_rope = self.kv_a_layernorm(kv[..., : self.r]), kv[..., self.r :]  # [B, T, R], [B, T, P]
        if self.use_rope:
            cos, sin = rope_angles(positions, self.rope, self.theta)
            q_rope = apply_rope_interleaved(q_rope, cos, sin)
            k_rope = apply_rope_interleaved(k_rope, cos, sin)
        latent_cache = write_cache(latent_cache, latent, lengths, rows)
        rope_cache = write_cache(rope_cache, k_rope, lengths, rows)
        whole = latent_cache, rope_cache
        if rows is not None and not (form == "absorbed" and self.kernels != "reference"):
            # only the decode kernel reads the rows' slots in place; the other forms read them gathered
            latent_cache, rope_cache = slot_rows.take(whole, rows)
            rows = None

        w_kvb = self.kv_b_proj.kernel[...].reshape(self.r, self.h, self.nope + self.vd)
        w_uk, w_uv = w_kvb[..., : self.nope], w_kvb[..., self.nope :]  # [R, H, nope], [R, H, V]
        kernels = self.kernels
        c = latent_cache.astype(dtype)
        if form == "plain" and kernels != "reference":
            # The chunk's own keys at the cache's rounding, as the reference reads them back.
            prefix = lengths if valid is None else jnp.where(valid > 0, lengths, 0)
            o = prefill_attention(q_nope, q_rope, latent.astype(latent_cache.dtype), k_rope.astype(rope_cache.dtype),
                                  latent_cache, rope_cache, w_uk, w_uv, prefix, scale=self.scale, backend=kernels,
                                  mesh=self.mesh)
        elif form == "plain":
            k_nope = jnp.einsum("blr,rhn->blhn", c, w_uk.astype(dtype))
            v = jnp.einsum("blr,rhv->blhv", c, w_uv.astype(dtype))
            scores = (jnp.einsum("bthn,blhn->bhtl", q_nope, k_nope, preferred_element_type=jnp.float32)
                      + jnp.einsum("bthp,blp->bhtl", q_rope, rope_cache.astype(dtype),
                                   preferred_element_type=jnp.float32))
            p = _softmax(scores * self.scale, positions).astype(dtype)
            o = jnp.einsum("bhtl,blhv->bthv", p, v, preferred_element_type=jnp.float32)
        else:
            q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk.astype(dtype),
                               preferred_element_type=jnp.float32).astype(dtype)  # [B, T, H, R]
            if kernels != "reference":  # the split-cache decode kernel; query t sits at lengths + t
                prefix = lengths if not prefill or valid is None else jnp.where(valid > 0, lengths, 0)
                o_lat = mla_decode(q_lat, q_rope, latent_cache, rope_cache, prefix + t, scale=self.scale,
                                   rows=rows, backend=kernels)
            else:
                scores = (jnp.einsum("bthr,blr->bhtl", q_lat, c, preferred_element_type=jnp.float32)
                          + jnp.einsum("bthp,blp->bhtl", q_rope, rope_cache.astype(dtype),
                                       preferred_element_type=jnp.float32))
                p = _softmax(scores * self.scale, positions).astype(dtype)
                o_lat = jnp.einsum("bhtl,blr->bthr", p, c, preferred_element_type=jnp.float32)
            o = jnp.einsum("bthr,rhv->bthv", o_lat.astype(dtype), w_uv.astype(dtype),
                           preferred_element_type=jnp.float32)
        o = o.astype(dtype)
        if len(self.widths) == 3:  # the head-wise output gate
            o = o * jax.nn.sigmoid(proj[..., nq + nkv :].astype(jnp.float32)).astype(dtype)[..., None]
        return o.reshape(b, t, self.h * self.vd), *whole


def _softmax(scores, positions):  # scores [B, H, T, L] fp32, positions [B, T]: causal over the cache
    scores = jnp.where(causal_mask(positions, scores.shape[-1])[:, None], scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)

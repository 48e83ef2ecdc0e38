"""The per-sequence decoding state: B slots, allocated once and carried through every step.

- KDA layer: conv states (q, k, v) each [B, W-1, C] (the last W-1 projected inputs) and the
  recurrent state [B, H, K, V] in fp32.
- MLA layer (and the NEXTN layer, which has its own MLA): the latent cache [B, L, R] and the rotated
  rope-key cache [B, L, P], L = max_seq_len.
- the DSpark block drafter (`ling.dspark`): per backbone layer the keys and values of the context
  features [B, L, H, K], masked past the length as the MLA cache.
- lengths [B]: tokens already in the state of each slot (the position of the next token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ling.config import ModelConfig
from ling.dspark import dspark_cache


@struct.dataclass
class KDAState:
    conv: tuple  # (q, k, v) each [B, W-1, C]
    recurrent: jnp.ndarray  # [B, H, K, V] fp32


@struct.dataclass
class MLACache:
    latent: jnp.ndarray  # [B, L, R]
    k_rope: jnp.ndarray  # [B, L, P]


@struct.dataclass
class State:
    layers: tuple  # KDAState or MLACache, one per decoder layer
    lengths: jnp.ndarray  # [B] int32
    nextn: MLACache | None = None
    dspark: object = None  # ling.dspark.DSparkCache of the block drafter, if the model has one


def kda_state(cfg: ModelConfig, batch: int, dtype) -> KDAState:
    return KDAState(
        conv=tuple(jnp.zeros((batch, cfg.conv_size - 1, cfg.kda_dim), dtype) for _ in range(3)),
        recurrent=jnp.zeros((batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
    )


def mla_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> MLACache:
    return MLACache(latent=jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                    k_rope=jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, nextn: bool = False,
               dspark=None) -> State:
    """dspark: the block drafter's config (`ling.dspark.DSparkConfig`) to hold its cache, or None."""
    layers = tuple(kda_state(cfg, batch, dtype) if t == "kda" else mla_cache(cfg, batch, max_len, dtype)
                   for t in cfg.layer_types)
    return State(layers=layers, lengths=jnp.zeros((batch,), jnp.int32),
                 nextn=mla_cache(cfg, batch, max_len, dtype) if nextn else None,
                 dspark=None if dspark is None else dspark_cache(dspark, batch, max_len, dtype))


@struct.dataclass
class KDAPending:
    """A KDA layer's state after a forward, before the number of tokens to keep is known."""

    window: tuple  # (q, k, v) each [B, W-1+T, C]: the old conv state followed by the T new inputs
    recurrent: jnp.ndarray  # [B, H, K, V] after the valid tokens, or [B, T, H, K, V] after each position
    initial: jnp.ndarray  # [B, H, K, V] the state before the forward (kept when n = 0)
    conv_len: int = struct.field(pytree_node=False, default=3)


@jax.named_scope("commit")
def commit(pending: State, n) -> State:
    """Keeps the first n[b] tokens of the last forward in each slot: KDA conv and recurrent state
    taken at that position, MLA entries past it left behind the slot's length (masked, then
    overwritten), lengths advanced by n."""
    from pallas_kernels.kda_reference import conv_state_after, state_after

    layers = []
    for c in pending.layers:
        if isinstance(c, KDAPending):
            rec = c.recurrent
            if rec.ndim == 5:  # per-position states: the one after token n[b], or the initial one
                rec = state_after(rec, n, c.initial)
            c = KDAState(conv=tuple(conv_state_after(w, n, c.conv_len) for w in c.window), recurrent=rec)
        layers.append(c)
    return pending.replace(layers=tuple(layers), lengths=pending.lengths + n)

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
from pallas_kernels import slot_rows


@struct.dataclass
class KDAState:
    conv: tuple  # (q, k, v) each [B, W-1, C]
    recurrent: jnp.ndarray  # [B, H, K, V] fp32
    rows: jnp.ndarray | None = None  # [K] int32: a forward over K of the B slots (`at_rows`)


@struct.dataclass
class MLACache:
    latent: jnp.ndarray  # [B, L, R]
    k_rope: jnp.ndarray  # [B, L, P]
    rows: jnp.ndarray | None = None  # [K] int32: a forward over K of the B slots (`at_rows`)


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
    into: KDAState | None = None  # a forward over rows (`at_rows`): the whole state the commit writes


def at_rows(state: State, rows) -> State:
    """The state of a forward over K of its B slots, rows [K] int32 (`pallas_kernels.slot_rows`:
    distinct slots, entries >= B padding rows that read slot B - 1 and write nothing): lengths
    [K] taken from the rows' slots, every layer's state (and the NEXTN cache) left whole and
    marked with the rows, so that the attention kernels read and write those slots in place and
    a slot no row names costs nothing. The block drafter's cache is taken too (its forwards take
    no rows). `from_rows` puts the result back."""
    mark = lambda c: None if c is None else c.replace(rows=rows)  # noqa: E731
    return state.replace(layers=tuple(mark(c) for c in state.layers), lengths=slot_rows.take(state.lengths, rows),
                         nextn=mark(state.nextn),
                         dspark=slot_rows.take(state.dspark, rows))


def from_rows(whole: State, rows, state: State) -> State:
    """`whole` after a forward over `at_rows(whole, rows)` that returned `state`: its layers (whole
    arrays, the rows' slots written), its lengths and drafter cache put back at the rows' slots."""
    unmark = lambda c: None if c is None else c.replace(rows=None)  # noqa: E731
    return whole.replace(layers=tuple(unmark(c) for c in state.layers), nextn=unmark(state.nextn),
                         lengths=slot_rows.put(whole.lengths, rows, state.lengths),
                         dspark=slot_rows.put(whole.dspark, rows, state.dspark))


@jax.named_scope("commit")
def commit(pending: State, n) -> State:
    """Keeps the first n[b] tokens of the last forward in each slot: KDA conv and recurrent state
    taken at that position, MLA entries past it left behind the slot's length (masked, then
    overwritten), lengths advanced by n. Over rows (`at_rows`) the KDA states are written into
    the whole state at the slots of the rows with n[b] > 0 (n = 0 keeps the slot as it is)."""
    from pallas_kernels.kda_reference import conv_state_after, state_after

    layers = []
    for c in pending.layers:
        if isinstance(c, KDAPending) and c.into is not None:
            whole, b = c.into, c.into.recurrent.shape[0]
            kept = jnp.where(n > 0, whole.rows, b)  # out of range: no write
            rec = c.recurrent
            if rec.ndim == 5:  # per-position states: the one after token n[b]
                rec = jnp.take_along_axis(rec, jnp.maximum(n - 1, 0)[:, None, None, None, None], axis=1)[:, 0]
            conv = tuple(conv_state_after(w, n, c.conv_len) for w in c.window)
            c = whole.replace(conv=slot_rows.put(whole.conv, kept, conv),
                              recurrent=slot_rows.put(whole.recurrent, kept, rec))
        elif isinstance(c, KDAPending):
            rec = c.recurrent
            if rec.ndim == 5:  # per-position states: the one after token n[b], or the initial one
                rec = state_after(rec, n, c.initial)
            c = KDAState(conv=tuple(conv_state_after(w, n, c.conv_len) for w in c.window), recurrent=rec)
        layers.append(c)
    return pending.replace(layers=tuple(layers), lengths=pending.lengths + n)

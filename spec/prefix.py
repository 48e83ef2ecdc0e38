"""The prefix cache's device side: a pool of checkpoints of slot states, and the two programs that
move them, `save` (slot -> pool) and `restore` (pool -> slot). Which prompt prefix a checkpoint
holds is the host's business (`serve.prefix_cache`).

Layout. The pool has N entries; entry e holds, for a checkpoint at n tokens whose page starts at
row r0 (a multiple of the interval I, r0 < n <= r0 + I):
  - every KDA layer's conv and recurrent state after token n-1 (a slot's, `ling.state.KDAState`),
    and the target's final hidden state h_{n-1} (a slot's `last_hidden`);
  - one page: rows [r0, r0 + I) of every MLA layer's latent and rope-key cache and of the NEXTN
    cache, [N, I, R] and [N, I, P] (rows past n unused).
A checkpoint at n is restored from the pages of the entries on its path (entry of the checkpoint
at I, 2I, ... and its own, the last): the rows [0, n) of the MLA and NEXTN caches come from them,
page after page, and the KDA states from its own entry.

NEXTN rows. The NEXTN cache row i is the pair (h_i, token_{i+1}); a checkpoint written after a
prefill chunk that ended at n before the prompt's end holds row n-1 with the prompt's token n, so
it is valid for prompts that agree on tokens 0..n (the host keys it so).

Both programs take their indices as device int32 scalars (one compiled program for any slot,
entry and length) and donate what they write: `save` the pool, `restore` the slots. JAX runs
programs in dispatch order, so a restore dispatched before a save that reuses its entries reads
the old contents, and a save dispatched after a prefill chunk copies that chunk's result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ling.state import KDAState, MLACache, State


@struct.dataclass
class Pool:
    """N checkpoint entries (module docstring): per target layer a KDAState [N, ...] or an MLACache
    [N, I, ...], the NEXTN cache's pages (or None), and the hidden states h_{n-1} [N, D]."""

    layers: tuple
    nextn: MLACache | None
    hidden: jnp.ndarray

    @property
    def entries(self) -> int:
        return self.hidden.shape[0]

    @property
    def interval(self) -> int:
        return next((c.latent.shape[1] for c in self.layers if isinstance(c, MLACache)),
                    self.nextn.latent.shape[1] if self.nextn is not None else 0)


def _entry_like(c, n: int, interval: int, make):
    if isinstance(c, KDAState):
        return jax.tree.map(lambda a: make((n,) + a.shape[1:], a.dtype), c)
    return jax.tree.map(lambda a: make((n, interval) + a.shape[2:], a.dtype), c)


def new_pool(state: State, last_hidden, entries: int, interval: int) -> Pool:
    """A pool of `entries` checkpoints shaped after the slots' state and last_hidden [B, D]
    (arrays or shape structs)."""
    z = lambda shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
    return Pool(layers=tuple(_entry_like(c, entries, interval, z) for c in state.layers),
                nextn=None if state.nextn is None else _entry_like(state.nextn, entries, interval, z),
                hidden=jnp.zeros((entries,) + last_hidden.shape[1:], last_hidden.dtype))


def entry_bytes(state: State, last_hidden, interval: int) -> int:
    """Bytes of one pool entry for slots of this state (arrays or shape structs)."""
    one = jax.eval_shape(lambda: new_pool(state, last_hidden, 1, interval))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(one))


def _take(a, i):
    return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _put(a, i, x):
    return jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), i, 0)


def save(pool: Pool, slots, slot, entry, row0) -> Pool:
    """The pool with entry `entry` holding slot `slot`'s KDA states and last_hidden and the rows
    [row0, row0 + I) of its MLA and NEXTN caches (the slots' caches have at least row0 + I rows;
    `dynamic_slice` would move a page that does not fit)."""
    interval = pool.interval
    page = lambda c, p: jax.tree.map(  # noqa: E731
        lambda dst, src: _put(dst, entry, jax.lax.dynamic_slice_in_dim(_take(src, slot), row0, interval, 0)), p, c)
    layers = tuple(jax.tree.map(lambda dst, src: _put(dst, entry, _take(src, slot)), p, c) if isinstance(c, KDAState)
                   else page(c, p) for c, p in zip(slots.model.layers, pool.layers))
    nextn = None if pool.nextn is None else page(slots.model.nextn, pool.nextn)
    return pool.replace(layers=layers, nextn=nextn, hidden=_put(pool.hidden, entry, _take(slots.last_hidden, slot)))


def restore(pool: Pool, slots, slot, path, n, tokens):
    """The slots with slot `slot` holding the checkpoint of n tokens whose entries are path [M]
    (the entries of its pages in order; its own, whose KDA states and hidden state it takes, is
    path[(n - 1) // I]; entries past it are padding), M * I <= the slots' cache length: MLA and
    NEXTN rows [0, n) from the pages (rows past n keep their values), lengths n, last_hidden
    h_{n-1}, and `seen` (the prompt's tokens, for the penalties) set from tokens [M * I] (the
    prompt's first n tokens, then padding >= the vocabulary size, which marks nothing)."""
    m, interval = path.shape[0], pool.interval
    own = path[jnp.maximum(n - 1, 0) // interval]
    keep = jnp.arange(m * interval) < n

    def rows(dst, src):  # dst [B, L, X]: slot row of L; src [N, I, X] pages
        got = src[path].reshape((m * interval,) + src.shape[2:])
        row = _take(dst, slot)
        head = jnp.where(keep.reshape((-1,) + (1,) * (got.ndim - 1)), got, row[:m * interval])
        return _put(dst, slot, jax.lax.dynamic_update_slice_in_dim(row, head, 0, 0))

    state = slots.model
    layers = tuple(jax.tree.map(lambda dst, src: _put(dst, slot, _take(src, own)), c, p) if isinstance(c, KDAState)
                   else jax.tree.map(rows, c, p) for c, p in zip(state.layers, pool.layers))
    nextn = None if state.nextn is None else jax.tree.map(rows, state.nextn, pool.nextn)
    vocab = slots.seen.shape[1]
    seen = jnp.zeros((vocab,), bool).at[jnp.where(keep, tokens, vocab)].set(True, mode="drop")
    state = state.replace(layers=layers, nextn=nextn, lengths=_put(state.lengths, slot, n))
    return slots.replace(model=state, last_hidden=_put(slots.last_hidden, slot, _take(pool.hidden, own)),
                         seen=_put(slots.seen, slot, seen))


def complete_nextn(model, slots, slot):
    """The slots with slot `slot`'s NEXTN cache row n-1 (n its length) holding the pair
    (last_hidden, last_token) = (h_{n-1}, token_n), as the next speculative step would write it:
    a finished slot's state, made whole for a checkpoint at n."""
    one = lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, 0)  # noqa: E731
    cache = jax.tree.map(one, slots.model.nextn)
    _, _, cache = model.draft(one(slots.last_hidden)[:, None], one(slots.last_token)[:, None], cache,
                              one(slots.model.lengths) - 1, form="decode", logits=False)
    nextn = jax.tree.map(lambda a, c: jax.lax.dynamic_update_slice_in_dim(a, c, slot, 0), slots.model.nextn, cache)
    return slots.replace(model=slots.model.replace(nextn=nextn))


class PrefixPool:
    """The pool on the device and `save` / `restore` compiled once each (indices travel as device
    int32 scalars). The pool is donated to `save`; the slots, to `restore` and `complete` (pass
    the Stepper's current slots and put the result back)."""

    def __init__(self, model, slots, entries: int, interval: int):
        length = slots.model.nextn.latent.shape[1] if slots.model.nextn is not None else next(
            (c.latent.shape[1] for c in slots.model.layers if isinstance(c, MLACache)), 0)
        self.interval, self.entries = interval, entries
        self.pages = length // interval  # pages a restore can write (M)
        if self.pages < 1:
            raise ValueError(f"the slots hold {length} positions, fewer than one prefix-cache interval ({interval})")
        self._sharding = slots.done.sharding
        self._shapes = (slots.model, slots.last_hidden)
        self.clear()
        self._save = jax.jit(save, donate_argnums=0)
        self._restore = jax.jit(restore, donate_argnums=1)
        self._complete = None
        if slots.model.nextn is not None:
            from spec.stepper import _flat_weights

            self._params, merge = _flat_weights(model)
            self._complete = jax.jit(lambda params, slots, slot: complete_nextn(merge(params), slots, slot),
                                     donate_argnums=1)

    def complete(self, slots, slot: int):
        """`complete_nextn` (the slots unchanged without a NEXTN layer). Returns the slots."""
        return slots if self._complete is None else self._complete(self._params, slots, np.int32(slot))

    def clear(self) -> None:
        """A fresh pool (after a failure: the old one may have been donated to a program that failed)."""
        self.pool = jax.device_put(new_pool(*self._shapes, self.entries, self.interval), self._sharding)

    def save(self, slots, slot: int, entry: int, row0: int) -> None:
        self.pool = self._save(self.pool, slots, np.int32(slot), np.int32(entry), np.int32(row0))

    def restore(self, slots, slot: int, path, n: int, tokens):
        """path: the entries of the checkpoint's pages (host ints); tokens: the prompt (its first n
        are used). Returns the slots."""
        m, vocab = self.pages, slots.seen.shape[1]
        p = np.zeros(m, np.int32)
        p[:len(path)] = path
        t = np.full(m * self.interval, vocab, np.int32)
        t[:n] = tokens[:n]
        return self._restore(self.pool, slots, np.int32(slot), p, np.int32(n), t)

"""Slot rows: a call over K of the B slots of a batched state, the state left whole.

A state array x [B, ...] holds every slot. A call that runs K rows names their slots with
rows [K] int32: row i reads and writes slot rows[i]; an entry >= B is a padding row, which reads
slot B - 1 and writes nothing. The real entries are distinct, so no two rows write one slot and
a kernel may write a slot's state over itself (in place) with no race between programs.
`take` and `put` are the plain-jnp reads and writes, of one array or of every leaf of a tree;
the kernels that take `rows` index the whole state arrays themselves (`kda`, `kda_epilogue`,
`mla_decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slot(rows, b: int):
    """The slot a row reads (padding rows: B - 1); rows any int32 array or scalar."""
    return jnp.minimum(rows, b - 1)


def take(tree, rows):
    """Every leaf [B, ...] of tree -> [K, ...]: the rows' slots."""
    return jax.tree.map(lambda x: x[slot(rows, x.shape[0])], tree)


def put(tree, rows, values):
    """tree with every leaf's real rows' slots set to values' leaf [K, ...] (padding rows dropped)."""
    return jax.tree.map(lambda x, v: x.at[rows].set(v.astype(x.dtype), mode="drop"), tree, values)

"""Slot rows: a call over K of the B slots of a batched state, the state left whole.

A state array x [B, ...] holds every slot. A call that runs K rows names their slots with
rows [K] int32: row i reads and writes slot rows[i]; an entry >= B is a padding row, which reads
slot B - 1 and writes nothing. The real entries are distinct, so no two rows write one slot and
a kernel may write a slot's state over itself (in place) with no race between programs.
`take` and `put` are the plain-jnp reads and writes; the kernels that take `rows` index the
whole state arrays themselves (`kda`, `kda_epilogue`, `mla_decode`).
"""

from __future__ import annotations

import jax.numpy as jnp


def slot(rows, b: int):
    """The slot a row reads (padding rows: B - 1); rows any int32 array or scalar."""
    return jnp.minimum(rows, b - 1)


def take(x, rows):
    """x [B, ...] -> [K, ...]: the rows' slots."""
    return x[slot(rows, x.shape[0])]


def put(x, rows, values):
    """x [B, ...] with the real rows' slots set to values [K, ...] (padding rows dropped)."""
    return x.at[rows].set(values.astype(x.dtype), mode="drop")

"""Ticket counters: how a kernel whose programs each hold a share of a sum (split K) finishes the
sum in its own launch instead of leaving the partials to a second one.

Each program stores its share, then takes a ticket (`atomic_add(counters[i], 1)`, acquire-release,
after a barrier so that every thread's stores precede it); the program that draws the last ticket
of its output tile reads the shares back, in split order (so the sum does not depend on which
program came last), writes the result and puts the counter back to zero. Counters are therefore
zero before and after every launch.

Where the counters live: a step program opens a `scope` over an int32 buffer of `CAPACITY` zeros
(the `spec.stepper.Stepper` keeps one, donated, so it stays at one address across steps and needs
no memset). A ticket kernel `take`s the buffer, aliases it to one of its outputs and `give`s the
output back: the kernels that use it run one after another, in the order they were traced, and
every one of them may use counters [0, CAPACITY). Without a scope (`current()` is None) kernels
leave their partials to an XLA sum. A scope must not span a `lax` loop or `cond` whose
body traces a ticket kernel (the buffer would cross the body's boundary): step programs unroll.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

CAPACITY = 4096  # counters: the most output tiles one ticket kernel reduces


class Counters:
    """The scope's buffer, threaded through the ticket kernels in trace order."""

    def __init__(self, buffer: jax.Array):
        if buffer.shape != (CAPACITY,) or buffer.dtype != jnp.int32:
            raise ValueError(f"ticket counters are int32[{CAPACITY}], got {buffer.dtype}{list(buffer.shape)}")
        self.buffer = buffer

    def take(self, n: int) -> jax.Array:
        """The buffer, for a kernel that uses counters [0, n)."""
        if n > CAPACITY:
            raise ValueError(f"a ticket kernel needs {n} counters; the scope holds {CAPACITY}")
        return self.buffer

    def give(self, buffer: jax.Array) -> None:
        """The kernel's aliased output: the buffer the next ticket kernel takes."""
        self.buffer = buffer


_scopes: list[Counters] = []


@contextlib.contextmanager
def scope(buffer: jax.Array):
    """Ticket kernels traced inside use `buffer` (int32[CAPACITY], all zeros); read the buffer
    to return from the scope's `Counters.buffer` at its end."""
    counters = Counters(buffer)
    _scopes.append(counters)
    try:
        yield counters
    finally:
        _scopes.pop()


def current() -> Counters | None:
    """The innermost scope's counters, or None."""
    return _scopes[-1] if _scopes else None


def zeros() -> jax.Array:
    """A fresh buffer for a scope."""
    return jnp.zeros((CAPACITY,), jnp.int32)

"""Per-slot sampling: temperature, top-k, top-p and a per-request seed; greedy at temperature 0;
presence, frequency and repetition penalties.

Every slot carries its own parameters as arrays, so one compiled step serves a batch of requests
with different settings. Randomness is a pure function of (seed, tokens generated so far, purpose),
so a request's output does not depend on what else shares the batch.
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
from flax import struct

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask log-probabilities of (OpenAI's limit)


@struct.dataclass
class SamplingParams:
    temperature: jnp.ndarray  # [B] fp32; 0 = greedy
    top_k: jnp.ndarray  # [B] int32; 0 = off
    top_p: jnp.ndarray  # [B] fp32; 1 = off
    seed: jnp.ndarray  # [B] uint32
    presence: jnp.ndarray  # [B] fp32; 0 = off (OpenAI's presence_penalty)
    frequency: jnp.ndarray  # [B] fp32; 0 = off (frequency_penalty)
    repetition: jnp.ndarray  # [B] fp32; 1 = off (repetition_penalty, over the prompt and the output)

    @classmethod
    def make(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, presence=0.0, frequency=0.0,
             repetition=1.0, *, on_host: bool = False) -> "SamplingParams":
        """Each field [B] broadcast from its value, as device arrays (buffers of their own: a step
        may donate them), or with on_host as numpy arrays (what `spec.stepper.ChunkPrefiller`
        takes: a device array there would be read back, waiting for every queued step)."""
        if on_host:
            full = lambda v, dt: np.array(np.broadcast_to(np.asarray(v), (batch,)), dt)  # noqa: E731
        else:
            full = lambda v, dt: jnp.array(np.broadcast_to(np.asarray(v), (batch,)), dt)  # noqa: E731
        return cls(full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                   full(seed, np.uint32), full(presence, np.float32), full(frequency, np.float32),
                   full(repetition, np.float32))

    @property
    def greedy(self):
        return self.temperature <= 0.0


def needs_sampling(p) -> np.ndarray:
    """Host side, per slot [B] bool: whether it needs the sampling program (it samples, or it has a
    penalty, which only that program applies). p: host arrays [B] named as SamplingParams' fields
    (temperature, presence, frequency, repetition)."""
    return ((np.asarray(p.temperature) > 0) | (np.asarray(p.presence) != 0) | (np.asarray(p.frequency) != 0)
            | (np.asarray(p.repetition) != 1))


def penalize(logits, counts, seen, p: SamplingParams):
    """Penalised logits [B, ..., V] fp32: minus presence where a token was generated, minus
    frequency times its count, and (repetition) divided by the penalty where positive and
    multiplied where negative for every token of the prompt or the output. counts int32 (the
    output's) and seen bool (the prompt's tokens): broadcastable to logits."""
    per = lambda a: a.reshape(a.shape + (1,) * (logits.ndim - 1))
    x = logits.astype(jnp.float32)
    rep = per(p.repetition)
    x = jnp.where(seen | (counts > 0), jnp.where(x > 0, x / rep, x * rep), x)
    return x - per(p.presence) * (counts > 0) - per(p.frequency) * counts


def penalize_verify(logits, counts, seen, drafts, p: SamplingParams):
    """`penalize` for a verify pass: logits [B, S+1, V], counts [B, V] before the step, drafts
    [B, S]. Position j's counts include drafts 0..j-1 (its prefix, if accepted): the base penalty
    everywhere, then each such draft's entry recomputed with its count at j."""
    b, s1, v = logits.shape
    s = s1 - 1
    out = penalize(logits, counts[:, None], seen[:, None], p)
    if s == 0:
        return out
    j, i = jnp.arange(s1)[:, None], jnp.arange(s)[None]  # [S+1, 1], [1, S]
    before = i < j  # draft i precedes position j
    same = drafts[:, :, None] == drafts[:, None, :]  # [B, S, S]: d_i' == d_i
    # occurrences of d_i among drafts 0..j-1: [B, S+1, S]
    extra = jnp.einsum("bki,jk->bji", same.astype(jnp.int32), before.astype(jnp.int32))
    c = jnp.take_along_axis(counts, drafts, axis=1)[:, None, :] + extra  # [B, S+1, S]
    x = jnp.take_along_axis(logits, jnp.broadcast_to(drafts[:, None, :], (b, s1, s)), axis=2)  # [B, S+1, S]
    val = penalize(x, c, jnp.take_along_axis(seen, drafts, axis=1)[:, None, :], p)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, s1, s))
    pos = jnp.broadcast_to(j[None], (b, s1, s))
    cols = jnp.where(before[None], drafts[:, None, :], v)  # a draft at or after j: dropped
    return out.at[rows, pos, cols].set(val, mode="drop")


def probs(logits, p: SamplingParams):
    """The distribution a slot samples from: logits [B, ..., V] fp32 -> probabilities [B, ..., V].
    Temperature first, then top-k, then top-p (nucleus over the top-k-filtered distribution)."""
    per = lambda a: a.reshape(a.shape + (1,) * (logits.ndim - 1))  # [B] -> [B, 1, ..., 1]
    x = logits / per(jnp.maximum(p.temperature, 1e-6))
    v = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, v), v)
    kth = jnp.take_along_axis(sorted_x, jnp.broadcast_to(per(k - 1), sorted_x.shape[:-1] + (1,)), axis=-1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    sorted_x = jnp.where(jnp.arange(v) < per(k), sorted_x, -jnp.inf)
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
    keep = (before < per(p.top_p)) | (jnp.arange(v) == 0)  # the top token always: top_p may flush to 0
    cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= cutoff, x, -jnp.inf)
    return jax.nn.softmax(x, axis=-1)


def token_logprobs(logits, tokens):
    """The target's log-probabilities (log_softmax of the raw logits: no temperature or
    filtering) of emitted tokens and of the most likely alternatives.
    logits [B, W, V], tokens [B, W] -> (logprobs [B, W, 1 + K] float32: the token's, then the K
    largest in descending order; their ids [B, W, K] int32), K = min(MAX_TOP_LOGPROBS, V)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)
    top, ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]))
    return jnp.concatenate([chosen, top], axis=-1), ids.astype(jnp.int32)


def key_for(p: SamplingParams, counter, purpose: int):
    """[B] keys from (seed, counter [B], purpose)."""
    def one(seed, c):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), c), purpose)

    return jax.vmap(one)(p.seed, counter.astype(jnp.uint32))


@jax.named_scope("sample")
def sample(logits, p: SamplingParams, keys, *, sampling: bool):
    """logits [B, V] -> (tokens [B] int32, probs [B, V]). sampling False (every slot greedy, which
    the host knows and compiles for): argmax, and probs None. sampling True: each slot draws from
    `probs`, except greedy slots, which take the argmax. No branch on the device: the variant is
    chosen when the step is compiled."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy, None
    pr = probs(logits, p)
    drawn = jax.vmap(lambda k, q: jax.random.categorical(k, jnp.log(q)))(keys, pr)
    return jnp.where(p.greedy, greedy, drawn).astype(jnp.int32), pr


def any_sampling(temperature, live) -> bool:
    """Host side: whether any live slot samples (temperature > 0), i.e. which compiled variant a
    step needs. temperature, live: [B] host arrays."""
    return bool(np.any((np.asarray(temperature) > 0) & np.asarray(live, bool)))

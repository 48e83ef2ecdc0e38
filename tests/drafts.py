"""A forced drafter for the speculative-decoding tests: it proposes the target's own greedy
continuation, so the number of drafts accepted each step is known."""

import jax
import jax.numpy as jnp


def forced(reference, mistake_at, limit=None):
    """A drafter (`spec.step.Drafter`) proposing reference [B, N] (the target's greedy tokens after
    the prompt), wrong at draft index mistake_at (None: never); limit: a verify limit [B] the
    drafter returns too (`spec.step.accept`), None for none."""
    ref = jnp.asarray(reference)  # [B, N]

    def drafter(model, slots, num_steps, *, sampling):
        idx = slots.n_out[:, None] + jnp.arange(num_steps)[None]  # d_1 is the token after last_token
        drafts = jnp.take_along_axis(ref, jnp.minimum(idx, ref.shape[1] - 1), axis=1)
        if mistake_at is not None:
            drafts = drafts.at[:, mistake_at].set((drafts[:, mistake_at] + 1) % model.cfg.vocab_size)
        q = jax.nn.one_hot(drafts, model.cfg.vocab_size)
        lim = () if limit is None else (jnp.full(drafts.shape[:1], limit, jnp.int32),)
        return (drafts, q, slots.model.nextn, *lim)

    return drafter

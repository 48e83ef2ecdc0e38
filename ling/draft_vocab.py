"""A reduced draft vocabulary: the drafter scores a fixed set of frequent tokens only.

A draft step's lm_head reads the whole [V, D] head for one token (157184 x 2560 for Ling: 805 MB in
bf16, 207 MB in int4, more than the NEXTN layer itself). Drafting over the V_d most frequent tokens
(FR-Spec's frequency-ranked drafting; SGLang's `--speculative-token-map`) reads V_d rows instead.
The draft logits are the full head's at those ids and -inf elsewhere, so everything downstream
(penalties, sampling, the draft probabilities q of rejection sampling) runs unchanged over V: a
draft is always one of the ids, q is zero outside them, and verification keeps the target's
distribution exactly; what a smaller set can cost is acceptance, never output.

The token map: the ids, a file of integers (`.npy`, `.json` list, or whitespace-separated `.txt`;
`.pt` where torch is installed), any order, each in [0, V). `python -m offline.token_map` counts a
corpus's tokens and writes one.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling.quantize import QLinear
from pallas_kernels.quant import take_rows

TOKEN_MAP_SUFFIXES = (".npy", ".json", ".txt", ".pt")


def load_token_map(path: str, vocab_size: int) -> np.ndarray:
    """The ids of a token map file as sorted unique int32 [V_d]. ValueError naming the file when it
    cannot be read as integers, is empty, or holds an id outside [0, vocab_size); OSError when
    missing."""
    if not os.path.isfile(path):
        raise OSError(f"token map {path}: no such file")
    suffix = os.path.splitext(path)[1]
    try:
        if suffix == ".npy":
            raw = np.load(path, allow_pickle=False)
        elif suffix == ".json":
            with open(path) as f:
                raw = np.asarray(json.load(f))
        elif suffix == ".txt":
            with open(path) as f:
                raw = np.asarray([int(tok) for tok in f.read().split()])
        elif suffix == ".pt":
            try:
                import torch
            except ImportError:
                raise ValueError("a .pt token map needs torch installed; save it as .npy instead") from None
            raw = np.asarray(torch.load(path, map_location="cpu", weights_only=True))
        else:
            raise ValueError(f"unknown suffix {suffix!r}: one of {', '.join(TOKEN_MAP_SUFFIXES)}")
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"token map {path}: {e}") from None
    if raw.ndim != 1 or raw.size == 0 or not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(f"token map {path}: expected a non-empty list of integer token ids, got "
                         f"{raw.dtype} of shape {raw.shape}")
    ids = np.unique(raw)
    if ids[0] < 0 or ids[-1] >= vocab_size:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise ValueError(f"token map {path}: id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def most_frequent(counts, size: int) -> np.ndarray:
    """The ids of the `size` largest counts [V] (ties: the lower id), sorted."""
    counts = np.asarray(counts)
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"size must be in [1, {counts.shape[0]}], got {size}")
    order = np.argsort(-counts, kind="stable")[:size]
    return np.sort(order).astype(np.int32)


class DraftVocab(nnx.Module):
    """The lm_head's rows `ids` [V_d] (sorted unique) for drafting.

    head: bf16 [D, V_d] (the full head's columns), or a QLinear over [V_d, D] taken row by row from a
    quantised head (`pallas_kernels.quant.take_rows`: the same codes, scales and zeros, exact).
    slot [V] int32: the position of each token in ids, -1 for a token outside."""

    def __init__(self, model, ids):
        ids = np.asarray(ids, np.int32)
        v = model.cfg.vocab_size
        if ids.ndim != 1 or ids.size == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= v:
            raise ValueError(f"draft vocabulary ids must be sorted, unique and in [0, {v})")
        slot = np.full(v, -1, np.int32)
        slot[ids] = np.arange(ids.size, dtype=np.int32)
        self.size = int(ids.size)
        self.ids = nnx.Variable(jnp.asarray(ids))
        self.slot = nnx.Variable(jnp.asarray(slot))
        if isinstance(model.lm_head, QLinear):
            self.head = QLinear(take_rows(model.lm_head.weight, ids), kernels=model.lm_head.kernels)
        else:
            w = model.embed_tokens[...][ids].T if model.lm_head is None else model.lm_head[...][:, ids]
            self.head = nnx.Param(w)  # [D, V_d]

    @jax.named_scope("draft_lm_head")
    def __call__(self, hidden):
        """hidden [B, T, D] -> logits [B, T, V] fp32: the full head's at ids, -inf elsewhere."""
        if isinstance(self.head, QLinear):
            hot = self.head(hidden).astype(jnp.float32)
        else:
            hot = jnp.dot(hidden, self.head[...].astype(hidden.dtype), preferred_element_type=jnp.float32)
        slot = self.slot[...]
        return jnp.where(slot >= 0, jnp.take(hot, jnp.maximum(slot, 0), axis=-1), -jnp.inf)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(self)))

"""The hybrid KDA/MLA MoE model (Ling-3.0-flash, Kimi-Linear): config, layers, checkpoints.

    model = ling.load("ling-tiny")            # a preset (random weights), a hub dir or a converted dir
    logits = ling.forward(model, [1, 2, 3])   # [T, vocab] for one sequence
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling.config import ConfigError, ModelConfig, load_config, preset
from ling.model import LingModel, apply
from ling.state import State, init_state

__all__ = ["ConfigError", "LingModel", "ModelConfig", "State", "apply", "forward", "init_state", "load", "load_config", "preset"]


def _dtype(dtype):
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype name (try 'bfloat16' or 'float32')") from e


def load(path_or_preset: str | os.PathLike, *, dtype="bfloat16", seed: int = 0, progress: bool = True) -> LingModel:
    """A preset name gives random weights; a hub directory (config.json + safetensors) or a
    converted directory (`python -m ling.convert`) gives the checkpoint's weights."""
    from ling import checkpoint

    dtype = _dtype(dtype)
    p = os.fspath(path_or_preset)
    if os.path.isdir(p) and checkpoint.is_converted(p):
        return checkpoint.load_converted(p, dtype=dtype)
    cfg = load_config(p)
    if os.path.isdir(p):
        return checkpoint.load_hub(p, cfg, dtype=dtype, progress=progress)
    return LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def forward(model: LingModel, token_ids) -> np.ndarray:
    """Logits [T, vocab] (fp32) of one sequence, from an empty state, in one prefill."""
    tokens = jnp.asarray(np.asarray(token_ids, np.int32).reshape(1, -1))
    dtype = model.embed_tokens[...].dtype
    state = init_state(model.cfg, 1, tokens.shape[1], dtype)
    logits, _, _ = apply(model, tokens, state)
    return np.asarray(logits[0])

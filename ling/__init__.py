"""The hybrid KDA/MLA MoE model (Ling-3.0-flash, Kimi-Linear): config, layers, checkpoints.

    model = ling.load("ling-tiny")            # a preset (random weights), a hub dir or a converted dir
    logits = ling.forward(model, [1, 2, 3])   # [T, vocab] for one sequence
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from ling.config import PRESETS, ConfigError, ModelConfig, load_config, preset
from ling.model import LingModel, apply, use_kernels
from ling.state import State, init_state

__all__ = ["ConfigError", "LingModel", "ModelConfig", "State", "apply", "forward", "init_state", "load", "load_config", "preset",
           "use_kernels"]


def _dtype(dtype):
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype name (try 'bfloat16' or 'float32')") from e


def load(path_or_preset: str | os.PathLike, *, dtype="bfloat16", seed: int = 0, progress: bool = True,
         quantize: str | None = None, group_size: int = 128, quantize_lm_head: bool = False,
         quantize_experts: bool = False, ep_size: int = 1, num_layers: int | None = None,
         memory_budget: int | None = None, kernels: str = "auto", quantize_layout: str = "tiles") -> LingModel:
    """A preset name gives random weights (num_layers: only its first decoder layers, the NEXTN
    layer kept, so that a cut of a large preset fits one device for benchmarks); a hub directory
    (config.json + safetensors) or a converted directory (`python -m ling.convert`) gives the
    checkpoint's weights.
    quantize ("int8", "int4", "int2") stores the projections grouped low-bit (`ling.quantize`),
    and with quantize_experts (int4 / int8) the routed experts in the fused MoE kernel's format;
    a converted directory that was quantised at conversion is served as stored (its projections
    re-laid out if quantize_layout asks another layout: "rows", int4 or int8 in groups of 128,
    for the tensor-core Triton kernels; "tiles", the Pallas ones).
    ep_size > 1 shards the routed experts over that many devices (`moe.parallel`).
    kernels: the kernel backend the model runs (`pallas_kernels.backend`; "auto": Pallas on a GPU,
    the plain-jnp references elsewhere, or LING_KERNELS where set), fixed when the model is built.
    The model is built layer by layer in its final form and sharding (`ling.build`): a model that
    fits only quantised never exists in full precision, and one whose weights exceed
    memory_budget bytes (default: the device's memory, where known) is refused before anything
    is read."""
    from ling import build, checkpoint
    from ling.quantize import Quantization, bits_of

    if quantize_experts and quantize is None:
        raise ValueError("quantize_experts needs quantize (int4 or int8): the experts take its bits")
    p = os.fspath(path_or_preset)
    if num_layers is not None and p not in PRESETS:
        raise ValueError(f"num_layers cuts a preset's random model; {p!r} is a checkpoint "
                         f"(presets: {', '.join(sorted(PRESETS))})")
    dtype = _dtype(dtype)
    quant = None if quantize is None else Quantization(bits_of(quantize), group_size, quantize_lm_head,
                                                       quantize_experts, quantize_layout)
    mesh = None
    if ep_size > 1:
        from moe.parallel import make_mesh

        mesh = make_mesh(ep_size)
    if os.path.isdir(p) and checkpoint.is_converted(p):
        return checkpoint.load_converted(p, dtype=dtype, quant=quant, mesh=mesh, progress=progress,
                                         budget=memory_budget, kernels=kernels)
    cfg = load_config(p)
    if num_layers is not None:
        cfg = cfg.first_layers(num_layers)
    if os.path.isdir(p):
        return checkpoint.load_hub(p, cfg, dtype=dtype, quant=quant, mesh=mesh, progress=progress,
                                   budget=memory_budget, kernels=kernels)
    build.plan(cfg, dtype=dtype, quant=quant, mesh=mesh, budget=memory_budget)
    return build.random(cfg, dtype=dtype, seed=seed, quant=quant, mesh=mesh, progress=progress, kernels=kernels)


def forward(model: LingModel, token_ids) -> np.ndarray:
    """Logits [T, vocab] (fp32) of one sequence, from an empty state, in one prefill."""
    tokens = jnp.asarray(np.asarray(token_ids, np.int32).reshape(1, -1))
    dtype = model.embed_tokens[...].dtype
    state = init_state(model.cfg, 1, tokens.shape[1], dtype)
    logits, _, _ = apply(model, tokens, state)
    return np.asarray(logits[0])

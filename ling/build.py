"""Models built in their final form, one layer at a time.

Every loader builds the model through `LingModel`'s `finish`: each decoder layer (and the NEXTN
block) is quantised (`ling.quantize`) and placed in its sharding as soon as its weights exist, so
that at most one layer is ever held in full precision:
- a preset's random weights are drawn by the modules' own initialisers, layer by layer (`random`);
- a hub checkpoint is read into an abstract model, layer by layer (`ling.checkpoint.load_hub`);
- a converted checkpoint restores straight into the final tree (`abstract`), low-bit as stored.

Placement: with a mesh, each parameter goes to `NamedSharding(mesh, spec)` with spec from its
logical axes (`moe.parallel.RULES`: the routed experts split over "expert", the rest replicated);
without one it stays on the default device. `plan` states what the weights will take per device
before anything is built or read, and refuses a model that does not fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

from ling.config import ModelConfig
from ling.model import LingModel
from ling.quantize import Quantization, quantize_lm_head, quantize_module
from moe.parallel import EXPERT, spec_for

GB = 1e9


def sharding(var, mesh) -> NamedSharding | None:
    """The sharding of a parameter from its logical axes (None without a mesh)."""
    if mesh is None:
        return None
    axes = var.get_metadata().get("logical_axes") or (None,) * len(var.shape)
    return NamedSharding(mesh, spec_for(axes))


def variables(module):
    """(path, Variable) of every parameter under module."""
    return [(p, v) for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)]


def place(module, mesh) -> None:
    """Puts every parameter under module in its sharding (nothing to do without a mesh)."""
    for _, var in variables(module) if mesh is not None else ():
        var.set_value(jax.device_put(var.get_value(), sharding(var, mesh)))


def check_mesh(cfg: ModelConfig, quant: Quantization | None, mesh) -> None:
    """ValueError unless the routed experts can be split over the mesh's expert axis."""
    if mesh is None:
        return
    ep = mesh.shape[EXPERT]
    if quant is not None and quant.experts:
        raise ValueError("expert parallelism runs the routed experts in full precision: load the model without "
                         "quantize_experts (--quantize-experts) or with --ep-size 1")
    if cfg.num_experts % ep:
        raise ValueError(f"--ep-size {ep} must divide the number of experts ({cfg.num_experts})")


class Finish:
    """The `finish` of `LingModel`: quantise a freshly built layer and place it; `model` then does
    the same for what lies outside the layers (embedding, lm_head, final norm)."""

    def __init__(self, quant: Quantization | None, mesh, bar=None):
        self.quant, self.mesh, self.bar = quant, mesh, bar

    def __call__(self, module):
        if self.quant is not None:
            quantize_module(module, self.quant)
        place(module, self.mesh)
        if self.bar is not None:
            self.bar.update()
        return module

    def model(self, model: LingModel) -> LingModel:
        if self.quant is not None:
            quantize_module(model, self.quant)  # what the layers left: nothing, or a model built whole
            quantize_lm_head(model, self.quant)
        place(model, self.mesh)
        return model


def abstract(cfg: ModelConfig, *, dtype, nextn: bool | None = None, quant: Quantization | None = None,
             mesh=None, kernels: str = "auto") -> LingModel:
    """The model's final tree with ShapeDtypeStructs for values (in their shardings with a mesh):
    nothing is allocated."""
    model = nnx.eval_shape(lambda: Finish(quant, None).model(
        LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(0), nextn=nextn, mesh=mesh, kernels=kernels)))
    for _, var in variables(model):
        v = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(var, mesh)))
    return model


def nbytes(module, mesh=None) -> int:
    """Bytes the parameters under module take on one device (a split axis counts its share)."""
    total = 0
    for _, var in variables(module):
        s = sharding(var, mesh)
        shape = var.shape if s is None else s.shard_shape(var.shape)
        total += int(np.prod(shape)) * jnp.dtype(var.dtype).itemsize
    return total


def device_memory() -> int | None:
    """Bytes this process's first device can hold (None where the backend does not say: CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


def plan(cfg: ModelConfig, *, dtype, nextn: bool | None = None, quant: Quantization | None = None, mesh=None,
         budget: int | None = None) -> tuple[LingModel, int]:
    """The final abstract model and the peak bytes its build takes on one device (the final
    weights plus the largest layer held in full precision before it is quantised). ValueError,
    naming the numbers, when the peak exceeds `budget` (default: the device's memory, where known)."""
    check_mesh(cfg, quant, mesh)
    if quant is not None:
        quant.check(cfg)
    final = abstract(cfg, dtype=dtype, nextn=nextn, quant=quant, mesh=mesh)
    full = abstract(cfg, dtype=dtype, nextn=nextn, mesh=mesh) if quant is not None else final
    units = list(full.layers) + ([full.nextn] if full.nextn is not None else [])
    peak = nbytes(final, mesh) + (max(nbytes(u, mesh) for u in units) if quant is not None and units else 0)
    budget = device_memory() if budget is None else budget
    if budget is not None and peak > budget:
        raise ValueError(f"the weights need {peak / GB:.1f} GB on a device ({nbytes(final, mesh) / GB:.1f} GB "
                         f"{'as stored' if quant is None else f'at int{quant.bits}'}, plus one layer in full "
                         f"precision while loading) but the device holds {budget / GB:.1f} GB: quantise "
                         "(--quantize int4 --quantize-experts) or shard the experts (--ep-size)")
    return final, peak


def random(cfg: ModelConfig, *, dtype, seed: int = 0, nextn: bool | None = None, quant: Quantization | None = None,
           mesh=None, progress: bool = True, kernels: str = "auto") -> LingModel:
    """Random weights, the same as `LingModel(cfg, rngs=nnx.Rngs(seed))`'s, quantised and placed
    layer by layer."""
    layers = cfg.num_hidden_layers + (cfg.num_nextn_layers > 0 if nextn is None else bool(nextn))
    with tqdm(total=layers, desc="random weights", unit="layer", disable=not progress, leave=False) as bar:
        finish = Finish(quant, mesh, bar)
        return finish.model(LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(seed), nextn=nextn, mesh=mesh,
                                          finish=finish, kernels=kernels))

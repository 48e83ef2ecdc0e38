"""Checkpoint I/O: hub-layout safetensors in, orbax out and back.

The hub layout is described once, as a plan from each model parameter to the hub tensors it is
built from (`hub_plan`). Loading reads tensor by tensor (safetensors maps the files; each
parameter is assembled in one host buffer and handed to the device before the next one is
read), checks every name and shape first, and fails naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm import tqdm

from ling.config import DENSE, KDA, ModelConfig


class CheckpointError(ValueError):
    """A tensor is missing, unexpected or mis-shaped; the message names it."""


Path = tuple  # a parameter path in the model, e.g. ("layers", 0, "attention", "q_proj", "kernel")


@dataclasses.dataclass
class Source:
    """How one model parameter is built from hub tensors: their names and hub shapes, and a
    function of a reader (name -> np.ndarray) that assembles the parameter."""

    shapes: dict[str, tuple[int, ...]]
    build: Callable[[Callable[[str], np.ndarray]], np.ndarray]


class _Names:
    """Resolves a hub tensor name among alternatives (real checkpoints differ in a few names)."""

    def __init__(self, available: set[str]):
        self.available = available

    def __call__(self, *alternatives: str) -> str:
        for name in alternatives:
            if name in self.available:
                return name
        return alternatives[0]  # reported as missing


def _linear(name: str, d_in: int, d_out: int) -> Source:  # torch [out, in] -> kernel [in, out]
    return Source({name: (d_out, d_in)}, lambda read: read(name).T)


def _fused_linear(parts: dict[str, int], d_in: int) -> Source:
    """Torch Linears of one input, {name: d_out} -> one kernel [in, Σ d_out], side by side in order."""
    return Source({n: (w, d_in) for n, w in parts.items()},
                  lambda read: np.concatenate([read(n).T for n in parts], axis=1))


def _vector(name: str, n: int, hub_shape=None) -> Source:
    return Source({name: hub_shape or (n,)}, lambda read: read(name).reshape(n))


def _conv(name: str, c: int, w: int) -> Source:  # torch depthwise Conv1d [C, 1, W] -> [C, W]
    return Source({name: (c, 1, w)}, lambda read: read(name)[:, 0])


def _experts_w13(gate: list[str], up: list[str], d: int, inter: int) -> Source:
    """Per-expert gate/up [I, D] -> w13 [E, D, 2I], gate and up interleaved column by column."""

    def build(read):
        out = None
        for e, (g, u) in enumerate(zip(gate, up)):
            pair = np.stack([read(g).T, read(u).T], axis=-1).reshape(d, 2 * inter)
            if out is None:
                out = np.empty((len(gate), d, 2 * inter), pair.dtype)
            out[e] = pair
        return out

    return Source({n: (inter, d) for n in gate + up}, build)


def _experts_w2(down: list[str], d: int, inter: int) -> Source:
    def build(read):
        out = None
        for e, n in enumerate(down):
            w = read(n).T  # [I, D]
            if out is None:
                out = np.empty((len(down), inter, d), w.dtype)
            out[e] = w
        return out

    return Source({n: (d, inter) for n in down}, build)


def _layer_plan(cfg: ModelConfig, i: int, name: _Names, nextn: bool) -> dict[Path, Source]:
    kimi = cfg.model_type == "kimi_linear"
    pre = f"model.layers.{i}."
    attn = pre + ("self_attn." if kimi else "attention.")
    d, c, h = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads
    me = ("layers", i) if not nextn else ("nextn", "layer")
    plan: dict[Path, Source] = {
        me + ("input_layernorm", "weight"): _vector(pre + "input_layernorm.weight", d),
        me + ("post_attention_layernorm", "weight"): _vector(pre + "post_attention_layernorm.weight", d),
    }
    a = me + ("attention",)
    out_proj = name(attn + "dense.weight", attn + "o_proj.weight")
    kind = "mla" if nextn else cfg.layer_types[i]
    if kind == KDA:
        kd = cfg.kda_head_dim
        # in_proj: q, k, v, f (Kimi: f_a), g (Kimi: g_a) and b side by side (ling.kda.KDAttention).
        f, g, fw = ("f_a_proj", "g_a_proj", kd) if kimi else ("f_proj", "g_proj", c)
        widths = {"q_proj": c, "k_proj": c, "v_proj": c, f: fw, g: fw, "b_proj": h}
        plan[a + ("in_proj", "kernel")] = _fused_linear({f"{attn}{p}.weight": w for p, w in widths.items()}, d)
        for p in "qkv":
            plan[a + (f"{p}_conv",)] = _conv(attn + f"{p}_conv1d.weight", c, cfg.conv_size)
        if kimi:
            plan[a + ("f_b_proj", "kernel")] = _linear(attn + "f_b_proj.weight", kd, c)
            plan[a + ("g_b_proj", "kernel")] = _linear(attn + "g_b_proj.weight", kd, c)
            plan[a + ("A_log",)] = _vector(attn + "A_log", h, (1, 1, h, 1))
        else:
            plan[a + ("A_log",)] = _vector(attn + "A_log", h)
        plan[a + ("dt_bias",)] = _vector(attn + "dt_bias", c)
        plan[a + ("o_norm",)] = _vector(attn + "o_norm.weight", cfg.kda_head_dim)
        plan[a + ("o_proj", "kernel")] = _linear(out_proj, c, d)
    else:
        nh = cfg.num_attention_heads
        # in_proj: q, the latent and roped key, and the output gate side by side (ling.mla.MLAttention).
        widths = {"q_proj": nh * cfg.qk_head_dim, "kv_a_proj_with_mqa": cfg.kv_lora_rank + cfg.qk_rope_head_dim}
        if cfg.mla_output_gate:
            widths["g_proj"] = nh
        plan[a + ("in_proj", "kernel")] = _fused_linear({f"{attn}{p}.weight": w for p, w in widths.items()}, d)
        plan[a + ("kv_a_layernorm", "weight")] = _vector(attn + "kv_a_layernorm.weight", cfg.kv_lora_rank)
        plan[a + ("kv_b_proj", "kernel")] = _linear(
            attn + "kv_b_proj.weight", cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        plan[a + ("o_proj", "kernel")] = _linear(out_proj, nh * cfg.v_head_dim, d)

    m = me + ("mlp",)
    if not nextn and cfg.mlp_types[i] == DENSE:
        mlp = name(pre + "mlp.gate_proj.weight", pre + "block_sparse_moe.gate_proj.weight")[: -len("gate_proj.weight")]
        plan.update(_swiglu_plan(m, mlp, d, cfg.intermediate_size))
        return plan
    mlp = name(pre + "mlp.gate.weight", pre + "block_sparse_moe.gate.weight")[: -len("gate.weight")]
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    plan[m + ("gate_weight",)] = Source({mlp + "gate.weight": (e, d)}, lambda read, n=mlp + "gate.weight": read(n))
    plan[m + ("expert_bias",)] = _vector(name(mlp + "gate.expert_bias", mlp + "gate.e_score_correction_bias"), e)
    gate_n, up_n, down_n = ("w1", "w3", "w2") if kimi else ("gate_proj", "up_proj", "down_proj")
    ex = [f"{mlp}experts.{j}." for j in range(e)]
    plan[m + ("w13",)] = _experts_w13([p + gate_n + ".weight" for p in ex], [p + up_n + ".weight" for p in ex], d, inter)
    plan[m + ("w2",)] = _experts_w2([p + down_n + ".weight" for p in ex], d, inter)
    if cfg.num_shared_experts:
        plan.update(_swiglu_plan(m + ("shared_experts",), f"{mlp}shared_experts.", d, inter * cfg.num_shared_experts))
    return plan


def _swiglu_plan(me: Path, pre: str, d: int, inter: int) -> dict[Path, Source]:
    """moe.block.SwiGLUMLP: one expert in the routed format, w13 [1, D, 2I], w2 [1, I, D]."""
    return {me + ("w13",): _experts_w13([pre + "gate_proj.weight"], [pre + "up_proj.weight"], d, inter),
            me + ("w2",): _experts_w2([pre + "down_proj.weight"], d, inter)}


def hub_plan(cfg: ModelConfig, available: set[str], with_nextn: bool) -> dict[Path, Source]:
    """Every model parameter's source in a hub checkpoint holding the names `available`."""
    name = _Names(available)
    d, v = cfg.hidden_size, cfg.vocab_size
    plan: dict[Path, Source] = {
        ("embed_tokens",): Source({(n := name("model.word_embeddings.weight", "model.embed_tokens.weight")): (v, d)},
                                  lambda read: read(n)),
        ("norm", "weight"): _vector("model.norm.weight", d),
    }
    if not cfg.tie_word_embeddings:
        plan[("lm_head",)] = _linear("lm_head.weight", d, v)
    for i in range(cfg.num_hidden_layers):
        plan.update(_layer_plan(cfg, i, name, nextn=False))
    if with_nextn:
        pre = f"model.layers.{cfg.num_hidden_layers}."
        for p in ("enorm", "hnorm", "final_layernorm"):
            plan[("nextn", p, "weight")] = _vector(pre + p + ".weight", d)
        plan[("nextn", "eh_proj", "kernel")] = _linear(pre + "eh_proj.weight", 2 * d, d)
        plan.update(_layer_plan(cfg, cfg.num_hidden_layers, name, nextn=True))
    return plan


# ----------------------------------------------------------------------------------------------
# Reading hub safetensors


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class SafetensorsIndex:
    """The tensors of a hub directory (one model.safetensors or shards with an index), opened lazily."""

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {k: os.path.join(directory, v) for k, v in weight_map.items()}
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors files and no model.safetensors.index.json")
            self.files = {}
            for fname in files:
                with safe_open(os.path.join(directory, fname), "numpy") as f:
                    self.files.update({k: os.path.join(directory, fname) for k in f.keys()})
        self._open: dict[str, object] = {}

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._open:
            if not os.path.exists(path):
                raise CheckpointError(f"tensor {name!r}: its shard {path} does not exist")
            self._open[path] = safe_open(path, "numpy")
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def nbytes(self, name: str) -> int:
        sl = self._handle(name).get_slice(name)
        return int(np.prod(sl.get_shape())) * _DTYPE_BYTES.get(sl.get_dtype(), 2)


def has_nextn_weights(cfg: ModelConfig, names: set[str]) -> bool:
    return cfg.num_nextn_layers > 0 and any(n.startswith(f"model.layers.{cfg.num_hidden_layers}.") for n in names)


def load_hub(directory: str, cfg: ModelConfig, *, dtype=jnp.bfloat16, quant=None, mesh=None, progress: bool = True,
             budget: int | None = None, kernels: str = "auto"):
    """Builds the model from a hub directory, layer by layer (`ling.build`): each layer's tensors
    are read, put on the device(s) in their shardings, quantised as `quant` says and the full-
    precision copy dropped before the next layer is read. Checks every name and shape, and that
    the weights fit `budget` (default: the device's memory), before reading any data."""
    from ling import build
    from ling.model import LingModel

    index = SafetensorsIndex(directory)
    available = set(index.files)
    with_nextn = has_nextn_weights(cfg, available)
    plan = hub_plan(cfg, available, with_nextn)
    errors = []
    for path, src in plan.items():
        for n, want in src.shapes.items():
            if n not in available:
                errors.append(f"missing tensor {n!r} (for parameter {'.'.join(map(str, path))}, shape {want})")
            elif index.shape(n) != tuple(want):
                errors.append(f"tensor {n!r} has shape {index.shape(n)}, expected {tuple(want)}")
    used = {n for src in plan.values() for n in src.shapes}
    unexpected = sorted(available - used)
    errors += [f"unexpected tensor {n!r} (shape {index.shape(n)})" for n in unexpected]
    if errors:
        raise CheckpointError(f"{directory}: {len(errors)} problem(s):\n  " + "\n  ".join(errors[:20]))
    build.plan(cfg, dtype=dtype, nextn=with_nextn, quant=quant, mesh=mesh, budget=budget)

    model = nnx.eval_shape(lambda: LingModel(cfg, dtype=dtype, rngs=nnx.Rngs(0), nextn=with_nextn, mesh=mesh,
                                             kernels=kernels))
    flat = {path: var for path, var in build.variables(model)}
    if set(flat) != set(plan):  # the plan and the model must describe the same parameters
        raise AssertionError(f"plan/model mismatch: {sorted(set(flat) ^ set(plan), key=str)[:10]}")
    units = [(("layers", i), layer) for i, layer in enumerate(model.layers)]
    units += [(("nextn",), model.nextn)] if with_nextn else []
    total = sum(index.nbytes(n) for n in used)
    with tqdm(total=total, desc=f"loading {os.path.basename(os.path.normpath(directory))}", unit="B",
              unit_scale=True, disable=not progress) as bar:
        def fill(prefix, module):  # the parameters under module that are still abstract
            for path, var in build.variables(module):
                if not isinstance(var.get_value(), jax.ShapeDtypeStruct):
                    continue
                src = plan[prefix + path]
                host = src.build(index.read)
                assert host.shape == var.shape, (prefix + path, host.shape, var.shape)
                value = jnp.asarray(host) if mesh is None else jax.device_put(host, build.sharding(var, mesh))
                var.set_value(value.astype(var.dtype))
                bar.update(sum(index.nbytes(n) for n in src.shapes))
                del host, value

        finish = build.Finish(quant, mesh)
        for prefix, unit in units:
            fill(prefix, unit)
            finish(unit)
        fill((), model)  # what lies outside the layers: embedding, final norm, lm_head
        return finish.model(model)


# ----------------------------------------------------------------------------------------------
# Writing hub safetensors (the inverse of hub_plan)


def save_hub(model, directory: str, *, dtype=None) -> None:
    """Writes `model` in the hub layout that `load_hub` reads: config.json in transformers'
    `bailing_hybrid` format and model.safetensors under the hub tensor names, the NEXTN layer (if
    the model has one) as model.layers.{num_hidden_layers}.*.

    dtype: the stored dtype of floating tensors (None: as the model holds them); parameters the
    model keeps in fp32 whatever its dtype (router gate and expert bias, KDA decay and conv) stay
    fp32. Every tensor is the plan's source read backwards; each parameter is rebuilt from the
    written tensors through `hub_plan` and must come back bit for bit, or nothing is written.
    """
    from safetensors.numpy import save_file

    from ling.config import KDA, MOE, from_hub_config
    from ling.model import LingModel
    from ling.quantize import QLinear
    from moe.block import QExperts

    cfg = model.cfg
    if cfg.model_type != "bailing_hybrid":
        raise CheckpointError(f"save_hub writes bailing_hybrid checkpoints; this model is {cfg.model_type!r}")
    if any(isinstance(m, (QLinear, QExperts)) for _, m in nnx.iter_graph(model)):
        raise CheckpointError("save_hub writes full-precision weights; this model holds quantised weights")

    # config.json: the names transformers' save_pretrained writes, read back by from_hub_config.
    n, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    first_dense = next((i for i, t in enumerate(cfg.mlp_types) if t == MOE), n)

    def limit_list(limits):
        return None if not limits else [x if x is not None else 0 for x in limits]

    hub_cfg = {
        "architectures": ["BailingHybridForCausalLM"], "model_type": "bailing_hybrid",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": n,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "layer_types": ["linear_attention" if t == KDA else "full_attention" for t in cfg.layer_types],
        "mlp_layer_types": ["sparse" if t == MOE else "dense" for t in cfg.mlp_types],
        "first_k_dense_replace": first_dense,
        # The KDA head dim is `head_dim` in the original hub config; transformers keeps it in
        # `linear_head_dim` (and its KDA has num_attention_heads heads).
        "head_dim": cfg.kda_head_dim, "linear_head_dim": cfg.kda_head_dim, "linear_num_heads": cfg.kda_num_heads,
        "short_conv_kernel_size": cfg.conv_size, "kda_safe_gate": cfg.kda_gate == "safe",
        "kda_lower_bound": cfg.kda_lower_bound,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_tok,
        "num_shared_experts": cfg.num_shared_experts, "num_expert_group": cfg.n_group,
        "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": cfg.norm_topk_prob, "num_nextn_predict_layers": cfg.num_nextn_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings, "model_max_length": cfg.max_position_embeddings,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
    }
    for key, limits in (("expert_swiglu_limit_list", cfg.expert_swiglu_limits),
                        ("share_expert_swiglu_limit_list", cfg.shared_swiglu_limits)):
        if limits:
            hub_cfg[key] = limit_list(limits)
    if from_hub_config(hub_cfg) != cfg:
        raise AssertionError(f"config.json would not read back as the model's config: {from_hub_config(hub_cfg)} != {cfg}")

    with_nextn = model.nextn is not None
    plan = hub_plan(cfg, set(), with_nextn)  # no names available: the first (save_pretrained) spelling
    flat = {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(nnx.split(model)[1])}
    if set(flat) != set(plan):
        raise AssertionError(f"plan/model mismatch: {sorted(set(flat) ^ set(plan), key=str)[:10]}")
    always_fp32 = {path for path, var in nnx.to_flat_state(nnx.split(nnx.eval_shape(
        lambda: LingModel(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), nextn=with_nextn)))[1])
        if var.dtype == jnp.float32}

    tensors: dict[str, np.ndarray] = {}
    for path, src in plan.items():
        a = flat[path]
        if dtype is not None and jnp.issubdtype(a.dtype, jnp.floating) and path not in always_fp32:
            a = np.asarray(jnp.asarray(a).astype(dtype))
        names = list(src.shapes)
        if path[-1] == "w13":  # [E, D, 2I], gate and up interleaved -> per-expert gate, up [I, D]
            e = a.shape[0]
            out = {**{g: a[j][:, 0::2].T for j, g in enumerate(names[:e])},
                   **{u: a[j][:, 1::2].T for j, u in enumerate(names[e:])}}
        elif path[-1] == "w2":  # [E, I, D] -> per-expert down [D, I]
            out = {d: a[j].T for j, d in enumerate(names)}
        else:
            if path[-1] in ("kernel", "lm_head"):  # [in, Σ out] -> torch [out, in] each, in order
                ends = np.cumsum([src.shapes[n][0] for n in names])[:-1]
                out = {n: w.T for n, w in zip(names, np.split(a, ends, axis=1))}
            else:  # vectors, conv [C, W] -> [C, 1, W], router gate and embeddings as they are
                (name,) = names
                out = {name: a.reshape(tuple(src.shapes[name]))}
        for k, v in out.items():
            if v.shape != tuple(src.shapes[k]):
                raise AssertionError(f"tensor {k!r}: wrote shape {v.shape}, the plan expects {src.shapes[k]}")
            tensors[k] = np.ascontiguousarray(v)
        back = src.build(tensors.__getitem__)
        if back.dtype != a.dtype or not np.array_equal(back, a):
            raise AssertionError(f"parameter {'.'.join(map(str, path))} does not read back from its hub tensors")

    os.makedirs(directory, exist_ok=True)
    stored = {str(np.dtype(v.dtype)) for v in tensors.values()} - {"float32"}
    hub_cfg["torch_dtype"] = stored.pop() if len(stored) == 1 else "float32"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hub_cfg, f, indent=1)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# Orbax: the converted format (`ling_config.json` + `params/`)

CONFIG_FILE = "ling_config.json"
# The parameter tree's layout: 2 = projections of one input fused (KDA and MLA in_proj) and the
# MLPs held as one expert (w13, w2). Directories converted in another layout are refused by name.
LAYOUT = 2


def is_converted(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, CONFIG_FILE))


def save_converted(model, directory: str) -> None:
    import orbax.checkpoint as ocp

    from ling.quantize import quantization_of

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    _, state = nnx.split(model)
    # Uncompressed: low-bit codes and bf16 weights barely compress (~0-15% with zstd), and
    # decompressing a large array's one chunk on one thread bounds the load (half the speed).
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckpt:
        ckpt.save(os.path.join(directory, "params"), args=ocp.args.PyTreeSave(nnx.to_pure_dict(state)), force=True)
    quant = quantization_of(model)
    meta = {"config": model.cfg.to_json(), "nextn": model.nextn is not None,
            "quantization": None if quant is None else dataclasses.asdict(quant), "layout": LAYOUT}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(meta, f, indent=1)


def converted_quantization(directory: str):
    """The `ling.quantize.Quantization` a converted directory was stored with (None: full precision)."""
    from ling.quantize import Quantization

    with open(os.path.join(directory, CONFIG_FILE)) as f:
        q = json.load(f).get("quantization")
    return None if q is None else Quantization(**q)


def load_converted(directory: str, *, dtype=None, quant=None, mesh=None, progress: bool = True,
                   budget: int | None = None, kernels: str = "auto"):
    """Reads a converted checkpoint straight into its final tree and shardings (dtype None keeps
    the stored dtypes). A directory stored low-bit is served as stored; one stored in full
    precision is quantised as `quant` says once read (the whole full-precision model is then held:
    convert with --quantize for a model that only fits quantised)."""
    import orbax.checkpoint as ocp

    from ling import build
    from ling.config import ModelConfig
    from ling.quantize import relayout_module

    directory = os.path.abspath(directory)
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        meta = json.load(f)
    if meta.get("layout", 1) != LAYOUT:
        raise CheckpointError(f"{directory} was converted in parameter layout {meta.get('layout', 1)}; this version "
                              f"reads layout {LAYOUT} (fused projections): convert the hub checkpoint again "
                              "with python -m ling.convert")
    cfg = ModelConfig.from_json(meta["config"])
    stored_quant = converted_quantization(directory)
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(os.path.join(directory, "params"))
    stored = getattr(stored, "item_metadata", stored)
    first = jax.tree_util.tree_leaves(stored)[0]
    model_dtype = dtype or (first.dtype if hasattr(first, "dtype") else jnp.bfloat16)
    build.plan(cfg, dtype=model_dtype, nextn=meta["nextn"], quant=stored_quant, mesh=mesh, budget=budget)
    model = build.abstract(cfg, dtype=model_dtype, nextn=meta["nextn"], quant=stored_quant, mesh=mesh,
                           kernels=kernels)
    one = None if mesh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    units = [(("layers", i), layer) for i, layer in enumerate(model.layers)]
    units += [(("nextn",), model.nextn)] if model.nextn is not None else []
    units += [((), model)]  # what lies outside the layers
    finish = build.Finish(quant if stored_quant is None else None, mesh)
    # A stored low-bit model is served as stored, its projections in the layout asked for.
    layout = quant.layout if stored_quant is not None and quant is not None else None
    size = lambda v: int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize  # noqa: E731
    with tqdm(total=sum(size(v) for _, v in build.variables(model)), desc=f"restoring {os.path.basename(directory)}",
              unit="B", unit_scale=True, disable=not progress) as bar, \
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckpt:
        for prefix, unit in units:
            todo = {prefix + path: var for path, var in build.variables(unit)
                    if isinstance(var.get_value(), jax.ShapeDtypeStruct)}
            target: dict = {}
            for path, var in todo.items():  # the nested dict of nnx.to_pure_dict, for these parameters
                node = target
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                v = var.get_value()
                node[path[-1]] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding or one)
            restore_args = jax.tree_util.tree_map(lambda v: ocp.ArrayRestoreArgs(sharding=v.sharding, dtype=v.dtype),
                                                  target)
            restored = ckpt.restore(os.path.join(directory, "params"), args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True))
            for path, var in todo.items():
                value = restored
                for key in path:
                    value = value[key]
                var.set_value(value)
            bar.update(sum(size(v) for v in todo.values()))
            if layout is not None and layout != stored_quant.layout:
                relayout_module(unit, layout)
            if prefix:
                finish(unit)
    return finish.model(model)

"""The DSpark block drafter (Cheng et al., 2026): a parallel backbone that drafts a block of B
positions in one forward, conditioned on the target's hidden states, a sequential (Markov) head
that biases position j's logits by the token drafted at j - 1, and a confidence head that
estimates each position's survival given that the ones before it were accepted.

Backbone (DFlash-style): the context feature of position i is c_i = fc(norm([x^(l)_i for l in
feature_layers])), the residual streams after the listed target decoder layers. Each backbone
layer projects the context features to keys and values with the same projections as its block
positions, so a block query attends to every context position < n (cached, `DSparkCache`) and,
causally, to the block positions before it. The block at slot length n is
[token_n, mask, ..., mask] at positions n .. n+B-1; its output j (final norm, the target's
lm_head) is the base logits U_j of token n+1+j. Causal attention inside the block makes a block
of 8 the first 8 positions of a block of 16.

Sequential head: logits_j = U_j + (E[x_{j-1}] * sigmoid(G h_j)) W, rank r, x_{-1} = token_n.
Confidence head: c_j = sigmoid(w . [h_j, E[x_{j-1}]] + b), the probability that draft j is
accepted when every draft before it was; the survival of drafts 1..j is prod_{k<=j} c_k.

State: per backbone layer the rotated keys and the values of the context features, [B, L, H, K]
each, written at positions lengths[b] + t by `extend`; as the MLA cache, entries past a slot's
length are masked and later overwritten, so commit is the length alone.

The drafter shares the target's embedding and lm_head (frozen) and adds its own parameters only;
`save` / `load` keep them next to a checkpoint (dspark.safetensors + dspark.json).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ling.layers import RMSNorm, apply_rope_interleaved, rope_angles
from moe.nn import Linear, param

CONFIG_FILE, WEIGHTS_FILE = "dspark.json", "dspark.safetensors"


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int  # the target's: the drafter shares its embedding and lm_head
    vocab_size: int
    feature_layers: tuple[int, ...]  # target decoder layers whose outputs feed the context features
    block_size: int = 16  # the largest block B the drafter was trained for
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    markov_rank: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_json(cls, d: dict) -> DSparkConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{CONFIG_FILE}: unknown fields {sorted(unknown)}")
        return cls(**{**d, "feature_layers": tuple(d["feature_layers"])})


def default_config(target_cfg, **overrides) -> DSparkConfig:
    """A drafter for target_cfg: features from three layers spread over the stack (the last included)."""
    n = target_cfg.num_hidden_layers
    layers = tuple(sorted({max(n // 3 - 1, 0), max(2 * n // 3 - 1, 0), n - 1}))
    return DSparkConfig(hidden_size=target_cfg.hidden_size, vocab_size=target_cfg.vocab_size, feature_layers=layers,
                        rms_norm_eps=target_cfg.rms_norm_eps, **overrides)


@struct.dataclass
class DSparkCache:
    keys: tuple  # per backbone layer [B, L, H, K], rotated
    values: tuple  # per backbone layer [B, L, H, K]


def dspark_cache(cfg: DSparkConfig, batch: int, max_len: int, dtype) -> DSparkCache:
    z = lambda: jnp.zeros((batch, max_len, cfg.num_heads, cfg.head_dim), dtype)  # noqa: E731
    return DSparkCache(keys=tuple(z() for _ in range(cfg.num_layers)), values=tuple(z() for _ in range(cfg.num_layers)))


class _Layer(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs: nnx.Rngs):
        d, hk = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(d, hk, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, hk, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, hk, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(hk, d, ("heads", "embed"), dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.up = Linear(d, 2 * cfg.intermediate_size, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down = Linear(cfg.intermediate_size, d, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.heads, self.head_dim, self.theta = cfg.num_heads, cfg.head_dim, cfg.rope_theta

    def _split(self, x):
        return x.reshape(x.shape[:-1] + (self.heads, self.head_dim))

    def kv(self, x, positions):
        """x [B, T, D] at positions [B, T] -> rotated keys, values [B, T, H, K]."""
        cos, sin = rope_angles(positions, self.head_dim, self.theta)
        return apply_rope_interleaved(self._split(self.k_proj(x)), cos, sin), self._split(self.v_proj(x))

    def context_kv(self, c, positions):
        return self.kv(self.ctx_norm(c), positions)

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, blk_mask):
        """x [B, Q, D] block positions at positions [B, Q]; ctx_k / ctx_v [B, L, H, K] with ctx_mask
        [B, Q, L]; blk_mask [B or 1, Q, Q] which block positions each one sees."""
        h = self.attn_norm(x)
        cos, sin = rope_angles(positions, self.head_dim, self.theta)
        q = apply_rope_interleaved(self._split(self.q_proj(h)), cos, sin)
        k, v = self.kv(h, positions)
        keys = jnp.concatenate([ctx_k.astype(k.dtype), k], axis=1)
        vals = jnp.concatenate([ctx_v.astype(v.dtype), v], axis=1)
        mask = jnp.concatenate([ctx_mask, jnp.broadcast_to(blk_mask, ctx_mask.shape[:2] + blk_mask.shape[2:])], axis=2)
        s = jnp.einsum("bqhk,blhk->bhql", q, keys, preferred_element_type=jnp.float32) * self.head_dim ** -0.5
        s = jnp.where(mask[:, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(vals.dtype)
        o = jnp.einsum("bhql,blhk->bqhk", p, vals, preferred_element_type=jnp.float32).astype(x.dtype)
        x = x + self.o_proj(o.reshape(o.shape[:2] + (-1,)))
        g = self.up(self.mlp_norm(x))
        i = g.shape[-1] // 2
        return x + self.down((jax.nn.silu(g[..., :i].astype(jnp.float32)) * g[..., i:]).astype(x.dtype))


class DSparkDrafter(nnx.Module):
    """The drafter's own parameters (module docstring). Calls that need the target's embedding or
    lm_head take them as functions (`LingModel.embed`, `LingModel.logits`)."""

    def __init__(self, cfg: DSparkConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        d, k = cfg.hidden_size, len(cfg.feature_layers)
        self.cfg = cfg
        self.feature_norm = RMSNorm(k * d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.fc = Linear(k * d, d, ("embed", "embed"), dtype=dtype, rngs=rngs)
        self.mask_embed = param(rngs, (d,), ("embed",), dtype)
        self.layers = nnx.List([_Layer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        r = cfg.markov_rank
        self.markov_in = param(rngs, (cfg.vocab_size, r), ("vocab", "rank"), dtype)
        self.markov_gate = Linear(d, r, ("embed", "rank"), dtype=dtype, rngs=rngs)
        self.markov_out = param(rngs, (r, cfg.vocab_size), ("rank", "vocab"), dtype, init="zeros")
        self.conf_w = param(rngs, (d + r,), ("embed",), jnp.float32, init="zeros")
        self.conf_b = param(rngs, (1,), ("one",), jnp.float32, init="zeros")

    # -- context ---------------------------------------------------------------------------------

    def features(self, taps):
        """taps: the target's residual streams after `feature_layers`, each [B, T, D] -> c [B, T, D]."""
        return self.fc(self.feature_norm(jnp.concatenate(taps, axis=-1)))

    def extend(self, cache: DSparkCache, taps, lengths) -> DSparkCache:
        """Writes the context entries of positions lengths[b] + t (t < T) from taps [B, T, D] each.
        Entries past a slot's final length are never read (the length masks them)."""
        c = self.features(taps)
        b, t = c.shape[:2]
        positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        rows = jnp.arange(b)[:, None]
        keys, values = [], []
        for layer, ck, cv in zip(self.layers, cache.keys, cache.values):
            k, v = layer.context_kv(c, positions)
            keys.append(ck.at[rows, positions].set(k.astype(ck.dtype), mode="drop"))
            values.append(cv.at[rows, positions].set(v.astype(cv.dtype), mode="drop"))
        return DSparkCache(keys=tuple(keys), values=tuple(values))

    # -- the block -------------------------------------------------------------------------------

    def _inputs(self, anchor_embeds, block: int):
        """anchor_embeds [B, A, D] -> [B, A * block, D]: each anchor then block - 1 mask embeddings."""
        b, a, d = anchor_embeds.shape
        masks = jnp.broadcast_to(self.mask_embed[...].astype(anchor_embeds.dtype), (b, a, block - 1, d))
        return jnp.concatenate([anchor_embeds[:, :, None], masks], axis=2).reshape(b, a * block, d)

    def block(self, embed, cache: DSparkCache, lengths, last_token, block: int):
        """The block [token_n, mask ...] at positions n .. n+block-1 (n = lengths) over the cached
        context (positions < n). Returns h [B, block, D] (after the final norm): base logits are
        the target's lm_head of h."""
        if block > self.cfg.block_size:
            raise ValueError(f"block {block} exceeds the drafter's block_size {self.cfg.block_size}")
        x = self._inputs(embed(last_token[:, None]), block)
        positions = lengths[:, None] + jnp.arange(block, dtype=jnp.int32)
        L = cache.keys[0].shape[1]
        ctx_mask = jnp.broadcast_to((jnp.arange(L)[None] < lengths[:, None])[:, None], (x.shape[0], block, L))
        blk_mask = jnp.tril(jnp.ones((block, block), bool))[None]
        for layer, ck, cv in zip(self.layers, cache.keys, cache.values):
            x = layer(x, positions, ck, cv, ctx_mask, blk_mask)
        return self.norm(x)

    def train_blocks(self, embed, taps, anchors, anchor_tokens, block: int):
        """Many blocks of one sequence batch at once (training): taps [B, T, D] each (the context),
        anchors [B, A] positions n of the blocks, anchor_tokens [B, A] token_n. Block a sees the
        context positions < anchors[:, a] only. Returns h [B, A, block, D]."""
        b, a = anchors.shape
        c = self.features(taps)
        t = c.shape[1]
        ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        x = self._inputs(embed(anchor_tokens), block)
        positions = (anchors[:, :, None] + jnp.arange(block, dtype=jnp.int32)).reshape(b, a * block)
        q_anchor = jnp.repeat(anchors, block, axis=1)  # [B, Q]
        ctx_mask = jnp.arange(t)[None, None] < q_anchor[:, :, None]
        qi = jnp.arange(a * block)
        blk_mask = ((qi[:, None] // block) == (qi[None] // block)) & (qi[None] <= qi[:, None])
        for layer in self.layers:
            ck, cv = layer.context_kv(c, ctx_pos)
            x = layer(x, positions, ck, cv, ctx_mask, blk_mask[None])
        return self.norm(x).reshape(b, a, block, -1)

    # -- sequential and confidence heads ---------------------------------------------------------

    def markov_bias(self, h, prev):
        """h [..., D] a block position's hidden state, prev [...] the token drafted before it ->
        the bias [..., V] (fp32) on its base logits."""
        e = jnp.take(self.markov_in[...], prev, axis=0).astype(jnp.float32)
        g = jax.nn.sigmoid(self.markov_gate(h).astype(jnp.float32))
        return jnp.dot(e * g, self.markov_out[...].astype(jnp.float32))

    def confidence_logit(self, h, prev):
        """h [..., D], prev [...] -> the logit of the position's conditional acceptance [...] (fp32)."""
        e = jnp.take(self.markov_in[...], prev, axis=0).astype(jnp.float32)
        z = jnp.concatenate([h.astype(jnp.float32), e], axis=-1)
        return jnp.dot(z, self.conf_w[...]) + self.conf_b[...][0]


# ----------------------------------------------------------------------------------------------
# Files


def _flat(drafter: DSparkDrafter) -> dict[str, jax.Array]:
    out = {}
    for path, v in nnx.to_flat_state(nnx.split(drafter, nnx.Param)[1]):
        out[".".join(map(str, path))] = v.get_value()
    return out


def save(drafter: DSparkDrafter, directory: str, *, dtype=jnp.bfloat16, meta: dict | None = None) -> None:
    """Writes dspark.json (config, and meta under "meta") and dspark.safetensors (the drafter's own
    parameters in dtype; the confidence head stays fp32)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {k: np.asarray(v.astype(jnp.float32 if k.startswith("conf_") else dtype))
               for k, v in _flat(drafter).items()}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump({"config": drafter.cfg.to_json(), "meta": meta or {}}, f, indent=1)


def exists(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, CONFIG_FILE))


def load(directory: str, target_cfg, *, dtype=jnp.bfloat16) -> DSparkDrafter:
    """The drafter stored in directory, checked against the target's config."""
    from safetensors.numpy import load_file

    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE} (train one with `python -m offline.train_dspark`)")
    cfg = DSparkConfig.from_json(json.load(open(path))["config"])
    if (cfg.hidden_size, cfg.vocab_size) != (target_cfg.hidden_size, target_cfg.vocab_size):
        raise ValueError(f"{path}: drafter for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, the target has "
                         f"{target_cfg.hidden_size} / {target_cfg.vocab_size}")
    bad = [i for i in cfg.feature_layers if not 0 <= i < target_cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"{path}: feature_layers {bad} outside the target's {target_cfg.num_hidden_layers} layers")
    drafter = DSparkDrafter(cfg, dtype=dtype)
    tensors = load_file(os.path.join(directory, WEIGHTS_FILE))
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    flat = dict(nnx.to_flat_state(params))
    for p, v in flat.items():
        name = ".".join(map(str, p))
        if name not in tensors:
            raise ValueError(f"{directory}/{WEIGHTS_FILE}: tensor {name} missing")
        if tuple(tensors[name].shape) != tuple(v.get_value().shape):
            raise ValueError(f"{directory}/{WEIGHTS_FILE}: tensor {name} has shape {tensors[name].shape}, "
                             f"expected {v.get_value().shape}")
        v.set_value(jnp.asarray(tensors[name]).astype(v.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)

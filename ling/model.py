"""The hybrid decoder: KDA or MLA attention by layer, dense or MoE MLP by layer, and the NEXTN
draft layer.

A forward takes tokens [B, T] and the state of B slots and returns logits, the final hidden states
and the new state; prefilling a prompt and then stepping token by token gives the logits of one
prefill of the whole sequence. `form` picks the algorithm, not the result: "prefill" (chunked KDA,
plain MLA; absorbed MLA for a chunk of up to ABSORBED_CHUNK_MAX_T tokens) or "decode" (recurrent
KDA, absorbed MLA); "auto" takes decode up to DECODE_MAX_T tokens.
"verify" is decode that keeps the KDA state after every position and leaves the state uncommitted:
`commit(pending, n)` then keeps any number of the tokens without recomputation. `forward` runs
several batches of slots in one pass, each in its own form (a decode step beside a prefill chunk):
the attention between its projections per batch; norms, projections and MLP once over all their
tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ling.config import DENSE, KDA, ModelConfig
from ling.draft_vocab import DraftVocab
from ling.kda import KDAttention
from ling.layers import RMSNorm
from ling.mla import MLAttention
from ling.quantize import QLinear
from ling.state import KDAPending, KDAState, MLACache, State, commit
from moe.block import MoE, SwiGLUMLP
from moe.nn import Linear, param
from pallas_kernels.backend import resolve

DECODE_MAX_T = 16
# A prefill chunk of up to this many tokens runs MLA in the absorbed form (the decode kernel, T
# queries over the latents up to each slot's length: work ~ T x the prefix) rather than the plain
# one, whose expansion of the latents to keys and values costs the cache's whole capacity every
# chunk (~8.4 MFLOP a position for Ling, against ~70 kFLOP a position and query absorbed).
ABSORBED_CHUNK_MAX_T = 32


def pick_form(form: str, t: int) -> str:
    if form == "auto":
        return "decode" if t <= DECODE_MAX_T else "prefill"
    if form not in ("prefill", "decode", "verify"):
        raise ValueError(f"form must be 'auto', 'prefill', 'decode' or 'verify', got {form!r}")
    return form


class Residual(NamedTuple):
    """The residual stream x + add [B, T, D], the add left to the next norm's launch
    (`pallas_kernels.rmsnorm`): between decoder layers, and before the final norms."""

    x: jax.Array
    add: jax.Array

    def total(self):
        return self.x + self.add


def norm_stream(norm: RMSNorm, stream):
    """(norm(stream), stream as an array) for an array or a `Residual` (whose add runs in the
    norm's launch)."""
    if isinstance(stream, Residual):
        return norm(stream.add, residual=stream.x)
    return norm(stream), stream


def join_rows(arrays):
    """[B_i, T_i, X] each -> [N, X] (N = Σ B_i T_i): the rows of several batches one after another."""
    flat = [a.reshape(-1, a.shape[-1]) for a in arrays]
    return flat[0] if len(flat) == 1 else jnp.concatenate(flat)


def split_rows(flat, shapes):
    """The inverse of `join_rows`: flat [N, X] -> [B_i, T_i, X] for each (B_i, T_i) of shapes."""
    ends = list(itertools.accumulate(b * t for b, t in shapes))
    parts = jnp.split(flat, ends[:-1]) if len(shapes) > 1 else [flat]
    return [part.reshape(b, t, flat.shape[-1]) for part, (b, t) in zip(parts, shapes)]


def real_rows(shapes, valids, forms):
    """[N] bool over several batches' rows (`join_rows` order): a prefill batch's rows past its
    valid tokens (a chunk's padding) are not real. None where no batch is a prefill: a step's
    rows are its slots' tokens (a done slot's are left to it, not masked at a launch a layer)."""
    if "prefill" not in forms:
        return None
    return jnp.concatenate([((jnp.arange(t)[None] < v[:, None]) if form == "prefill" else jnp.ones((b, t), bool))
                            .reshape(-1) for (b, t), v, form in zip(shapes, valids, forms)])


class DecoderLayer(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)). `index` selects the attention and MLP kinds and the
    SwiGLU limits; the NEXTN layer is index num_hidden_layers (MLA + MoE)."""

    def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs, mesh=None, kernels: str = "auto"):
        nextn = index >= cfg.num_hidden_layers
        self.kernels = kernels = resolve(kernels)
        self.kind = "mla" if nextn else cfg.layer_types[index]
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.attention = (KDAttention(cfg, dtype=dtype, rngs=rngs, kernels=kernels) if self.kind == KDA
                          else MLAttention(cfg, dtype=dtype, rngs=rngs, mesh=mesh, kernels=kernels))
        if not nextn and cfg.mlp_types[index] == DENSE:
            self.mlp = SwiGLUMLP(d, cfg.intermediate_size, dtype=dtype, rngs=rngs, kernels=kernels)
        else:
            self.mlp = MoE(d, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                           inter=cfg.moe_intermediate_size, num_shared=cfg.num_shared_experts, n_group=cfg.n_group,
                           topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                           norm_topk_prob=cfg.norm_topk_prob, swiglu_limit=cfg.swiglu_limit(index, False),
                           shared_swiglu_limit=cfg.swiglu_limit(index, True), dtype=dtype, rngs=rngs, mesh=mesh,
                           kernels=kernels)

    def __call__(self, x, positions, lengths, valid, cache, *, form: str):
        """x [B, T, D]. Returns the new x and the layer's state: KDA after prefill committed at
        valid (KDAState), after decode / verify uncommitted (KDAPending); MLA the written MLACache."""
        b, t, d = x.shape
        y, (cache,) = self.grouped(x.reshape(b * t, d), [(b, t)], [positions], [lengths], [valid], [cache],
                                   forms=(form,))
        return y.reshape(b, t, d), cache

    def grouped(self, x, shapes, positions, lengths, valids, caches, *, forms, defer: bool = False):
        """Several batches of slots through the layer at once. x: their residual streams, the rows
        one after another [N, D] (`join_rows` of [B, T, D] per batch, shapes [(B, T)] per batch;
        an array or a `Residual`); positions, lengths, valids, caches: lists, one entry per batch
        as `__call__` takes them. The norms, the attention's two projections and the MLP run once
        over all N rows; the attention between the projections per batch, in its own form over
        its own state. Decode and verify batches placed before prefill ones give the MoE its
        decode rows first (`MoE`'s n_decode: the tile-scheduled launch runs their tiles before
        the prefill chunk's). Returns the new stream [N, D] (with defer a `Residual`, its last add
        left to the next norm's launch) and each batch's new state."""
        normed, x = norm_stream(self.input_layernorm, x)
        outs, new = [], []
        for proj, pos, ln, v, cache, form in zip(split_rows(self.attention.in_proj(normed), shapes), positions,
                                                 lengths, valids, caches, forms):
            o, cache = self._attention(proj, pos, ln, v, cache, form)
            outs.append(o)
            new.append(cache)
        normed, x = self.post_attention_layernorm(self.attention.o_proj(join_rows(outs)), residual=x)
        sizes = [b * t for b, t in shapes]
        n_decode = sum(n for n, form in itertools.takewhile(lambda p: p[1] != "prefill", zip(sizes, forms)))
        live = real_rows(shapes, valids, forms)
        if len(shapes) == 1:  # one batch: the MLP sees its [B, T, D] (offline.routing's stand-in records it so)
            y = self.mlp(normed.reshape(*shapes[0], -1), live=live)
        else:
            y = self.mlp(normed[None], n_decode=n_decode if 0 < n_decode < x.shape[0] else None, live=live)
        out = Residual(x, y.reshape(x.shape))
        return (out if defer else out.total()), new

    def _attention(self, proj, positions, lengths, valid, cache, form: str):
        """The attention's core over one batch's in_proj output [B, T, P]: (o_proj's input
        [B, T, C], the new state). The cache's `rows` (`ling.state.at_rows`) reach the attention,
        which reads and writes the rows' slots of the whole state."""
        if self.kind == KDA:
            o, conv, rec = self.attention.core(proj, cache.conv, cache.recurrent, valid, rows=cache.rows,
                                               form={"prefill": "chunked", "decode": "decode"}.get(form, "recurrent"))
            if form != "verify":  # prefill and decode return the state after the valid tokens: committed
                return o, KDAState(conv=conv, recurrent=rec, rows=cache.rows)
            return o, KDAPending(window=conv, recurrent=rec, initial=cache.recurrent, conv_len=cache.conv[0].shape[1],
                                 into=None if cache.rows is None else cache)
        plain = form == "prefill" and proj.shape[1] > ABSORBED_CHUNK_MAX_T
        o, latent, k_rope = self.attention.core(proj, positions, cache.latent, cache.k_rope, lengths, valid=valid,
                                                form="plain" if plain else "absorbed", rows=cache.rows,
                                                prefill=form == "prefill")
        return o, MLACache(latent=latent, k_rope=k_rope, rows=cache.rows)


class NextN(nnx.Module):
    """The NEXTN (MTP) draft layer: h = eh_proj([enorm(emb(tok_{i+1})), hnorm(h_i)]), one decoder
    layer (MLA + MoE), final_layernorm; the target's embedding and lm_head. Its MLA cache slot and
    RoPE position for the pair (h_i, tok_{i+1}) is i, the position of h_i."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None, kernels: str = "auto"):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kernels = kernels = resolve(kernels)
        self.enorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.hnorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.eh_proj = Linear(2 * d, d, ("embed", "embed"), dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, dtype=dtype, rngs=rngs, mesh=mesh, kernels=kernels)
        self.final_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs, kernels=kernels)

    def __call__(self, hidden, next_embeds, cache: MLACache, lengths, *, form: str = "auto"):
        """hidden [B, T, D] (target final hidden states, after its norm) at positions lengths[b] + t;
        next_embeds [B, T, D] (embeddings of the tokens one position later). Returns the draft hidden
        states [B, T, D] (before lm_head) and the new cache."""
        ((h, cache),) = self.grouped([hidden], [next_embeds], [cache], [lengths], forms=(form,))
        return h, cache

    @jax.named_scope("nextn")
    def grouped(self, hiddens, next_embeds, caches, lengths, *, forms):
        """Several batches at once (lists, each as `__call__` takes it), their rows through each
        norm and projection together (`DecoderLayer.grouped`). Returns [(draft hidden states,
        new cache)] per batch."""
        shapes = [hidden.shape[:2] for hidden in hiddens]
        x = self.eh_proj(jnp.concatenate([self.enorm(join_rows(next_embeds)), self.hnorm(join_rows(hiddens))], -1))
        positions, valids, picked = [], [], []
        for (b, t), ln, form in zip(shapes, lengths, forms):
            positions.append(ln[:, None] + jnp.arange(t, dtype=jnp.int32))
            valids.append(jnp.full(ln.shape, t, jnp.int32))  # the MLA layer needs no commit: lengths are the caller's
            picked.append(pick_form(form, t))
        x, caches = self.layer.grouped(x, shapes, positions, list(lengths), valids, list(caches), forms=picked,
                                       defer=True)
        return list(zip(split_rows(norm_stream(self.final_layernorm, x)[0], shapes), caches))


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a grouped target forward (`LingModel.forward`): the arguments of `__call__`."""

    tokens: jax.Array  # [B, T]
    state: State
    valid: jax.Array | None = None  # [B]
    form: str = "auto"
    logits: bool = True
    taps: tuple[int, ...] = ()  # as `__call__`'s


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """One batch of a grouped NEXTN forward (`LingModel.draft_forward`): the arguments of `draft`."""

    hidden: jax.Array  # [B, T, D]
    next_tokens: jax.Array  # [B, T]
    cache: MLACache
    lengths: jax.Array  # [B]
    form: str = "auto"
    logits: bool = True


def _same(module):
    return module


class LingModel(nnx.Module):
    """The decoder. nextn: with the NEXTN draft layer (default: if the config has one). mesh: the
    device mesh the MoE blocks run expert-parallel over (None: one device). kernels: the kernel
    backend every layer runs (`pallas_kernels.backend`: "auto" is resolved here, once, so a traced
    program never depends on the environment; `use_kernels` switches a built model). finish:
    called on each decoder layer and on the NEXTN block as soon as it is built, and its result
    kept; the loaders (`ling.build`) quantise and place each layer so, so that the
    full-precision model is never whole."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None, nextn: bool | None = None,
                 mesh=None, finish=None, kernels: str = "auto"):
        rngs = rngs or nnx.Rngs(0)
        finish = finish or _same
        self.cfg = cfg
        self.mesh = mesh
        self.kernels = kernels = resolve(kernels)
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List([finish(DecoderLayer(cfg, i, dtype=dtype, rngs=rngs, mesh=mesh, kernels=kernels))
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype))
        with_nextn = cfg.num_nextn_layers > 0 if nextn is None else nextn
        self.nextn = finish(NextN(cfg, dtype=dtype, rngs=rngs, mesh=mesh, kernels=kernels)) if with_nextn else None
        self.dspark = nnx.data(None)  # the DSpark block drafter (`ling.dspark`), attached by `attach_dspark`
        self.draft_vocab = nnx.data(None)  # the drafters' reduced vocabulary (`ling.draft_vocab`), if attached

    def attach_dspark(self, drafter) -> LingModel:
        """Attaches a block drafter (`ling.dspark.DSparkDrafter`) for this target; returns the model."""
        cfg = drafter.cfg
        if (cfg.hidden_size, cfg.vocab_size) != (self.cfg.hidden_size, self.cfg.vocab_size) or \
                not all(0 <= i < self.cfg.num_hidden_layers for i in cfg.feature_layers):
            raise ValueError(f"the drafter (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, feature layers "
                             f"{cfg.feature_layers}) does not fit this target ({self.cfg.hidden_size}, "
                             f"{self.cfg.vocab_size}, {self.cfg.num_hidden_layers} layers)")
        self.dspark = drafter
        return self

    def attach_draft_vocab(self, ids) -> LingModel:
        """Drafts over the tokens `ids` only (`ling.draft_vocab.DraftVocab`, from the lm_head as it is
        now: attach after quantising); ids None detaches. Returns the model."""
        self.draft_vocab = None if ids is None else DraftVocab(self, ids)
        return self

    def embed(self, tokens):
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    @jax.named_scope("lm_head")
    def logits(self, hidden):
        """hidden [B, T, D] -> logits [B, T, V] in fp32."""
        if isinstance(self.lm_head, QLinear):  # a quantised lm_head (ling.quantize)
            return self.lm_head(hidden).astype(jnp.float32)
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.dot(hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)

    def draft_logits(self, hidden):
        """The drafters' logits [B, T, V] fp32 for hidden [B, T, D]: the lm_head's, or with a draft
        vocabulary its rows alone (-inf for the other tokens)."""
        return self.logits(hidden) if self.draft_vocab is None else self.draft_vocab(hidden)

    def __call__(self, tokens, state: State, *, valid=None, form: str = "auto", logits: bool = True,
                 taps: tuple[int, ...] = ()):
        """tokens [B, T] appended to every slot; valid [B] (default T): how many are real, the rest
        being padding that leaves the slot's state untouched. Returns (logits [B, T, V] fp32,
        hidden [B, T, D], new state) — for form "verify", the uncommitted state for `commit`.
        logits=False skips the lm_head (None in its place): prefill needs logits at one position.
        taps (static): decoder layers whose output residual streams [B, T, D] are returned too, as
        a fourth element (a tuple in the order of taps; the DSpark drafter's features)."""
        (result,) = self.forward([Batch(tokens, state, valid, form, logits, tuple(taps))])
        return result

    def forward(self, batches) -> list:
        """Several batches of slots in one pass (`Batch`: each with its own tokens, state, valid,
        form and taps, as `__call__` takes them): the residual stream holds every batch's rows one
        after another, and every layer runs each batch's attention on its own and its norms,
        projections and MLP once over all the rows (`DecoderLayer.grouped`; decode and verify
        batches first, then prefill ones). Returns what `__call__` returns, per batch."""
        shapes = [batch.tokens.shape for batch in batches]
        forms, valids, positions = [], [], []
        for batch, (b, t) in zip(batches, shapes):
            forms.append(pick_form(batch.form, t))
            valids.append(jnp.full((b,), t, jnp.int32) if batch.valid is None else batch.valid.astype(jnp.int32))
            positions.append(batch.state.lengths[:, None] + jnp.arange(t, dtype=jnp.int32))  # [B, T]
        x = self.embed(jnp.concatenate([batch.tokens.reshape(-1) for batch in batches]))  # [N, D]
        lengths = [batch.state.lengths for batch in batches]
        caches, tapped = [[] for _ in batches], [{} for _ in batches]
        for i, layer in enumerate(self.layers):
            x, new = layer.grouped(x, shapes, positions, lengths, valids, [batch.state.layers[i] for batch in batches],
                                   forms=forms, defer=True)
            for g, cache in enumerate(new):
                caches[g].append(cache)
            if any(i in batch.taps for batch in batches):
                for g, part in enumerate(split_rows(x.total(), shapes)):
                    if i in batches[g].taps:
                        tapped[g][i] = part
        results = []
        hiddens = split_rows(norm_stream(self.norm, x)[0], shapes)
        for batch, hidden, form, valid, layer_caches, taken in zip(batches, hiddens, forms, valids, caches, tapped):
            pending = batch.state.replace(layers=tuple(layer_caches))
            out = self.logits(hidden) if batch.logits else None
            result = (out, hidden, pending if form == "verify" else commit(pending, valid))
            results.append(result + (tuple(taken[i] for i in batch.taps),) if batch.taps else result)
        return results

    def draft(self, hidden, next_tokens, cache: MLACache, lengths, *, form: str = "auto", logits: bool = True):
        """One NEXTN step: logits [B, T, V] (`draft_logits`) for the tokens two positions after
        `hidden`'s (None with logits=False), the draft hidden states and the new NEXTN cache."""
        (result,) = self.draft_forward([DraftBatch(hidden, next_tokens, cache, lengths, form, logits)])
        return result

    def draft_forward(self, batches) -> list:
        """Several NEXTN batches in one pass (`DraftBatch`; `NextN.grouped`): what `draft` returns,
        per batch."""
        if self.nextn is None:
            raise ValueError("this model has no NEXTN layer (the checkpoint holds none)")
        out = self.nextn.grouped([b.hidden for b in batches], [self.embed(b.next_tokens) for b in batches],
                                 [b.cache for b in batches], [b.lengths for b in batches],
                                 forms=[b.form for b in batches])
        return [((self.draft_logits(h) if b.logits else None), h, cache) for b, (h, cache) in zip(batches, out)]


def use_kernels(model: nnx.Module, kernels: str) -> nnx.Module:
    """Switches every layer under model (a model, a layer) to the kernel backend `kernels`, in
    place, and returns it: calls traced afterwards run that backend (`nnx.jit` keys a program by
    its modules' static attributes). Objects that captured the model's graph when they were
    built (`spec.stepper.Stepper`, `ChunkPrefiller`, `SlotCopier`) keep the backend they saw:
    switch before building them."""
    kernels = resolve(kernels)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "kernels"):
            node.kernels = kernels
    return model


@functools.partial(nnx.jit, static_argnames="form")
def apply(model: LingModel, tokens, state: State, valid=None, form: str = "auto"):
    """model(tokens, state) compiled once per (shapes, form): the convenient entry for tests and tools."""
    return model(tokens, state, valid=valid, form=form)

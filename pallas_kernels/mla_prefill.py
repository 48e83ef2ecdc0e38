"""MLA prefill attention: a chunk of T queries over the cached prefix and over itself, plain form.

Query t of sequence b sits at position lengths[b] + t and attends to every position up to its own:
the prefix 0 .. lengths[b] - 1 (latents already in the cache) and the chunk's tokens 0 .. t.
Per head h, with c a position's normalised latent [R] and k_r its rotated rope key [P] (shared by
all heads):
  k_nope = c W_UK,h [N],  v = c W_UV,h [V],  s = scale (q_nope·k_nope + q_rope·k_r),  o = Σ softmax(s) v
The attention is computed in two parts, each with its own log-sum-exp, and merged exactly:
  chunk   the T queries over the chunk's own T keys, causal (key s ≤ query t): square, top-left
  prefix  the T queries over cache positions < lengths[b], all visible
  o = (e^{lse_c} o_c + e^{lse_p} o_p) / (e^{lse_c} + e^{lse_p})
The chunk part is then what fused flash-attention kernels do natively: cuDNN's causal mask is
aligned at the top left and cannot be shifted per sequence, so one call over [prefix | chunk]
keys could not express "query t sees lengths[b] + t + 1 keys". The prefix part loops over the
cache in blocks (a static trip count, ceil(L / block): no host round trip) and expands each
block's latents to keys and values as it goes. Nothing forms [T, T] or
[T, L] scores, and nothing expands the whole cache.

Implementations (`prefill_attention`, backend from pallas_kernels.backend):
  "pallas"     cuDNN flash attention for both parts (jax's cuDNN fused-attention custom call; bf16
               or fp16 only: fp32 inputs take the jnp path). The chunk part is one causal call;
               each prefix block is one call with a padding mask (kv length per sequence).
  "interpret"  the same split and merge in blockwise jnp: per key block one masked softmax, its
               (o, lse) merged into the running result (what CI checks: there is no Pallas kernel
               here to interpret, and cuDNN runs only on a GPU).
  "reference"  `reference`: plain jnp over [prefix cache | chunk] with [B, H, T, L + T] scores.
cuDNN shapes: q = [q_nope | q_rope] [B, T, H, N+P], k = [k_nope | k_r broadcast over heads]
[B, S, H, N+P], v [B, S, H, V], layout BTNH. Ling: N+P = 192, V = 128 — different qk and v head
dims, which cuDNN >= 9.10 on Hopper accepts ("MLA"); where it does not (older cuDNN), v is padded
with zeros to 192 and the output sliced back (~20% more attention FLOPs: PV at 192, not 128). The
public `jax.nn.dot_product_attention` requires value.shape == key.shape and rounds the returned
log-sum-exp to the output dtype (bf16: ~3% error in the merge weights), so the private
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (same signature in jax 0.10.2
and 0.11) is called, which takes MLA dims and returns the lse in fp32 ([B, H, T]).

FLOPs that must be done, per sequence: chunk 2·H·(N+P+V)·T(T+1)/2; prefix 2·H·(N+P+V)·T·lengths;
expanding latents 2·R·H·(N+V) per position (the chunk's T once, each prefix position once per
chunk). Bytes: q, k, v of the chunk and the prefix's latents, far below the FLOPs' time.
On the GPU, bench/prefill.py checks the cuDNN path against `reference` (ragged B = 2, a prefix over
several blocks) before it times it; its figures are in bench/RESULTS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.backend import resolve

IMPLS = ("cudnn", "xla")
PALLAS_IMPL = "cudnn"  # what the "pallas" backend runs for 16-bit inputs (a benchmark may set "xla")
XLA_BLOCK = 512  # key positions per step of the jnp loops: [B, H, T, 512] fp32 scores at a time
CUDNN_PREFIX_BLOCK = 4096  # prefix positions per cuDNN call (expanded keys [B, 4096, H, N+P])


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp): the specification.


def reference(q_nope, q_rope, latent, k_rope, cache_latent, cache_rope, w_uk, w_uv, lengths, *, scale: float):
    """Plain attention over [cache | chunk]: cache rows < lengths[b] visible to every query, chunk
    key s visible to query t iff s <= t. Cache rows at or past lengths[b] are never read (they may
    hold anything, NaN included). fp32 softmax; probabilities rounded to the value dtype."""
    dt = q_nope.dtype
    l_max = cache_latent.shape[1]
    t = q_nope.shape[1]
    live = jnp.arange(l_max)[None, :] < lengths[:, None]  # [B, L]
    c = jnp.concatenate([jnp.where(live[..., None], cache_latent, 0), latent], axis=1).astype(dt)  # [B, L+T, R]
    kr = jnp.concatenate([jnp.where(live[..., None], cache_rope, 0), k_rope], axis=1).astype(dt)  # [B, L+T, P]
    k_nope = jnp.einsum("bsr,rhn->bshn", c, w_uk.astype(dt))
    v = jnp.einsum("bsr,rhv->bshv", c, w_uv.astype(dt))
    s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
         + jnp.einsum("bthp,bsp->bhts", q_rope, kr, preferred_element_type=jnp.float32)) * scale
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T, T]
    visible = jnp.concatenate([jnp.broadcast_to(live[:, None, :], (live.shape[0], t, l_max)),
                               jnp.broadcast_to(causal[None], (live.shape[0], t, t))], axis=2)  # [B, T, L+T]
    p = jax.nn.softmax(jnp.where(visible[:, None], s, -jnp.inf), axis=-1).astype(dt)
    return jnp.einsum("bhts,bshv->bthv", p, v, preferred_element_type=jnp.float32).astype(dt)


# ----------------------------------------------------------------------------------------------
# Pieces shared by both implementations.


def merge(o_a, lse_a, o_b, lse_b):
    """Two softmax-normalised partial results over disjoint key sets -> the result over their union.
    o [B, T, H, V] fp32, lse [B, T, H] fp32 (-inf: that part saw no key, its o is ignored)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.exp(lse_a - ref)[..., None]
    w_b = jnp.exp(lse_b - ref)[..., None]
    # where, not multiply: an empty part's o may be anything (cuDNN with a zero kv length).
    o = jnp.where(w_a > 0, o_a * w_a, 0.0) + jnp.where(w_b > 0, o_b * w_b, 0.0)
    return o, lse


def _expand(c, w_uk, w_uv, dt):
    """Latents c [B, S, R] -> k_nope [B, S, H, N], v [B, S, H, V] in dt (as ling/mla.py's plain form)."""
    c = c.astype(dt)
    return jnp.einsum("bsr,rhn->bshn", c, w_uk.astype(dt)), jnp.einsum("bsr,rhv->bshv", c, w_uv.astype(dt))


def _prefix_blocks(cache_latent, cache_rope, w_uk, w_uv, lengths, o, lse, *, dt, block, attend):
    """Merges the prefix (cache rows < lengths[b]) into (o, lse) in ceil(L / block) steps of at
    most `block` positions: a static trip count, since one read from lengths would be a host round
    trip on XLA:GPU (the loop's predicate copied to the host every step). Blocks past every slot's
    length add nothing (their lse is -inf); the caller cuts the cache to the positions its slots
    hold (`spec.stepper.ChunkPrefiller`'s context buckets). The blocks are balanced, a multiple of
    64 positions when there are several: a cache one position past `block` takes two half blocks,
    not two whole ones. attend(k_nope, k_rope, v, kv_len [B]) -> (o, lse) of the T queries over
    the block's first kv_len[b] keys."""
    l_max = cache_latent.shape[1]
    n = -(-l_max // block)
    bs = -(-l_max // n)
    if n > 1 and block >= 64:
        bs = min(-(-bs // 64) * 64, block)

    def body(j, carry):
        pos = jnp.minimum(j * bs + jnp.arange(bs), l_max - 1)  # rows past the cache are past lengths too
        kv_len = jnp.clip(lengths - j * bs, 0, bs)  # [B] live keys of this block
        live = (jnp.arange(bs)[None, :] < kv_len[:, None])[..., None]  # [B, bs, 1]
        c = jnp.where(live, jnp.take(cache_latent, pos, axis=1), 0)  # dead rows may hold NaN: never read
        kr = jnp.where(live, jnp.take(cache_rope, pos, axis=1), 0).astype(dt)
        k_nope, v = _expand(c, w_uk, w_uv, dt)
        return merge(*carry, *attend(k_nope, kr, v, kv_len))

    return lax.fori_loop(0, -(-l_max // bs), body, (o, lse))


# ----------------------------------------------------------------------------------------------
# Blockwise jnp (CPU, and the GPU's fallback for fp32).


def _attend_jnp(q_nope, q_rope, k_nope, k_rope, v, visible, *, scale):
    """One masked softmax: q [B, T, H, ·] over keys [B, S, ·]; visible [B, T, S] bool.
    Returns (o [B, T, H, V] fp32, lse [B, T, H] fp32, -inf where no key is visible)."""
    s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
         + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope, preferred_element_type=jnp.float32)) * scale
    s = jnp.where(visible[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [B, H, T]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])  # 0 where masked
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhts,bshv->bthv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    l_safe = jnp.where(l > 0, l, 1.0)
    o = o / jnp.moveaxis(l_safe, 1, 2)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)
    return o, jnp.moveaxis(lse, 1, 2)


def _chunk_jnp(q_nope, q_rope, k_nope, k_rope, v, *, scale, block):
    """The chunk part, causal, over key blocks of `block` positions (all T queries per step)."""
    b, t, h = q_nope.shape[:3]
    bs = min(block, t)
    n = -(-t // bs)
    pad = n * bs - t
    if pad:  # padded keys sit after every real query: the causal mask hides them
        k_nope = jnp.pad(k_nope, ((0, 0), (0, pad), (0, 0), (0, 0)))
        k_rope = jnp.pad(k_rope, ((0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))

    def body(j, carry):
        kn = lax.dynamic_slice_in_dim(k_nope, j * bs, bs, axis=1)
        kr = lax.dynamic_slice_in_dim(k_rope, j * bs, bs, axis=1)
        vb = lax.dynamic_slice_in_dim(v, j * bs, bs, axis=1)
        visible = (j * bs + jnp.arange(bs))[None, :] <= jnp.arange(t)[:, None]  # [T, bs]
        visible = jnp.broadcast_to(visible[None], (b, t, bs))
        return merge(*carry, *_attend_jnp(q_nope, q_rope, kn, kr, vb, visible, scale=scale))

    init = (jnp.zeros((b, t, h, v.shape[-1]), jnp.float32), jnp.full((b, t, h), -jnp.inf, jnp.float32))
    return lax.fori_loop(0, n, body, init)


def _prefix_attend_jnp(q_nope, q_rope, *, scale):
    def attend(k_nope, k_rope, v, kv_len):
        b, t, s = q_nope.shape[0], q_nope.shape[1], k_nope.shape[1]
        visible = jnp.broadcast_to((jnp.arange(s)[None, :] < kv_len[:, None])[:, None, :], (b, t, s))
        return _attend_jnp(q_nope, q_rope, k_nope, k_rope, v, visible, scale=scale)

    return attend


# ----------------------------------------------------------------------------------------------
# cuDNN (GPU).


def _cudnn(q, k, v, *, scale, kv_len=None, mesh=None):
    """cuDNN flash attention, layout BTNH: q [B, T, H, D], k [B, S, H, D], v [B, S, H, Dv].
    kv_len None: causal (top-left); else a padding mask, key s visible iff s < kv_len[b].
    mesh: the model's device mesh, if any (expert parallel, attention replicated): cuDNN's
    partitioner insists that q, k and v be placed alike, which XLA's propagation does not ensure,
    so they are pinned replicated. Returns (o [B, T, H, Dv] fp32, lse [B, T, H] fp32)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # see the module docstring: why private

    if mesh is not None:
        pin = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P()))  # noqa: E731
        q, k, v = pin(q), pin(k), pin(v)
        kv_len = None if kv_len is None else pin(kv_len)
    b, t = q.shape[:2]
    if kv_len is None:
        extra = dict(mask_type=fa.MaskType.CAUSAL)
    else:
        extra = dict(mask_type=fa.MaskType.PADDING, q_seqlen=jnp.full((b,), t, jnp.int32),
                     kv_seqlen=kv_len.astype(jnp.int32))

    def call(v_):
        return fa.dot_product_attention(q, k, v_, scale=scale, qkv_layout="BTNH", return_residual=True, **extra)

    dv = v.shape[-1]
    try:
        o, lse = call(v)
    except NotImplementedError:  # cuDNN < 9.10 or pre-Hopper: no MLA head dims; pad v to q's head dim
        o, lse = call(jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv))))
        o = o[..., :dv]
    return o.astype(jnp.float32), jnp.moveaxis(lse.astype(jnp.float32), 1, 2)


def _qk(nope, rope, h):
    """[nope | rope] along the head dim; rope [B, S, P] (keys, shared by heads) is broadcast."""
    if rope.ndim == 3:
        rope = jnp.broadcast_to(rope[:, :, None], rope.shape[:2] + (h,) + rope.shape[2:])
    return jnp.concatenate([nope, rope.astype(nope.dtype)], axis=-1)


def _prefix_attend_cudnn(q, *, scale, mesh):
    def attend(k_nope, k_rope, v, kv_len):
        # A sequence with no key in this block (B > 1, ragged) gets one zeroed key rather than a
        # zero-length one, and no weight in the merge.
        o, lse = _cudnn(q, _qk(k_nope, k_rope, q.shape[2]), v, scale=scale, kv_len=jnp.maximum(kv_len, 1),
                        mesh=mesh)
        return o, jnp.where((kv_len > 0)[:, None, None], lse, -jnp.inf)

    return attend


# ----------------------------------------------------------------------------------------------
# The public function.


def prefill_attention(q_nope, q_rope, latent, k_rope, cache_latent, cache_rope, w_uk, w_uv, lengths, *,
                      scale: float, backend: str = "auto", impl: str | None = None, block: int | None = None,
                      mesh=None):
    """MLA attention of a prefill chunk; see the module docstring.

    q_nope [B, T, H, N], q_rope [B, T, H, P] (rotated); latent [B, T, R], k_rope [B, T, P]: the
    chunk's own normalised latents and rotated rope keys (as written to the cache); cache_latent
    [B, L, R], cache_rope [B, L, P]: rows < lengths[b] hold the prefix, the rest is never read;
    w_uk [R, H, N], w_uv [R, H, V]; lengths [B] int32 (query t sits at position lengths[b] + t).
    impl ("cudnn" | "xla") overrides the backend's choice (benchmarks time both); block: key
    positions per loop step; mesh: the model's device mesh when it runs expert parallel (the
    attention stays replicated; see `_cudnn`). Returns o [B, T, H, V] in q_nope's dtype.
    """
    b, t, h, n = q_nope.shape
    r = latent.shape[-1]
    assert q_rope.shape[:3] == (b, t, h) and latent.shape[:2] == (b, t) and k_rope.shape[:2] == (b, t)
    assert cache_latent.shape[0] == b and cache_latent.shape[2] == r and cache_rope.shape[:2] == cache_latent.shape[:2]
    assert w_uk.shape == (r, h, n) and w_uv.shape[:2] == (r, h) and lengths.shape == (b,)
    backend = resolve(backend)
    if backend == "reference" and impl is None:
        return reference(q_nope, q_rope, latent, k_rope, cache_latent, cache_rope, w_uk, w_uv, lengths, scale=scale)
    if impl is None:
        half = q_nope.dtype in (jnp.bfloat16, jnp.float16)  # cuDNN takes 16-bit inputs only
        impl = PALLAS_IMPL if backend == "pallas" and half else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    dt = q_nope.dtype
    k_nope, v = _expand(latent, w_uk, w_uv, dt)  # the chunk's own keys and values
    kr = k_rope.astype(dt)
    lengths = lengths.astype(jnp.int32)
    if impl == "cudnn":
        q = _qk(q_nope, q_rope, h)
        o, lse = _cudnn(q, _qk(k_nope, kr, h), v, scale=scale, mesh=mesh)
        attend = _prefix_attend_cudnn(q, scale=scale, mesh=mesh)
        block = block or CUDNN_PREFIX_BLOCK
    else:
        block = block or XLA_BLOCK
        o, lse = _chunk_jnp(q_nope, q_rope, k_nope, kr, v, scale=scale, block=block)
        attend = _prefix_attend_jnp(q_nope, q_rope, scale=scale)
    o, _ = _prefix_blocks(cache_latent, cache_rope, w_uk, w_uv, lengths, o, lse, dt=dt, block=block, attend=attend)
    return o.astype(dt)

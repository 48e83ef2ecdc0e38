"""The MoE peers: XLA's own forms (`xla_gathered` at decode sizes, `xla_ragged` at prefill sizes)
and torch's grouped GEMM on the same routing: on its own weights (`torch_grouped_mm_us`) and on
experts pre-gathered from JAX's (`torch_gathered_us`)."""

from __future__ import annotations

import time

from bench.common import torch_us


def xla_gathered(x, topk_ids, topk_weights, w13, w2):
    """XLA's peer at decode sizes: an einsum over the pairs' gathered experts in x's dtype with
    float32 accumulation (w13 [E, D, 2I] interleaved, w2 [E, I, D])."""
    import jax
    import jax.numpy as jnp

    h = jnp.einsum("md,mkdn->mkn", x, w13[topk_ids].astype(x.dtype), preferred_element_type=jnp.float32)
    g, u = h[..., 0::2], h[..., 1::2]
    h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)  # [M, k, I]
    out = jnp.einsum("mki,mkid->mkd", h, w2[topk_ids].astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.sum(out * topk_weights[..., None].astype(jnp.float32), axis=1).astype(x.dtype)


def xla_ragged(x, topk_ids, topk_weights, w13, w2):
    """XLA's peer at prefill sizes: pairs sorted by expert, `lax.ragged_dot` in x's dtype with
    float32 accumulation (on the GPU it reads every expert)."""
    import jax
    import jax.numpy as jnp

    m, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w13.shape[0]).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // k], w13.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    g, u = h[:, 0::2], h[:, 1::2]
    h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
    out = jax.lax.ragged_dot(h, w2.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    out = out * topk_weights.reshape(-1)[order, None].astype(jnp.float32)
    return jnp.zeros((m, x.shape[1]), jnp.float32).at[order // k].add(out).astype(x.dtype)


def torch_grouped_mm_us(ids, ws, *, e: int, d: int, inter: int, n: int = 20) -> float:
    """µs per MoE layer of torch._grouped_mm on its own random bf16 weights for this routing
    (ids, ws [M, k] host arrays): argsort, gather, gate_up, SiLU*up, down, weights, index_add;
    eager, CUDA events over n layers (its ~10 launches a layer are noise at ~2 ms)."""
    import numpy as np
    import torch

    m, k = ids.shape
    dv = "cuda"
    g = torch.Generator(device=dv).manual_seed(0)
    # B operands in the layout torch's grouped GEMM wants: [E, N, K] stored, K-major view.
    w13 = (torch.randn(e, 2 * inter, d, device=dv, dtype=torch.bfloat16, generator=g) * 0.03).transpose(1, 2)
    w2 = (torch.randn(e, d, inter, device=dv, dtype=torch.bfloat16, generator=g) * 0.05).transpose(1, 2)
    x = torch.randn(m, d, device=dv, dtype=torch.bfloat16, generator=g)
    tid = torch.from_numpy(np.asarray(ids)).to(dv).long()
    tw = torch.from_numpy(np.asarray(ws, np.float32)).to(dv)

    def layer():
        flat = tid.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        tok = order // k
        h = torch._grouped_mm(x[tok], w13, offs=offs)  # [P, 2I]
        h = (torch.nn.functional.silu(h[:, 0::2].float()) * h[:, 1::2].float()).to(torch.bfloat16)
        out = torch._grouped_mm(h, w2, offs=offs).float() * tw.reshape(-1)[order, None]
        return torch.zeros(m, d, device=dv).index_add_(0, tok, out).to(torch.bfloat16)

    us = torch_us(layer, n=n)
    del w13, w2, x
    torch.cuda.empty_cache()
    return us


def torch_gathered_us(x, ids, ws, w, k: int, d: int):
    """torch._grouped_mm over experts pre-gathered per routing (the gather is not timed), on JAX's
    own bf16 buffers through DLPack: x [M, D], ids and ws lists of [M, k] routings, w (w13 [E, D, 2I],
    w2 [E, I, D]). Per routing: rows sorted by expert, gate/up GEMM, SiLU·up, down GEMM, weighted
    index_add. Batches of 12 and of 3 passes over the routings, the difference over 9 (best of 2).
    Returns (µs a call, the first routing's y as a torch tensor)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    m = x.shape[0]
    w13, w2 = (torch.from_dlpack(a) for a in w)  # [E, D, 2I], [E, I, D]
    xt = torch.from_dlpack(x)
    dev = xt.device

    def k_major(w):  # the same [U, K, N] values with K contiguous (the layout cuBLASLt/CUTLASS take)
        return w.transpose(1, 2).contiguous().transpose(1, 2)

    calls = []
    for i, s in zip(ids, ws):
        flat = np.asarray(i).reshape(-1)
        order = np.argsort(flat, kind="stable")
        experts, counts = np.unique(flat[order], return_counts=True)
        e = torch.as_tensor(experts, device=dev)
        calls.append(dict(rows=torch.as_tensor(order // k, device=dev), w13=k_major(w13[e]), w2=k_major(w2[e]),
                          offs=torch.as_tensor(np.cumsum(counts), dtype=torch.int32, device=dev),
                          weight=torch.as_tensor(np.asarray(s).reshape(-1)[order], device=dev)))

    def one(c):
        h = torch._grouped_mm(xt[c["rows"]], c["w13"], offs=c["offs"])  # [P, 2I]
        h = (F.silu(h[:, 0::2].float()) * h[:, 1::2].float()).to(torch.bfloat16)  # [P, I]
        o = torch._grouped_mm(h, c["w2"], offs=c["offs"])  # [P, D]
        y = torch.zeros(m, d, dtype=torch.float32, device=dev)
        return y.index_add_(0, c["rows"], o.float() * c["weight"][:, None]).to(torch.bfloat16)

    y0 = one(calls[0])
    torch.cuda.synchronize()

    def batch(n):
        t = time.perf_counter()
        for _ in range(n):
            for c in calls:
                one(c)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    batch(2)
    us = min(batch(12) - batch(3) for _ in range(2)) / (9 * len(calls)) * 1e6
    return us, y0

"""bench.prefill --parts gemm: the MoE grouped GEMM at prefill sizes.

gemm  the MoE grouped GEMM (pallas_kernels.grouped_gemm.grouped_moe: align + up GEMM/SwiGLU + down
      GEMM/weights + combine), E 512, top-8, D 2560, I 768, bf16, uniform random routing, at 512,
      4096 and 16384 tokens; TFLOP/s over 6·M·k·D·I; the peer torch._grouped_mm on the same routing
      (bench/peers.py `torch_grouped_mm_us`). Ceilings from the same run: its bytes (the
      used experts' weights once, x, y, h and the bf16 pair rows written and read) over the copy
      ceiling, and the experts' weights streamed by XLA's dense dot (cuBLAS) at 64 rows (a TMA
      kernel streamed them no faster, bench/history/chronicle.md). Target >= 250 TFLOP/s at 4096 tokens.
"""

from __future__ import annotations

from bench.common import copy_ceiling_tbs, rel_err
from bench.prefill_common import device_us, fmt_us, log, row


class GemmPart:
    """bench.prefill's gemm part (a base of its Bench, beside `prefill_common.Part`)."""

    def gemm(self):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels import experts
        from pallas_kernels import grouped_gemm as gg

        e, k, d, inter = (13, 4, 256, 128) if self.tiny else (512, 8, 2560, 768)
        sizes = (24, 64) if self.tiny else (512, 4096, 16384)
        key = jax.random.PRNGKey(0)
        k1, k2 = jax.random.split(key)
        w13 = jax.random.normal(k1, (e, d, 2 * inter), jnp.bfloat16) * 0.03  # std: h and y stay O(1)
        w2 = jax.random.normal(k2, (e, inter, d), jnp.bfloat16) * 0.05
        ours = jax.jit(lambda x, i, s, a, b: gg.grouped_moe(x, i, s, a, b, backend=self.backend))
        ref = jax.jit(lambda x, i, s, a, b: experts.reference(x, i, s, a, b))
        ceiling = copy_ceiling_tbs(1 << (20 if self.tiny else 30))
        stream = self.weight_stream_us(w13, w2)
        log(f"copy ceiling {ceiling:.2f} TB/s; the experts' weights through XLA's dense dot at 64 rows "
            f"(cuBLAS on the GPU; [64, D] @ [D, E*2I] and [64, I] @ [I, E*D]): {stream:.1f} µs")
        for m in sizes:
            if self.left() < 0:
                log(f"budget spent: gemm M={m} skipped")
                continue
            kx, ka, kb = jax.random.split(jax.random.fold_in(key, m), 3)
            x = jax.random.normal(kx, (m, d), jnp.bfloat16)
            ids = jax.lax.top_k(jax.random.uniform(ka, (m, e)), k)[1].astype(jnp.int32)  # distinct per token
            ws = jax.random.uniform(kb, (m, k), jnp.float32) / k + 0.05
            s = min(m, 256)  # a token's output depends on its own row only
            err = rel_err(ours(x, ids, ws, w13, w2)[:s].astype(jnp.float32),
                          ref(x[:s], ids[:s], ws[:s], w13, w2).astype(jnp.float32))
            if not err < 1e-2:
                raise AssertionError(f"grouped_moe M={m}: rel err {err:.2e} against grouped_gemm.reference")
            us = device_us(ours, x, ids, ws, w13, w2, reps=self.reps)
            flop = 6 * m * k * d * inter
            peer = None
            if self.gpu:
                try:
                    from bench.peers import torch_grouped_mm_us

                    peer = torch_grouped_mm_us(np.asarray(ids), np.asarray(ws), e=e, d=d, inter=inter)
                except Exception as exc:  # noqa: BLE001
                    log(f"  torch._grouped_mm peer failed: {type(exc).__name__}: {str(exc)[:300]}")
            tf = flop / us / 1e6
            floor = gemm_bytes(np.asarray(ids), e=e, d=d, inter=inter) / ceiling / 1e6
            log(f"gemm M={m}: {us:.1f} µs, {tf:.1f} TFLOP/s, err {err:.1e}; torch._grouped_mm "
                f"{fmt_us(peer)}{f' (ours {peer / us:.2f}x)' if peer else ''}; its bytes at the copy ceiling "
                f"{floor:.1f} µs ({floor / us:.2f} of ours); the weights through XLA's dot {stream:.1f} µs "
                f"({stream / us:.2f} of ours)")
            row("gemm", f"grouped_moe M={m}", us=us, tflops=tf, peer="torch._grouped_mm", peer_us=peer,
                target=(tf >= 250) if m == 4096 and not self.tiny else None,
                note=f"bytes floor {floor / us:.2f}, XLA-dot weights {stream / us:.2f} of ours")

    def weight_stream_us(self, w13, w2):
        """µs for XLA's dense dot (cuBLAS on the GPU) to stream the experts' weights at 64 rows,
        measured beside ours: what a vendor GEMM takes for these bytes on this GPU. The weights are
        laid out as one [D, E*2I] and one [I, E*D] matrix (a transposed copy, made once)."""
        import jax

        e, d, n13 = w13.shape
        b13 = w13.transpose(1, 0, 2).reshape(d, e * n13)
        b2 = w2.transpose(1, 0, 2).reshape(w2.shape[1], e * d)
        a13 = jax.random.normal(jax.random.PRNGKey(7), (64, d), w13.dtype)
        a2 = jax.random.normal(jax.random.PRNGKey(8), (64, w2.shape[1]), w2.dtype)
        us = device_us(jax.jit(lambda a13, b13, a2, b2: (a13 @ b13, a2 @ b2)), a13, b13, a2, b2, reps=self.reps)
        del b13, b2
        return us


def gemm_bytes(ids, *, e: int, d: int, inter: int) -> int:
    """Bytes the grouped GEMM must move for this routing (ids [M, k] host array), bf16, plan_for's
    "sum16" combine: each used expert's weights once, x and y, h's pair rows written and read, the
    bf16 pair rows written and read (pallas_kernels/grouped_gemm.py, Bytes)."""
    import numpy as np

    m, k = ids.shape
    p = m * k
    used = int(np.unique(ids[ids < e]).size)
    return 2 * (used * 3 * d * inter + 2 * m * d + 2 * p * inter + 2 * p * d)

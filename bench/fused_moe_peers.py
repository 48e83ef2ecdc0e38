"""bench.fused_moe's peer rows, on bf16 weights and the run's routings: XLA `lax.ragged_dot`
(bench/peers.py `xla_ragged`), XLA einsum over gathered experts (`xla_gathered`), both timed and
checked like ours, and torch._grouped_mm over experts pre-gathered per routing (`torch_gathered_us`:
the gather not timed; GPU only), checked against `experts.reference`.
"""

from __future__ import annotations

from bench.peers import torch_gathered_us, xla_gathered, xla_ragged


def peer_tasks(routing, timed, check, wts, fmts, rows, kd, log):
    """(peers: name -> the XLA form, the task peer(name, m), the task torch_peer(_, m)); kd: (K, D)."""
    import jax.numpy as jnp

    K, D = kd
    peers = {"ragged": lambda x, i, s, w: xla_ragged(x, i, s, w[0], w[1]),
             "gathered": lambda x, i, s, w: xla_gathered(x, i, s, w[0], w[1])}

    def peer(name, m):
        x, ids, ws, _ = routing(m)
        us, ys = timed(peers[name], wts["bf16"], x, ids, ws)
        check("bf16", m, wts["bf16"], x, ids, ws, ys, name)
        for fmt in fmts:
            rows[(fmt, m)][name] = us
        log(f"{name} bf16 M={m}: {us:.1f} µs")

    def torch_peer(_, m):
        """torch._grouped_mm over pre-gathered experts, timed like `timed` (R routings a batch)."""
        x, ids, ws, _ = routing(m)
        us, y0 = torch_gathered_us(x, ids, ws, wts["bf16"], K, D)
        check("bf16", m, wts["bf16"], x, ids, ws, [jnp.asarray(y0.cpu().float().numpy())], "torch")
        for fmt in fmts:
            rows[(fmt, m)]["torch"] = us
        log(f"torch._grouped_mm bf16 M={m}: {us:.1f} µs")

    return peers, peer, torch_peer

"""Expert parallelism: a device mesh, the rules from logical axes to mesh axes, and the
expert-parallel MoE computation.

Every parameter was declared with logical axis names (`moe.nn.param`'s `logical_axes`); a layout
is a table from those names to mesh axes. The default table shards the routed experts over the
"expert" axis and replicates everything else (attention, dense MLPs, the shared expert, the
router); the "tensor" axis is there for attention heads when a later layout needs it. The
loaders create each parameter in its sharding (`ling.build`).

The MoE block itself runs under `jax.shard_map` when it was built with a mesh (`moe.block`):
- decode / verify sizes: tokens are replicated on every rank; each rank computes the pairs routed
  to its local experts and the partial outputs are summed over the expert axis (one psum of
  [M, D] fp32 a layer);
- from A2A_MIN_TOKENS tokens (set above any prefill chunk: the psum path was faster at every
  size measured on two GPUs, see there): the tokens are split over the ranks, each pair is sent
  to the rank owning its expert with an all-to-all of fixed capacity, computed there and sent
  back, and the combined tokens are gathered again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

EXPERT, TENSOR = "expert", "tensor"

# logical axis -> mesh axis (None: replicated). Names not listed are replicated.
RULES: dict[str, str | None] = {
    "experts": EXPERT,
    "heads": None,  # TENSOR here would split attention heads (and needs its collectives)
    "vocab": None,
    "embed": None,
    "mlp": None,
}

# From this many tokens in one MoE call the all-to-all dispatch replaces the replicated psum.
# Measured on two H200s (NVLink; bench/decode.py --ep 2, bench/history/chronicle.md): one Ling MoE layer
# at 256 / 1024 / 4096 / 8192 tokens takes 1424 / 1521 / 2110 / 2230 µs by the psum path and
# 1.10 / 1.10 / 1.61 / 1.98x that by the all-to-all. With the attention replicated every rank
# holds every token anyway, and the psum moves M·D fp32 where the all-to-all moves M·k·D/ep
# activations each way, so the psum wins at every size a prefill chunk takes (up to 8192): the
# all-to-all is for layouts whose attention is split over the ranks too.
A2A_MIN_TOKENS = 16384


def make_mesh(ep_size: int, tp_size: int = 1, devices=None) -> Mesh:
    """A mesh of ep_size x tp_size devices with axes ("expert", "tensor")."""
    devices = jax.devices() if devices is None else devices
    if ep_size * tp_size > len(devices):
        raise ValueError(f"--ep-size {ep_size} x tensor {tp_size} needs {ep_size * tp_size} devices, "
                         f"{len(devices)} available")
    grid = np.asarray(devices[: ep_size * tp_size]).reshape(ep_size, tp_size)
    return Mesh(grid, (EXPERT, TENSOR))


def spec_for(logical_axes, rules=RULES) -> P:
    return P(*(rules.get(a) if a is not None else None for a in logical_axes))


def replicate(tree, mesh: Mesh):
    """Puts a pytree (the decoding state) on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def initialize_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None):
    """Multi-host: joins JAX's distributed runtime when a coordinator is given (the flags are
    JAX's own names); afterwards jax.devices() lists every process's devices."""
    if coordinator_address is None:
        return
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def expert_parallel(x, ids, weights, w13, w2, *, swiglu_limit, mesh: Mesh, compute):
    """The routed experts of x [M, D] over the mesh's expert axis; compute is the single-device
    routed-experts function (moe.block.routed_experts), called with skips=True: other ranks'
    pairs carry id E/ep. w13, w2 are sharded along experts."""
    ep = mesh.shape[EXPERT]
    if x.shape[0] >= A2A_MIN_TOKENS and x.shape[0] % ep == 0:
        return all_to_all(x, ids, weights, w13, w2, swiglu_limit, mesh, compute)
    return replicated(x, ids, weights, w13, w2, swiglu_limit, mesh, compute)


def replicated(x, ids, weights, w13, w2, limit, mesh, compute):
    """Tokens on every rank; each computes the pairs of its local experts; psum of the partials.
    (The partials are rounded to x's dtype before the sum: exact in fp32, one extra bf16 rounding
    per rank in bf16.)"""
    def local(x, ids, weights, w13, w2):  # w13 [E/ep, D, 2I], w2 [E/ep, I, D]
        e_local = w13.shape[0]
        lo = jax.lax.axis_index(EXPERT) * e_local
        mine = (ids >= lo) & (ids < lo + e_local)
        # Pairs of other ranks are skipped (id E/ep, `moe.block.routed_experts`).
        y = compute(x, jnp.where(mine, ids - lo, e_local), jnp.where(mine, weights, 0.0), w13, w2,
                    swiglu_limit=limit, skips=True)
        return jax.lax.psum(y, EXPERT)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(EXPERT), P(EXPERT)), out_specs=P(),
                         check_vma=False)(x, ids, weights, w13, w2)


def all_to_all(x, ids, weights, w13, w2, limit, mesh, compute):
    """Tokens split over the ranks; every (token, slot) pair travels to the rank owning its expert
    and back, by two all-to-alls of fixed capacity (a rank may receive every pair of a sender:
    capacity M/ep·k). XLA:CPU has no ragged_all_to_all, so this dense form is the portable one."""
    ep = mesh.shape[EXPERT]

    def local(x, ids, weights, w13, w2):  # x [M/ep, D]; ids, weights [M/ep, k]
        m, k = ids.shape
        d = x.shape[1]
        e_local = w13.shape[0]
        cap = m * k
        dest = (ids // e_local).reshape(-1)  # [P] owning rank of each pair
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=ep)
        starts = jnp.cumsum(counts) - counts
        slot = jnp.zeros_like(dest).at[order].set(jnp.arange(m * k) - starts[dest[order]])  # place in its bucket
        token = jnp.arange(m * k) // k
        send_x = jnp.zeros((ep, cap, d), x.dtype).at[dest, slot].set(x[token])
        # Unfilled capacity slots are skipped pairs (id E/ep): no expert computes them.
        send_id = jnp.full((ep, cap), e_local, jnp.int32).at[dest, slot].set((ids % e_local).reshape(-1))
        send_w = jnp.zeros((ep, cap), weights.dtype).at[dest, slot].set(weights.reshape(-1))
        a2a = lambda a: jax.lax.all_to_all(a, EXPERT, 0, 0, tiled=True)  # [ep, cap, ...]: row s from rank s
        rx, rid, rw = a2a(send_x), a2a(send_id), a2a(send_w)
        out = compute(rx.reshape(ep * cap, d), rid.reshape(-1, 1), rw.reshape(-1, 1), w13, w2, swiglu_limit=limit,
                      skips=True)
        back = a2a(out.reshape(ep, cap, d))  # row r: my pairs' results computed on rank r
        return jnp.zeros((m, d), jnp.float32).at[token].add(back[dest, slot].astype(jnp.float32)).astype(x.dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(EXPERT), P(EXPERT), P(EXPERT), P(EXPERT), P(EXPERT)),
                         out_specs=P(EXPERT), check_vma=False)(x, ids, weights, w13, w2)

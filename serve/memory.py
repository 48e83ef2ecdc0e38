"""The device memory of a server: the weights, one slot's state, the prefix cache's pool, and
whether the asked slots fit (`memory_plan`, `plan_prefix_cache`, `check_memory`)."""

from __future__ import annotations

import dataclasses

# The prefix cache's default pool: on a GPU this share of the memory left after the weights and the
# slots (its KDA states are large: a checkpoint of Ling-3-flash holds tens of MB); on a CPU, GB.
PREFIX_SHARE, PREFIX_CPU_GB = 0.5, 0.1


def human(n: float) -> str:
    """Bytes as a short decimal figure: 66.6 GB, 412 MB, 83 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}" if scale == 1e9 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass
class MemoryPlan:
    """Bytes on one device: the weights, one slot's state at max_seq_len, and what is free."""

    weights: int
    kda: int  # per slot: conv and recurrent states of the KDA layers
    mla: int  # per slot: latent and rope-key caches of the MLA layers and the NEXTN layer
    mla_per_token: int
    verify: int  # per slot: the KDA states a verify pass keeps after each of its positions
    other: int  # per slot: tokens, sampling parameters, the output buffer
    free: int | None  # after the weights (None where the backend does not say: CPU)
    prefix_entry: int = 0  # one prefix-cache checkpoint (spec.prefix.entry_bytes; 0: no cache)
    prefix_entries: int = 0  # checkpoints in the pool
    prefix_interval: int = 0

    @property
    def slot(self) -> int:
        return self.kda + self.mla + self.verify + self.other

    @property
    def pool(self) -> int:
        return self.prefix_entry * self.prefix_entries

    def describe(self, max_batch: int) -> str:
        left = "" if self.free is None else f", {human(self.free - max_batch * self.slot - self.pool)} left"
        pool = (f"; prefix cache {human(self.pool)} ({self.prefix_entries} checkpoints of {self.prefix_interval} "
                f"tokens, {human(self.prefix_entry)} each)" if self.prefix_entries else "; prefix cache off")
        return (f"memory: weights {human(self.weights)}; a slot {human(self.slot)} (KDA states {human(self.kda)}, "
                f"MLA cache {human(self.mla)}, verify states {human(self.verify)}); "
                f"{max_batch} slots {human(max_batch * self.slot)}{pool}{left}")


RESERVE = 0.05  # of the device's memory kept free for the steps' activations and XLA's workspace


def memory_plan(model, *, max_seq_len: int, speculative_steps: int, prefix_interval: int = 0) -> MemoryPlan:
    """prefix_interval: the prefix cache's (0: none), for the size of one checkpoint."""
    import jax
    import numpy as np

    from ling import build
    from ling.state import KDAState, MLACache
    from spec.prefix import entry_bytes
    from spec.step import new_slots

    width = speculative_steps + 1
    one = jax.eval_shape(lambda: new_slots(model, 1, max_seq_len + width, max_seq_len, logprob_width=width))
    size = lambda tree: sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    layers = list(one.model.layers) + ([one.model.nextn] if one.model.nextn is not None else [])
    kda = sum(size(c) for c in layers if isinstance(c, KDAState))
    mla = sum(size(c) for c in layers if isinstance(c, MLACache))
    recurrent = sum(size(c.recurrent) for c in layers if isinstance(c, KDAState))
    verify = recurrent * (width + 1) if speculative_steps else 0  # per position, and the initial state
    free = build.device_memory()
    if free is not None:
        stats = jax.local_devices()[0].memory_stats()
        free = int(free * (1 - RESERVE)) - stats.get("bytes_in_use", 0)
    return MemoryPlan(weights=build.nbytes(model, model.mesh), kda=kda, mla=mla,
                      mla_per_token=mla // (max_seq_len + width), verify=verify,
                      other=size(one) - kda - mla, free=free,
                      prefix_entry=entry_bytes(one.model, one.last_hidden, prefix_interval) if prefix_interval else 0,
                      prefix_interval=prefix_interval)


def plan_prefix_cache(plan: MemoryPlan, args) -> None:
    """Sets plan.prefix_entries from --prefix-cache-gb (or its default) and --disable-prefix-cache;
    ValueError when an explicit budget holds no checkpoint."""
    if args.disable_prefix_cache or not plan.prefix_entry:
        plan.prefix_entries = 0
        return
    budget = args.prefix_cache_gb * 1e9 if args.prefix_cache_gb is not None else (
        PREFIX_CPU_GB * 1e9 if plan.free is None else PREFIX_SHARE * max(plan.free - args.max_batch * plan.slot, 0))
    plan.prefix_entries = int(budget // plan.prefix_entry)
    if plan.prefix_entries < 1 and args.prefix_cache_gb:
        raise ValueError(f"--prefix-cache-gb {args.prefix_cache_gb:g} holds no checkpoint of "
                         f"{human(plan.prefix_entry)}: give it more, or --disable-prefix-cache")


def check_memory(plan: MemoryPlan, max_batch: int, max_seq_len: int) -> None:
    """ValueError, with the numbers and the largest settings that fit, when the slots do not."""
    if plan.free is None or max_batch * plan.slot + plan.pool <= plan.free:
        return
    if max_batch * plan.slot <= plan.free:
        raise ValueError(f"the prefix cache's {human(plan.pool)} do not fit next to {max_batch} slots "
                         f"({human(max(plan.free - max_batch * plan.slot, 0))} left): pass a smaller "
                         f"--prefix-cache-gb or --disable-prefix-cache")
    fit_batch = max(plan.free // plan.slot, 0)
    fixed = plan.slot - plan.mla_per_token * max_seq_len
    fit_len = (plan.free // max_batch - fixed) // plan.mla_per_token if plan.mla_per_token else 0
    hint = [f"--max-batch {fit_batch}" if fit_batch else None,
            f"--max-seq-len {fit_len}" if fit_len >= 2 else None]
    hint = " or ".join(h for h in hint if h) or "a smaller model (--quantize int4 --quantize-experts)"
    raise ValueError(f"{max_batch} slots x {max_seq_len} tokens need {human(max_batch * plan.slot)} "
                     f"({human(plan.slot)} a slot) but {human(max(plan.free, 0))} are free after the "
                     f"{human(plan.weights)} of weights: try {hint}")

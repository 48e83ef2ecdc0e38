"""What bench.attention's KDA and MLA benchmarks share: the log, the budget, the device-side timer
(`time_jax`: a fori_loop of unrolled calls over rotating buffers), the rows and their floor (bytes
over the copy ceiling measured in the run), and the shapes (BENCH_SMOKE=1: tiny, interpreted)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.55")  # leave room for torch (fla)
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's own Triton kernel, no plugins

import jax
import jax.numpy as jnp

from bench.common import Log, copy_ceiling_tbs, time_loop

OUT = os.environ.get("OUT", "/tmp/attention_bench")
os.makedirs(OUT, exist_ok=True)
# Past this many seconds the optional sweeps are skipped; a full run (all sweeps, fla, every
# case) takes about 300 s of device time on an H200, most of it compiling.
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "150"))
# BENCH_SMOKE=1: tiny shapes through the Pallas interpreter on CPU, to check this script itself.
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
PALLAS = "interpret" if SMOKE else "pallas"
T0 = time.time()
log = Log(T0)
log.open(os.path.join(OUT, "attention.log"))
ROWS: list[dict] = []

H, KD = (2, 16) if SMOKE else (32, 128)  # KDA heads, head dim
MH, R, P = (2, 32, 16) if SMOKE else (32, 512, 64)  # MLA heads, latent rank, rope dims
MLA_LENGTHS = (64, 128, 256) if SMOKE else (1024, 8192, 65536)
MLA_SCALE = 192 ** -0.5


def over_budget() -> bool:
    return time.time() - T0 > BUDGET_S


def time_jax(fn, shared, rotating, perturb) -> float:
    """µs per call of fn(shared, rot), rot over the rotating buffers, measured on the device side:
    a fori_loop whose body makes len(rotating) calls is run for 2 and for 12 iterations in one
    dispatch each, and the difference is divided by 10·len(rotating), so dispatch and the
    creation of output arrays cancel. The outputs are carried through the loop (nothing is dead
    code), and perturb(shared, eps) adds the carried eps (always 0) to the small shared inputs,
    so no call is loop-invariant (one small fusion per iteration, shared by all calls)."""
    n = len(rotating)

    def calls(sh, rots):
        return [fn(sh, r) for r in rots]

    def step(args, carry):
        (sh0, rots), (eps, _) = args, carry
        outs = calls(perturb(sh0, eps), rots)
        probe = sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(outs))
        return eps + probe * 0.0, outs

    init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(calls, shared, rotating))
    us = time_loop(step, (shared, rotating), (jnp.float32(0.0), init), lo=2, hi=12) / n
    log.write(f"    time_jax: {n} calls/iter, {us:.2f} µs a call\n")
    return us


def add_eps(a, eps):
    """a + eps with eps the loop-carried 0.0: same values, but no longer loop-invariant."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a + eps.astype(a.dtype)
    return (a.astype(jnp.float32) + eps).astype(a.dtype)




def record(kind, case, config, us, nbytes, ceiling_tbs, **extra):
    row = dict(kind=kind, case=case, config=config, us=round(us, 3), bytes=nbytes,
               tbs=round(nbytes / us / 1e6, 3), floor_us=round(nbytes / (ceiling_tbs * 1e6), 3), **extra)
    row["pct_floor"] = round(100 * row["floor_us"] / us, 1)
    ROWS.append(row)
    log(f"  {kind:4s} {case:10s} {config:34s} {us:9.2f} us  {row['tbs']:6.3f} TB/s  "
        f"{row['pct_floor']:5.1f}% of floor" + "".join(f"  {k}={v}" for k, v in extra.items()))
    return row


# ----------------------------------------------------------------------------------------------


def copy_ceiling() -> float:
    """Read + write TB/s of an XLA pass over 1 GiB (`common.copy_ceiling_tbs`)."""
    tbs = copy_ceiling_tbs((4 << 20) if SMOKE else (1 << 30))
    log(f"copy ceiling: {tbs:.3f} TB/s (1 GiB read + write, XLA, queued dispatches)")
    return tbs


# ----------------------------------------------------------------------------------------------
# KDA

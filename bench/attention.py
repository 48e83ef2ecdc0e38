"""Attention decode kernels on the GPU at Ling-3.0-flash shapes: fused KDA verify and MLA decode.

    python -m bench.attention            (on the GPU machine; $OUT gets attention.log, attention.json)

KDA: B 1, 32 heads, K = V = 128, fp32 state, T = 1 and 6, bf16 activations, fp32 conv weights.
MLA: B 1, 32 heads, R 512, P 64, bf16 cache of 1k, 8k, 64k positions (all valid), T = 1 and 6.
Each figure is µs per layer: N calls unrolled in one jit (one CUDA graph: XLA's command buffers),
each call on its own state / cache buffer (together past the 60 MB L2, so reads are cold),
timed over repeated executions, median of 3. fla's Triton `fused_recurrent_kda` (the peer) is
timed the same way under a torch CUDA graph. Bytes "that must move" count each input read once
and each output written once; the floor is those bytes over the copy bandwidth measured here.
Every Pallas configuration is checked against the jnp reference on the GPU before it is timed.
BENCH_ONLY=mla (or kda) runs one kernel's cases; BENCH_BUDGET_S bounds the sweeps.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.55")  # leave room for torch (fla)
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla's own Triton kernel, no plugins

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import copy_ceiling_tbs, rel_err, time_torch_graph
from pallas_kernels import kda, mla_decode as md

OUT = os.environ.get("OUT", "/tmp/attention_bench")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "attention.log"), "w")
# Past this many seconds the optional sweeps are skipped; a full run (all sweeps, fla, every
# case) takes about 300 s of device time on an H200, most of it compiling.
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "150"))
# BENCH_SMOKE=1: tiny shapes through the Pallas interpreter on CPU, to check this script itself.
SMOKE = os.environ.get("BENCH_SMOKE") == "1"
PALLAS = "interpret" if SMOKE else "pallas"
T0 = time.time()
ROWS: list[dict] = []

H, KD = (2, 16) if SMOKE else (32, 128)  # KDA heads, head dim
MH, R, P = (2, 32, 16) if SMOKE else (32, 512, 64)  # MLA heads, latent rank, rope dims
MLA_LENGTHS = (64, 128, 256) if SMOKE else (1024, 8192, 65536)
MLA_SCALE = 192 ** -0.5


def log(*a):
    s = f"[{time.time() - T0:5.0f}s] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


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

    def loop(sh0, rots, n_iter):
        def calls(sh):
            return [fn(sh, r) for r in rots]

        def body(_, carry):
            eps, _ = carry
            outs = calls(perturb(sh0, eps))
            probe = sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(outs))
            return eps + probe * 0.0, outs

        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(calls, sh0))
        return jax.lax.fori_loop(0, n_iter, body, (jnp.float32(0.0), init))

    run = jax.jit(loop)
    jax.block_until_ready(run(shared, rotating, 1))  # compile + warm-up

    def wall(k):
        t = time.perf_counter()
        jax.block_until_ready(run(shared, rotating, k))
        return time.perf_counter() - t

    lo = statistics.median(wall(2) for _ in range(3))
    hi = statistics.median(wall(12) for _ in range(3))
    LOG.write(f"    time_jax: {n} calls/iter, 2 iters {lo * 1e3:.3f} ms, 12 iters {hi * 1e3:.3f} ms\n")
    return (hi - lo) / (10 * n) * 1e6


def _add_eps(a, eps):
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


def kda_bytes(t, all_states=True, b=1, e=2, nw=4):
    c = H * KD
    state = 4 * b * H * KD * KD
    acts = e * b * t * (3 * c + c + c + H) + e * b * t * c  # q k v, g_in, gate_in, b_in; o out
    conv = e * b * 3 * c * ((nw - 1) + (t + nw - 1)) + 4 * 3 * c * nw  # state in, window out, weights
    return state * (1 + (t if all_states else 1)) + acts + conv + 4 * (H + c) + e * KD


def kda_inputs(t, n_rot, seed=0):
    rng = np.random.default_rng(seed)
    c, nw = H * KD, 4
    bf, f32 = jnp.bfloat16, jnp.float32
    r = lambda shape, s=1.0, dt=bf: jnp.asarray(s * rng.standard_normal(shape), f32).astype(dt)  # noqa: E731
    x = kda.KdaInputs(r((1, t, c)), r((1, t, c)), r((1, t, c)), r((1, t, H, KD)), r((1, t, H)), r((1, t, c)))
    w = kda.KdaWeights(r((c, nw), 0.5, f32), r((c, nw), 0.5, f32), r((c, nw), 0.5, f32), r((H,), 0.5, f32),
                       r((c,), 0.5, f32), r((KD,), 1.0))
    s = kda.KdaState(r((1, nw - 1, c)), r((1, nw - 1, c)), r((1, nw - 1, c)), r((1, H, KD, KD), 0.1, f32))
    recs = [jnp.asarray(0.1 * rng.standard_normal((1, H, KD, KD)), f32) for _ in range(n_rot)]
    return x, w, s, recs


def bench_kda(t, ceiling, n_rot=4 if SMOKE else 32, sweep=True):
    log(f"KDA verify T={t}: B 1, H {H}, K = V {KD}, all states out")
    x, w, s, recs = kda_inputs(t, n_rot, seed=t)
    nbytes = kda_bytes(t)
    want = kda.kda_verify(x, w, s, backend="reference")
    case = f"T={t}"

    def run(shared, rec, **kw):
        xx, ww, ss = shared
        return kda.kda_verify(xx, ww, ss._replace(recurrent=rec), **kw)

    def perturb(shared, eps):  # every activation depends on eps: no part of a call is hoisted
        xx, ww, ss = shared
        return kda.KdaInputs(*(_add_eps(a, eps) for a in xx)), ww, ss._replace(
            conv_q=_add_eps(ss.conv_q, eps), conv_k=_add_eps(ss.conv_k, eps), conv_v=_add_eps(ss.conv_v, eps))

    ref_us = time_jax(lambda sh, r: run(sh, r, backend="reference"), (x, w, s), recs, perturb)
    record("kda", case, "xla reference", ref_us, nbytes, ceiling)

    # A first sweep (2026-11-30) put BV 64 and 128 far behind (the serial chain of one program
    # grows with BV while the grid shrinks); fla's own tiling is BV 32 / 4 warps.
    configs = [(16, 4), (8, 2), (32, 4)]
    if sweep:
        configs += [(16, 2), (4, 2)]
    configs = [(bv, w) for bv, w in configs if bv <= KD]
    best = None
    for bv, nwarps in configs:
        if over_budget() and best is not None:
            log(f"  (budget) skipping BV={bv} warps={nwarps}")
            continue
        nwarps_eff = nwarps or kda.default_num_warps(KD, bv)
        cfg = f"pallas BV={bv} warps={nwarps_eff}"
        try:
            got = kda.kda_verify(x, w, s, bv=bv, num_warps=nwarps, backend=PALLAS)
            err = max(rel_err(got.o, want.o), rel_err(got.states, want.states))
            us = time_jax(lambda sh, r: run(sh, r, bv=bv, num_warps=nwarps, backend=PALLAS), (x, w, s), recs,
                          perturb)
            row = record("kda", case, cfg, us, nbytes, ceiling, err=f"{err:.1e}", vs_xla=round(ref_us / us, 2))
            if err < 2e-2 and (best is None or us < best["us"]):
                best = row | {"bv": bv, "warps": nwarps_eff}
        except Exception as exc:  # keep the rest of the sweep
            log(f"  FAILED {cfg}: {type(exc).__name__}: {str(exc)[:400]}")
    if best is not None and t > 1:
        bv, nwarps = best["bv"], best["warps"]
        us = time_jax(lambda sh, r: run(sh, r, bv=bv, num_warps=nwarps, all_states=False, backend=PALLAS),
                      (x, w, s), recs, perturb)
        record("kda", case, f"pallas BV={bv} warps={nwarps} final only", us, kda_bytes(t, False), ceiling)
    fla = {} if SMOKE else bench_fla(t, ceiling, n_rot)
    if best is not None:
        best["vs_fla"] = {k: round(v / best["us"], 2) for k, v in fla.items()}
        log(f"  best {best['config']}: {best['us']:.2f} us; fla / ours = {best['vs_fla']}")
    return best, fla


def bench_fla(t, ceiling, n_rot):
    """fla 0.6.0 fused_recurrent_kda: L2 norm, gate and beta in kernel; no conv, no gated norm."""
    res = {}
    try:
        import torch
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
    except Exception as exc:
        log(f"  fla unavailable: {type(exc).__name__}: {exc}")
        return res
    try:
        dev, bf = "cuda", torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(t)
        rn = lambda *shape, dt=bf: torch.randn(*shape, device=dev, generator=gen).to(dt)  # noqa: E731
        q, k, v, g = (rn(1, t, H, KD) for _ in range(4))
        beta = rn(1, t, H)
        a_log = rn(H, dt=torch.float32) * 0.5
        dt_bias = rn(H * KD, dt=torch.float32) * 0.5
        h0 = [rn(1, H, KD, KD, dt=torch.float32) * 0.1 for _ in range(n_rot)]
        kw = dict(A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        calls = [lambda i=i: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0[i], output_final_state=True,
                                                 **kw) for i in range(n_rot)]
        us = time_torch_graph(calls)
        fl_bytes = 4 * H * KD * KD * 2 + 2 * t * H * (4 * KD + 1) + 4 * (H + H * KD)
        record("fla", f"T={t}", "fused_recurrent_kda final state", us, fl_bytes, ceiling)
        res["final"] = us
        # Per-position states (what speculative verify needs): the continuous-batching path, each
        # token's state written in place to its own slot of a pool.
        pools = [rn(t, H, KD, KD, dt=torch.float32) * 0.1 for _ in range(n_rot)]
        idx = torch.arange(t, device=dev, dtype=torch.int32)[None]
        out = torch.empty_like(v)
        calls = [lambda i=i: fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=pools[i],
                                                     inplace_final_state=True, ssm_state_indices=idx, out=out,
                                                     **kw) for i in range(n_rot)]
        us = time_torch_graph(calls)
        record("fla", f"T={t}", "fused_recurrent_kda_fwd all states", us,
               fl_bytes + 4 * H * KD * KD * (t - 1), ceiling)
        res["all_states"] = us
    except Exception as exc:
        log(f"  fla FAILED: {type(exc).__name__}: {str(exc)[:600]}")
        log(traceback.format_exc()[-1500:])
    return res


# ----------------------------------------------------------------------------------------------
# MLA


def mla_bytes(t, length, b=1, e=2):
    return e * b * (length * (R + P) + t * MH * (R + P) + t * MH * R) + 4 * b


def mla_flops(t, length, b=1):
    return 2 * b * t * MH * length * (R + P + R)


def bench_mla(length, t, ceiling, mm_tflops=790.0, sweep=True):
    n_rot = 4 if SMOKE else int(min(64, max(8, math.ceil(256e6 / (length * (R + P) * 2)))))
    log(f"MLA decode L={length} T={t}: B 1, {MH} heads, R {R}, P {P}, {n_rot} rotating caches")
    key = jax.random.PRNGKey(length + t)
    ks = jax.random.split(key, 2 * n_rot + 2)
    bf = jnp.bfloat16
    ql = jax.random.normal(ks[0], (1, t, MH, R), jnp.float32).astype(bf)
    qr = jax.random.normal(ks[1], (1, t, MH, P), jnp.float32).astype(bf)
    caches = [(jax.random.normal(ks[2 + 2 * i], (1, length, R), bf),
               jax.random.normal(ks[3 + 2 * i], (1, length, P), bf)) for i in range(n_rot)]
    lengths = jnp.full((1,), length, jnp.int32)
    nbytes = mla_bytes(t, length)
    flop_floor_us = mla_flops(t, length) / (mm_tflops * 1e6)
    case = f"L={length // 1024}k T={t}" if length >= 1024 else f"L={length} T={t}"
    want = md.mla_decode(ql, qr, *caches[0], lengths, scale=MLA_SCALE, backend="reference")

    def run(shared, cache, **kw):
        q_lat, q_rope, lens = shared
        return md.mla_decode(q_lat, q_rope, cache[0], cache[1], lens, scale=MLA_SCALE, **kw)

    def perturb(shared, eps):  # every activation (and the lengths) depends on eps
        return tuple(_add_eps(a, eps) for a in shared)

    ref_us = time_jax(lambda sh, c: run(sh, c, backend="reference"), (ql, qr, lengths), caches, perturb)
    record("mla", case, "xla reference", ref_us, nbytes, ceiling, flop_floor_us=round(flop_floor_us, 2))

    def try_cfg(bm, bl, ns, nwarps, stages):
        cfg = f"pallas BM={bm} BL={bl} S={ns} w={nwarps} st={stages}"
        try:
            kw = dict(block_rows=bm, block_l=bl, num_splits=ns, num_warps=nwarps, num_stages=stages,
                      backend=PALLAS)
            err = rel_err(run((ql, qr, lengths), caches[0], **kw), want)
            us = time_jax(lambda sh, c: run(sh, c, **kw), (ql, qr, lengths), caches, perturb)
            return record("mla", case, cfg, us, nbytes, ceiling, err=f"{err:.1e}", vs_xla=round(ref_us / us, 2),
                          flop_floor_us=round(flop_floor_us, 2)) | {"ok": err < 3e-2}
        except Exception as exc:
            log(f"  FAILED {cfg}: {type(exc).__name__}: {str(exc)[:400]}")
            return None

    rows = t * MH
    bm0 = min(32, max(16, 1 << (rows - 1).bit_length()))  # mla_decode's default
    ns0 = md.default_num_splits(1, math.ceil(rows / bm0), length, 64)
    default = (bm0, 64, ns0, 4, 2)
    results = [try_cfg(*default)]
    if sweep:
        cands = [(bm0, 64, ns0, 8, 2), (bm0, 64, max(1, ns0 // 2), 4, 2), (bm0, 64, min(128, ns0 * 2), 4, 2),
                 (16, 64, ns0, 4, 2), (bm0, 32, ns0, 4, 3), (bm0, 64, ns0, 4, 1)]
        for cand in dict.fromkeys(c for c in cands if c != default):
            if over_budget():
                log(f"  (budget) skipping {cand}")
                continue
            results.append(try_cfg(*cand))
        if not over_budget():
            mla_parts(run, (ql, qr, lengths), caches, perturb, default, nbytes, ceiling, case)
    ok = [r for r in results if r is not None and r["ok"]]
    return min(ok, key=lambda r: r["us"]) if ok else None


def mla_parts(run, shared, caches, perturb, cfg, nbytes, ceiling, case):
    """Where the default's time goes: the split kernel alone, and chains of one and of two
    launches that do no work (one program per split, 16 floats each, nothing between them), timed
    the same way: what one launch costs, and what any split + combine pays before moving a byte."""
    from jax.experimental import pallas as pl

    bm, bl, ns, nwarps, stages = cfg
    kw = dict(scale=MLA_SCALE, block_rows=bm, block_l=bl, num_splits=ns, num_warps=nwarps, num_stages=stages,
              interpret=SMOKE)

    def split_only(sh, c):
        q_lat, q_rope, lens = sh
        return md._split(q_lat, q_rope, c[0], c[1], lens, **kw)

    record("mla", case, "· split kernel alone", time_jax(split_only, shared, caches, perturb), nbytes, ceiling)

    def bump(x_ref, tie_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.float32) + tie_ref[...].astype(jnp.float32)

    def launch(x, tie):  # x: 16 * ns elements (or more); tie: this call's cache, so no two calls are equal
        return pl.pallas_call(bump, grid=(ns,), in_specs=[pl.BlockSpec((16,), lambda i: (i,)),
                                                          pl.BlockSpec((16,), lambda i: (0,))],
                              out_specs=pl.BlockSpec((16,), lambda i: (i,)),
                              out_shape=jax.ShapeDtypeStruct((16 * ns,), jnp.float32), interpret=SMOKE)(x, tie)

    for n in (1, 2):
        def chain(sh, c, n=n):
            x, tie = sh[0].reshape(-1), c[1].reshape(-1)  # free reshapes: no XLA kernel before the first
            for _ in range(n):
                x = launch(x, tie)
            return x

        record("mla", case, f"· {n} launch(es) doing nothing", time_jax(chain, shared, caches, perturb), nbytes,
               ceiling)


# ----------------------------------------------------------------------------------------------


def main():
    log(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d %H:%M')}")
    ceiling = copy_ceiling()
    summary = {}
    short, mid, long = MLA_LENGTHS
    steps = [("kda", 6), ("mla", (mid, 1)), ("mla", (mid, 6)), ("kda", 1),
             ("mla", (long, 1)), ("mla", (short, 1)), ("mla", (long, 6)), ("mla", (short, 6))]
    only = os.environ.get("BENCH_ONLY")  # "kda" or "mla": one kernel's cases
    for kind, arg in steps:
        if only and kind != only:
            continue
        try:
            if kind == "kda":
                summary[f"kda T={arg}"] = bench_kda(arg, ceiling, sweep=arg > 1 and not over_budget())
            else:
                summary[f"mla L={arg[0]} T={arg[1]}"] = bench_mla(*arg, ceiling,
                                                                  sweep=arg[0] == mid and not over_budget())
        except Exception as exc:
            log(f"{kind} {arg} FAILED: {type(exc).__name__}: {str(exc)[:600]}")
            log(traceback.format_exc()[-2000:])
    with open(os.path.join(OUT, "attention.json"), "w") as f:
        json.dump(dict(ceiling_tbs=ceiling, rows=ROWS), f, indent=1, default=str)

    log("")
    log(f"== summary (H200, copy ceiling {ceiling:.2f} TB/s; floor = bytes / ceiling) ==")
    log(f"{'case':18s} {'best config':36s} {'us':>8s} {'TB/s':>6s} {'%floor':>7s} {'xXLA':>6s}  peer")
    for name, val in summary.items():
        if name.startswith("kda"):
            best, fla = val
            if best is None:
                log(f"{name:18s} (no passing config)")
                continue
            peer = ", ".join(f"fla {k} {v:.2f} us (x{v / best['us']:.2f})" for k, v in fla.items())
            log(f"{name:18s} {best['config']:36s} {best['us']:8.2f} {best['tbs']:6.2f} {best['pct_floor']:6.1f}% "
                f"{best['vs_xla']:6.2f}  {peer}")
        elif val is None:
            log(f"{name:18s} (no passing config)")
        else:
            log(f"{name:18s} {val['config']:36s} {val['us']:8.2f} {val['tbs']:6.2f} {val['pct_floor']:6.1f}% "
                f"{val['vs_xla']:6.2f}  flop floor {val['flop_floor_us']} us")
    log(f"targets: KDA T=6 < fla and <= 23.1 us (2 x 11.56); MLA 8k >= 60% of floor. wall {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()

"""bench.attention's MLA cases: MLA decode over a bf16 cache of 1k, 8k and 64k positions at T = 1 and 6,
the default plan and a sweep against the XLA reference, and where the default's time goes (the
split kernel alone, empty launches); floor: the bytes that must move over the copy ceiling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bench.attention_common import MH, MLA_SCALE, P, PALLAS, R, SMOKE, add_eps, log, over_budget, record, time_jax
from bench.common import rel_err
from pallas_kernels import mla_decode as md


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
        return tuple(add_eps(a, eps) for a in shared)

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
        return md.split_pass(q_lat, q_rope, c[0], c[1], lens, **kw)

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

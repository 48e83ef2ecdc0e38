"""bench.attention's KDA cases: the fused KDA verify (conv, delta rule, gated norm; all states or the
final one) at T = 1 and 6 against the XLA reference and fla's Triton `fused_recurrent_kda` (the
peer, under a torch CUDA graph); floor: the bytes that must move over the copy ceiling."""

from __future__ import annotations

import traceback

import jax.numpy as jnp
import numpy as np

from bench.attention_common import H, KD, PALLAS, SMOKE, add_eps, log, over_budget, record, time_jax
from bench.common import rel_err, time_torch_graph
from pallas_kernels import kda


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
        return kda.KdaInputs(*(add_eps(a, eps) for a in xx)), ww, ss._replace(
            conv_q=add_eps(ss.conv_q, eps), conv_k=add_eps(ss.conv_k, eps), conv_v=add_eps(ss.conv_v, eps))

    ref_us = time_jax(lambda sh, r: run(sh, r, backend="reference"), (x, w, s), recs, perturb)
    record("kda", case, "xla reference", ref_us, nbytes, ceiling)

    # A sweep put BV 64 and 128 far behind (the serial chain of one program
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

"""bench.kda_prefill_check's shared parts: the shapes (B, T, H, K = V, conv width W; --smoke sets
smaller ones here, as module attributes), the log, the rows and checks, the bytes that must move
(the floor, at the copy bandwidth measured in the same run) and the design bytes, the inputs, the
device-side loop timer (fori_loop of n calls, difference of two counts), the copy ceiling, the
check against the jnp reference, plan names and the table printed last.
"""

from __future__ import annotations

import time


from bench.common import rel_err, time_loop

B, T, H, KD, W = 1, 8192, 32, 128, 4
T_CHECK = 1024
T0 = time.time()
LOG = None
ROWS: list[dict] = []
CHECKS: list[dict] = []
COMPILED: list[dict] = []


def log(*a):
    s = f"[{time.time() - T0:6.1f}s] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    if LOG:
        LOG.write(s + "\n")
        LOG.flush()


def must_move_bytes(t, e=2):
    """q, k, v, g_in, gate_in read and o written (activation dtype), b_in, conv states, the fp32
    state in and out: what any implementation moves."""
    c = H * KD
    return e * t * (6 * c + H) + 2 * (4 * H * KD * KD) + 2 * e * 3 * (W - 1) * c


def design_bytes(t, bv, e=2, chunk=32):
    """must_move + the intermediates written and read (w, u, qg, kg, aqk in the activation dtype,
    gc fp32) + with BV < V the unfused norm's o (written and read once more)."""
    tp = -(-t // chunk) * chunk
    inter = e * tp * H * (4 * KD + chunk) + 4 * (tp // chunk) * H * KD
    return must_move_bytes(t, e) + 2 * inter + (2 * e * t * H * KD if bv < KD else 0)



def make_inputs(t, key, dtype):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kda

    c = H * KD
    ks = jax.random.split(key, 12)
    nrm = lambda k, shape, s=1.0, dt=dtype: (s * jax.random.normal(k, shape, jnp.float32)).astype(dt)  # noqa: E731
    x = kda.KdaInputs(nrm(ks[0], (B, t, c)), nrm(ks[1], (B, t, c)), nrm(ks[2], (B, t, c)), nrm(ks[3], (B, t, H, KD)),
                      nrm(ks[4], (B, t, H)), nrm(ks[5], (B, t, c)))
    w = kda.KdaWeights(nrm(ks[6], (c, W), 0.3, jnp.float32), nrm(ks[7], (c, W), 0.3, jnp.float32),
                       nrm(ks[8], (c, W), 0.3, jnp.float32), jnp.log(jnp.linspace(1.0, 16.0, H, dtype=jnp.float32)),
                       nrm(ks[9], (c,), 0.5, jnp.float32), jnp.ones((KD,), dtype))
    s = kda.KdaState(nrm(ks[10], (B, W - 1, c)), nrm(ks[11], (B, W - 1, c)), nrm(ks[10], (B, W - 1, c), 0.5),
                     nrm(ks[11], (B, H, KD, KD), 0.1, jnp.float32))
    return x, w, s, jnp.full((B,), t, jnp.int32)


def copy_ceiling():
    import jax.numpy as jnp

    a = jnp.zeros(((1 << 30) // 4,), jnp.uint32)
    us = time_loop(lambda _, c: c ^ jnp.uint32(1), (), a)
    return 2 * (1 << 30) / (us * 1e-6)  # read + write


def record(case, what, us, t, bv, ceiling, chunk=32, nbytes=None, **extra):
    """One timing; TB/s and the share of the floor over nbytes (a part's own bytes), else the
    layer's must-move bytes."""
    mm = nbytes or must_move_bytes(t)
    row = dict(case=case, what=what, us=us, tbs=mm / (us * 1e-6) / 1e12, floor_pct=100 * mm / ceiling / (us * 1e-6),
               design_floor_us=design_bytes(t, bv, chunk=chunk) / ceiling * 1e6 if bv else None, **extra)
    ROWS.append(row)
    log(f"  {case:9s} {what:48s} {us:9.1f} µs  {row['tbs']:.2f} TB/s  {row['floor_pct']:.0f}% of floor")
    return row



def check(gate, t, backend, plan=None):
    import jax

    from pallas_kernels import kda_prefill as kp

    x, w, s, valid = make_inputs(t, jax.random.PRNGKey(t), jax.numpy.bfloat16)
    o, st = kp.kda_prefill(x, w, s, valid, gate=gate, plan=plan, backend=backend)
    o_ref, st_ref = jax.jit(lambda *a: kp.reference(*a, gate=gate))(x, w, s, valid)
    rec = dict(gate=gate, t=t, o=rel_err(o, o_ref), state=rel_err(st.recurrent, st_ref.recurrent),
               conv=max(rel_err(a, b) for a, b in zip(st[:3], st_ref[:3])),
               plan="default" if plan is None else plan_name(plan))
    CHECKS.append(rec)
    log(f"  check {gate} T={t} {rec['plan']}: rel err o {rec['o']:.2e}, state {rec['state']:.2e}, "
        f"conv {rec['conv']:.1e}")
    return rec



def parse_plan(spec: str) -> dict:
    """'bv=16,state_stages=4' -> {'bv': 16, 'state_stages': 4}: Plan fields, ints, bools or strings."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        out[key] = int(val) if val.lstrip("-").isdigit() else {"true": True, "false": False}.get(val.lower(), val)
    return out


def plan_name(p):
    dots = "hi+lo" if p.state_hi_lo else "rounded"
    return f"(intra {p.intra_warps}w {p.precision}; state BV {p.bv} {p.state_warps}w {p.state_stages}s {dots})"



def table():
    print("\n| gate | what | µs/layer | TB/s (must-move) | % of floor | design floor µs | vs fla |")
    print("|---|---|---|---|---|---|---|")
    for gate in sorted({r["case"] for r in ROWS}):
        rows = [r for r in ROWS if r["case"] == gate]
        fla = next((r["us"] for r in rows if r["what"].startswith("fla")), None)
        for r in rows:
            vs = f"{fla / r['us']:.2f}x" if fla else "—"
            d = f"{r['design_floor_us']:.0f}" if r["design_floor_us"] else ""
            print(f"| {gate} | {r['what']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['floor_pct']:.0f}% | {d} | {vs} |")
    for c in CHECKS:
        print(f"check {c['gate']} T={c['t']} {c['plan']}: rel err o {c['o']:.2e}, state {c['state']:.2e}, "
              f"conv {c['conv']:.1e}")


"""The KDA prefill kernels (interpret mode) against their jnp reference (the model's chunked form),
the reference against a float64 token loop of the equations, prefill followed by the decode
kernel against one longer prefill, and the kernels' lowering for the GPU (Triton IR, offline).
Fresh random inputs every run (the seed is in the failure message). Interpret mode fills every
output with NaN before the kernel runs, so an element the kernels never write fails the
finiteness check."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda, kda_reference
from pallas_kernels import kda_prefill as kp
from test_kda_kernel import make_inputs, token_loop
from backends import KERNELS

H, K = 2, 32  # heads, head dim (K = V): BV 16 takes the unfused norm, BV 32 the fused one


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


def _close(a, b, tol, msg):
    a, b = np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32))
    assert a.shape == b.shape, msg
    assert np.all(np.isfinite(a)), f"non-finite (unwritten?) elements: {msg}"
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err <= tol, f"{msg}: max error {err:.2e} > {tol:.0e}"


def _rows(x, b, t0, t1):
    """Rows t0..t1 of sequence b of every per-token array of KdaInputs."""
    return kda.KdaInputs(*(a[b:b + 1, t0:t1] for a in x))


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_reference_matches_token_loop(gate):
    """The specification itself: the chunked form over 3 chunks with ragged valid lengths and a
    nonzero initial state equals the per-token equations, and so does the state it returns."""
    seed = _seed()
    b, t, chunk = 2, 37, 16
    x, w, s = make_inputs(seed, b=b, t=t, h=H, kd=K)
    valid = np.array([t, 20])
    o, new = kp.kda_prefill(x, w, s, jnp.asarray(valid), gate=gate, chunk=chunk, backend="reference")
    for bi, n in enumerate(valid):
        sb = kda.KdaState(*(a[bi:bi + 1] for a in s))
        o_loop, states = token_loop(_rows(x, bi, 0, n), w, sb, gate=gate)
        msg = f"{gate} seq {bi} seed {seed}"
        _close(o[bi:bi + 1, :n], o_loop, 2e-5, "o " + msg)
        _close(new.recurrent[bi:bi + 1], states[:, -1], 2e-5, "state " + msg)
        for got, xin, cs in ((new.conv_q, x.q, s.conv_q), (new.conv_k, x.k, s.conv_k), (new.conv_v, x.v, s.conv_v)):
            window = np.concatenate([np.asarray(cs[bi]), np.asarray(xin[bi, :n])], 0)
            np.testing.assert_array_equal(np.asarray(got[bi]), window[n:n + 3], err_msg="conv " + msg)


# (T, gate, chunk, BV, dtype, hi_lo): T = 1, not a multiple of the chunk, a multiple, several chunks;
# both gates, both norm paths (BV 16 < V: the norm pass; BV 32 = V: fused), fp32 and bf16.
# hi_lo False: the bf16 state kernel's dots take the state rounded to bf16 (one dot, as fla).
CASES = [
    (1, "safe", 64, 16, jnp.float32, True),
    (37, "softplus", 32, 32, jnp.float32, True),
    (37, "safe", 32, 16, jnp.bfloat16, True),
    (130, "safe", 64, 32, jnp.float32, True),
    (130, "softplus", 64, 16, jnp.bfloat16, True),
    (130, "safe", 32, 32, jnp.bfloat16, False),
    (130, "safe", 32, 16, jnp.bfloat16, False),
    (64, "safe", 32, 32, jnp.bfloat16, False),  # T a multiple of the chunk: the intra kernel's unmasked loads
    (64, "softplus", 32, 16, jnp.float32, True),
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("t,gate,chunk,bv,dtype,hi_lo", CASES)
def test_interpret_matches_reference(backend, t, gate, chunk, bv, dtype, hi_lo):
    """B = 3, ragged: one full sequence, one cut short, one slot sitting out (valid 0, its state
    must come back unchanged); nonzero initial recurrent and conv states."""
    seed = _seed()
    x, w, s = make_inputs(seed, b=3, t=t, dtype=dtype, h=H, kd=K)
    valid = jnp.asarray([t, (t + 1) // 2, 0])
    plan = dataclasses.replace(kp.default_plan(K, dtype), bv=bv, state_hi_lo=hi_lo)  # bf16: the dots' bf16
    # operands (interpret too)
    got_o, got = kp.kda_prefill(x, w, s, valid, gate=gate, chunk=chunk, plan=plan, backend=backend)
    want_o, want = kp.kda_prefill(x, w, s, valid, gate=gate, chunk=chunk, backend="reference")
    msg = f"T={t} gate={gate} chunk={chunk} BV={bv} {jnp.dtype(dtype).name} hi_lo={hi_lo} seed {seed}"
    assert got_o.dtype == dtype and got.recurrent.dtype == jnp.float32
    # o is specified on each sequence's valid rows; rows past valid[b] are padding that callers
    # discard, checked finite only (bf16: one differed from the reference by 3.9e-2 of max |o|
    # on both forms of the state kernel's dots, where valid rows stay ≤ 1.0e-2).
    assert np.all(np.isfinite(np.asarray(got_o, np.float32))), "non-finite (unwritten?) o: " + msg
    real = (jnp.arange(t)[None, :] < valid[:, None])[:, :, None, None]
    # The gated norm divides each row by its rms: an error of o before it grows by 1/rms, so rows
    # whose rms lies below the median are compared scaled by rms / median (seed 156896, T 64,
    # bf16: a row at a small rms came out 7.9e-2 off after the norm, with the code of 2026-12-01
    # too; the hi + lo state dots changed nothing).
    # fp32: rounding level (40 seeds: o ≤ 2e-5). bf16: the kernels keep their intermediates in
    # bf16 and o is rounded twice (before and after the norm, as the model): a few bf16 ulps (40
    # seeds at T 130, BV 32, either form of the state kernel's dots: o ≤ 1.0e-2, state ≤ 6.7e-3).
    pre, _ = kp.reference_delta(x, w, s, valid, gate=gate, chunk=chunk)
    rms = np.sqrt(np.mean(np.asarray(pre, np.float64) ** 2, axis=-1, keepdims=True))  # [B, T, H, 1]
    scale = np.minimum(1.0, rms / np.median(rms[np.broadcast_to(np.asarray(real), rms.shape)]))
    # Compiled fp32 (the GPU's dots at their own operand precision): o ≤ 4.5e-4 measured on the H200.
    fp32 = 1e-4 if backend == "interpret" else 1e-3
    _close(jnp.where(real, got_o, 0) * scale, jnp.where(real, want_o, 0) * scale,
           fp32 if dtype == jnp.float32 else 3e-2, "o " + msg)
    _close(got.recurrent, want.recurrent, fp32 if dtype == jnp.float32 else 2e-2, "state " + msg)
    np.testing.assert_array_equal(np.asarray(got.recurrent[2]), np.asarray(s.recurrent[2]), err_msg="valid 0 " + msg)
    for name in ("conv_q", "conv_k", "conv_v"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name), np.float32),
                                      np.asarray(getattr(want, name), np.float32), err_msg=name + " " + msg)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("t,dtype", [(1, jnp.float32), (37, jnp.bfloat16), (64, jnp.float32)])
def test_conv_and_norm_passes(backend, t, dtype):
    """The conv pass over q, k and v in one launch (rows past a block edge, the conv state reached
    by block 0, T not a multiple of its rows, ragged valid lengths down to 0 and 1: the conv state
    after them partly the old one) against the model's `causal_conv`, `l2_normalize` and
    `conv_state_after`, and the norm pass against `kda_reference.gated_norm` of the rounded o; outputs start
    as NaN in interpret mode, so every element checked was written."""
    seed = _seed()
    b = 4
    x, w, s = make_inputs(seed, b=b, t=t, dtype=dtype, h=H, kd=K)
    valid = jnp.asarray([t, (t + 1) // 2, 0, 1])
    msg = f"T={t} {jnp.dtype(dtype).name} seed {seed}"
    tol = 1e-6 if dtype == jnp.float32 else 2.0**-8  # one rounding to the activation dtype apart at most
    projections = (("q", x.q, s.conv_q, w.conv_q, K**-0.5), ("k", x.k, s.conv_k, w.conv_k, 1.0),
                   ("v", x.v, s.conv_v, w.conv_v, None))
    for block_t in (kp.CONV_ROWS, 8):
        xc, rn, conv = kp.conv_pass(x, w, s, valid, interpret=backend == "interpret", block_t=block_t)
        for (name, xin, cs, wt, scale), got, got_rn, got_state in zip(projections, (xc.q, xc.k, xc.v),
                                                                      rn + (None,), conv):
            m = f"{name} {msg}, {block_t} rows"
            want, window = kp.causal_conv(xin, cs, wt)
            _close(got, want, tol, "conv " + m)
            if scale is not None:
                norms = np.linalg.norm(np.asarray(got, np.float64).reshape(b, t, H, K), axis=-1)  # eps: negligible
                np.testing.assert_allclose(np.asarray(got_rn), scale / norms.transpose(0, 2, 1), rtol=1e-5,
                                           err_msg="norm factors " + m)
            want_state = kp.conv_state_after(window, valid, cs.shape[1])
            assert got_state.dtype == want_state.dtype, m
            np.testing.assert_array_equal(np.asarray(got_state, np.float32), np.asarray(want_state, np.float32),
                                          err_msg="conv state " + m)
    # The norm pass at its defaults, and programs of 2 steps of 8 rows (steps past T, programs past T)
    o = x.v.reshape(b, t, H, K)
    want_o = kda_reference.gated_norm(o.astype(jnp.float32), x.gate_in.reshape(b, t, H, K), w.o_norm, 1e-6)
    for rows, steps in ((kp.NORM_ROWS, kp.NORM_STEPS), (8, 2)):
        got = kp.norm_pass(o, x.gate_in, w.o_norm, eps=1e-6, interpret=backend == "interpret", block_t=rows,
                            n_steps=steps)
        _close(got, want_o, 1e-5 if dtype == jnp.float32 else 2.0**-7,
               f"gated norm {msg}, {steps} steps of {rows} rows")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_bf16_operand_dots(backend, gate):
    """Plan precision "bf16" rounds the dots' operands to bf16 in interpret mode too (where the
    other precisions all run as fp32): with fp32 activations it differs from "tf32" and stays
    within bf16-operand error of the reference. o is judged by its relative Frobenius error (31
    seeds: ≤ 7.7e-3 safe, ≤ 3.0e-3 softplus) and, loosely, by its largest element error: a token
    whose pre-norm output nearly cancels has its bf16 error scaled up by the gated norm (safe gate:
    one row of 114 at 16%, 3.2e-2 of max |o|), so a per-element bound at bf16 precision is flaky."""
    seed = _seed()
    t, chunk = 37, 32
    x, w, s = make_inputs(seed, b=2, t=t, h=H, kd=K)
    valid = jnp.asarray([t, 20])
    want_o, want = kp.kda_prefill(x, w, s, valid, gate=gate, chunk=chunk, backend="reference")
    runs = {p: kp.kda_prefill(x, w, s, valid, gate=gate, chunk=chunk, plan=kp.Plan(bv=K, precision=p),
                              backend=backend) for p in ("tf32", "bf16")}
    msg = f"gate={gate} seed {seed}"
    real = (jnp.arange(t)[None, :] < valid[:, None])[:, :, None, None]
    got_o, got = runs["bf16"]
    got_o, want_o = (np.asarray(jnp.where(real, o, 0)) for o in (got_o, want_o))
    frob = np.linalg.norm(got_o - want_o) / np.linalg.norm(want_o)
    assert frob <= 2e-2, f"bf16 o {msg}: relative Frobenius error {frob:.2e} > 2e-2"
    _close(got_o, want_o, 1e-1, "bf16 o " + msg)
    _close(got.recurrent, want.recurrent, 2e-2, "bf16 state " + msg)
    assert np.max(np.abs(np.asarray(got.recurrent) - np.asarray(runs["tf32"][1].recurrent))) > 0, \
        "bf16 operands changed nothing: " + msg


@pytest.mark.parametrize("backend", KERNELS)
def test_prefill_then_decode_equals_longer_prefill(backend):
    """Chunked prefill over a ragged batch, then 3 tokens through the decode kernel from the
    returned state: the decode outputs and final state equal one reference prefill of each
    sequence's valid prefix followed by those tokens."""
    seed = _seed()
    t1, t2, chunk = 70, 3, 32
    x, w, s = make_inputs(seed, b=2, t=t1 + t2, h=H, kd=K)
    valid = np.array([t1, 45])
    first = kda.KdaInputs(*(a[:, :t1] for a in x))
    _, mid = kp.kda_prefill(first, w, s, jnp.asarray(valid), chunk=chunk, backend=backend)
    nxt = kda.KdaInputs(*(a[:, t1:] for a in x))
    out = kda.kda_verify(nxt, w, mid, all_states=False, backend=backend)
    for bi, n in enumerate(valid):
        seq = kda.KdaInputs(*(jnp.concatenate([a[bi:bi + 1, :n], a[bi:bi + 1, t1:]], 1) for a in x))
        sb = kda.KdaState(*(a[bi:bi + 1] for a in s))
        o_ref, st_ref = kp.kda_prefill(seq, w, sb, jnp.asarray([n + t2]), chunk=chunk, backend="reference")
        msg = f"seq {bi} (valid {n}) seed {seed}"
        tol = 1e-4 if backend == "interpret" else 1e-3  # compiled: the GPU's dot precision (H200: 1.8e-4)
        _close(out.o[bi:bi + 1], o_ref[:, n:], tol, "decode o " + msg)
        _close(out.states[bi:bi + 1], st_ref.recurrent, tol, "state " + msg)


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_lowers_for_gpu(gate):
    """At Ling's shapes (B 1, T 8192, H 32, K = V = 128, bf16) both kernels lower through Pallas'
    Triton backend (no GPU needed); bench/kda_prefill_check.py --lower also compiles the Triton
    IR for sm_90a where triton imports."""
    sds = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    b, t, h, d, c = 1, 8192, 32, 128, 32 * 128
    x = kda.KdaInputs(sds((b, t, c), bf), sds((b, t, c), bf), sds((b, t, c), bf), sds((b, t, h, d), bf),
                      sds((b, t, h), bf), sds((b, t, c), bf))
    w = kda.KdaWeights(sds((c, 4), f32), sds((c, 4), f32), sds((c, 4), f32), sds((h,), f32), sds((c,), f32),
                       sds((d,), bf))
    s = kda.KdaState(sds((b, 3, c), bf), sds((b, 3, c), bf), sds((b, 3, c), bf), sds((b, h, d, d), f32))

    def run(x, w, s, valid):
        return kp.kda_prefill(x, w, s, valid, gate=gate, backend="pallas")

    text = jax.jit(run).trace(x, w, s, sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    kernels = 3 + (kp.default_plan(d, bf).bv < d)  # conv pass, intra, state, (norm pass)
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == kernels


def test_rejects_bad_shapes_and_options():
    x, w, s = make_inputs(0, b=1, t=8, h=2, kd=24)  # K = 24: not a power of two
    with pytest.raises(ValueError, match="powers of two"):
        kp.kda_prefill(x, w, s, jnp.asarray([8]), backend="interpret")
    x, w, s = make_inputs(0, b=1, t=8, h=2, kd=16)
    with pytest.raises(ValueError, match="chunk"):
        kp.kda_prefill(x, w, s, jnp.asarray([8]), chunk=16, backend="interpret")
    with pytest.raises(ValueError, match="gate"):
        kp.kda_prefill(x, w, s, jnp.asarray([8]), gate="sigmoid", backend="interpret")

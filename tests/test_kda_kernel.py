"""The fused KDA verify kernel (interpret mode) against its jnp reference, and the reference against
a plain per-token loop of the equations. Fresh random inputs every run (the seed is in the
failure message). Interpret mode fills every output with NaN before the kernel runs (jax's
`uninitialized_value`), so an element the kernel never writes fails the finiteness check."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels import kda
from backends import KERNELS

H, K, W = 2, 16, 4  # heads, head dim (K = V), conv width


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


def make_inputs(seed, b, t, *, dtype=jnp.float32, h=H, kd=K, nw=W):
    rng = np.random.default_rng(seed)
    c = h * kd

    def rnd(shape, scale=1.0, dt=dtype):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dt)

    x = kda.KdaInputs(q=rnd((b, t, c)), k=rnd((b, t, c)), v=rnd((b, t, c)), g_in=rnd((b, t, h, kd)),
                      b_in=rnd((b, t, h)), gate_in=rnd((b, t, c)))
    w = kda.KdaWeights(conv_q=rnd((c, nw), 0.5, jnp.float32), conv_k=rnd((c, nw), 0.5, jnp.float32),
                       conv_v=rnd((c, nw), 0.5, jnp.float32), A_log=rnd((h,), 0.5, jnp.float32),
                       dt_bias=rnd((c,), 0.5, jnp.float32), o_norm=rnd((kd,), 1.0, dtype))
    s = kda.KdaState(conv_q=rnd((b, nw - 1, c)), conv_k=rnd((b, nw - 1, c)), conv_v=rnd((b, nw - 1, c)),
                     recurrent=rnd((b, h, kd, kd), 0.3, jnp.float32))
    return x, w, s


def token_loop(x, w, s, *, gate, eps=1e-6, lower_bound=-5.0):
    """The equations, one sequence, token and head at a time, in float64 numpy."""
    f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    q_in, k_in, v_in, g_in, b_in, gate_in = map(f, x)
    cq, ck, cv, a_log, dt_bias, w_norm = map(f, w)
    sq, sk, sv, rec = map(f, s)
    b, t, c = q_in.shape
    h = b_in.shape[2]
    kd = c // h
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    o = np.zeros((b, t, h, kd))
    states = np.zeros((b, t, h, kd, kd))
    for bi in range(b):
        hist = [sq[bi].copy(), sk[bi].copy(), sv[bi].copy()]  # [W-1, C] each, oldest first
        S = rec[bi].copy()  # [H, K, V]
        for ti in range(t):
            conv = []
            for j, (xin, wt) in enumerate(((q_in, cq), (k_in, ck), (v_in, cv))):
                win = np.concatenate([hist[j], xin[bi, ti][None]], 0)  # [W, C]
                y = np.sum(win.T * wt, axis=1)  # [C]
                conv.append(y * sig(y))
                hist[j] = win[1:]
            for hi in range(h):
                sl = slice(hi * kd, (hi + 1) * kd)
                qh, kh, vh = conv[0][sl], conv[1][sl], conv[2][sl]
                qh = qh / np.sqrt(np.sum(qh * qh) + 1e-6) * kd ** -0.5
                kh = kh / np.sqrt(np.sum(kh * kh) + 1e-6)
                z = g_in[bi, ti, hi] + dt_bias[sl]
                if gate == "safe":
                    g = lower_bound * sig(np.exp(a_log[hi]) * z)
                else:
                    g = -np.exp(a_log[hi]) * np.log1p(np.exp(z))
                beta = sig(b_in[bi, ti, hi])
                Sp = np.exp(g)[:, None] * S[hi]
                S[hi] = Sp + beta * np.outer(kh, vh - Sp.T @ kh)
                oh = S[hi].T @ qh
                oh = oh / np.sqrt(np.mean(oh * oh) + eps) * w_norm * sig(gate_in[bi, ti, sl])
                o[bi, ti, hi] = oh
            states[bi, ti] = S
    return o, states


def _close(a, b, tol, msg):
    a, b = np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32))
    assert a.shape == b.shape, msg
    assert np.all(np.isfinite(a)), f"non-finite (unwritten?) elements: {msg}"
    err = np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))
    assert err <= tol, f"{msg}: max error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_reference_matches_token_loop(gate):
    seed = _seed()
    x, w, s = make_inputs(seed, b=2, t=5)
    out = kda.kda_verify(x, w, s, gate=gate, backend="reference")
    o, states = token_loop(x, w, s, gate=gate)
    _close(out.o, o, 2e-5, f"o, seed {seed}")
    _close(out.states, states, 2e-5, f"states, seed {seed}")
    for win, xin, cs in ((out.window_q, x.q, s.conv_q), (out.window_k, x.k, s.conv_k), (out.window_v, x.v, s.conv_v)):
        np.testing.assert_array_equal(np.asarray(win), np.concatenate([np.asarray(cs), np.asarray(xin)], 1))


# T = 1..8, each with a different gate / V-block / dtype mix; BV = V (16) takes the fused-norm path.
CASES = [(1, "safe", 16, jnp.float32), (2, "softplus", 4, jnp.bfloat16), (3, "safe", 8, jnp.float32),
         (4, "softplus", 16, jnp.bfloat16), (5, "safe", 4, jnp.bfloat16), (6, "softplus", 8, jnp.float32),
         (7, "safe", 16, jnp.float32), (8, "softplus", 8, jnp.bfloat16)]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("t,gate,bv,dtype", CASES)
def test_interpret_matches_reference(backend, t, gate, bv, dtype):
    seed = _seed()
    x, w, s = make_inputs(seed, b=3, t=t, dtype=dtype)
    got = kda.kda_verify(x, w, s, gate=gate, bv=bv, backend=backend)
    want = kda.kda_verify(x, w, s, gate=gate, backend="reference")
    msg = f"T={t} gate={gate} BV={bv} {jnp.dtype(dtype).name} seed {seed}"
    # o is rounded once to the activation dtype: one bf16 ulp of slack there.
    _close(got.o, want.o, 1e-5 if dtype == jnp.float32 else 1e-2, "o " + msg)
    _close(got.states, want.states, 1e-5, "states " + msg)
    for name in ("window_q", "window_k", "window_v"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name), np.float32),
                                      np.asarray(getattr(want, name), np.float32), err_msg=name + " " + msg)


@pytest.mark.parametrize("backend", KERNELS)
def test_final_state_only(backend):
    seed = _seed()
    x, w, s = make_inputs(seed, b=2, t=4)
    got = kda.kda_verify(x, w, s, bv=8, all_states=False, backend=backend)
    want = kda.kda_verify(x, w, s, backend="reference")
    assert got.states.shape == s.recurrent.shape
    _close(got.states, want.states[:, -1], 1e-5, f"final state, seed {seed}")
    _close(got.o, want.o, 1e-5, f"o, seed {seed}")


@pytest.mark.parametrize("backend", KERNELS)
def test_commit_equals_shorter_step(backend):
    """The state committed at n accepted tokens equals the state of a step over those n tokens."""
    seed = _seed()
    t = 6
    x, w, s = make_inputs(seed, b=2, t=t)
    out = kda.kda_verify(x, w, s, bv=8, backend=backend)
    n_acc = np.array([2, 6])
    committed = kda.commit(out, jnp.asarray(n_acc))
    for bi, n in enumerate(n_acc):
        xb = kda.KdaInputs(*(a[bi:bi + 1, :n] for a in x))
        sb = kda.KdaState(*(a[bi:bi + 1] for a in s))
        ref = kda.kda_verify(xb, w, sb, backend="reference")
        _close(committed.recurrent[bi:bi + 1], ref.states[:, -1], 1e-5, f"recurrent n={n} seed {seed}")
        for got_c, win in ((committed.conv_q, ref.window_q), (committed.conv_k, ref.window_k),
                           (committed.conv_v, ref.window_v)):
            np.testing.assert_array_equal(np.asarray(got_c[bi:bi + 1]), np.asarray(win[:, n:]))


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
@pytest.mark.parametrize("t", [1, 3])
def test_decode_commits_in_the_kernel(backend, t):
    """kda_decode's state after valid[b] ∈ 0..T tokens (the initial state at 0) equals a step over
    those tokens alone; its o equals kda_verify's; under jit with the state donated, the
    recurrent state's buffer is written in place."""
    seed = _seed()
    b = 4
    x, w, s = make_inputs(seed, b=b, t=t)
    valid = np.array([t, 0, min(1, t), t - 1 if t > 1 else 1])
    o, new = kda.kda_decode(x, w, s, jnp.asarray(valid), bv=8, backend=backend)
    want = kda.kda_verify(x, w, s, backend="reference")
    _close(o, want.o, 1e-5, f"o, seed {seed}")
    for bi, n in enumerate(valid):
        sb = kda.KdaState(*(a[bi:bi + 1] for a in s))
        if n == 0:
            rec, conv = sb.recurrent, sb[:3]
        else:
            ref = kda.kda_verify(kda.KdaInputs(*(a[bi:bi + 1, :n] for a in x)), w, sb, backend="reference")
            rec, conv = ref.states[:, -1], (ref.window_q[:, n:], ref.window_k[:, n:], ref.window_v[:, n:])
        _close(new.recurrent[bi:bi + 1], rec, 1e-5, f"recurrent, valid {n}, seed {seed}")
        for got_c, want_c in zip(new[:3], conv):
            np.testing.assert_array_equal(np.asarray(got_c[bi:bi + 1]), np.asarray(want_c))

    step = jax.jit(lambda s, x, v: kda.kda_decode(x, w, s, v, bv=8, backend=backend), donate_argnums=0)
    before = s.recurrent.unsafe_buffer_pointer()
    _, again = step(s, x, jnp.asarray(valid))
    if backend != "reference":  # the kernel aliases the state; the reference's XLA select need not
        assert again.recurrent.unsafe_buffer_pointer() == before
    _close(again.recurrent, new.recurrent, 0 if backend != "reference" else 1e-6, f"donated, seed {seed}")


@pytest.mark.parametrize("t", [1, 6, 16, 17, 40])
def test_conv_state_after_cuts_each_slots_window(t):
    """Short windows are cut by selects, long ones by a gather: both give window[b, n : n + W-1]
    for every slot's own n in 0..T."""
    from pallas_kernels.kda_reference import conv_state_after

    rng = np.random.default_rng(_seed())
    state_len, b = 3, 8
    window = rng.standard_normal((b, state_len + t, 5)).astype(np.float32)
    n = rng.integers(0, t + 1, b)
    n[:3] = (0, t, t // 2)
    got = np.asarray(conv_state_after(jnp.asarray(window), jnp.asarray(n, jnp.int32), state_len))
    want = np.stack([window[i, c:c + state_len] for i, c in enumerate(n)])
    np.testing.assert_array_equal(got, want)


def test_auto_is_reference_on_cpu():
    assert jax.default_backend() != "cpu" or kda.resolve("auto") == "reference"
    with pytest.raises(ValueError):
        kda.resolve("xla")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("t,bv", [(1, 8), (6, 16)])
def test_columns_of_a_fused_projection(backend, t, bv):
    """Inputs given as `Columns` of one wider array (a fused projection's output, fields in a
    shuffled order with padding between them) give the same step as separate arrays."""
    seed = _seed()
    x, w, s = make_inputs(seed, b=2, t=t, dtype=jnp.bfloat16)
    b, c = x.q.shape[0], x.q.shape[2]
    flat = [x.q, x.k, x.v, x.g_in.reshape(b, t, c), x.b_in, x.gate_in]
    pieces, starts, at = [], {}, 0
    for i in [5, 0, 3, 4, 2, 1]:
        starts[i] = at
        n = flat[i].shape[2]
        gap = K + (-n) % K  # padding that keeps the next start a multiple of K (and of BV)
        pieces += [flat[i], jnp.zeros((b, t, gap), x.q.dtype)]
        at += n + gap
    proj = jnp.concatenate(pieces, axis=2)
    cols = kda.KdaInputs(*(kda.Columns(proj, starts[i], flat[i].shape[2]) for i in range(6)))
    got = kda.kda_verify(cols, w, s, bv=bv, backend=backend)
    want = kda.kda_verify(x, w, s, bv=bv, backend=backend)
    ref = kda.kda_verify(cols, w, s, backend="reference")
    for name in kda.KdaOut._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, name), np.float32),
                                      np.asarray(getattr(want, name), np.float32), err_msg=f"{name} seed {seed}")
    _close(ref.o, want.o, 1e-2, f"reference on Columns, seed {seed}")
    with pytest.raises(ValueError, match="q starts at column"):
        kda.kda_verify(x._replace(q=kda.Columns(proj, starts[0] + 1, c)), w, s, bv=bv, backend=backend)


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
@pytest.mark.parametrize("t", [1, 3])
def test_slot_rows_step_the_named_slots_in_place(backend, t):
    """kda_decode over rows of a larger state (`slot_rows`, the last row padding) equals it over
    those slots gathered, the other slots and the padding row's slot untouched; under jit with
    the state donated the kernels write the whole state in place. kda_verify reads the rows'
    slots as the gathered call does."""
    seed = _seed()
    n, b = 6, 4
    x, w, _ = make_inputs(seed, b=b, t=t)
    _, _, full = make_inputs(seed + 1, b=n, t=t)
    rows = jnp.asarray([4, 1, 2, n], jnp.int32)  # slot 5 idle, the last row padding (reads slot 5)
    valid = jnp.asarray([t, 0, 1, t])
    gathered = kda.KdaState(*(a[jnp.minimum(rows, n - 1)] for a in full))
    o_want, want = kda.kda_decode(x, w, gathered, valid, bv=8, backend="reference")
    o, got = kda.kda_decode(x, w, full, valid, bv=8, rows=rows, backend=backend)
    _close(o[:3], o_want[:3], 1e-5, f"o, seed {seed}")
    for g, f, wt in zip(got, full, want):
        assert g.shape == f.shape
        _close(g[np.array([4, 1, 2])], wt[:3], 1e-5, f"stepped slots, seed {seed}")
        np.testing.assert_array_equal(np.asarray(g[np.array([0, 3, 5])]), np.asarray(f[np.array([0, 3, 5])]))
    verify = kda.kda_verify(x, w, full, rows=rows, bv=8, backend=backend)
    _close(verify.states, kda.kda_verify(x, w, gathered, backend="reference").states, 1e-5, f"verify, seed {seed}")

    step = jax.jit(lambda s, x, v, r: kda.kda_decode(x, w, s, v, bv=8, rows=r, backend=backend), donate_argnums=0)
    before = [a.unsafe_buffer_pointer() for a in full]
    _, again = step(full, x, valid, rows)
    if backend != "reference":
        assert [a.unsafe_buffer_pointer() for a in again] == before
    _close(again.recurrent, got.recurrent, 0 if backend != "reference" else 1e-6, f"donated, seed {seed}")

"""Fused KDA decode / verify step: conv update + gated delta rule + gated RMSNorm, T = 1..8 tokens.

One call advances B sequences by T tokens through one KDA layer (between the projections and
o_proj). `kda_verify` returns, besides the outputs, the recurrent state after *every* position and
the raw conv inputs of the window, so that a speculative engine commits any accepted length n
(1..T) by indexing (`commit`), with no recomputation. `kda_decode` commits in the kernel: the
state after valid[b] tokens, written over the old one.

Per head h (K = V = head dim), token t, all math in fp32 (inputs are upcast on load):
  q, k, v = SiLU(causal depthwise conv_W(x)) over the window [conv state (W-1 rows) | T new rows]
  q̂ = K^-1/2 q / sqrt(Σq² + 1e-6),  k̂ = k / sqrt(Σk² + 1e-6)
  g = lower_bound σ(exp(A_log_h) (g_in + dt_bias))        gate="safe"      (Ling, lower_bound -5)
  g = -exp(A_log_h) softplus(g_in + dt_bias)               gate="softplus"  (Kimi)
  β = σ(b_in)
  S' = diag(exp g) S;  S = S' + β k̂ (v - S'ᵀ k̂)ᵀ;  o = Sᵀ q̂            S [K, V] fp32
  y = o / sqrt(mean_V(o²) + eps) · w_norm · σ(gate_in)
Rounding: the conv output is kept in fp32 (never rounded to the activation dtype) and the norm
reads the fp32 o; y is rounded once, to q's dtype.

Layouts (C = H*K):
  q, k, v            [B, T, C]        pre-conv projections (bf16 or fp32)
  g_in               [B, T, H, K]     raw f_proj output;  b_in [B, T, H];  gate_in [B, T, H*V]
  Any of these may instead be `Columns` of a wider [B, T, N] array (a fused projection's output):
  the kernel reads them in place, so nothing is sliced in front of it.
  conv_state_{q,k,v} [B, W-1, C]      the last W-1 pre-conv inputs, oldest first
  conv_weight_{q,k,v} [C, W]          (PyTorch depthwise Conv1d weight squeezed; [:, W-1] hits the newest input)
  A_log [H], dt_bias [H*K], o_norm_weight [V], recurrent [B, H, K, V] fp32
Outputs (`KdaOut`):
  o          [B, T, H, V]             q's dtype
  states     [B, T, H, K, V] fp32     state after each position (all_states=True), or
             [B, H, K, V]             the state after the last position (all_states=False: plain decode)
  window_{q,k,v} [B, T+W-1, C]        concat(conv state, new inputs); the conv state after accepting
                                      n tokens is window[:, n : n+W-1]
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import kda_epilogue, slot_rows
from pallas_kernels.backend import resolve
from pallas_kernels.kda_reference import gated_norm, recurrent, state_after

MAX_T = 8  # tokens per call: decode (1) and verify (draft steps + 1)



class KdaInputs(NamedTuple):
    """Per-step activations (the projection outputs)."""
    q: jax.Array  # [B, T, H*K]
    k: jax.Array  # [B, T, H*K]
    v: jax.Array  # [B, T, H*V]
    g_in: jax.Array  # [B, T, H, K]
    b_in: jax.Array  # [B, T, H]
    gate_in: jax.Array  # [B, T, H*V]


class Columns(NamedTuple):
    """Columns [start, start + width) of a wider activation array [B, T, N], standing for one
    `KdaInputs` field (g_in: its [B, T, H*K] flattening). start and width are Python ints."""
    array: jax.Array  # [B, T, N]
    start: int
    width: int

    def value(self) -> jax.Array:
        return self.array[..., self.start:self.start + self.width]


def materialize(x: KdaInputs) -> KdaInputs:
    """x with every `Columns` field sliced out into its own array, in the layouts above."""
    q, k, v, g_in, b_in, gate_in = (f.value() if isinstance(f, Columns) else f for f in x)
    return KdaInputs(q, k, v, g_in.reshape(*g_in.shape[:2], b_in.shape[2], -1), b_in, gate_in)


def _shapes(x: KdaInputs) -> KdaInputs:
    """The fields' shapes and dtypes in the layouts above (no slicing)."""
    def spec(f):
        return jax.ShapeDtypeStruct((*f.array.shape[:2], f.width), f.array.dtype) if isinstance(f, Columns) else f

    q, k, v, g_in, b_in, gate_in = map(spec, x)
    if len(g_in.shape) == 3:
        g_in = jax.ShapeDtypeStruct((*g_in.shape[:2], b_in.shape[2], g_in.shape[2] // b_in.shape[2]), g_in.dtype)
    return KdaInputs(q, k, v, g_in, b_in, gate_in)


class KdaWeights(NamedTuple):
    """Per-layer parameters the kernel reads."""
    conv_q: jax.Array  # [H*K, W]
    conv_k: jax.Array  # [H*K, W]
    conv_v: jax.Array  # [H*V, W]
    A_log: jax.Array  # [H]
    dt_bias: jax.Array  # [H*K]
    o_norm: jax.Array  # [V]


class KdaState(NamedTuple):
    """Per-sequence decoding state of one KDA layer."""
    conv_q: jax.Array  # [B, W-1, H*K]
    conv_k: jax.Array  # [B, W-1, H*K]
    conv_v: jax.Array  # [B, W-1, H*V]
    recurrent: jax.Array  # [B, H, K, V] fp32


class KdaOut(NamedTuple):
    o: jax.Array  # [B, T, H, V]
    states: jax.Array  # [B, T, H, K, V] fp32 (or [B, H, K, V] with all_states=False)
    window_q: jax.Array  # [B, T+W-1, H*K]
    window_k: jax.Array  # [B, T+W-1, H*K]
    window_v: jax.Array  # [B, T+W-1, H*V]


def default_bv(v: int, t: int) -> int:
    """V-block from the H200 sweep of bench/attention.py (BV 16 at T = 6 and 8 at T = 1 won;
    the figures: bench/history/kda.md)."""
    return min(v, 16 if t > 1 else 8)


def default_num_warps(k: int, bv: int) -> int:
    # One warp per 512 state elements (4 fp32 registers a thread), between 1 and 8.
    return max(1, min(8, (k * bv) // 512))


# ----------------------------------------------------------------------------------------------
# Shared elementwise pieces (used by the kernel and by the reference, so both compute the same
# function; they are plain jnp on values of any shape).


def _gate(z, a, *, gate: str, lower_bound: float):
    """Log-decay from z = g_in + dt_bias and a = exp(A_log); ≤ 0."""
    if gate == "safe":
        return lower_bound * jax.nn.sigmoid(a * z)
    # softplus(z) = max(z, 0) + log1p(exp(-|z|)): no overflow for large |z|.
    return -a * (jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z))))


def _silu(x):
    return x * jax.nn.sigmoid(x)


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp): the specification.


def reference(x: KdaInputs, w: KdaWeights, state: KdaState, *, gate: str = "safe", eps: float = 1e-6,
              lower_bound: float = -5.0, all_states: bool = True) -> KdaOut:
    """Plain-jnp KDA step; same signature and outputs as `kda_verify`: the conv (its output kept in
    fp32), L2 norms and gate here, the delta rule and the gated norm of `kda_reference`. Reductions
    are multiply + sum (not einsum) so that no backend rounds them through tf32."""
    f32 = jnp.float32
    x = materialize(x)
    b, t, c = x.q.shape
    h = x.b_in.shape[2]
    kd, vd = c // h, x.v.shape[2] // h
    nw = w.conv_q.shape[1]

    def conv(xs, cs, wt):  # [B, T, C], [B, W-1, C], [C, W] -> ([B, T, C] fp32, window [B, T+W-1, C])
        win = jnp.concatenate([cs.astype(xs.dtype), xs], axis=1)
        wf, wt = win.astype(f32), wt.astype(f32)
        y = sum(wf[:, i:i + t] * wt[:, i] for i in range(nw))
        return _silu(y), win

    q, win_q = conv(x.q, state.conv_q, w.conv_q)
    k, win_k = conv(x.k, state.conv_k, w.conv_k)
    v, win_v = conv(x.v, state.conv_v, w.conv_v)
    q = q.reshape(b, t, h, kd)
    k = k.reshape(b, t, h, kd)
    v = v.reshape(b, t, h, vd)
    q = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * kd ** -0.5
    k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    z = x.g_in.astype(f32) + w.dt_bias.astype(f32).reshape(h, kd)
    g = _gate(z, jnp.exp(w.A_log.astype(f32))[:, None], gate=gate, lower_bound=lower_bound)  # [B, T, H, K]
    beta = jax.nn.sigmoid(x.b_in.astype(f32))  # [B, T, H]

    o, ss = recurrent(q, k, v, g, beta, state.recurrent)  # [B, T, H, V], states [B, T, H, K, V]
    o = gated_norm(o, x.gate_in.reshape(b, t, h, vd), w.o_norm, eps).astype(x.q.dtype)
    states = ss if all_states else ss[:, -1]
    return KdaOut(o, states, win_q, win_k, win_v)


# ----------------------------------------------------------------------------------------------
# The Pallas (Triton lowering) kernel.


def _kda_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, gate_ref, csq_ref, csk_ref, csv_ref,
                wq_ref, wk_ref, wv_ref, alog_ref, dtb_ref, wn_ref, s0_ref, *refs,
                t_len: int, n_taps: int, gate: str, lower_bound: float, eps: float,
                fuse_norm: bool, all_states: bool, commit: bool, slotted: bool):
    """One program = one (sequence b, head h, V-block j). Every tensor is [K], [BV] or [K, BV]:
    the T loop is unrolled in Python, so no block ever needs a power-of-two T.

    refs: ([valid] with commit, [rows] when slotted; then the outputs) (o, states, window q, k, v),
    or with commit (o, state): the state after the first valid[b] tokens (the initial one when
    valid[b] = 0), no windows. slotted: the conv and recurrent states (and with commit the state
    written) are the whole [B, ...] arrays, read at slot rows[b] (`slot_rows`); a padding row
    writes nothing."""
    f32 = jnp.float32
    kd = q_ref.shape[1]
    bv = v_ref.shape[1]
    j, l = pl.program_id(1), pl.program_id(2)
    first_vblock = l == 0
    valid_ref = refs[0] if commit else None
    refs = refs[commit:]
    rows_ref, refs = (refs[0], refs[1:]) if slotted else (None, refs)
    if commit:
        o_ref, st_ref = refs
    else:
        o_ref, st_ref, winq_ref, wink_ref, winv_ref = refs

    if slotted:  # one indexer a load (the Triton lowering's limit): slot, then the block's place
        row = rows_ref[()]
        sl = slot_rows.slot(row, s0_ref.shape[0])
        state_at = (sl, j, slice(None), pl.ds(l * bv, bv))
        conv_at = lambda i, col, width: (sl, i, pl.ds(col, width))  # noqa: E731
    else:
        state_at = ...
        conv_at = lambda i, col, width: (i, slice(None))  # noqa: E731
    s = s0_ref[state_at].astype(f32)  # [K, BV]: the largest load, issued first
    # The window rows x[-(W-1)] .. x[T-1], loaded once, up front (independent loads in flight).
    def window(cs_ref, x_ref, col, width):
        return [cs_ref[conv_at(i, col, width)] for i in range(n_taps - 1)] + [x_ref[i, :] for i in range(t_len)]

    nv = pl.num_programs(2)
    xq, xk = window(csq_ref, q_ref, j * kd, kd), window(csk_ref, k_ref, j * kd, kd)
    xv = window(csv_ref, v_ref, (j * nv + l) * bv, bv)
    taps_q = [wq_ref[:, i].astype(f32) for i in range(n_taps)]  # [K] each
    taps_k = [wk_ref[:, i].astype(f32) for i in range(n_taps)]
    taps_v = [wv_ref[:, i].astype(f32) for i in range(n_taps)]  # [BV] each
    a = jnp.exp(alog_ref[()].astype(f32))
    dtb = dtb_ref[...].astype(f32)  # [K]
    wn = wn_ref[...].astype(f32) if fuse_norm else None  # [V]

    if not commit:
        # The raw window is the engine's conv state source; q/k rows of head h are written once
        # (by the first V-block), v rows by each V-block for its own channels.
        @pl.when(first_vblock)
        def _():
            for i in range(t_len + n_taps - 1):
                winq_ref[i, :] = xq[i]
                wink_ref[i, :] = xk[i]

        for i in range(t_len + n_taps - 1):
            winv_ref[i, :] = xv[i]

    def conv(rows, taps, i):
        y = taps[0] * rows[i].astype(f32)
        for tap in range(1, n_taps):
            y = y + taps[tap] * rows[i + tap].astype(f32)
        return _silu(y)

    # Everything that does not depend on the state is computed (and its loads issued) before the
    # recurrence, so the serial chain over t holds only the state update.
    qs, ks, vs, gs, betas, gates = [], [], [], [], [], []
    for i in range(t_len):
        q = conv(xq, taps_q, i)  # [K]
        k = conv(xk, taps_k, i)
        qs.append(q * (jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * kd ** -0.5))
        ks.append(k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6))
        vs.append(conv(xv, taps_v, i))  # [BV]
        gs.append(jnp.exp(_gate(g_ref[i, :].astype(f32) + dtb, a, gate=gate, lower_bound=lower_bound)))
        betas.append(jax.nn.sigmoid(b_ref[i].astype(f32)))
        if fuse_norm:
            gates.append(wn * jax.nn.sigmoid(gate_ref[i, :].astype(f32)))  # [V]

    n = valid_ref[()] if commit else None
    kept = s
    for i in range(t_len):
        s = s * gs[i][:, None]  # decay scales key rows
        kv = jnp.sum(s * ks[i][:, None], axis=0)  # S'ᵀ k̂  [BV]
        s = s + ks[i][:, None] * (betas[i] * (vs[i] - kv))[None, :]
        o = jnp.sum(s * qs[i][:, None], axis=0)  # Sᵀ q̂  [BV]
        if fuse_norm:  # BV == V: the whole row is here
            o = o * jax.lax.rsqrt(jnp.sum(o * o) / o.shape[0] + eps) * gates[i]
        o_ref[i, :] = o.astype(o_ref.dtype)
        if commit:
            kept = jnp.where(i < n, s, kept)
        elif all_states:
            st_ref[i] = s
    if commit and slotted:
        @pl.when(row < s0_ref.shape[0])
        def _():
            st_ref[state_at] = kept
    elif commit:
        st_ref[...] = kept
    elif not all_states:
        st_ref[...] = s


@functools.partial(jax.jit, static_argnames=("dims", "starts", "gate", "eps", "lower_bound", "bv", "num_warps",
                                             "all_states", "defer_norm", "interpret"))
def _kda_pallas(xs: tuple, w: KdaWeights, state: KdaState, valid=None, rows=None, *, dims, starts, gate, eps,
                lower_bound, bv, num_warps, all_states, interpret, defer_norm=False):
    """xs: q, k, v, g_in, b_in, gate_in, each a [B, T, N] array whose field starts at column
    starts[i] (a `Columns`, or the field itself flattened to 3-D with start 0). Without valid:
    a `KdaOut`. With valid [B] int32: (o, the recurrent state after valid[b] tokens), the state
    written over state.recurrent's buffer (input_output_aliases). defer_norm: with BV < V, o is
    returned fp32 before the gated norm (the caller runs it). rows [B] int32 (`slot_rows`): the
    states hold every slot and row b is slot rows[b]; the committed state is then the whole
    array, written at the real rows' slots only."""
    commit, slotted = valid is not None, rows is not None
    b, t, h, kd, vd, nw = dims
    c = h * kd
    nv = vd // bv
    fuse_norm = nv == 1
    tw = t + nw - 1
    sq, sk, sv, sg, sb, sgate = starts
    act = xs[0].dtype

    def blk(shape, index_map):
        return pl.BlockSpec(shape, index_map)

    # Grid (B, H, V/BV). None = a squeezed (size-1) block dimension; a field's block index is its
    # start column over the block width (the caller checks the divisibility) plus its own index.
    in_specs = [
        blk((None, t, kd), lambda i, j, l: (i, 0, sq // kd + j)),  # q
        blk((None, t, kd), lambda i, j, l: (i, 0, sk // kd + j)),  # k
        blk((None, t, bv), lambda i, j, l: (i, 0, sv // bv + j * nv + l)),  # v
        blk((None, t, kd), lambda i, j, l: (i, 0, sg // kd + j)),  # g_in
        blk((None, t, None), lambda i, j, l: (i, 0, sb + j)),  # b_in
        blk((None, t, bv), lambda i, j, l: (i, 0, sgate // bv + j * nv + l)),  # gate_in
        blk((None, nw - 1, kd), lambda i, j, l: (i, 0, j)),  # conv state q
        blk((None, nw - 1, kd), lambda i, j, l: (i, 0, j)),  # conv state k
        blk((None, nw - 1, bv), lambda i, j, l: (i, 0, j * nv + l)),  # conv state v
        blk((kd, nw), lambda i, j, l: (j, 0)),  # conv weight q
        blk((kd, nw), lambda i, j, l: (j, 0)),  # conv weight k
        blk((bv, nw), lambda i, j, l: (j * nv + l, 0)),  # conv weight v
        blk((None,), lambda i, j, l: (j,)),  # A_log
        blk((kd,), lambda i, j, l: (j,)),  # dt_bias
        blk((bv,), lambda i, j, l: (l,)),  # o_norm weight
        blk((None, None, kd, bv), lambda i, j, l: (i, j, 0, l)),  # recurrent state
    ]
    if slotted:  # the states whole: the kernel indexes them at the row's slot
        whole = lambda x: blk(x.shape, lambda i, j, l, n=x.ndim: (0,) * n)  # noqa: E731
        in_specs[6:9] = [whole(x) for x in state[:3]]
        in_specs[15] = whole(state.recurrent)
    if commit and slotted:
        st_shape, st_spec = state.recurrent.shape, in_specs[15]
    elif all_states and not commit:
        st_shape, st_spec = (b, t, h, kd, vd), blk((None, t, None, kd, bv), lambda i, j, l: (i, 0, j, 0, l))
    else:
        st_shape, st_spec = (b, h, kd, vd), blk((None, None, kd, bv), lambda i, j, l: (i, j, 0, l))
    o_dtype = act if fuse_norm else jnp.float32  # unfused: fp32 o feeds the norm epilogue
    out_specs = [blk((None, t, None, bv), lambda i, j, l: (i, 0, j, l)), st_spec]  # o, state(s)
    out_shape = [jax.ShapeDtypeStruct((b, t, h, vd), o_dtype), jax.ShapeDtypeStruct(st_shape, jnp.float32)]
    if not commit:
        out_specs += [
            blk((None, tw, kd), lambda i, j, l: (i, 0, j)),  # window q
            blk((None, tw, kd), lambda i, j, l: (i, 0, j)),  # window k
            blk((None, tw, bv), lambda i, j, l: (i, 0, j * nv + l)),  # window v
        ]
        out_shape += [
            jax.ShapeDtypeStruct((b, tw, c), xs[0].dtype),
            jax.ShapeDtypeStruct((b, tw, c), xs[1].dtype),
            jax.ShapeDtypeStruct((b, tw, h * vd), xs[2].dtype),
        ]
    args = [*xs, state.conv_q, state.conv_k, state.conv_v,
            w.conv_q, w.conv_k, w.conv_v, w.A_log, w.dt_bias, w.o_norm, state.recurrent]
    if commit:  # valid, and the state read and written by the same program, in place
        in_specs.append(blk((None,), lambda i, j, l: (i,)))
        args.append(valid)
    if slotted:
        in_specs.append(blk((None,), lambda i, j, l: (i,)))
        args.append(rows)
    kernel = functools.partial(_kda_kernel, t_len=t, n_taps=nw, gate=gate, lower_bound=lower_bound,
                               eps=eps, fuse_norm=fuse_norm, all_states=all_states, commit=commit, slotted=slotted)
    o, states, *windows = pl.pallas_call(
        kernel,
        grid=(b, h, nv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={15: 1} if commit else {},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode" if commit else "kda_verify",
    )(*args)
    if not fuse_norm and not defer_norm:  # the norm needs the whole V row, spread over V-blocks: one XLA fusion
        gate_in = xs[5][..., sgate:sgate + h * vd].reshape(b, t, h, vd)
        o = gated_norm(o, gate_in, w.o_norm, eps).astype(act)
    return (o, states) if commit else KdaOut(o, states, *windows)


class Dims(NamedTuple):
    b: int  # sequences
    t: int  # new tokens
    h: int  # heads
    k: int  # key head dim
    v: int  # value head dim
    w: int  # conv width


def check_args(x: KdaInputs, w: KdaWeights, state: KdaState, gate: str, rows=None) -> Dims:
    """The dimensions of a KDA call (decode, verify or prefill); checks that every array agrees.
    With rows [B] (`slot_rows`) the states may hold any number of slots."""
    x = _shapes(x)
    b, t, c = x.q.shape
    h = x.b_in.shape[2]
    kd, vd = c // h, x.v.shape[2] // h
    nw = w.conv_q.shape[1]
    if gate not in ("safe", "softplus"):
        raise ValueError(f"gate must be 'safe' or 'softplus', got {gate!r}")
    assert x.k.shape == (b, t, c) and x.g_in.shape == (b, t, h, kd) and x.b_in.shape == (b, t, h)
    assert x.v.shape == x.gate_in.shape == (b, t, h * vd)
    n = b if rows is None else state.recurrent.shape[0]
    assert rows is None or rows.shape == (b,)
    assert state.conv_q.shape == state.conv_k.shape == (n, nw - 1, c)
    assert state.conv_v.shape == (n, nw - 1, h * vd) and state.recurrent.shape == (n, h, kd, vd)
    assert w.conv_k.shape == (c, nw) and w.conv_v.shape == (h * vd, nw)
    assert w.A_log.shape == (h,) and w.dt_bias.shape == (c,) and w.o_norm.shape == (vd,)
    return Dims(b, t, h, kd, vd, nw)


def kda_verify(x: KdaInputs, w: KdaWeights, state: KdaState, *, gate: str = "safe", eps: float = 1e-6,
               lower_bound: float = -5.0, bv: int | None = None, num_warps: int | None = None,
               all_states: bool = True, rows=None, backend: str = "auto") -> KdaOut:
    """KDA over T = 1..8 new tokens of B sequences; see the module docstring for layouts.
    rows [B] int32 (`slot_rows`): the state holds every slot (any number) and sequence b is slot
    rows[b], read in place; the outputs are the B sequences'.

    Pallas kernel: grid (B, H, V/BV), one program per (sequence, head, V-block of BV columns).
    A program loads the q/k window of its head ((T+W-1)·K each: the q/k conv and L2 norm are
    recomputed by every V-block, which is cheaper than serialising them), its BV v channels, the
    [K, BV] fp32 state block, then runs the T steps in registers, storing o and each state.
    With BV == V the gated RMSNorm is fused; with BV < V it runs as one XLA fusion after.
    H200, Ling shapes, B 1: 10.2 µs at T = 6 (BV 16, both launches), 6.6 µs at T = 1 (BV 8).
    Bytes that must move (fp32 state, e = activation bytes): 4·H·K·V (state in)
    + 4·T·H·K·V (every state out; 4·H·K·V with all_states=False)
    + e·T·(3C + H·K + H·V + H·V) (q, k, v, g_in, gate_in, o) + e·(T+2W-2)·3C (conv state in,
    window out). At Ling shapes (H 32, K = V 128) the state dominates: 2 MiB in, T·2 MiB out.
    """
    dims = check_args(x, w, state, gate, rows)
    backend = resolve(backend)
    if backend == "reference":  # any T
        state = state if rows is None else slot_rows.take(state, rows)
        return reference(x, w, state, gate=gate, eps=eps, lower_bound=lower_bound, all_states=all_states)
    return _launch(x, w, state, None, dims, rows=rows, gate=gate, eps=eps, lower_bound=lower_bound, bv=bv,
                   num_warps=num_warps, all_states=all_states, backend=backend)


def kda_decode(x: KdaInputs, w: KdaWeights, state: KdaState, valid: jax.Array, *, gate: str = "safe",
               eps: float = 1e-6, lower_bound: float = -5.0, bv: int | None = None, num_warps: int | None = None,
               rows=None, backend: str = "auto") -> tuple[jax.Array, KdaState]:
    """KDA over T = 1..8 new tokens of B sequences (any T on the reference backend), committed at
    once: (o [B, T, H, V], the state after the first valid[b] ∈ 0..T tokens of sequence b; the
    initial state where valid[b] = 0), the conv states in their own dtype. o past valid[b] is
    computed as if those tokens were real.

    The same kernel as `kda_verify`, which keeps the state it would otherwise store last
    (`jnp.where(t < valid[b], S_t, kept)` in registers) and writes it over state.recurrent's
    buffer (input_output_aliases: in place when the caller donates the state), with no window
    outputs. A second launch after the kernel (`kda_epilogue`) runs the gated norm (when BV < V)
    and writes the conv states, the window's rows valid[b] .. valid[b] + W-2, over the old ones
    (this kernel cannot write them in place: every V-block of a head reads the q/k conv state).
    Bytes: `kda_verify`'s with all_states=False, less the windows. Decode needs no later `commit`.
    rows [B] int32 (`slot_rows`): the state holds every slot (any number), sequence b is slot
    rows[b]; the states returned are the whole arrays, the real rows' slots advanced in place."""
    dims = check_args(x, w, state, gate, rows)
    valid = jnp.asarray(valid, jnp.int32).reshape(dims.b)
    backend = resolve(backend)
    xs = [(f.array, f.start) if isinstance(f, Columns) else f for f in x[:3]]
    if backend == "reference":  # any T
        mine = state if rows is None else slot_rows.take(state, rows)
        out = reference(x, w, mine, gate=gate, eps=eps, lower_bound=lower_bound, all_states=True)
        o, rec = out.o, state_after(out.states, valid, mine.recurrent)
        _, conv = kda_epilogue.decode_epilogue(xs, mine[:3], valid, backend=backend)
        new = KdaState(*conv, rec)
        if rows is not None:
            new = slot_rows.put(state, rows, new)
        return o, new
    bv = default_bv(dims.v, dims.t) if bv is None else bv
    o, rec = _launch(x, w, state, valid, dims, rows=rows, gate=gate, eps=eps, lower_bound=lower_bound, bv=bv,
                     num_warps=num_warps, all_states=False, backend=backend, defer_norm=True)
    norm = None
    if bv < dims.v:  # o is fp32 and unnormalised: the norm runs in the epilogue's launch
        g = x.gate_in
        norm = kda_epilogue.Norm(o, (g.array, g.start) if isinstance(g, Columns) else g, w.o_norm, eps)
    y, conv = kda_epilogue.decode_epilogue(xs, state[:3], valid, norm=norm, after=rec, rows=rows, backend=backend)
    return (o if y is None else y), KdaState(*conv, rec)


def _launch(x: KdaInputs, w: KdaWeights, state: KdaState, valid, dims: Dims, *, gate, eps, lower_bound, bv,
            num_warps, all_states, backend, defer_norm: bool = False, rows=None):
    """The Pallas kernel's plan checked and launched (`_kda_pallas`)."""
    t, kd, vd = dims.t, dims.k, dims.v
    if not 1 <= t <= MAX_T:
        raise ValueError(f"the KDA kernel takes T = 1..{MAX_T} tokens, got T={t}")
    bv = default_bv(vd, t) if bv is None else bv
    if vd % bv or bv & (bv - 1) or kd & (kd - 1):
        raise ValueError(f"K={kd} and BV={bv} must be powers of two and BV must divide V={vd}")
    num_warps = default_num_warps(kd, bv) if num_warps is None else num_warps
    xs = [(f.array, f.start) if isinstance(f, Columns) else (f.reshape(*f.shape[:2], -1), 0) for f in x]
    starts = tuple(s for _, s in xs)
    for name, start, block in zip(KdaInputs._fields, starts, (kd, kd, bv, kd, 1, bv)):
        if start % block:
            raise ValueError(f"{name} starts at column {start}, not a multiple of its block width {block}")
    rows = None if rows is None else jnp.asarray(rows, jnp.int32)
    return _kda_pallas(tuple(a for a, _ in xs), w, state, valid, rows, dims=tuple(dims), starts=starts, gate=gate,
                       eps=float(eps), lower_bound=float(lower_bound), bv=bv, num_warps=num_warps,
                       all_states=all_states, defer_norm=defer_norm, interpret=backend == "interpret")


def commit(out: KdaOut, n_accepted: jax.Array) -> KdaState:
    """The state after accepting n_accepted[b] ∈ 1..T tokens of each sequence: a gather, no
    recomputation. Needs out from all_states=True."""
    nw1 = out.window_q.shape[1] - out.states.shape[1]  # W-1
    n = n_accepted.astype(jnp.int32)
    rec = jnp.take_along_axis(out.states, (n - 1)[:, None, None, None, None], axis=1)[:, 0]
    idx = n[:, None] + jnp.arange(nw1)[None, :]  # [B, W-1]

    def conv(win):
        return jnp.take_along_axis(win, idx[:, :, None], axis=1)

    return KdaState(conv(out.window_q), conv(out.window_k), conv(out.window_v), rec)

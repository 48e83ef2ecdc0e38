"""KDA prefill: conv + L2 norm + gate + chunked gated delta rule + gated RMSNorm over long prompts.

One call advances B sequences by T new tokens (the first valid[b] of each are real, the rest
padding that leaves its state untouched) through one KDA layer, between the projections and
o_proj, and returns the outputs and the state to decode from: the recurrent state [B, H, K, V]
fp32 and the conv states (the last W-1 raw inputs before position valid[b]).

Per head (K = V = head dim), token t: the equations of `pallas_kernels.kda` (conv + SiLU, L2 norm,
decay gate g ≤ 0, β, S' = diag(e^g) S, S = S' + β k̂ (v - S'ᵀ k̂)ᵀ, o = Sᵀ q̂, gated RMSNorm),
in the chunked (WY) form of `chunked`: within a chunk of C tokens with cumulative log-decay
G_t = Σ_{s≤t} g_s [K] and the state S_0 at the chunk start,
  A[t, s] = Σ_c k_t k_s e^{G_t - G_s} (s < t),    Aqk[t, s] = Σ_c q_t k_s e^{G_t - G_s} (s ≤ t)
  M = I + diag(β) A (unit lower triangular);  w = M⁻¹ diag(β) (k ⊙ e^G);  u = M⁻¹ diag(β) v
  v_new = u - w S_0;   o = (q ⊙ e^G) S_0 + Aqk v_new;   S_C = e^{G_C} ⊙ S_0 + (k ⊙ e^{G_C - G})ᵀ v_new

Numerics of the decay. G reaches lower_bound·C = -320 within a chunk (safe gate), so neither
e^G nor e^-G can be formed on its own; every product e^{G_t - G_s} is split at an anchor a as
e^{G_t - a} e^{a - G_s}. The chunk is two halves of R = C/2 rows, each relative to O_h, the
decay before it:
  cross block (half 1 × half 0): a = O_1, between s and t, so both factors are ≤ 1 and a factor
    that underflows means a negligible entry;
  diagonal blocks, safe gate (lower_bound ≥ -5, Ling): per row sub-block of SUB = 16 rows the
    anchor sits half a sub-block's worst decay below its start, so the factors of the entries
    that matter lie in [e^-40, e^40]: dots, no overflow, and no factor of a non-negligible term
    denormal (XLA:CPU and the GPU's ex2.approx.ftz flush denormals to 0; a ±80 span lost terms);
  diagonal blocks, other gates (Kimi's softplus decay is unbounded): ≤ 1 factors across the
    16-row sub-blocks and elementwise within them (t ≥ s only), SUB steps.
M⁻¹ per half by recursive doubling (log2 R levels of two dots), merged across the halves by
T_10 = -T_11 M_10 T_00. Decays are kept in base 2 (exp2 is one MUFU op; exp a libdevice call).

Rounding: the conv output is rounded to the activation dtype (as the model's `causal_conv`) and
L2-normalised in fp32 from that;
w, u, q ⊙ e^G, k ⊙ e^{G_C - G} and Aqk are stored in the activation dtype between the kernels
(as fla's chunk_kda; exact for fp32 activations); o is rounded to it before the norm (as the
model) and once more after. Dots: the intra kernel's at `Plan.precision` ("tf32": 10-bit
operands, fp32 accumulation), the inverse's (`INV_PRECISION`) as fp32 FMAs; the state kernel
multiplies the stored 16-bit tiles by the fp32 state rounded to 16 bits (as fla's chunk_kda;
`Plan.state_hi_lo`: split into hi + lo, two dots, ~16 mantissa bits; fp32 activations:
`Plan.precision`). The state itself accumulates in fp32.

Layouts (C = H·K; every array is its own buffer): KdaInputs, KdaWeights, KdaState of
`pallas_kernels.kda` with T the prompt length; valid [B] int32 (clipped to 0..T).
Intermediates (Tp = N·C, N = ceil(T / C)): the conv outputs q, k, v [B, T, C] in the activation
dtype and q's and k's L2-norm factors rnq, rnk [B, H, T] fp32; w, qg, kg [B, H, Tp, K],
u [B, H, Tp, V], aqk [B, H, Tp, C] in the activation dtype; gc = e^{G_C} [B, H, N, K] fp32.

Kernels (Triton lowering), in this order:
  conv   one launch for q, k and v, grid (B, T/CONV_ROWS, 3H): conv + SiLU of a row block of one
         head, the W-1 rows before it from the previous block or, for block 0, the conv state (a
         gather under lax.cond); q and k also store each row's L2-norm factor, and the block
         holding row valid-1 the conv state after it. A pass of its own: inside the intra kernel the
         taps' instructions and registers held that kernel at 4 warps.
  intra  grid (B, N, H), one program per (sequence, chunk, head), all independent: the chunk's
         q/k/v rows, times their norm factors, gate, decays, A and Aqk, the inverse, w and u;
         stores w, u, qg, kg, aqk, gc. Rows past valid are padding (g = 0, β = 0: u = w = 0).
  state  grid (B, H, V/BV), sequential over the N chunks with the [K, BV] fp32 state in
         registers: v_new = u - w S, o = qg S + aqk v_new, S = gc ⊙ S + kgᵀ v_new; wgmma, the
         next chunk's loads pipelined (cp.async). The V-blocks of a head run side by side and
         share w/qg/kg/aqk through L2. BV == V fuses the gated norm; else o (activation dtype)
         goes through the norm pass.
  norm   (BV < V) grid (B, T/(NORM_ROWS·NORM_STEPS), H): the gated RMSNorm of whole V rows,
         each step's loads issued during the step before (XLA's fusion of it ran at 1.7 TB/s).
  The conv states after valid[b] are a gather of W-1 rows (XLA).

Cost at Ling's shapes (B 1, T 8192, H 32, K = V = 128, bf16), per layer: 36.5 GFLOP (0.074 ms of
dense tf32); the bytes any implementation must move ≈ 408 MB (0.095 ms); this design also writes
and reads its intermediates, ≈ 1.55 GB (0.36 ms). The intra kernel is bound by instructions, not
bytes. The derivation, instruction counts and timings: bench/history/kda_prefill.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import resolve
from pallas_kernels.kda import KdaInputs, KdaState, KdaWeights, check_args
from pallas_kernels.kda_reference import causal_conv, chunked, conv_state_after, decay_gate, gated_norm, l2_normalize

CHUNK = 32  # tokens per chunk of the WY form. H200, 8192 tokens: the layer 1656 µs vs 2792 at 64
# (the intra kernel's code halves, 3.5-5k SASS instructions; the state kernel takes twice the steps)
SUB = 16  # rows per sub-block of one decay anchor (and the smallest side of a dot)
ANCHOR_MAX = 40.0  # bound of |Gl - anchor| in the bounded-gate blocks: e^±40, far from overflow and denormals

# The inverse's dots ([R, R] @ [R, R]; T_10's): fp32 FMAs. sm_90a (triton 3.6, 4 warps, chunk 32):
# 3xtf32 took ~790 SASS instructions a level (its splits and the mma results' shuffles into the
# next dot's operand layout), ~3.2k of the ~10.2k executed a thread; FMA dots ~110 a level.
INV_PRECISION = "ieee"
LOG2E = 1.4426950408889634  # the kernels keep log-decays in base 2: exp2 is one MUFU op, exp a libdevice call

PRECISIONS = {
    "tf32": lax.Precision.DEFAULT,  # Pallas' Triton lowering: tf32 inputs for fp32 operands
    "ieee": lax.Precision.HIGHEST,  # fp32 FMAs, no tensor cores
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16": "bf16",  # operands rounded to bf16 (8 mantissa bits), fp32 accumulation: `_dot_general`
}


# ----------------------------------------------------------------------------------------------
# The reference (plain jnp), from the one specification in kda_reference.


def reference_delta(x: KdaInputs, w: KdaWeights, state: KdaState, valid, *, gate: str = "safe",
                    lower_bound: float = -5.0, chunk: int = CHUNK):
    """`reference` up to the gated norm: (o [B, T, H, V] fp32 before it, KdaState after the valid
    tokens). valid [B] int32 in 0..T."""
    b, t, c = x.q.shape
    h = x.b_in.shape[2]
    kd = c // h
    nw = w.conv_q.shape[1]
    convs = [causal_conv(a, s, wt) for a, s, wt in
             zip((x.q, x.k, x.v), (state.conv_q, state.conv_k, state.conv_v), (w.conv_q, w.conv_k, w.conv_v))]
    q, k, v = (y.reshape(b, t, h, -1) for y, _ in convs)
    q = l2_normalize(q) * kd**-0.5
    k = l2_normalize(k)
    g = decay_gate(x.g_in, w.A_log, w.dt_bias, kind=gate, lower_bound=lower_bound)
    beta = jax.nn.sigmoid(x.b_in.astype(jnp.float32))  # [B, T, H]
    real = jnp.arange(t)[None, :] < valid[:, None]  # [B, T]: padding decays nothing and writes nothing
    g = jnp.where(real[..., None, None], g, 0.0)
    beta = jnp.where(real[..., None], beta, 0.0)
    o, rec = chunked(q, k, v, g, beta, state.recurrent, chunk)
    conv = (conv_state_after(win, valid, nw - 1) for _, win in convs)
    return o, KdaState(*conv, rec)


def reference(x: KdaInputs, w: KdaWeights, state: KdaState, valid, *, gate: str = "safe", eps: float = 1e-6,
              lower_bound: float = -5.0, chunk: int = CHUNK):
    """Plain jnp, the model's prefill (ling.kda.KDAttention, form "chunked"): same signature and
    outputs as `kda_prefill`."""
    b, t, c = x.q.shape
    h = x.b_in.shape[2]
    valid = jnp.clip(jnp.asarray(valid, jnp.int32), 0, t)
    o, new = reference_delta(x, w, state, valid, gate=gate, lower_bound=lower_bound, chunk=chunk)
    o = gated_norm(o.astype(x.q.dtype).astype(jnp.float32), x.gate_in.reshape(b, t, h, -1), w.o_norm, eps)
    return o.astype(x.q.dtype), new


# ----------------------------------------------------------------------------------------------
# Launch parameters.


@dataclasses.dataclass(frozen=True)
class Plan:
    bv: int  # V-block of the state kernel (V/BV programs per head); BV == V fuses the gated norm
    intra_warps: int = 4  # H200, 8192 tokens, chunks of 32, bf16 dots: 464-553 µs at 2 warps vs 660-716 at 4
    # (255 registers either way: 4 vs 2 programs an SM); with the conv inside, 4 warps had won (977 vs 1885)
    state_warps: int = 4
    state_stages: int = 3  # Triton pipelining of the chunk loop; H200 at BV 32: 367 µs vs 562 at 2 stages
    # (3 stages of BV 128's loads pass the 227 KB of shared memory: give larger V-blocks 2 or 1)
    precision: str = "tf32"  # dot operand precision, a key of PRECISIONS (default_plan: "bf16" for 16-bit
    # activations, as fla's chunk_kda; the inverse is apart, INV_PRECISION)
    # 16-bit activations: the fp32 state (and v_new) enter the state kernel's dots rounded to the
    # activation dtype (one dot, as fla's chunk_kda), or as 16-bit hi + lo when True (two dots, ~16
    # mantissa bits). H200, 8192 tokens: state kernel 418 µs rounded vs 616 hi + lo, and the same
    # error against the fp32 reference (o 7.5e-3, state 3.7e-3: the stored 16-bit tiles dominate)
    state_hi_lo: bool = False


def default_plan(v: int, dtype) -> Plan:
    """The H200 sweep's best at Ling's shapes (bench/kda_prefill_check.py, bench/history/chronicle.md):
    BV 32 of 4 warps and 3 stages for the state kernel (4 and 5 stages: within the spread). fp32
    intermediates (4 B each) do not fit two pipeline stages of the state kernel's loads in
    shared memory. 16-bit activations: the intra kernel's dots on bf16 operands (their outputs
    are stored in 16 bits anyway; sm_90a: half the MMAs of tf32 and no fp32 operand layouts,
    ~4.8k -> ~4.5k SASS instructions; interpret, K 128, bf16: o ≤ 1.0e-2 of max |o| vs ≤ 7.4e-3
    with fp32 dots, state ≤ 5.3e-3 either way) in programs of 2 warps; fp32 activations keep 4
    (sm_90a: 2 warps of tf32 dots spill 716 B, 4 warps 32 B; not timed)."""
    bits16 = jnp.dtype(dtype).itemsize <= 2
    return Plan(bv=min(v, 32), intra_warps=2 if bits16 else 4, state_stages=3 if bits16 else 1,
                precision="bf16" if bits16 else "tf32")


def _dot_general(a, b, dims, precision):
    """lax.dot_general with fp32 accumulation at a value of PRECISIONS: "bf16" rounds the
    operands to bf16 (also in interpret mode, where the others all become fp32 on the CPU)."""
    if isinstance(precision, str) and precision == "bf16":
        a, b, precision = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _dot(a, b, precision, *, trans_b: bool = False):
    """a @ b (or a @ bᵀ), fp32 accumulation."""
    return _dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision)


# ----------------------------------------------------------------------------------------------
# Kernel 0: the short conv + SiLU (and q's and k's L2-norm factors), one program per row block and head.

CONV_ROWS = 16  # rows per program of the conv pass: bandwidth-bound, it wants many loads in flight (H200 sweep:
# bench/history/kda_prefill.md)


def _conv_rows(x_ref, cs_ref, w_ref, y_ref, rn_ref, s_ref, valid, i, *, t_len: int, block_t: int, scale: float):
    """One projection's part of `_conv_kernel` (refs as there, rn_ref None for v) in row block i."""
    f32 = jnp.float32
    act = x_ref.dtype
    n_taps = w_ref.shape[1]
    t0 = i * block_t
    r = t0 + jnp.arange(block_t, dtype=jnp.int32)  # [BT]
    cols = jnp.arange(x_ref.shape[1], dtype=jnp.int32)[None, :]
    taps = [w_ref[:, j].astype(f32) for j in range(n_taps)]  # [BC] each

    def window(rr):
        """Raw inputs of rows rr [R] (< 0: the conv state's row rr + W-1), fp32 [R, BC]."""
        xs = pltriton.load(x_ref.at[jnp.clip(rr, 0, t_len - 1)[:, None], cols],
                           mask=((rr >= 0) & (rr < t_len))[:, None], other=0.0).astype(f32)
        cs = pltriton.load(cs_ref.at[jnp.clip(rr + n_taps - 1, 0, n_taps - 2)[:, None], cols],
                           mask=(rr < 0)[:, None], other=0.0)
        return xs + cs.astype(act).astype(f32)

    def plain():
        y = None
        for j in range(n_taps):
            shift = n_taps - 1 - j
            xs = pltriton.load(x_ref.at[pl.ds(t0 - shift, block_t)], mask=(r - shift < t_len)[:, None],
                               other=0.0).astype(f32)
            y = taps[j][None, :] * xs if y is None else y + taps[j][None, :] * xs
        return y

    def with_state():
        y = None
        for j in range(n_taps):
            xs = window(r - (n_taps - 1 - j)) if j < n_taps - 1 else pltriton.load(
                x_ref.at[pl.ds(t0, block_t)], mask=(r < t_len)[:, None], other=0.0).astype(f32)
            y = taps[j][None, :] * xs if y is None else y + taps[j][None, :] * xs
        return y

    y = lax.cond(i == 0, with_state, plain)
    y = (y * _sigmoid(y)).astype(act)
    inside = r < t_len
    pltriton.store(y_ref.at[pl.ds(t0, block_t)], y, mask=inside[:, None])
    if rn_ref is not None:
        y = y.astype(f32)
        rn = lax.rsqrt(jnp.sum(y * y, axis=1) + 1e-6) * scale  # [BT]
        pltriton.store(rn_ref.at[pl.ds(t0, block_t)], rn, mask=inside)

    # The conv state after the valid tokens: raw rows valid-(W-1) .. valid-1, written by the block
    # holding row valid-1 (block 0 when valid is 0: the old state, unchanged).
    @pl.when(i == jnp.maximum(valid - 1, 0) // block_t)
    def _():
        n_rows = n_taps - 1
        # W-1 rows padded to a power of two by repeating the last: the repeats store the same value to
        # the same row, unmasked (a masked duplicate could land its stale value last in interpret mode)
        k = jnp.minimum(jnp.arange(pl.next_power_of_2(n_rows), dtype=jnp.int32), n_rows - 1)
        pltriton.store(s_ref.at[k[:, None], cols], window(valid - n_rows + k).astype(s_ref.dtype))


def _conv_kernel(valid_ref, xq, xk, xv, csq, csk, csv, wq, wk, wv, yq, yk, yv, rnq, rnk, sq, sk, sv, *,
                 t_len: int, block_t: int, n_heads: int, scale: float):
    """Refs (squeezed blocks) of one head of q, k and v: x [T, BC] raw inputs, cs [W-1, BC] the conv
    state (oldest first), w [BC, W] taps; y [T, BC]; rn [T] (q and k); s [W-1, BC] the conv state
    after valid. Column block l < H is q's head l, then k's, then v's. Rows t0 .. t0+BT-1:
    y = SiLU(Σ_j w_j x[t - (W-1-j)]) rounded to the activation dtype (as the model's
    `causal_conv`), and rn = scale / sqrt(Σ y² + 1e-6) over the row (fp32, from the rounded y:
    the L2 norm's factor, as `l2_normalize`; q's scale K^-1/2, k's 1). Tap j of block 0 reaches
    rows before 0, the conv state's: it gathers, every other block loads plain (possibly
    unaligned) row ranges."""
    # program ids read here, outside the switch's branches (interpret mode substitutes them only at top level)
    rows = functools.partial(_conv_rows, valid=valid_ref[...], i=pl.program_id(1), t_len=t_len, block_t=block_t)
    lax.switch(pl.program_id(2) // n_heads, [
        lambda: rows(xq, csq, wq, yq, rnq, sq, scale=scale),
        lambda: rows(xk, csk, wk, yk, rnk, sk, scale=1.0),
        lambda: rows(xv, csv, wv, yv, None, sv, scale=1.0)])


def conv_pass(x: KdaInputs, w: KdaWeights, state: KdaState, valid, *, interpret: bool, block_t: int = CONV_ROWS,
           num_warps: int = 4):
    """The conv pass over q, k and v in one launch, grid (B, T / block_t, 3H): (x with q, k, v
    replaced by SiLU(conv) in their dtype, (rnq, rnk) [B, H, T] the L2-norm factors of q's rows
    (times K^-1/2) and k's, the conv states after valid [B, W-1, C] of q, k, v in the states'
    dtype); see `_conv_kernel`. Bytes: x read once (the taps' overlapping rows hit in cache), y
    written once: 2·B·T·C·2 a projection at bf16, 134 MB at Ling's T 8192 (rn 1 MB)."""
    b, t, _ = x.q.shape
    h = x.b_in.shape[2]
    kd, vd = x.q.shape[2] // h, x.v.shape[2] // h
    nw = w.conv_q.shape[1]
    bt = min(block_t, pl.next_power_of_2(t))

    def col(which):  # projection `which`'s head for column block l (clamped: other projections' programs)
        return lambda l: jnp.clip(l - which * h, 0, h - 1)

    def specs(which, head):
        c = col(which)
        return dict(x=pl.BlockSpec((None, t, head), lambda i, j, l: (i, 0, c(l))),
                    cs=pl.BlockSpec((None, nw - 1, head), lambda i, j, l: (i, 0, c(l))),
                    w=pl.BlockSpec((head, nw), lambda i, j, l: (c(l), 0)),
                    rn=pl.BlockSpec((None, None, t), lambda i, j, l: (i, c(l), 0)))

    sp = [specs(0, kd), specs(1, kd), specs(2, vd)]
    xs, cs, ws = (x.q, x.k, x.v), (state.conv_q, state.conv_k, state.conv_v), (w.conv_q, w.conv_k, w.conv_v)
    out = pl.pallas_call(
        functools.partial(_conv_kernel, t_len=t, block_t=bt, n_heads=h, scale=kd**-0.5),
        grid=(b, -(-t // bt), 3 * h),  # column blocks fastest: neighbours cover whole rows
        in_specs=[pl.BlockSpec((None,), lambda i, j, l: (i,))] + [s[k] for k in ("x", "cs", "w") for s in sp],
        out_specs=[s["x"] for s in sp] + [sp[0]["rn"], sp[1]["rn"]] + [s["cs"] for s in sp],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in xs]
        + [jax.ShapeDtypeStruct((b, h, t), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cs],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_conv",
    )(valid, *xs, *cs, *ws)
    q, k, v, rnq, rnk, *conv = out
    return x._replace(q=q, k=k, v=v), (rnq, rnk), conv


# ----------------------------------------------------------------------------------------------
# Kernel 1: the intra-chunk quantities, one program per (sequence, chunk, head).


def _sigmoid(x):
    """σ(x) as rsqrt(1 + 2^(-x·log2 e))²: two MUFU ops where 1 / (1 + e^-x) lowers to an IEEE
    division (~10 instructions); ~1e-7 relative error, exact limits 0 and 1."""
    r = lax.rsqrt(1.0 + jnp.exp2(-LOG2E * x))
    return r * r


def _gate2(f, dtb, a, *, gate: str, lower_bound: float):
    """The log-decay of `pallas_kernels.kda._gate` in base 2 (g · log2 e) from f = g_in [R, K]
    fp32, dtb = dt_bias [K] and a = exp(A_log). safe: lower_bound · σ(a z), z = f + dt_bias, its
    exponent -a z log2 e as one FMA of f (and the [K] vector c · dt_bias) and the scale folded
    into the square: 6 instructions an element where the plain form took 8."""
    if gate == "safe":
        c = -LOG2E * a
        r = lax.rsqrt(1.0 + jnp.exp2(f * c + (c * dtb)[None, :]))
        return (r * (lower_bound * LOG2E)) * r
    z = f + dtb[None, :]
    return (-LOG2E) * a * (jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp2(-LOG2E * jnp.abs(z))))


def _unit_lower_inverse(lo, precision):
    """(I + lo)⁻¹ for lo [S, S] strictly lower triangular, S a power of two, by recursive
    doubling: with T the inverse of the b×b diagonal blocks, the 2b×2b blocks' inverse is
    T - T L_b T, L_b the lower-left b×b block of each 2b×2b block (the blocked triangular
    inversion). log2 S levels, the first (b = 1) elementwise and each other of two [S, S] dots,
    where row-by-row substitution would take S - 1 steps, each with cross-warp reductions and
    barriers. The levels are a loop (the intra kernel's code size, not its arithmetic, limited
    it at 3xtf32); with fp32 FMA dots (`INV_PRECISION`) ptxas unrolls its 3 trips at S = 16."""
    s = lo.shape[0]
    row = jnp.arange(s, dtype=jnp.int32)[:, None]
    col = jnp.arange(s, dtype=jnp.int32)[None, :]

    def level(i, inv):  # blocks of b = 2^i
        rb, cb = lax.shift_right_logical(row, i), lax.shift_right_logical(col, i)
        lower_left = ((rb & 1) == 1) & (cb == rb - 1)
        return inv - _dot(inv, _dot(jnp.where(lower_left, lo, 0.0), inv, precision), precision)

    # Level 0 (b = 1) without dots: T = I there, so T - T L_1 T = I - L_1 (the subdiagonal of
    # each 2×2 block).
    first = (row == col).astype(jnp.float32) - jnp.where(((row & 1) == 1) & (col == row - 1), lo, 0.0)
    return lax.fori_loop(1, s.bit_length() - 1, level, first)


def _diag_bounded(q, k, g, gl, *, lower_bound, precision):
    """(A, Aqk) [R, R] within one half, for a decay bounded by lower_bound ≤ g ≤ 0 (lower_bound
    ≥ -5), by 2·R/SUB dots of [R, K] @ [K, R]. Each sub-block m of SUB rows has the anchor
    a_m = Gl[m·SUB - 1] + SUB/2 · lower_bound (a_0 = SUB/2 · lower_bound): its rows take
    2^{Gl_t - a_m}, and the columns they meet 2^{a_m - Gl_s}, so for t ≥ s both lie in
    [e^-40, e^40]; for s in an earlier sub-block the column factor is ≤ e^-40 and the entry's
    true value below e^40 times it. No overflow, and a factor that underflows or goes denormal
    (flushed to 0 by XLA:CPU and by the GPU's ex2.approx.ftz) belongs to a negligible term.
    Entries with t < s are garbage (finite); the caller masks them.
    q, k [R, K]; g, gl [R, K] in base 2; R a multiple of SUB."""
    n = gl.shape[0]
    row = jnp.arange(n, dtype=jnp.int32)[:, None]
    half_span = SUB / 2 * lower_bound * LOG2E
    cap = ANCHOR_MAX * LOG2E
    anchors = [jnp.full((gl.shape[1],), half_span, jnp.float32)]
    for m in range(1, n // SUB):
        anchors.append(jnp.sum(jnp.where(row < m * SUB, g, 0.0), axis=0) + half_span)  # Gl[m·SUB - 1] + ...
    a_row = anchors[0][None, :]
    for m in range(1, n // SUB):
        a_row = jnp.where(row >= m * SUB, anchors[m][None, :], a_row)  # [R, K]: each row's anchor
    up = jnp.exp2(gl - a_row)
    kup, qup = k * up, q * up
    a = aq = None
    for m, anc in enumerate(anchors):
        # Columns past the sub-block are only met by masked entries: capped to stay finite.
        cols = k * jnp.exp2(jnp.minimum(anc[None, :] - gl, cap))
        a_m, aq_m = _dot(kup, cols, precision, trans_b=True), _dot(qup, cols, precision, trans_b=True)
        mine = (row >= m * SUB) & (row < (m + 1) * SUB)
        a = a_m if a is None else jnp.where(mine, a_m, a)
        aq = aq_m if aq is None else jnp.where(mine, aq_m, aq)
    return a, aq


def _diag_unbounded(q, k, g, gl, *, precision):
    """(A, Aqk) [R, R] within one half, for an unbounded decay (Kimi's softplus gate); entries
    with t < s are zero. Left of the diagonal sub-blocks: rows 2^{Gl_t - O_m}, columns
    2^{O_m - Gl_s}, O_m = Gl[m·SUB - 1] between them, every factor ≤ 1, by dots. The diagonal
    SUB×SUB blocks, all sub-blocks at once as [R/SUB, SUB, K]: column j from 2^{Gl_t - Gl_j},
    t ≥ j only, in fp32 (SUB steps). q, k [R, K]; g, gl [R, K] in base 2."""
    n, kd = gl.shape
    ns = n // SUB
    row = jnp.arange(n, dtype=jnp.int32)[:, None]
    col = jnp.arange(n, dtype=jnp.int32)[None, :]
    offs = [jnp.zeros((kd,), jnp.float32)]
    for m in range(1, ns):
        offs.append(jnp.sum(jnp.where(row < m * SUB, g, 0.0), axis=0))  # O_m = G[m·SUB - 1]
    o_row = offs[0][None, :]
    for m in range(1, ns):
        o_row = jnp.where(row >= m * SUB, offs[m][None, :], o_row)
    rf = jnp.exp2(gl - o_row)  # ≤ 1
    kr, qr = k * rf, q * rf
    a = jnp.zeros((n, n), jnp.float32)
    aq = jnp.zeros((n, n), jnp.float32)
    for m in range(1, ns):
        cols = k * jnp.exp2(jnp.where(row < m * SUB, offs[m][None, :] - gl, -jnp.inf))  # ≤ 1, 0 from m·SUB on
        mine = (row >= m * SUB) & (row < (m + 1) * SUB)
        a = jnp.where(mine, _dot(kr, cols, precision, trans_b=True), a)
        aq = jnp.where(mine, _dot(qr, cols, precision, trans_b=True), aq)
    # The diagonal blocks, elementwise: [NS, SUB, K] views of the chunk.
    k3, q3, g3 = (x.reshape(ns, SUB, kd) for x in (k, q, gl))
    sub = jnp.arange(SUB, dtype=jnp.int32)

    def body(j, acc):
        ad, aqd = acc  # [NS, SUB, SUB]
        pick = (sub == j)[None, :, None]
        k_j = jnp.sum(jnp.where(pick, k3, 0.0), axis=1)  # [NS, K]: row j of each sub-block
        g_j = jnp.sum(jnp.where(pick, g3, 0.0), axis=1)
        dec = jnp.exp2(jnp.where((sub >= j)[None, :, None], g3 - g_j[:, None, :], -jnp.inf))  # t ≥ j: ≤ 1
        kd_ = dec * k_j[:, None, :]  # [NS, SUB, K]
        here = (sub == j)[None, None, :]
        ad = ad + jnp.where(here, jnp.sum(k3 * kd_, axis=2)[:, :, None], 0.0)
        aqd = aqd + jnp.where(here, jnp.sum(q3 * kd_, axis=2)[:, :, None], 0.0)
        return ad, aqd

    zero = jnp.zeros((ns, SUB, SUB), jnp.float32)
    ad, aqd = lax.fori_loop(0, SUB, body, (zero, zero))

    def spread(x3):  # [NS, SUB, SUB] -> [C, C]: block m on the diagonal, zero elsewhere
        tiled = jnp.broadcast_to(x3.reshape(n, 1, SUB), (n, ns, SUB)).reshape(n, n)
        return jnp.where(row // SUB == col // SUB, tiled, 0.0)

    return a + spread(ad), aq + spread(aqd)


def _intra_kernel(valid_ref, q_ref, k_ref, v_ref, g_ref, b_ref, rnq_ref, rnk_ref, alog_ref, dtb_ref,
                  w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gc_ref,
                  *, t_len: int, chunk: int, gate: str, lower_bound: float, anchored: bool, precision, inv_precision):
    """Refs (squeezed blocks): q, k [T, K], v [T, V] (the conv pass's outputs); g [T, K]; b [T];
    rnq, rnk [T] the L2-norm factors of q's and k's rows; A_log, dt_bias; outputs w, qg, kg [C, K],
    u [C, V], aqk [C, C], gc [K].
    The chunk is two halves of R = C/2 rows; the decay factors of half h are taken relative to
    O_h, the cumulative decay before it (see the module docstring); decays are in base 2. The
    work of a half is ordered so that its [R, K] tiles die early (register pressure)."""
    f32 = jnp.float32
    act = q_ref.dtype
    kd = q_ref.shape[1]
    hf = chunk // 2
    n = pl.program_id(1)
    t0 = n * chunk
    valid = valid_ref[...]
    a = jnp.exp(alog_ref[...].astype(f32))
    dtb = dtb_ref[...].astype(f32)  # [K]
    rows = jnp.arange(hf, dtype=jnp.int32)
    row, col = rows[:, None], rows[None, :]

    def load_rows(ref, start, inside):
        """Rows start .. start+R-1 of ref as fp32, those not inside (past T) 0. T a multiple of
        the chunk (static): every row lies before T, and plain loads drop the masks (their
        predicates and zero fills: ~0.26k of ~6.8k SASS instructions executed a thread, sm_90a)."""
        if t_len % chunk == 0:
            return ref[pl.ds(start, hf)].astype(f32)
        mask = inside if ref.ndim == 1 else inside[:, None]
        return pltriton.load(ref.at[pl.ds(start, hf)], mask=mask, other=0.0).astype(f32)

    def half(h, carry):
        """Half h of the chunk. carry: O_h [K] (the decay before the half, base 2) and half
        h-1's k ⊙ e^{O_h - G}, k ⊙ e^G, v, inverse and β for the cross block — zeros at h = 0,
        where the cross terms then vanish. A loop rather than two unrolled halves: the unrolled
        kernel was ~20k SASS instructions, and on the H200 half its stalls were instruction
        fetches (ncu)."""
        o_h, kt0, keg0, v0, inv0, beta0 = carry
        sl = pl.ds(pl.multiple_of(h * hf, hf), hf)
        other = pl.ds(pl.multiple_of((1 - h) * hf, hf), hf)  # h = 1: half 0's columns; h = 0: above the diagonal
        start = t0 + h * hf
        r = start + rows
        z = load_rows(g_ref, start, r < t_len)
        g = _gate2(z, dtb, a, gate=gate, lower_bound=lower_bound)
        g = jnp.where((r < valid)[:, None], g, 0.0)  # padding: no decay and (β = 0) no write
        beta = _sigmoid(load_rows(b_ref, start, r < t_len))
        beta = jnp.where(r < valid, beta, 0.0)
        gl = jnp.cumsum(g, axis=0)  # [R, K]: G - O_h, ≤ 0
        o_next = o_h + jnp.sum(g, axis=0)  # O_{h+1}
        inside = r < t_len
        # The conv pass's rows times their L2-norm factors (q's also carry K^-1/2)
        k = load_rows(k_ref, start, inside) * load_rows(rnk_ref, start, inside)[:, None]
        q = load_rows(q_ref, start, inside) * load_rows(rnq_ref, start, inside)[:, None]
        if anchored:
            a_hh, aqk_hh = _diag_bounded(q, k, g, gl, lower_bound=lower_bound, precision=precision)
        else:
            a_hh, aqk_hh = _diag_unbounded(q, k, g, gl, precision=precision)
        aqk_ref[sl, sl] = jnp.where(row >= col, aqk_hh, 0.0).astype(act)
        inv = _unit_lower_inverse(beta[:, None] * jnp.where(row > col, a_hh, 0.0), inv_precision)  # [R, R]
        # 2^x of an x near ±58 carries ~4e-6 relative error: these take their own exps, ≤ 1.
        egl = jnp.exp2(gl)
        ke, qe = k * egl, q * egl  # the row sides, relative to O_h
        kt = k * jnp.exp2((o_next - o_h)[None, :] - gl)  # k ⊙ e^{O_{h+1} - G} ≤ 1
        eo = jnp.exp2(o_h)[None, :]
        keg = ke * eo  # k ⊙ e^G, G from the chunk start
        qg_ref[sl, :] = (qe * eo).astype(act)
        v = load_rows(v_ref, start, inside)  # [R, V]
        tb = inv * beta[None, :]  # M⁻¹ diag(β), the diagonal block
        # The cross block (rows of half 1, columns of half 0), anchored at O_1: factors ≤ 1.
        aqk_ref[sl, other] = _dot(qe, kt0, precision, trans_b=True).astype(act)
        m10 = beta[:, None] * _dot(ke, kt0, precision, trans_b=True)  # [R, R]
        # M⁻¹'s lower-left block, times diag(β_0): -T_11 M_10 T_00 diag(β_0)
        tb10 = -_dot(inv, _dot(m10, inv0, inv_precision), inv_precision) * beta0[None, :]
        w_ref[sl, :] = (_dot(tb, keg, precision) + _dot(tb10, keg0, precision)).astype(act)
        u_ref[sl, :] = (_dot(tb, v, precision) + _dot(tb10, v0, precision)).astype(act)
        # kg = k ⊙ e^{G_C - G} needs G_C = O_2: both halves' rows are stored at h = 1 (half 0's
        # from the carry), and nothing at h = 0 — each address is written once, since two
        # stores of differently laid-out tiles to one address are unordered between threads.
        last = jnp.broadcast_to(h == 1, (hf, kd))
        pltriton.store(kg_ref.at[pl.ds(0, hf), :], (kt0 * jnp.exp2(o_next - o_h)[None, :]).astype(act), mask=last)
        pltriton.store(kg_ref.at[pl.ds(hf, hf), :], kt.astype(act), mask=last)
        return o_next, kt.astype(dot_in), keg.astype(dot_in), v.astype(dot_in), inv, beta

    # kt, keg and v cross to the second half as operands of its dots: with bf16 dots they are carried
    # rounded, as the dots round them anyway (kt also gives kg's first-half rows, rounded once more).
    # sm_90a, 2 warps: 604 -> 212 B of spills.
    dot_in = jnp.bfloat16 if isinstance(precision, str) and precision == "bf16" else f32
    zk = jnp.zeros((hf, kd), dot_in)
    init = (jnp.zeros((kd,), f32), zk, zk, jnp.zeros((hf, v_ref.shape[1]), dot_in),
            jnp.zeros((hf, hf), f32), jnp.zeros((hf,), f32))
    o_c = lax.fori_loop(0, 2, half, init)[0]
    gc_ref[...] = jnp.exp2(o_c)


def intra_pass(x: KdaInputs, w: KdaWeights, rn, valid, *, chunk, gate, lower_bound, precision, inv_precision,
           num_warps, interpret):
    """The intra kernel over x, whose q, k, v are the conv pass's outputs, and rn = (rnq, rnk)
    [B, H, T] their norm factors (`conv_pass`)."""
    b, t, c = x.q.shape
    h = x.b_in.shape[2]
    kd, vd = c // h, x.v.shape[2] // h
    n = -(-t // chunk)
    tp = n * chunk
    act = x.q.dtype
    # Anchored (dot) diagonal blocks when the decay over half a sub-block is bounded by ANCHOR_MAX.
    anchored = gate == "safe" and -lower_bound * SUB / 2 <= ANCHOR_MAX

    def blk(shape, index_map):
        return pl.BlockSpec(shape, index_map)

    in_specs = [
        blk((None,), lambda i, j, l: (i,)),  # valid
        blk((None, t, kd), lambda i, j, l: (i, 0, l)),  # q
        blk((None, t, kd), lambda i, j, l: (i, 0, l)),  # k
        blk((None, t, vd), lambda i, j, l: (i, 0, l)),  # v
        blk((None, t, None, kd), lambda i, j, l: (i, 0, l, 0)),  # g_in
        blk((None, t, None), lambda i, j, l: (i, 0, l)),  # b_in
        blk((None, None, t), lambda i, j, l: (i, l, 0)),  # rnq
        blk((None, None, t), lambda i, j, l: (i, l, 0)),  # rnk
        blk((None,), lambda i, j, l: (l,)),  # A_log
        blk((kd,), lambda i, j, l: (l,)),  # dt_bias
    ]
    out_specs = [
        blk((None, None, chunk, kd), lambda i, j, l: (i, l, j, 0)),  # w
        blk((None, None, chunk, vd), lambda i, j, l: (i, l, j, 0)),  # u
        blk((None, None, chunk, kd), lambda i, j, l: (i, l, j, 0)),  # qg
        blk((None, None, chunk, kd), lambda i, j, l: (i, l, j, 0)),  # kg
        blk((None, None, chunk, chunk), lambda i, j, l: (i, l, j, 0)),  # aqk
        blk((None, None, None, kd), lambda i, j, l: (i, l, j, 0)),  # gc
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, h, tp, kd), act),
        jax.ShapeDtypeStruct((b, h, tp, vd), act),
        jax.ShapeDtypeStruct((b, h, tp, kd), act),
        jax.ShapeDtypeStruct((b, h, tp, kd), act),
        jax.ShapeDtypeStruct((b, h, tp, chunk), act),
        jax.ShapeDtypeStruct((b, h, n, kd), jnp.float32),
    ]
    kernel = functools.partial(_intra_kernel, t_len=t, chunk=chunk, gate=gate, lower_bound=lower_bound,
                               anchored=anchored, precision=precision, inv_precision=inv_precision)
    return pl.pallas_call(
        kernel,
        grid=(b, n, h),  # heads fastest: neighbouring programs read neighbouring columns of a row
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_intra",
    )(valid, x.q, x.k, x.v, x.g_in, x.b_in, *rn, w.A_log, w.dt_bias)


# ----------------------------------------------------------------------------------------------
# Kernel 2: the recurrence over chunks, one program per (sequence, head, V-block).


def _state_kernel(w_ref, qg_ref, kg_ref, u_ref, aqk_ref, gc_ref, s0_ref, gate_ref, wn_ref, o_ref, s_ref,
                  *, t_len: int, chunk: int, n_chunks: int, eps: float, fuse_norm: bool, precision,
                  hi_lo: bool):
    """Refs (squeezed blocks): w, qg, kg [Tp, K]; u [Tp, BV]; aqk [Tp, C]; gc [N, K];
    s0 / s [K, BV]; gate [T, V] and wn [V] (fused norm only); o [T, BV]."""
    f32 = jnp.float32
    bits16 = jnp.dtype(w_ref.dtype).itemsize == 2

    def mm(a, b, *, contract_a=1):
        """a (stored, activation dtype) times b fp32. With 16-bit storage a is exact in its dtype
        and b enters in that dtype too, so a stays a shared-memory operand (no fp32 copy in
        registers): split into hi + lo (two dots, ~2x the mantissa bits of b), or rounded."""
        dims = (((contract_a,), (0,)), ((), ()))
        if not bits16:
            return _dot_general(a, b, dims, precision)
        b_hi = b.astype(a.dtype)
        out = lax.dot_general(a, b_hi, dims, preferred_element_type=f32)
        if hi_lo:
            out = out + lax.dot_general(a, (b - b_hi.astype(f32)).astype(a.dtype), dims, preferred_element_type=f32)
        return out

    def body(n, s):  # s [K, BV] fp32: the state at the start of chunk n
        r0 = pl.multiple_of(n * chunk, chunk)
        rows = pl.ds(r0, chunk)
        v_new = u_ref[rows, :].astype(f32) - mm(w_ref[rows, :], s)  # [C, BV]
        o = mm(qg_ref[rows, :], s) + mm(aqk_ref[rows, :], v_new)
        s = gc_ref[n, :][:, None] * s + mm(kg_ref[rows, :], v_new, contract_a=0)  # kgᵀ v_new
        real = (r0 + jnp.arange(chunk, dtype=jnp.int32)) < t_len
        o = o.astype(o_ref.dtype)
        if fuse_norm:  # BV == V: the whole row is here; the norm reads o rounded, as the model's
            gate = pltriton.load(gate_ref.at[rows, :], mask=real[:, None], other=0.0)
            o = gated_norm(o.astype(f32), gate, wn_ref[...], eps).astype(o_ref.dtype)
        pltriton.store(o_ref.at[rows, :], o, mask=real[:, None])
        return s

    s_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(f32))


def state_pass(inter, x: KdaInputs, w: KdaWeights, rec, *, chunk, eps, bv, precision, num_warps, num_stages,
           interpret, hi_lo: bool):
    wy, u, qg, kg, aqk, gc = inter
    b, h, tp, kd = wy.shape
    t = x.q.shape[1]
    vd = u.shape[3]
    nv = vd // bv
    fuse_norm = nv == 1

    def blk(shape, index_map):
        return pl.BlockSpec(shape, index_map)

    in_specs = [
        blk((None, None, tp, kd), lambda i, j, l: (i, j, 0, 0)),  # w
        blk((None, None, tp, kd), lambda i, j, l: (i, j, 0, 0)),  # qg
        blk((None, None, tp, kd), lambda i, j, l: (i, j, 0, 0)),  # kg
        blk((None, None, tp, bv), lambda i, j, l: (i, j, 0, l)),  # u
        blk((None, None, tp, chunk), lambda i, j, l: (i, j, 0, 0)),  # aqk
        blk((None, None, tp // chunk, kd), lambda i, j, l: (i, j, 0, 0)),  # gc
        blk((None, None, kd, bv), lambda i, j, l: (i, j, 0, l)),  # initial state
        blk((None, t, vd), lambda i, j, l: (i, 0, j)),  # gate_in (read only when fused)
        blk((vd,), lambda i, j, l: (0,)),  # o_norm weight
    ]
    out_specs = [
        blk((None, t, None, bv), lambda i, j, l: (i, 0, j, l)),  # o
        blk((None, None, kd, bv), lambda i, j, l: (i, j, 0, l)),  # final state
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, t, h, vd), x.q.dtype),
        jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32),
    ]
    kernel = functools.partial(_state_kernel, t_len=t, chunk=chunk, n_chunks=tp // chunk, eps=eps,
                               fuse_norm=fuse_norm, precision=precision, hi_lo=hi_lo)
    o, s = pl.pallas_call(
        kernel,
        grid=(b, h, nv),  # V-blocks fastest: the programs of one head share its loads in L2
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_prefill_state",
    )(wy, qg, kg, u, aqk, gc, rec, x.gate_in, w.o_norm)
    if not fuse_norm:  # the norm needs the whole V row, spread over V-blocks: a pass of its own
        o = norm_pass(o, x.gate_in, w.o_norm, eps=eps, interpret=interpret)
    return o, s


# ----------------------------------------------------------------------------------------------
# Kernel 3 (BV < V): the gated RMSNorm over whole V rows, one program per NORM_STEPS row blocks and head.

NORM_ROWS = 32  # rows per step of the norm pass
NORM_STEPS = 4  # steps per program, the next step's loads issued before this step's maths (bytes in flight;
# H200 timings: bench/history/kda_prefill.md)


def _norm_kernel(o_ref, gate_ref, wn_ref, y_ref, *, t_len: int, block_t: int, n_steps: int, eps: float):
    """Refs (squeezed blocks): o [T, V] (the state kernel's, activation dtype), gate [T, V], wn [V];
    y [T, V] = rmsnorm(o) · wn · σ(gate) over the program's rows, BT a step, in fp32 and rounded
    once (as `pallas_kernels.kda._gated_norm` of the rounded o)."""
    f32 = jnp.float32
    first = pl.program_id(1) * (block_t * n_steps)
    end = jnp.minimum(first + block_t * n_steps, t_len)
    cols = jnp.arange(o_ref.shape[1], dtype=jnp.int32)[None, :]
    wn = wn_ref[...].astype(f32)[None, :]

    def rows(t0):  # [BT, 1] clipped row indices (every address in bounds) and [BT, 1] the program's
        r = t0 + jnp.arange(block_t, dtype=jnp.int32)
        return jnp.clip(r, 0, t_len - 1)[:, None], (r < end)[:, None]

    def load(t0):
        idx, mine = rows(t0)
        return (pltriton.load(o_ref.at[idx, cols], mask=mine, other=0.0),
                pltriton.load(gate_ref.at[idx, cols], mask=mine, other=0.0))

    def step(i, tiles):
        t0 = first + i * block_t
        ahead = load(t0 + block_t)  # the next step's (none after the last: masked)
        o, gate = (a.astype(f32) for a in tiles)
        # `_gated_norm`'s maths with `_sigmoid` (two MUFU ops) for its σ, which lowers to a division
        o = o * lax.rsqrt(jnp.mean(o * o, axis=1, keepdims=True) + eps)
        y = o * wn * _sigmoid(gate)
        # A row slice, not the clipped indices: masked rows would repeat row T-1, and the
        # interpreter's masked scatter may write its stale value last
        pltriton.store(y_ref.at[pl.ds(t0, block_t)], y.astype(y_ref.dtype), mask=rows(t0)[1])
        return ahead

    lax.fori_loop(0, n_steps, step, load(first))


def norm_pass(o, gate_in, weight, *, eps: float, interpret: bool, block_t: int = NORM_ROWS,
               n_steps: int = NORM_STEPS, num_warps: int = 4):
    """o [B, T, H, V], gate_in [B, T, H·V], weight [V] -> the gated norm [B, T, H, V] in o's dtype.
    Bytes: o and gate read, y written (201 MB at Ling's T 8192)."""
    b, t, h, vd = o.shape
    bt = min(block_t, pl.next_power_of_2(t))
    n_steps = max(1, min(n_steps, -(-t // bt)))
    return pl.pallas_call(
        functools.partial(_norm_kernel, t_len=t, block_t=bt, n_steps=n_steps, eps=eps),
        grid=(b, -(-t // (bt * n_steps)), h),  # heads fastest: neighbours cover whole rows
        in_specs=[pl.BlockSpec((None, t, None, vd), lambda i, j, l: (i, 0, l, 0)),
                  pl.BlockSpec((None, t, vd), lambda i, j, l: (i, 0, l)),
                  pl.BlockSpec((vd,), lambda i, j, l: (0,))],
        out_specs=pl.BlockSpec((None, t, None, vd), lambda i, j, l: (i, 0, l, 0)),
        out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prefill_norm",
    )(o, gate_in, weight)


@functools.partial(jax.jit, static_argnames=("gate", "eps", "lower_bound", "chunk", "plan", "interpret"))
def _prefill_pallas(x: KdaInputs, w: KdaWeights, state: KdaState, valid, *, gate, eps, lower_bound, chunk, plan,
                    interpret):
    # The inverse's products as fp32 FMAs, the rest at the plan's precision; CPU (interpret): fp32
    # dots, except "bf16", whose operand rounding is explicit (so interpret tests exercise it).
    precision = lax.Precision.HIGHEST if interpret and plan.precision != "bf16" else PRECISIONS[plan.precision]
    inv_precision = PRECISIONS[INV_PRECISION]
    xc, rn, conv = conv_pass(x, w, state, valid, interpret=interpret)
    inter = intra_pass(xc, w, rn, valid, chunk=chunk, gate=gate, lower_bound=lower_bound, precision=precision,
                   inv_precision=inv_precision, num_warps=plan.intra_warps, interpret=interpret)
    o, rec = state_pass(inter, x, w, state.recurrent, chunk=chunk, eps=eps, bv=plan.bv, precision=precision,
                    num_warps=plan.state_warps, num_stages=plan.state_stages, interpret=interpret,
                    hi_lo=plan.state_hi_lo)
    return o, KdaState(*conv, rec)


def kda_prefill(x: KdaInputs, w: KdaWeights, state: KdaState, valid, *, gate: str = "safe", eps: float = 1e-6,
                lower_bound: float = -5.0, chunk: int = CHUNK, plan: Plan | None = None,
                backend: str = "auto"):
    """KDA over T new tokens of B sequences, valid [B] of them real (see the module docstring).
    Returns (o [B, T, H, V] in q's dtype, KdaState after the valid tokens: conv states [B, W-1, C]
    and the recurrent state [B, H, K, V] fp32)."""
    b, t, h, kd, vd, nw = check_args(x, w, state, gate)
    valid = jnp.clip(jnp.asarray(valid, jnp.int32).reshape(b), 0, t)
    backend = resolve(backend)
    if backend == "reference":
        return reference(x, w, state, valid, gate=gate, eps=eps, lower_bound=lower_bound, chunk=chunk)
    plan = default_plan(vd, x.q.dtype) if plan is None else plan
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731  (tensor-core dots, power-of-two blocks)
    if not (pow2(kd) and pow2(vd) and pow2(plan.bv) and vd % plan.bv == 0):
        raise ValueError(f"kda_prefill needs K={kd}, V={vd} and BV={plan.bv} powers of two >= 16, BV dividing V")
    if not (pow2(chunk) and chunk >= 2 * SUB):
        raise ValueError(f"chunk={chunk} must be a power of two >= {2 * SUB} (two halves of whole sub-blocks)")
    if not 2 <= nw <= 1 + chunk // 2:
        raise ValueError(f"conv width W={nw} must be 2..{chunk // 2 + 1}")
    if plan.precision not in PRECISIONS:
        raise ValueError(f"plan.precision must be one of {tuple(PRECISIONS)}, got {plan.precision!r}")
    return _prefill_pallas(x, w, state, valid, gate=gate, eps=float(eps), lower_bound=float(lower_bound),
                           chunk=chunk, plan=plan, interpret=backend == "interpret")

"""Fused dequantising matvec  y = x @ W^T  for grouped low-bit weights (decode and verify, M <= 16).

One entry, `qmatvec`, for both layouts of pallas_kernels/quant.py: the row layout (int4, int8)
runs the tensor-core Triton kernel of pallas_kernels/triton_qmatvec.py through jax_triton
(`rows_launch`, which the fused MoE's row-layout GEMMs share); the tile-transposed layout runs
the Pallas kernel below.

Layout (pallas_kernels/quant.py, tiles): words uint32 [T, WPR, B_N], scales (and zeros) bf16
[T, K/G, B_N]; inside a group of G columns, lane i of word w is column w + i*WPG (WPG = G*b/32).
x is bf16 [M, K], y is bf16 [M, N].

Grid: 1-D, one program per (active tile, K split): n_active * S programs. Program p owns tile
t = tiles[p // S] (tiles=None: t = p // S) and the groups [s*NG/S, (s+1)*NG/S) of its K range,
s = p % S. It walks its groups in a fori_loop; for each it loads the [CW, B_N] word block(s)
(unit stride), multiplies each lane i by the contiguous slice of x that lane i lines up with,
sums over the group and applies the group's scale once. No int->float conversion (quarter rate):
codes or-ed into the mantissa of a magic float. Two inner paths:
  "fma": CUDA-core multiply-adds into one [CW, B_N] accumulator tile per row of x (M = 1..2;
         each thread owns whole columns, so the sum over K stays in its registers): one and-or
         and one fma a weight, the group's offsets subtracted once (`compute_group_fma`).
  "mma": u - z in bf16, exact (int4: two codes an instruction by `int4_pairs`; int8: one and-or
         into 2^23 + u*2^off and one multiply-add a code, `lanes`, cast), and a tensor-core dot
         with x padded to 16 rows (M > 2), accumulated by the tensor cores (`dot_acc`).
Accumulation is float32 throughout. S = 1 writes bf16 y directly; S > 1 (split-K, so a small N
still fills the GPU) writes float32 partials [S, M, N_pad] that one XLA fusion sums, or, inside a
`pallas_kernels.tickets` scope, that the tile's last program sums in split order (the same launch).
Dequantised weights never leave registers.

Bytes moved: n_active/T * qw.nbytes of weights (words + scales + zeros, each read once; skipped
tiles are never addressed), x (M*K*2, L2 resident after the first programs) and y (M*N*2; plus
S*M*N_pad*4 twice when split).

Bound by the latency of the weight loads, neither by HBM nor by issue (bench/RESULTS.md): the int4
main loop compiles to 3.46 SASS instructions a weight on the fma path and 3.34 on the mma path
(`python -m bench.qmatvec_sass --pallas`), and on the fma path ptxas spreads a group's loads through
the loop, each shortly before its use, so a warp has few in flight.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import tickets
from pallas_kernels.backend import resolve
from pallas_kernels.int4_pairs import dot_acc, int4_pairs, subtrahend
from pallas_kernels.quant import QuantizedWeight, dequantize

MAX_M = 16
MMA_ROWS = 16  # tl.dot needs M >= 16: the mma path pads x's rows with masked loads
H200_SMS = 132


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call is launched (static). `qmatvec` picks it with `plan_for`."""

    path: str  # "fma" | "mma"
    split: int  # S: programs per tile along K
    num_warps: int
    num_stages: int = 2
    chunk_words: int = 32  # CW: most words of one group loaded at once (registers)
    prefetch: bool = False  # load the next group's words before computing this one


def plan_for(m: int, qw: QuantizedWeight, n_active: int) -> Plan:
    """Launch heuristics for the H200 (bench/qmatvec.py measures the alternatives).

    Split K until the grid has about 12 one-warp fma programs (about 4 four-warp mma programs)
    per SM: the kernel is latency-bound, so it needs warps in flight, and each program keeps
    whole groups.
    """
    wpg = qw.group_size * qw.bits // 32
    path = "fma" if m <= 2 or wpg < 16 else "mma"
    n_groups = qw.shape[1] // qw.group_size
    want = (12 if path == "fma" else 4) * H200_SMS
    divisors = [s for s in range(1, n_groups + 1) if n_groups % s == 0]
    split = next((s for s in divisors if n_active * s >= want), n_groups)
    if path == "fma":
        return Plan("fma", split, num_warps=max(1, qw.block_n // 128), chunk_words=8)
    return Plan("mma", split, num_warps=4, num_stages=3)


def reference(x, qw: QuantizedWeight, *, tiles=None):
    """Plain jnp: dequantise (float32, exact), multiply in float32, zero the inactive tiles."""
    w = dequantize(qw)  # [N, K] f32
    y = jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)  # [M, N]
    if tiles is not None:
        n = qw.shape[0]
        active = jnp.zeros((qw.n_tiles,), bool).at[tiles].set(True)
        y = jnp.where(jnp.repeat(active, qw.block_n)[:n], y, 0.0)
    return y.astype(jnp.bfloat16)


def lanes(words, bits, zero, magic):
    """Yield (lane, u - z as f32 [CW, B_N]) for the 32/bits lanes of words uint32 [CW, B_N].

    Or-ing the masked code into the mantissa of 2^23 gives 2^23 + u*2^off exactly; scaling by
    2^-off and subtracting 2^(23-off) + z is exact, so this equals an int->float conversion.
    Lanes that would reach bit 23 are taken from words >> 16 (one shift per word). magic is
    0x4B000000 read from memory: as a register, not an immediate, the and-or fuses into one LOP3.
    """
    high = words >> 16
    for i in range(32 // bits):
        src, off = words, i * bits
        if off + bits > 23:
            src, off = high, off - 16
        mant = (src & jnp.uint32((2**bits - 1) << off)) | magic
        f = lax.bitcast_convert_type(mant, jnp.float32)  # 2^23 + u * 2^off
        yield i, f * (2.0**-off) - (2.0 ** (23 - off) + zero)


def offset_lanes(words, bits, lane_magic):
    """Yield (lane, 2^c, f = 2^c + u as f32 [...]) for the 32/bits lanes of words uint32 [...].

    Each byte of a word is shifted once (not each code) so that its codes sit at mantissa offsets
    off = 15, 15 + b, ..; or-ing the masked code into the float 2^c (c = 23 - off; lane_magic[i]
    holds its bits for the byte's i-th code) gives 2^c + u exactly: one and-or a code. The
    caller subtracts sum_lanes (2^c + z) x once per group."""
    per_byte = 8 // bits
    for byte in range(4):
        shift = 15 - 8 * byte  # the byte's lowest code -> mantissa bit 15
        src = words << shift if shift > 0 else words >> -shift
        for i in range(per_byte):
            off = 15 + i * bits
            mant = (src & jnp.uint32((2**bits - 1) << off)) | lane_magic[i]
            yield byte * per_byte + i, 2.0 ** (23 - off), lax.bitcast_convert_type(mant, jnp.float32)


def lane_magics(bits):
    """The bits of 2^(23 - off_i), off_i = 15 + i*bits: `offset_lanes`' floats for a byte's codes."""
    return [(127 + 8 - i * bits) << 23 for i in range(8 // bits)]


def _kernel(*refs, m, n, bits, group_size, symmetric, block_n, plan, has_tiles, n_init, count, ticket_sums,
            interpret):
    refs = list(refs)
    x_ref = refs.pop(0)  # [M, K] bf16
    magic_ref = refs.pop(0)  # [1 + 8/b] uint32: 2^23, then 2^(23 - off_i) (fma)
    tiles_ref = refs.pop(0) if has_tiles else None  # [n_active] int32
    words_ref = refs.pop(0)  # [T, WPR, B_N] uint32
    scales_ref = refs.pop(0)  # [T, NG, B_N] bf16
    zeros_ref = None if symmetric else refs.pop(0)
    del refs[:n_init + ticket_sums]  # aliased initial values of the outputs: only their output refs are used
    out_ref = refs.pop(0)  # S == 1 or ticket sums: y [M, N] bf16; else partials [S, M, N_pad] f32
    touch_ref = refs.pop(0) if count else None  # [T, WPR] int32: rows of words read
    part_ref, counters_ref = (refs.pop(0), refs.pop(0)) if ticket_sums else (out_ref, None)  # [S, M, N_pad] f32

    wpg = group_size * bits // 32
    cw = min(wpg, plan.chunk_words)
    n_groups = x_ref.shape[1] // group_size
    groups_per_prog = n_groups // plan.split
    pid = pl.program_id(0)
    t = tiles_ref[pid // plan.split] if has_tiles else pid // plan.split
    split = pid % plan.split
    mma = plan.path == "mma"
    rows = MMA_ROWS if mma else m
    row_ok = jnp.arange(MMA_ROWS)[:, None] < m  # [16, 1]
    magic = magic_ref[0]  # 2^23: `lanes` (the mma path's int8)
    lane_magic = [magic_ref[1 + i] for i in range(8 // bits)]  # 2^(23 - off_i), off_i = 15 + i b (fma)
    evict = "evict_first"  # weights are streamed once: keep L2 for x

    n_chunks = wpg // cw
    g_first = split * groups_per_prog

    def load_group(g):  # the group's words: n_chunks x [CW, B_N] uint32
        chunks = []
        for c in range(n_chunks):
            w0 = g * wpg + c * cw
            chunks.append(pltriton.load(words_ref.at[t, pl.ds(w0, cw), :], eviction_policy=evict))
            if count:
                touch_ref[t, pl.ds(w0, cw)] = touch_ref[t, pl.ds(w0, cw)] + 1
        return tuple(chunks)

    def compute_group(g, chunks, acc):
        scale = scales_ref[t, g, :].astype(jnp.float32)  # [B_N]
        zero = 2.0 ** (bits - 1) if symmetric else zeros_ref[t, g, :].astype(jnp.float32)[None, :]
        if not mma:
            return compute_group_fma(chunks, g, scale, zero, acc)
        # Two [16, B_N] accumulator chains, alternating between lanes: shorter dependencies.
        part = [jnp.zeros((rows, block_n), jnp.float32)] * 2
        c_pairs = subtrahend(zero, (cw, block_n)) if bits == 4 else None
        for c, words in enumerate(chunks):
            if bits == 4:  # two codes an instruction, bf16 (exact)
                unpacked = enumerate(int4_pairs(words, c_pairs))
            else:
                unpacked = lanes(words, bits, zero, magic)
            for i, v in unpacked:  # v: [CW, B_N] = u - z (f32; bf16 from int4_pairs)
                x0 = g * group_size + i * wpg + c * cw  # lane i's contiguous slice of x
                xi = pltriton.load(
                    x_ref.at[pl.ds(0, MMA_ROWS), pl.ds(x0, cw)], mask=row_ok, other=0.0
                )  # [16, CW] bf16
                part[i % 2] = dot_acc(xi, v.astype(jnp.bfloat16), part[i % 2])
        return acc + (part[0] + part[1]) * scale[None, :]

    def compute_group_fma(chunks, g, scale, zero, acc):
        """One [CW, B_N] accumulator tile per row of x (every element its own chain), summed over
        CW once per group. No per-weight dequantisation: one and-or (`offset_lanes`) and one fma a
        weight accumulate sum_lanes (2^c + u) x; the group then subtracts sum_lanes (2^c + z) x
        (per element of x: cheap). Exact but for fp32's rounding of terms at most (256 + 2^b) / 2^b
        times the signal's."""
        part = [jnp.zeros((cw, block_n), jnp.float32)] * m
        corr = [jnp.zeros((cw,), jnp.float32)] * m  # sum_lanes 2^c x (+ z x when symmetric)
        sum_x = [jnp.zeros((cw,), jnp.float32)] * m  # sum_lanes x (zero points)
        for c, words in enumerate(chunks):
            for lane, base, f in offset_lanes(words, bits, lane_magic):  # f: [CW, B_N] = 2^c + u
                x0 = g * group_size + lane * wpg + c * cw  # the lane's contiguous slice of x
                for r in range(m):
                    xr = x_ref[jnp.int32(r), pl.ds(x0, cw)].astype(jnp.float32)  # [CW]
                    part[r] = part[r] + f * xr[:, None]  # [CW, B_N]
                    if symmetric:
                        corr[r] = corr[r] + (base + zero) * xr
                    else:
                        corr[r] = corr[r] + base * xr
                        sum_x[r] = sum_x[r] + xr
        out = []
        for r in range(m):
            sub = corr[r][:, None] if symmetric else corr[r][:, None] + zero * sum_x[r][:, None]
            out.append(acc[r] + jnp.sum(part[r] - sub, axis=0) * scale)  # [B_N]
        return tuple(out)

    init = jnp.zeros((rows, block_n), jnp.float32) if mma else (jnp.zeros(block_n, jnp.float32),) * m
    if plan.prefetch:
        # Software pipelining by hand: group j+1's words are in flight while group j is computed.
        def step(j, carry):
            acc, chunks = carry
            nxt = load_group(g_first + j + 1)
            return compute_group(g_first + j, chunks, acc), nxt

        last = g_first + groups_per_prog - 1
        acc, chunks = lax.fori_loop(0, groups_per_prog - 1, step, (init, load_group(g_first)))
        acc = compute_group(last, chunks, acc)
    else:
        def step(j, acc):
            g = g_first + j
            return compute_group(g, load_group(g), acc)

        acc = lax.fori_loop(0, groups_per_prog, step, init)

    cols = t * block_n + jnp.arange(block_n)
    ragged = n % block_n != 0

    def store_y(rows_of_y):  # [M or 16] rows of [B_N] fp32 -> y (bf16), masked to the real rows and columns
        if mma:
            pltriton.store(out_ref.at[pl.ds(0, MMA_ROWS), pl.ds(t * block_n, block_n)],
                           rows_of_y.astype(out_ref.dtype), mask=row_ok & (cols[None, :] < n))
        else:
            for r in range(m):
                pltriton.store(out_ref.at[jnp.int32(r), pl.ds(t * block_n, block_n)],
                               rows_of_y[r].astype(out_ref.dtype), mask=cols < n if ragged else None)

    if plan.split == 1:
        store_y(acc)
        return
    if mma:
        pltriton.store(part_ref.at[split, pl.ds(0, MMA_ROWS), pl.ds(t * block_n, block_n)], acc, mask=row_ok)
    else:
        for r in range(m):
            part_ref[split, jnp.int32(r), pl.ds(t * block_n, block_n)] = acc[r]
    if not ticket_sums:
        return

    # The tile's last program to arrive sums the S shares in split order (`pallas_kernels.tickets`).
    def barrier():  # the program's threads; the interpreter runs a program as one
        if not interpret:
            pltriton.debug_barrier()

    barrier()  # every thread's share stored before the ticket (an acquire-release atomic)
    ticket = pltriton.atomic_add(counters_ref, t, jnp.int32(1))
    barrier()

    @pl.when(ticket == plan.split - 1)
    def _():
        if mma:  # the partials hold M rows: the 16 of a tile masked to them
            def share(s_):
                return pltriton.load(part_ref.at[jnp.int32(s_), pl.ds(0, MMA_ROWS), pl.ds(t * block_n, block_n)],
                                     mask=row_ok, other=0.0)

            total = share(0)
            for s_ in range(1, plan.split):
                total = total + share(s_)
        else:
            total = [part_ref[0, jnp.int32(r), pl.ds(t * block_n, block_n)] for r in range(m)]
            for s_ in range(1, plan.split):
                total = [a + part_ref[s_, jnp.int32(r), pl.ds(t * block_n, block_n)] for r, a in enumerate(total)]
        store_y(total)
        counters_ref[t] = jnp.int32(0)  # zero again for the next ticket kernel


def _launch(x, qw: QuantizedWeight, tiles, plan: Plan, *, interpret, init=None, count=False, counters=None):
    """One pallas_call. init: initial output (aliased; needed when tiles are skipped). counters:
    split K with tickets (`pallas_kernels.tickets`; every tile computed): y in the launch, and the
    counters' buffer returned after y (aliased).

    Returns the raw output (y or the split partials) and, with count=True, the touch counts.
    """
    m, k = x.shape
    n = qw.shape[0]
    n_active = qw.n_tiles if tiles is None else tiles.shape[0]
    if (k // qw.group_size) % plan.split:
        raise ValueError(f"plan.split={plan.split} must divide the {k // qw.group_size} groups of K")
    if plan.path == "mma" and qw.group_size * qw.bits // 32 < 16:
        raise ValueError("the mma path needs >= 16 words per group (tl.dot's K >= 16)")
    if count and init is None:
        raise ValueError("count=True needs init (the aliased outputs are positional)")
    ticket_sums = counters is not None and plan.split > 1
    if ticket_sums and (tiles is not None or count):
        raise ValueError("split K with tickets computes every tile (tiles=None) and counts nothing")
    partials = jax.ShapeDtypeStruct((plan.split, m, qw.n_tiles * qw.block_n), jnp.float32)
    if plan.split == 1 or ticket_sums:
        out_shape = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    else:
        out_shape = partials
    magic = jnp.array([0x4B000000] + lane_magics(qw.bits), jnp.uint32)
    inputs = [x, magic] + ([] if tiles is None else [tiles]) + [qw.words, qw.scales]
    inputs += [] if qw.symmetric else [qw.zeros]
    out_shapes, inits = [out_shape], []
    if init is not None:
        inits.append(init)
    if count:
        out_shapes.append(jax.ShapeDtypeStruct(qw.words.shape[:2], jnp.int32))
        inits.append(jnp.zeros(qw.words.shape[:2], jnp.int32))
    aliases = {len(inputs) + i: i for i in range(len(inits))}
    if ticket_sums:  # the partials (scratch), then the counters, aliased
        out_shapes += [partials, jax.ShapeDtypeStruct(counters.shape, counters.dtype)]
        aliases[len(inputs) + len(inits)] = len(out_shapes) - 1
        inits.append(counters)
    kernel = functools.partial(
        _kernel,
        m=m,
        n=n,
        bits=qw.bits,
        group_size=qw.group_size,
        symmetric=qw.symmetric,
        block_n=qw.block_n,
        plan=plan,
        has_tiles=tiles is not None,
        n_init=len(inits) - ticket_sums,
        count=count,
        ticket_sums=ticket_sums,
        interpret=interpret,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shapes),
        grid=(n_active * plan.split,),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=plan.num_warps, num_stages=plan.num_stages
        ),
        name=f"qmatvec_{plan.path}_int{qw.bits}",
    )(*inputs, *inits)
    if ticket_sums:
        return outs[0], outs[-1]
    return outs if count else outs[0]


def _finish(out, n, plan: Plan):
    if plan.split == 1:
        return out
    return out.sum(axis=0)[:, :n].astype(jnp.bfloat16)  # one XLA fusion over [S, M, N_pad]


STAGES = {"matvec": 0, "up": 1, "down": 2}


def rows_launch(stage: str, a, qw: QuantizedWeight, *, out, m: int, plan, expert=None, pairs=None,
                n_blocks: int = 1, topk: int = 1, direct: bool = False, limit=None, block_m: int = MMA_ROWS):
    """One launch of the row layout's tensor-core kernel (`triton_qmatvec.rows_kernel`, through
    jax_triton), its split-K sum included. stage "matvec": a = x [M, K] -> y [M, N] bf16;
    "up" / "down": a MoE's GEMMs over n_blocks blocks of block_m rows (`fused_moe`). out: the
    result's jax.ShapeDtypeStruct; expert, pairs: int32 arrays as the kernel reads them (see there)."""
    n, k = qw.shape
    groups = k // qw.group_size
    if groups % plan.split or (groups // plan.split) % plan.groups_per_iter:
        raise ValueError(f"plan {plan}: split must divide the {groups} groups of K and groups_per_iter "
                         "the groups a split")
    try:
        import jax_triton as jt
    except ImportError as e:
        raise ImportError("weights in the row layout run Triton kernels through jax-triton, which is not installed: "
                          "pip install 'ling-serve[gpu]', or quantise with --quantize-layout tiles") from e

    from pallas_kernels import triton_qmatvec as tq
    from pallas_kernels.triton_ffi import use_ffi_target

    use_ffi_target()  # the custom call XLA's command buffers (CUDA graphs) capture

    e = qw.words.shape[0] if qw.words.ndim == 3 else 1
    tiles = -(-n // plan.block_n)
    rows = out.shape[0]
    dummy = jnp.zeros((1,), jnp.int32)
    out_shapes = [out, jax.ShapeDtypeStruct((plan.split, rows, n) if plan.split > 1 else (1,), jnp.float32),
                  jax.ShapeDtypeStruct((n_blocks * tiles,), jnp.int32)]  # the (block, tile) tickets
    res, _, _ = jt.triton_call(
        a, qw.words, qw.scales, qw.scales if qw.symmetric else qw.zeros,
        dummy if expert is None else expert, dummy if pairs is None else pairs,
        kernel=tq.rows_kernel, out_shape=out_shapes, grid=(n_blocks, tiles, plan.split),
        num_warps=plan.num_warps, num_stages=1, zeroed_outputs=(2,) if plan.split > 1 else (),
        name=f"rows_{stage}_int{qw.bits}",
        M=m, N=n, K=k, R=rows, E=e, TOPK=topk, STAGE=STAGES[stage], DIRECT=direct,
        HAS_LIMIT=limit is not None, LIMIT=0.0 if limit is None else float(limit),
        BN=plan.block_n, S=plan.split, GPI=plan.groups_per_iter, LW=plan.num_warps.bit_length() - 1,
        SYMMETRIC=qw.symmetric, BITS=qw.bits, MP=block_m, COMPILED=True)
    return res


def _rows(x, qw: QuantizedWeight, plan):
    """The row layout's matvec: one launch."""
    from pallas_kernels.rows_plan import rows_plan_for

    m, k = x.shape
    n = qw.shape[0]
    return rows_launch("matvec", x, qw, out=jax.ShapeDtypeStruct((m, n), jnp.bfloat16), m=m,
                       plan=plan or rows_plan_for(m, n, k))


def qmatvec(x, qw: QuantizedWeight, *, tiles=None, backend="auto", plan=None):
    """y = x @ W^T: x [M, K] (M = 1..16) -> bf16 [M, N], W the quantised [N, K] weight.

    tiles: optional int32 [n_active] indices in [0, qw.n_tiles) of the output tiles (qw.block_n
    rows each) to compute, each at most once; the other tiles' outputs are zero and their
    weights are never read (the grid has n_active * split programs). Tile layout only.
    backend: "pallas" (GPU: the Pallas kernel for tiles, the Triton kernel for rows, which needs
    jax_triton), "interpret" (the Pallas kernel on CPU; tile layout only: the row layout's kernel
    runs in Triton's own interpreter, tests/triton_interpret.py), "reference" (plain jnp), "auto"
    (pallas on GPU, reference elsewhere). plan overrides the launch heuristics (a `Plan` for
    tiles, a `rows_plan.RowsPlan` for rows).
    """
    backend = resolve(backend)
    if x.ndim != 2 or x.shape[1] != qw.shape[1]:
        raise ValueError(f"x must be [M, K={qw.shape[1]}], got shape {x.shape}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x must have 1..{MAX_M} rows (M), got {x.shape[0]}")
    if tiles is not None and (tiles.ndim != 1 or not jnp.issubdtype(tiles.dtype, jnp.integer)):
        raise ValueError(f"tiles must be a 1-D integer array, got {tiles.dtype}{tiles.shape}")
    if tiles is not None and qw.layout == "rows":
        raise ValueError("tiles= selects output tiles of the tile layout; this weight is in the row layout")
    if backend == "reference":
        return reference(x, qw, tiles=tiles)
    x = x.astype(jnp.bfloat16)
    if qw.layout == "rows":
        if backend == "interpret":
            raise ValueError("the row layout's kernel is Triton's (jax_triton), which Pallas' interpret "
                             "mode cannot run: use backend='reference' on CPU, or "
                             "tests/triton_interpret.py for Triton's interpreter")
        return _rows(x, qw, plan)
    n_active = qw.n_tiles if tiles is None else tiles.shape[0]
    if tiles is not None:
        tiles = tiles.astype(jnp.int32)
    plan = plan or plan_for(x.shape[0], qw, n_active)
    init = None
    if tiles is not None:  # inactive tiles are never written: start from zeros
        shape = (x.shape[0], qw.shape[0]) if plan.split == 1 else (
            plan.split, x.shape[0], qw.n_tiles * qw.block_n)
        init = jnp.zeros(shape, jnp.bfloat16 if plan.split == 1 else jnp.float32)
    scope = tickets.current()
    if scope is not None and plan.split > 1 and tiles is None and qw.n_tiles <= tickets.CAPACITY:
        y, counters = _launch(x, qw, tiles, plan, interpret=backend == "interpret",
                              counters=scope.take(qw.n_tiles))
        scope.give(counters)
        return y
    out = _launch(x, qw, tiles, plan, interpret=backend == "interpret", init=init)
    return _finish(out, qw.shape[0], plan)

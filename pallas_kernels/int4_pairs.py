"""`int4_pairs` and `dot_acc`: the two Triton ops the tensor-core paths of the int4 kernels unpack with.

`int4_pairs`: 32-bit words of eight int4 codes -> the eight exact bf16 values u - z, two codes an
instruction, for the tensor-core (dot) paths of the low-bit kernels.

Lanes j and j + 4 of a word (bits [4j, 4j + 4) and [16 + 4j, 20 + 4j)) fill the low mantissa bits of
a bf16 pair under one and-or with 0x43004300 (bf16 128.0): (128 + u_j, 128 + u_{j+4}) exactly. One
bf16x2 fma adds c = -(128 + z) to both halves: the exact integers u - z (|u - z| < 16; z an integer
zero point in [0, 16)). Per word: 3 shifts, 4 LOP3 and 4 HFMA2 for 8 weights, where the float32
magic number (`qmatvec.lanes`) takes a shift, an and-or and an add a weight, then a conversion to
bf16 every two.

    words uint32 [...], c uint32 [...] (the bf16 pair (-(128 + z), -(128 + z)); broadcast to words'
    shape) -> 8 x bf16 [...]: lanes 0..7 in order (lane i of word w is the layout's column w + i*WPG).

A primitive of its own because Pallas' `elementwise_inline_asm` lowers one result only. Its Triton
lowering is the inline PTX; every other backend (interpret mode on the CPU) runs the same bits in
jnp, so CI checks the kernels' logic and the GPU tests check the PTX against the same reference.

`dot_acc(a, b, acc)`: acc + a @ b (bf16 [M, K] @ [K, N], fp32 acc [M, N]) as one `tt.dot` with acc
as its accumulator. Pallas lowers `acc + jnp.dot(a, b)` to a dot from zeros and an add, which
Triton does not fold for floats (reassociation), so the lanes' K = WPG dots would pay one FADD an
accumulator element each; here the tensor cores accumulate. Elsewhere: acc + the float32 dot.

These are jax._src internals, as in `relaxed_atomic`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering

LANES = 8
MAGIC = 0x43004300  # the bf16 pair (128.0, 128.0)

# $0..$7: lanes 0, 4, 1, 5, 2, 6, 3, 7 of the word $8; $9: the bf16 pair c.
_PTX = """{
.reg .b32 t, s, one;
mov.b32 one, 0x3F803F80;
lop3.b32 t, $8, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 t, t, one, $9;
mov.b32 {$0, $1}, t;
shr.u32 s, $8, 4;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 t, t, one, $9;
mov.b32 {$2, $3}, t;
shr.u32 s, $8, 8;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 t, t, one, $9;
mov.b32 {$4, $5}, t;
shr.u32 s, $8, 12;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xea;
fma.rn.bf16x2 t, t, one, $9;
mov.b32 {$6, $7}, t;
}"""
_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the PTX's outputs, by lane

int4_pairs_p = jax_core.Primitive("int4_pairs")
int4_pairs_p.multiple_results = True


@int4_pairs_p.def_abstract_eval
def _abstract_eval(words, c):
    if words.shape != c.shape or words.dtype != jnp.uint32 or c.dtype != jnp.uint32:
        raise ValueError(f"int4_pairs: words and c must be uint32 of one shape, got {words} and {c}")
    return [jax_core.ShapedArray(words.shape, jnp.bfloat16)] * LANES


def _jnp(words, c):
    """The PTX's bits in jnp: each half of a pair read as the float32 it is the top of (exact)."""
    def top(x):  # a bf16 in the top half of x -> that value as float32
        return lax.bitcast_convert_type(x & jnp.uint32(0xFFFF0000), jnp.float32)

    c32 = top(c)
    out = [None] * LANES
    for j in range(LANES // 2):
        t = ((words >> jnp.uint32(4 * j)) & jnp.uint32(0x000F000F)) | jnp.uint32(MAGIC)
        out[j] = (top(t << jnp.uint32(16)) + c32).astype(jnp.bfloat16)
        out[j + 4] = (top(t) + c32).astype(jnp.bfloat16)
    return out


int4_pairs_p.def_impl(lambda words, c: _jnp(words, c))
mlir.register_lowering(int4_pairs_p, mlir.lower_fun(_jnp, multiple_results=True))


@lowering.register_lowering(int4_pairs_p)
def _triton_lowering(ctx: lowering.LoweringRuleContext, words, c):
    shape = ctx.avals_out[0].shape
    bf16 = lowering._dtype_to_ir_type(jnp.dtype(jnp.bfloat16))
    result = ir.RankedTensorType.get(shape, bf16) if shape else bf16
    op = tt_dialect.ElementwiseInlineAsmOp([result] * LANES, _PTX, constraints="=h," * LANES + "r,r",
                                           pure=True, packed_element=1, args=[words, c])
    by_lane = [None] * LANES
    for k, lane in enumerate(_ORDER):
        by_lane[lane] = op.results[k]
    return by_lane


def subtrahend(zero, shape) -> jax.Array:
    """c for `int4_pairs`, uint32 [shape]: -(128 + z) as a bf16 pair (z: an integer, a float or a
    float array that broadcasts to shape, e.g. a group's zero points [1, B_N])."""
    z = jnp.broadcast_to(jnp.asarray(zero, jnp.float32), shape)
    bits = lax.bitcast_convert_type((-(128.0 + z)).astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    return bits | (bits << jnp.uint32(16))


def int4_pairs(words, c):
    """words, c uint32 [...] -> the 8 lanes' u - z, bf16 [...] each (see the module docstring)."""
    return int4_pairs_p.bind(words, c)


dot_acc_p = jax_core.Primitive("dot_acc")


@dot_acc_p.def_abstract_eval
def _dot_acc_abstract_eval(a, b, acc):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or acc.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"dot_acc: a [M, K], b [K, N], acc [M, N], got {a}, {b}, {acc}")
    if a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16 or acc.dtype != jnp.float32:
        raise ValueError(f"dot_acc: a and b bf16, acc float32, got {a.dtype}, {b.dtype}, {acc.dtype}")
    return jax_core.ShapedArray(acc.shape, jnp.float32)


def _dot_acc_jnp(a, b, acc):
    return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)


dot_acc_p.def_impl(_dot_acc_jnp)
mlir.register_lowering(dot_acc_p, mlir.lower_fun(_dot_acc_jnp, multiple_results=False))


@lowering.register_lowering(dot_acc_p)
def _dot_acc_triton(ctx: lowering.LoweringRuleContext, a, b, acc):
    return tt_dialect.dot(a, b, acc)


def dot_acc(a, b, acc):
    """acc + a @ b, the tensor cores accumulating into acc (see the module docstring)."""
    return dot_acc_p.bind(a, b, acc)

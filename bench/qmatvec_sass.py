"""The row layout's tensor-core kernel (pallas_kernels.triton_qmatvec) compiled offline for sm_90a:
SASS instructions per weight in its main loop, registers, spills, shared memory, for the plans
`rows_plan_for` picks at the model's shapes: the matvecs of Ling-3.0-flash's decode step, and the
up and down GEMMs of its routed experts (top-8 of 512, D 2560, I 768; M = 1: one pair a block,
direct). No GPU needed:

    pip install triton==3.6.0   # in an environment of its own (it breaks the CPU oracle)
    python -m bench.qmatvec_sass [--out DIR]
    pip install jax==0.10.2 && python -m bench.qmatvec_sass --pallas   # + the Pallas kernel, same run

Per weight, two counts: the main loop's SASS (between a backward branch and its target) over a
thread's share of an iteration (BN * 128 * GPI / (32 * num_warps) weights), and the whole
program's (every static instruction once, plus the loop body once more an extra iteration) over
its share of the program; the second counts the launch's fixed costs (addresses, the partial's
store, the ticket, the last program's sum) and applies when a program is one iteration (no
loop). The pointer arguments are declared 16-byte aligned, as jax_triton declares JAX's buffers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

from bench.sass import main_loop, opcodes
from pallas_kernels.rows_plan import MP, RowsPlan, moe_rows_plans, rows_plan_for

SHAPES = [  # (name, N, K): the projections of Ling-3.0-flash's decode step and its lm_head
    ("kda in_proj (q|k|v|f|g|b)", 12352, 2560),
    ("o_proj", 2560, 4096),
    ("lm_head", 157184, 2560),
    ("20480 x 2560", 20480, 2560),
    ("4096 x 2560", 4096, 2560),
]
CORE = ("LOP3", "SHF", "HADD2", "HFMA2", "HGMMA", "FFMA")  # the dequantise-and-multiply instructions


MOE = dict(d=2560, inter=768, experts=512, topk=8)


def compile_sm90(plan: RowsPlan, m: int, n: int, k: int, symmetric: bool = True, stage: int = 0,
                 blocks: int = 1, bits: int = 4, block_m: int = MP) -> dict:
    """Compile the kernel for one call's constants; returns sass text, registers, spills, smem.
    stage 1 / 2: a MoE's up / down GEMM over `blocks` blocks of block_m pairs (M = 1: direct)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pallas_kernels import triton_qmatvec as tq

    sig = {"a_ptr": "*bf16", "w_ptr": "*u32", "s_ptr": "*bf16", "z_ptr": "*bf16", "expert_ptr": "*i32",
           "pair_ptr": "*i32", "out_ptr": "*fp32" if stage == 2 else "*bf16", "part_ptr": "*fp32",
           "ticket_ptr": "*i32"}
    moe = stage > 0
    consts = dict(M=m, N=n, K=k, R=blocks * block_m if moe else m, E=MOE["experts"] if moe else 1,
                  TOPK=MOE["topk"] if moe else 1, STAGE=stage, DIRECT=moe and m == 1, HAS_LIMIT=False, LIMIT=0.0,
                  BN=plan.block_n, S=plan.split, GPI=plan.groups_per_iter,
                  LW=plan.num_warps.bit_length() - 1, SYMMETRIC=symmetric, BITS=bits, MP=block_m, COMPILED=True)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    src = ASTSource(fn=tq.rows_kernel, signature=sig, constexprs=consts, attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=plan.num_warps, num_stages=1))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(kern.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(kern.asm["ptx"])
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True, check=True).stdout
        ptxas = subprocess.run([os.path.join(bin_dir, "ptxas"), "--gpu-name", "sm_90a", "-v", ptx, "-o",
                                os.devnull], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", ptxas)
    spill = re.search(r"(\d+) bytes spill stores", ptxas)
    return dict(sass=sass, ttgir=kern.asm["ttgir"], regs=regs and int(regs.group(1)),
                spill=spill and int(spill.group(1)), smem=kern.metadata.shared)


def report(m: int, out: str | None, log=print, bits: int = 4) -> list[dict]:
    rows = []
    d, inter, topk = MOE["d"], MOE["inter"], MOE["topk"]
    blocks = m * topk  # M = 1: one pair a block; verify sizes: at most one block a pair
    up, down = moe_rows_plans(blocks, inter, d)
    moe = [(f"MoE up ({blocks} blocks)", 2 * inter, d, 1, blocks, up, MP),
           (f"MoE down ({blocks} blocks)", d, inter, 2, blocks, down, MP)]
    if m == 1:  # and a 4096-token prefill chunk's experts, in blocks of 64 pairs (<= P/64 + E blocks)
        pre = 4096 * topk // 64 + MOE["experts"]
        pup, pdown = moe_rows_plans(pre, inter, d, 64)
        moe += [(f"MoE up, prefill ({pre} blocks of 64)", 2 * inter, d, 1, pre, pup, 64),
                (f"MoE down, prefill ({pre} blocks of 64)", d, inter, 2, pre, pdown, 64)]
    calls = [(nm, n, k, 0, 1, rows_plan_for(m, n, k), MP) for nm, n, k in SHAPES] + moe
    for name, n, k, stage, nblk, plan, block_m in calls:
        rec = compile_sm90(plan, 4096 if block_m > MP else m, n, k, stage=stage, blocks=nblk, bits=bits,
                           block_m=block_m)
        ops, every = main_loop(rec["sass"]), opcodes(rec["sass"])
        weights = plan.block_n * 128 * plan.groups_per_iter / (32 * plan.num_warps)
        iters = k // 128 // plan.split // plan.groups_per_iter
        total = sum(ops.values())
        program = sum(every.values()) + total * (iters - 1)
        core = sum(ops[o] for o in CORE) if total else sum(every[o] for o in CORE)
        rows.append(dict(shape=name, n=n, k=k, plan=plan, regs=rec["regs"], spill=rec["spill"],
                         smem=rec["smem"], loop=total, per_weight=total / weights if total else None,
                         program_per_weight=program / (weights * iters),
                         core_per_weight=core / weights, ops=dict((ops or every).most_common(12))))
        if out:
            os.makedirs(out, exist_ok=True)
            stem = os.path.join(out, f"rows_int{bits}_m{m}_{n}x{k}_stage{stage}")
            with open(stem + ".sass", "w") as f:
                f.write(rec["sass"])
            with open(stem + ".ttgir", "w") as f:
                f.write(rec["ttgir"])
        log(f"M={m} {name} ({n}x{k}) {plan}: {rec['regs']} regs, spill {rec['spill']} B, smem {rec['smem']} B; "
            f"loop {total} instructions / {weights:.0f} weights a thread, {iters} iterations; "
            f"{dict((ops or every).most_common(12))}")
    log(f"\nint{bits}:\n| shape | M | plan (BN, S, GPI, warps) | instructions / weight: loop, program | of which "
        "unpack + mma + scale | regs |")
    log("|---|---|---|---|---|---|")
    for r in rows:
        p = r["plan"]
        loop = "—" if r["per_weight"] is None else f"{r['per_weight']:.2f}"
        log(f"| {r['shape']} {r['n']}x{r['k']} | {m} | {p.block_n}, {p.split}, {p.groups_per_iter}, "
            f"{p.num_warps} | {loop}, {r['program_per_weight']:.2f} | {r['core_per_weight']:.2f} | {r['regs']} |")
    return rows


def pallas_report(log=print) -> None:
    """The tile layout's Pallas qmatvec (int4, its `plan_for` plans), lowered to Triton IR here and
    compiled the same way: its main loop per weight (one group of one 128-row tile an iteration)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import tempfile

    import jax
    import jax.numpy as jnp
    import triton
    from triton.backends.compiler import GPUTarget

    from bench.sass import capture_triton
    from pallas_kernels.qmatvec import plan_for, qmatvec
    from pallas_kernels.quant import QuantizedWeight

    captured: list = []
    capture_triton(captured)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for m, (name, n, k) in [(1, SHAPES[2]), (1, SHAPES[3]), (6, SHAPES[2])]:
        t = n // 128
        qw = QuantizedWeight(jax.ShapeDtypeStruct((t, k // 8, 128), jnp.uint32),
                             jax.ShapeDtypeStruct((t, k // 128, 128), jnp.bfloat16), None, 4, 128, True, (n, k))
        plan = plan_for(m, qw, t)
        captured.clear()
        jax.jit(lambda x, w: qmatvec(x, w, backend="pallas", plan=plan)).trace(
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16), qw).lower(lowering_platforms=("cuda",))
        with tempfile.TemporaryDirectory() as tmp:
            ttir, cubin = os.path.join(tmp, "k.ttir"), os.path.join(tmp, "k.cubin")
            with open(ttir, "w") as f:
                f.write(captured[0])
            kern = triton.compile(ttir, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
            with open(cubin, "wb") as f:
                f.write(kern.asm["cubin"])
            sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True,
                                  text=True, check=True).stdout
        ops = main_loop(sass, needs=None)
        weights = 128 * 128 / (32 * plan.num_warps)
        log(f"| Pallas qmatvec (tiles) {name} {n}x{k} | {m} | {plan.path}, split {plan.split}, "
            f"{plan.num_warps} warps | {sum(ops.values()) / weights:.2f} | {dict(ops.most_common(6))} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 6], help="rows of x (tokens)")
    ap.add_argument("--out", default=None, help="directory for each kernel's SASS and TTGIR")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    ap.add_argument("--pallas", action="store_true", help="also the tile layout's Pallas qmatvec (needs jax)")
    args = ap.parse_args()
    if args.pallas:
        print("| kernel | M | plan | main loop, instructions a weight | top opcodes |\n|---|---|---|---|---|")
        pallas_report()
    for bits in args.bits:
        for m in args.m:
            report(m, args.out, bits=bits)


if __name__ == "__main__":
    main()

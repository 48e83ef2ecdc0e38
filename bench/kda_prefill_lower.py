"""bench.kda_prefill_check --lower: every plan of the sweep (both gates) lowered at the timed shapes
to Triton IR, one file a pallas_call, on the CPU (the sm_90a compile report is bench/sass.py's).
"""

from __future__ import annotations

import os


from bench.kda_prefill_common import B, H, KD, T, W, log
from bench.sass import capture_triton, kernel_name


def lower_all(out_dir, args):
    """Lower every plan of the sweep (both gates) at the timed shapes and keep each pallas_call's
    Triton module; jax 0.11 asks the local GPU for its compute capability: told sm_90."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import kda, kda_prefill as kp

    captured = []
    capture_triton(captured)
    os.makedirs(out_dir, exist_ok=True)
    sds = jax.ShapeDtypeStruct
    bf, f32, c = jnp.bfloat16, jnp.float32, H * KD
    x = kda.KdaInputs(sds((B, T, c), bf), sds((B, T, c), bf), sds((B, T, c), bf), sds((B, T, H, KD), bf),
                      sds((B, T, H), bf), sds((B, T, c), bf))
    w = kda.KdaWeights(sds((c, W), f32), sds((c, W), f32), sds((c, W), f32), sds((H,), f32), sds((c,), f32),
                       sds((KD,), bf))
    s = kda.KdaState(sds((B, W - 1, c), bf), sds((B, W - 1, c), bf), sds((B, W - 1, c), bf), sds((B, H, KD, KD), f32))
    chunk = args.chunk or kp.CHUNK
    plans = [kp.default_plan(KD, bf), kp.Plan(bv=32, intra_warps=2), kp.Plan(bv=32, intra_warps=4),
             kp.Plan(bv=32, intra_warps=8), kp.Plan(bv=64, state_warps=8, state_stages=2),
             kp.Plan(bv=128, state_warps=8, state_stages=2), kp.Plan(bv=32, precision="bf16x3")]
    for gate in args.gates:
        for plan in plans:
            n0 = len(captured)
            jax.jit(lambda x, w, s, v: kp.kda_prefill(x, w, s, v, gate=gate, plan=plan, chunk=chunk,
                                                            backend="pallas")).trace(
                x, w, s, sds((B,), jnp.int32)).lower(lowering_platforms=("cuda",))
            for i, ir in enumerate(captured[n0:]):  # conv pass x 3, intra, state, (norm pass)
                name = kernel_name(ir).removeprefix("kda_prefill_")
                nw = {"intra": plan.intra_warps, "state": plan.state_warps}.get(name, 4)
                ns = plan.state_stages if name == "state" else 1
                tag = f"{gate}_c{chunk}_{i}{name}_bv{plan.bv}_{plan.precision}_w{nw}_s{ns}"
                with open(os.path.join(out_dir, tag + ".ttir"), "w") as f:
                    f.write(ir)
                log(f"lowered {tag}")


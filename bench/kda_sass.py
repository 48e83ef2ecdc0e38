"""The KDA decode and verify kernels (pallas_kernels/kda.py, and decode's epilogue,
pallas_kernels/kda_epilogue.py) compiled offline for sm_90a, at Ling's
shapes (32 heads of 128, conv width 4, batch 1, the fused projection's columns read in place):
registers, spills, shared memory and SASS instructions per program (`bench.sass.compile_report`).
No GPU needed, only the triton package beside jax:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.6.0 jax==0.10.2 "numpy<2.4"
    /tmp/tv/bin/python -m bench.kda_sass [--out DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.sass import capture_triton, compile_report, out_dir_arg  # noqa: E402
from pallas_kernels import kda  # noqa: E402

H, K, W = 32, 128, 4  # Ling-3.0-flash's KDA heads, head dim, conv width
C = H * K


def lower(name: str, t: int, decode: bool, out_dir: str) -> None:
    """Lowers one call at batch 1 and T = t and writes its Triton IR to out_dir as
    `{name}_w{warps}_s1.ttir` (the name `compile_report` reads the launch options from)."""
    s = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    w = kda.KdaWeights(s((C, W), f32), s((C, W), f32), s((C, W), f32), s((H,), f32), s((C,), f32), s((K,), bf))
    state = kda.KdaState(s((1, W - 1, C), bf), s((1, W - 1, C), bf), s((1, W - 1, C), bf), s((1, H, K, K), f32))

    def call(proj, b_in, w, state, valid):
        x = kda.KdaInputs(kda.Columns(proj, 0, C), kda.Columns(proj, C, C), kda.Columns(proj, 2 * C, C),
                          kda.Columns(proj, 3 * C, C), b_in, kda.Columns(proj, 4 * C, C))
        if decode:
            return kda.kda_decode(x, w, state, valid, backend="pallas")
        return kda.kda_verify(x, w, state, backend="pallas")

    captured: list = []
    capture_triton(captured)
    jax.jit(call).trace(s((1, t, 5 * C), bf), s((1, t, H), bf), w, state, s((1,), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    warps = kda.default_num_warps(K, kda.default_bv(K, t))
    kernels = [(name, warps, captured[0])]
    if decode:  # and its epilogue (gated norm, conv states)
        kernels.append((f"kda_decode_epilogue_t{t}", 4, captured[1]))
    for kname, nw, ttir in kernels:
        with open(os.path.join(out_dir, f"{kname}_w{nw}_s1.ttir"), "w") as f:
            f.write(ttir)


def main() -> None:
    out_dir = out_dir_arg(__doc__, "kda_sass_")
    for name, t, decode in [("kda_decode_t1", 1, True), ("kda_verify_t1", 1, False), ("kda_verify_t6", 6, False)]:
        lower(name, t, decode, out_dir)
    compile_report(out_dir)


if __name__ == "__main__":
    main()

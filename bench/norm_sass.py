"""The RMSNorm kernel (pallas_kernels/rmsnorm.py) compiled offline for sm_90a at Ling's hidden size
(D = 2560) and MLA's latent (512), alone and with the residual add, 1 and 6 rows: registers,
spills and SASS instructions per program (`bench.sass.compile_report`). No GPU needed, only the
triton package beside jax:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.6.0 jax==0.10.2 "numpy<2.4"
    /tmp/tv/bin/python -m bench.norm_sass [--out DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.sass import capture_triton, compile_report, out_dir_arg  # noqa: E402
from pallas_kernels import rmsnorm  # noqa: E402


def main() -> None:
    out_dir = out_dir_arg(__doc__, "norm_sass_")
    s = jax.ShapeDtypeStruct
    captured: list = []
    capture_triton(captured)
    for m, d, add in [(1, 2560, False), (1, 2560, True), (6, 2560, True), (1, 512, False)]:
        x, w = s((m, d), jnp.bfloat16), s((d,), jnp.bfloat16)

        def call(x, w, r):
            return rmsnorm.rms_norm(x, w, eps=1e-6, residual=r, backend="pallas")

        jax.jit(call).trace(x, w, x if add else None).lower(lowering_platforms=("cuda",))
        with open(os.path.join(out_dir, f"{'add_' if add else ''}rms_norm_m{m}_d{d}_w4_s1.ttir"), "w") as f:
            f.write(captured[-1])
    compile_report(out_dir)


if __name__ == "__main__":
    main()

"""The row layout's tensor-core matvec (pallas_kernels/triton_qmatvec.py) against dequantise-then-
multiply (float64): its kernel run by Triton's interpreter in a side environment (the CPU suite;
triton must not enter the main one), compiled through jax_triton on a GPU (`-m gpu`)."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qmatvec import qmatvec
from pallas_kernels.quant import dequantize, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE_ENV = os.path.join(os.path.expanduser("~"), ".cache", "ling-serve", "triton-interpreter")
SIDE_PACKAGES = ["triton==3.6.0", "torch==2.13.0", "numpy<2.4"]  # numpy 2.4 breaks the interpreter

# (M, N, K, symmetric, plan (BN, S, GPI, warps)): one program a tile; split K with the tickets'
# in-launch sum (S 2 and 4); 1, 2 and 4 groups an iteration; BN 64 and 128; a ragged last tile;
# every M from 1 to 16 (x's rows padded by repeating the last); asymmetric zeros.
CASES = [
    (1, 100, 512, True, (64, 1, 4, 4)),
    (3, 130, 512, False, (64, 2, 2, 4)),
    (16, 64, 512, True, (64, 4, 1, 4)),
    (6, 200, 1024, True, (128, 2, 4, 4)),
    (1, 256, 256, False, (128, 1, 2, 4)),
]


def _problem(m, n, k, symmetric, seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.05, 2.0, (n, 1)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return x, quantize(w, symmetric=symmetric, layout="rows")


def _check(y, x, qw):
    """y agrees with x @ W'^T up to its bf16 rounding plus float32 accumulation error."""
    w = np.asarray(dequantize(qw), np.float64)
    xf = np.asarray(x, np.float64)
    exact = xf @ w.T
    bound = 2.0**-8 * np.abs(exact) + 2.0**-20 * (np.abs(xf) @ np.abs(w).T)
    y = np.asarray(y, np.float64)
    assert y.shape == exact.shape
    bad = np.abs(y - exact) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} outside the bound, first at {np.argwhere(bad)[0]}"


def _side_python() -> str:
    """The side environment's python (triton, torch CPU, numpy), made once."""
    python = os.path.join(SIDE_ENV, "bin", "python")
    ready = os.path.join(SIDE_ENV, "ready")
    if not os.path.exists(ready):
        subprocess.run([sys.executable, "-m", "venv", "--clear", SIDE_ENV], check=True)
        pip = subprocess.run([python, "-m", "pip", "install", "-q", *SIDE_PACKAGES], capture_output=True, text=True)
        if pip.returncode:
            pytest.fail(f"could not make Triton's interpreter environment in {SIDE_ENV}:\n{pip.stderr[-2000:]}")
        open(ready, "w").close()
    return python


def test_interpreted_kernel_matches_dequantize_then_matmul(tmp_path):
    problems, arrays = {}, {}
    for i, (m, n, k, symmetric, plan) in enumerate(CASES):
        x, qw = _problem(m, n, k, symmetric, seed=i)
        problems[f"c{i}"] = (x, qw)
        arrays[f"c{i}/x"] = np.asarray(x).view(np.uint16)
        arrays[f"c{i}/words"] = np.asarray(qw.words)
        arrays[f"c{i}/scales"] = np.asarray(qw.scales).view(np.uint16)
        if not symmetric:
            arrays[f"c{i}/zeros"] = np.asarray(qw.zeros).view(np.uint16)
        arrays[f"c{i}/plan"] = np.array(plan)
    cases, out = str(tmp_path / "cases.npz"), str(tmp_path / "out.npz")
    np.savez(cases, **arrays)
    run = subprocess.run([_side_python(), os.path.join(HERE, "triton_interpret.py"), cases, out],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(out)
    for name, (x, qw) in problems.items():
        _check(got[name], x, qw)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,symmetric,plan", CASES + [(1, 157184, 2560, True, None), (6, 12352, 2560, True, None)])
def test_compiled_kernel_matches_dequantize_then_matmul(m, n, k, symmetric, plan):
    from pallas_kernels.triton_qmatvec import RowsPlan

    x, qw = _problem(m, n, k, symmetric, seed=m + n)
    y = qmatvec(x, qw, backend="pallas", plan=None if plan is None else RowsPlan(*plan))
    assert y.dtype == jnp.bfloat16
    _check(y.astype(jnp.float32), x, qw)
    again = qmatvec(x, qw, backend="pallas", plan=None if plan is None else RowsPlan(*plan))
    assert jnp.array_equal(y, again)  # the split-K sum is in a fixed order


def test_reference_and_errors():
    x, qw = _problem(2, 100, 256, True, seed=9)
    _check(qmatvec(x, qw, backend="reference").astype(jnp.float32), x, qw)
    with pytest.raises(ValueError, match="interpret"):
        qmatvec(x, qw, backend="interpret")
    with pytest.raises(ValueError, match="tiles"):
        qmatvec(x, qw, tiles=jnp.array([0], jnp.int32), backend="reference")

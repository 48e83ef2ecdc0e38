"""The row layout's tensor-core kernel (pallas_kernels/triton_qmatvec.py) against float64: the
matvec against dequantise-then-multiply, a MoE's experts (fused_moe's up and down GEMMs in blocks
of 16 pairs, the combine) against the experts' float64 sums; run by Triton's interpreter in a
side environment (the CPU suite; triton must not enter the main one), compiled through jax_triton
on a GPU (`-m gpu`)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from moe_inputs import E, expert_weights, routing
from pallas_kernels import fused_moe as fm
from pallas_kernels.experts import quantize_experts
from pallas_kernels.qmatvec import qmatvec
from pallas_kernels.quant import quantize
from pallas_kernels.rows_plan import RowsPlan, moe_rows_plans
from test_fused_moe import _check as fused_moe_check
from test_qmatvec import _check


def check_moe(y, x, ids, w, w13, w2, limit):
    """test_fused_moe's bound; a skipped pair (id E) counts as weight 0."""
    live = ids < E
    fused_moe_check(y, x, jnp.where(live, ids, 0), jnp.where(live, w, 0.0), w13, w2, limit)

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE_ENV = os.path.join(os.path.expanduser("~"), ".cache", "ling-serve", "triton-interpreter")
SIDE_PACKAGES = ["triton==3.6.0", "torch==2.13.0", "numpy<2.4"]  # numpy 2.4 breaks the interpreter

# (M, N, K, symmetric, plan (BN, S, GPI, warps), bits): one program a tile; split K with the
# tickets' in-launch sum (S 2 and 4); 1, 2 and 4 groups an iteration; BN 64 and 128; a ragged last
# tile; every M from 1 to 16 (x's rows padded by repeating the last); asymmetric zeros; int8.
CASES = [
    (1, 100, 512, True, (64, 1, 4, 4), 4),
    (3, 130, 512, False, (64, 2, 2, 4), 4),
    (16, 64, 512, True, (64, 4, 1, 4), 4),
    (6, 200, 1024, True, (128, 2, 4, 4), 4),
    (1, 256, 256, False, (128, 1, 2, 4), 4),
    (1, 100, 512, True, (64, 2, 2, 4), 8),
    (5, 64, 256, False, (64, 1, 1, 4), 8),
]


def _problem(m, n, k, symmetric, seed, bits=4):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.05, 2.0, (n, 1)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return x, quantize(w, bits=bits, symmetric=symmetric, layout="rows")


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


# (M, k, symmetric, routing, limit, (up plan, down plan) or None for moe_rows_plans, bits): M = 1
# direct (block j = pair j) with split K; aligned blocks (ragged, skewed, every token on one
# expert); a skipped pair (id E); asymmetric zeros; the SwiGLU limit; int8.
MOE_CASES = [
    (1, 4, True, "random", None, None, 4),
    (1, 2, False, "random", 0.5, ((64, 2, 1, 4), (64, 1, 1, 4)), 4),
    (5, 3, True, "skewed", None, ((128, 1, 2, 4), (64, 1, 1, 4)), 4),
    (6, 2, True, "one", 1.0, None, 4),
    (4, 4, False, "random", None, ((64, 2, 1, 4), (128, 1, 1, 4)), 4),
    (3, 2, False, "random", None, None, 8),
    (20, 4, True, "skewed", None, ((64, 2, 1, 4), (64, 1, 1, 4)), 4),  # 80 pairs: blocks of 64 (prefill)
]


def _moe_problem(m, k, symmetric, kind, seed, bits=4):
    rng = np.random.default_rng(seed)
    w13, w2 = expert_weights(rng, None)
    q = quantize_experts(w13, w2, bits=bits, symmetric=symmetric, layout="rows")
    ids, w = routing(rng, m, k, kind)
    if m == 4:  # a skipped pair (expert parallelism marks other ranks' pairs so): it adds nothing
        ids = ids.at[1, 0].set(E)
    x = jnp.asarray(rng.standard_normal((m, q.w13.shape[1])), jnp.bfloat16)
    return x, ids, w, q.w13, q.w2


def test_interpreted_kernel_matches_dequantize_then_matmul(tmp_path):
    problems, arrays = {}, {}
    for i, (m, k, symmetric, kind, limit, plans, bits) in enumerate(MOE_CASES):
        x, ids, w, w13, w2 = problems[f"moe{i}"] = _moe_problem(m, k, symmetric, kind, seed=40 + i, bits=bits)
        route = fm.rows_route(ids, E, backend="reference")
        if plans:
            up, down = (RowsPlan(*p) for p in plans)
        else:
            up, down = moe_rows_plans(route.n_blocks, w2.shape[1], w13.shape[1], route.block_m)
        arrays.update({f"moe{i}/x": np.asarray(x).view(np.uint16), f"moe{i}/topk": np.asarray(ids),
                       f"moe{i}/expert": np.asarray(route.expert), f"moe{i}/n_blocks": np.array(route.n_blocks),
                       f"moe{i}/block_m": np.array(route.block_m),
                       f"moe{i}/limit": np.array([] if limit is None else [limit], np.float32),
                       f"moe{i}/up_plan": np.array(dataclasses.astuple(up)),
                       f"moe{i}/down_plan": np.array(dataclasses.astuple(down))})
        if not route.direct:
            arrays[f"moe{i}/pairs"] = np.asarray(route.pairs)
        for name, qw in (("up", w13), ("down", w2)):
            arrays[f"moe{i}/{name}_words"] = np.asarray(qw.words)
            arrays[f"moe{i}/{name}_scales"] = np.asarray(qw.scales).view(np.uint16)
            if not symmetric:
                arrays[f"moe{i}/{name}_zeros"] = np.asarray(qw.zeros).view(np.uint16)
    for i, (m, n, k, symmetric, plan, bits) in enumerate(CASES):
        x, qw = _problem(m, n, k, symmetric, seed=i, bits=bits)
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
    for name, problem in problems.items():
        if name.startswith("moe"):
            x, ids, w, w13, w2 = problem
            route = fm.rows_route(ids, E, backend="reference")
            y = fm.rows_combine(jnp.asarray(got[name + "/out"]), route, ids, w, E).astype(x.dtype)
            check_moe(y, x, ids, w, w13, w2, MOE_CASES[int(name[3:])][4])
        else:
            _check(got[name], *problem)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,symmetric,plan,bits", CASES + [(1, 157184, 2560, True, None, 4),
                                                               (6, 12352, 2560, True, None, 4),
                                                               (1, 20480, 2560, True, None, 8)])
def test_compiled_kernel_matches_dequantize_then_matmul(m, n, k, symmetric, plan, bits):
    x, qw = _problem(m, n, k, symmetric, seed=m + n, bits=bits)
    y = qmatvec(x, qw, backend="pallas", plan=None if plan is None else RowsPlan(*plan))
    assert y.dtype == jnp.bfloat16
    import jax

    from pallas_kernels.triton_ffi import FFI_TARGET  # the call XLA's CUDA graphs capture

    assert f"@{FFI_TARGET}" in jax.jit(lambda x: qmatvec(x, qw, backend="pallas")).lower(x).as_text()
    _check(y.astype(jnp.float32), x, qw)
    again = qmatvec(x, qw, backend="pallas", plan=None if plan is None else RowsPlan(*plan))
    assert jnp.array_equal(y, again)  # the split-K sum is in a fixed order


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,symmetric,kind,limit,plans,bits", MOE_CASES)
def test_compiled_moe_matches_the_experts(m, k, symmetric, kind, limit, plans, bits):
    x, ids, w, w13, w2 = _moe_problem(m, k, symmetric, kind, seed=m * 10 + k, bits=bits)
    plan = None if plans is None else tuple(RowsPlan(*p) for p in plans)
    y = fm.fused_moe(x, ids, w, w13, w2, swiglu_limit=limit, backend="pallas", plan=plan)
    check_moe(y, x, ids, w, w13, w2, limit)


def test_ffi_adapter_lowers_to_the_command_buffer_target():
    """jax-triton 0.3's legacy custom call, as the adapter lowers it: jaxlib's FFI target, API
    version 4, the proto as its `opaque` attribute (checked in StableHLO on CPU: lowering only)."""
    import jax
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    from pallas_kernels.triton_ffi import FFI_TARGET, FfiAdapter, applies

    prim = Primitive("legacy_triton_call_for_test")
    prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(prim, lambda ctx, x: FfiAdapter(jax.ffi).ffi_lowering(
        "triton_kernel_call", api_version=2, backend_config=b"the-proto", operand_output_aliases={})(ctx, x))
    text = jax.jit(prim.bind).lower(jnp.ones((4,), jnp.float32)).as_text()
    call = next(line for line in text.splitlines() if "custom_call" in line)
    # API version 4 (typed FFI): the attributes are a dictionary, mhlo.backend_config
    assert f"@{FFI_TARGET}" in call and 'mhlo.backend_config = {opaque = "the-proto"}' in call, call
    assert applies("0.3.1", (0, 11, 2)) and not applies("0.4.0", (0, 11, 2)) and not applies("0.3.1", (0, 10, 2))


def test_reference_and_errors():
    x, qw = _problem(2, 100, 256, True, seed=9)
    _check(qmatvec(x, qw, backend="reference").astype(jnp.float32), x, qw)
    with pytest.raises(ValueError, match="interpret"):
        qmatvec(x, qw, backend="interpret")
    with pytest.raises(ValueError, match="tiles"):
        qmatvec(x, qw, tiles=jnp.array([0], jnp.int32), backend="reference")
    with pytest.raises(ValueError, match="split"):
        qmatvec(x, qw, backend="pallas", plan=RowsPlan(64, 4, 1))  # 2 groups cannot split 4 ways
    if importlib.util.find_spec("jax_triton") is None:  # the CPU suite's environment
        with pytest.raises(ImportError, match="jax-triton"):
            qmatvec(x, qw, backend="pallas")
    x, ids, w, w13, w2 = _moe_problem(3, 2, True, "random", seed=1)
    check_moe(fm.fused_moe(x, ids, w, w13, w2, backend="reference"), x, ids, w, w13, w2, None)
    with pytest.raises(ValueError, match="interpret"):
        fm.fused_moe(x, ids, w, w13, w2, backend="interpret")

"""Runs pallas_kernels.triton_qmatvec's kernel in Triton's interpreter (CPU, no JAX).

    python tests/triton_interpret.py CASES.npz OUT.npz

Each case in CASES.npz is a set of arrays named "<case>/<name>". A matvec: x (bf16 bits as
uint16 [M, K]), words (uint32 [N, K*b/32], b = 4 or 8), scales and zeros (bf16 bits as uint16 [N, K/128];
zeros absent when symmetric) and plan (int64 [BN, S, GPI, num_warps]); OUT.npz gets "<case>" =
y as float32 [M, N]. A MoE (its arrays prefixed "up_" and "down_" for the two weights, stacked
on E): x, topk ([M, k], only its shape is read), expert, pairs, n_blocks, block_m
(fused_moe.RowsRoute's; pairs absent when direct), limit ([] or [L]), up_plan, down_plan; OUT.npz gets "<case>/h" and
"<case>/out" as float32. It needs triton and torch (the interpreter takes torch tensors), which the main
test environment must not have; tests/test_qmatvec_rows.py makes a side environment and calls it.
"""

import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pallas_kernels import triton_qmatvec as tq  # noqa: E402


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16)


def launch(stage, a, words, scales, zeros, out, *, m, plan, r, n_blocks=1, expert=None, pairs=None,
           topk=1, direct=False, limit=None, mp=16):
    bn, s, gpi, warps = (int(v) for v in plan)
    e, n = (words.shape[0], words.shape[1]) if words.dim() == 3 else (1, words.shape[0])
    k = scales.shape[-1] * 128
    bits = 32 * words.shape[-1] // k
    tiles = math.ceil(n / bn)
    part = torch.zeros((s, r, n), dtype=torch.float32)
    tickets = torch.zeros((n_blocks * tiles,), dtype=torch.int32)
    dummy = torch.zeros((1,), dtype=torch.int32)
    tq.rows_kernel[(n_blocks, tiles, s)](
        a, words, scales, zeros, dummy if expert is None else expert, dummy if pairs is None else pairs,
        out, part, tickets, M=m, N=n, K=k, R=r, E=e, TOPK=topk, STAGE=stage, DIRECT=direct,
        HAS_LIMIT=limit is not None, LIMIT=0.0 if limit is None else limit,
        BN=bn, S=s, GPI=gpi, LW=int(math.log2(warps)), SYMMETRIC=zeros is scales, BITS=bits, MP=mp, COMPILED=False)
    return out


def _weight(arrays, prefix=""):
    w = torch.from_numpy(arrays[prefix + "words"].astype(np.int64)).to(torch.int32).view(torch.uint32)
    scales = _bf16(arrays[prefix + "scales"])
    zeros = scales if prefix + "zeros" not in arrays else _bf16(arrays[prefix + "zeros"])
    return w, scales, zeros


def run_moe(arrays: dict) -> dict:
    x = _bf16(arrays["x"])
    m, topk = arrays["topk"].shape
    expert = torch.from_numpy(arrays["expert"].astype(np.int32))
    direct = "pairs" not in arrays
    pairs = None if direct else torch.from_numpy(arrays["pairs"].astype(np.int32))
    n_blocks = expert.shape[0] if direct else int(arrays["n_blocks"])
    limit = float(arrays["limit"][0]) if arrays["limit"].size else None
    up, down = _weight(arrays, "up_"), _weight(arrays, "down_")
    inter, d = up[0].shape[1] // 2, down[0].shape[1]
    mp = int(arrays["block_m"]) if "block_m" in arrays else 16
    rows = n_blocks * mp
    common = dict(m=m, r=rows, n_blocks=n_blocks, expert=expert, topk=topk, direct=direct, mp=mp)
    h = launch(1, x, *up, torch.zeros((rows, inter), dtype=torch.bfloat16), plan=arrays["up_plan"],
               pairs=pairs, limit=limit, **common)
    out = launch(2, h, *down, torch.zeros((rows, d), dtype=torch.float32), plan=arrays["down_plan"], **common)
    return {"h": h.float().numpy(), "out": out.numpy()}


def run(arrays: dict):
    if "topk" in arrays:
        return run_moe(arrays)
    x = _bf16(arrays["x"])
    w, scales, zeros = _weight(arrays)
    m, n = x.shape[0], w.shape[0]
    y = launch(0, x, w, scales, zeros, torch.zeros((m, n), dtype=torch.bfloat16), m=m, plan=arrays["plan"], r=m)
    return y.float().numpy()


def main(cases_path: str, out_path: str) -> None:
    cases = np.load(cases_path)
    names = sorted({key.split("/")[0] for key in cases.files})
    out = {}
    for name in names:
        arrays = {key.split("/", 1)[1]: cases[key] for key in cases.files if key.startswith(name + "/")}
        result = run(arrays)
        if isinstance(result, dict):
            out.update({f"{name}/{key}": v for key, v in result.items()})
        else:
            out[name] = result
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

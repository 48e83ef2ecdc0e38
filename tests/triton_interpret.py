"""Runs pallas_kernels.triton_qmatvec's kernel in Triton's interpreter (CPU, no JAX).

    python tests/triton_interpret.py CASES.npz OUT.npz

Each case in CASES.npz is a set of arrays named "<case>/<name>": x (bf16 bits as uint16
[M, K]), words (uint32 [N, K/8]), scales and zeros (bf16 bits as uint16 [N, K/128]; zeros
absent when symmetric) and plan (int64 [BN, S, GPI, num_warps]). OUT.npz gets "<case>" = y as
float32 [M, N]. It needs triton and torch (the interpreter takes torch tensors), which the main
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


def run(arrays: dict) -> np.ndarray:
    x, words = arrays["x"], arrays["words"]
    bn, s, gpi, warps = (int(v) for v in arrays["plan"])
    m, k = x.shape
    n = words.shape[0]
    scales = _bf16(arrays["scales"])
    symmetric = "zeros" not in arrays
    zeros = scales if symmetric else _bf16(arrays["zeros"])
    tiles = math.ceil(n / bn)
    y = torch.zeros((m, n), dtype=torch.bfloat16)
    part = torch.zeros((s, m, n), dtype=torch.float32)
    tickets = torch.zeros((tiles,), dtype=torch.int32)
    w = torch.from_numpy(words.astype(np.int64)).to(torch.int32).view(torch.uint32)
    tq.qmatvec_rows_kernel[(tiles * s,)](
        _bf16(x), w, scales, zeros, y, part, tickets,
        M=m, N=n, K=k, BN=bn, S=s, GPI=gpi, LW=int(math.log2(warps)), SYMMETRIC=symmetric, COMPILED=False)
    assert not tickets.any() or s == 1 or bool((tickets == s).all()), tickets
    return y.float().numpy()


def main(cases_path: str, out_path: str) -> None:
    cases = np.load(cases_path)
    names = sorted({key.split("/")[0] for key in cases.files})
    out = {}
    for name in names:
        arrays = {key.split("/", 1)[1]: cases[key] for key in cases.files if key.startswith(name + "/")}
        out[name] = run(arrays)
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

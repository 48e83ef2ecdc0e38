"""The one place that decides which implementation a kernel call runs.

  "pallas"     the Pallas kernel compiled for the GPU
  "interpret"  the same kernel run by Pallas' interpreter on CPU (how CI checks kernels)
  "reference"  the plain-jnp specification beside each kernel (what CPU serving runs)
  "auto"       pallas on a GPU, reference elsewhere; the environment variable LING_KERNELS
               (pallas | interpret | reference) overrides it, e.g. to run a model's kernels in
               interpret mode on CPU.

A model resolves its backend once, when it is built (`ling.LingModel(kernels=...)`, `ling.load`),
and its layers pass it to every kernel entry; an entry called with "auto" resolves it at the call.
"""

from __future__ import annotations

import os

import jax

BACKENDS = ("auto", "pallas", "interpret", "reference")


def resolve(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    forced = os.environ.get("LING_KERNELS")
    if forced:
        if forced not in BACKENDS[1:]:
            raise ValueError(f"LING_KERNELS must be one of {BACKENDS[1:]}, got {forced!r}")
        return forced
    return "pallas" if jax.default_backend() == "gpu" else "reference"

import gc
import os
import sys

import pytest


def gpu_tier() -> bool:
    """`python -m pytest -m gpu` (or `--markexpr gpu`, also through PYTEST_ADDOPTS): the kernel
    tests' compiled (`pallas`) cases, on the machine's GPU. Any other run is the CPU suite
    (interpret mode), whatever devices the machine has. The controlling process decides from its
    arguments and tells pytest-xdist's workers through LING_TEST_TIER."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return os.environ.get("LING_TEST_TIER") == "gpu"
    argv = sys.argv[1:] + os.environ.get("PYTEST_ADDOPTS", "").split()
    for i, a in enumerate(argv):
        if a in ("-m", "--markexpr") and i + 1 < len(argv):
            return argv[i + 1].strip() == "gpu"
        if a.startswith("--markexpr="):
            return a.split("=", 1)[1].strip() == "gpu"
        if a.startswith("-m") and a[2:].strip() == "gpu":
            return True
    return False


# The CPU suite runs on CPU only; fp32 matmuls at full precision in both tiers (the oracle
# comparisons are fp32). The GPU tier does not preallocate, so that two workers share the device.
GPU_TIER = gpu_tier()
os.environ["LING_TEST_TIER"] = "gpu" if GPU_TIER else "cpu"
if GPU_TIER:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402  (after the environment above)

from offline.train import cpu_deadlock_workaround  # noqa: E402

# XLA:CPU's concurrency-optimised scheduler can hang for good on a KDA layer's backward (offline.train
# says when); `python -m offline.train` turns it off before JAX starts its backend, and so must the
# test process, which runs train.main after other tests have started it.
cpu_deadlock_workaround()


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops every compiled program after each test file. XLA:CPU maps memory for each executable
    it keeps, and the interpret-mode kernel tests compile thousands: in one process the whole suite
    passed Linux's vm.max_map_count (65530 mappings) and the compiler segfaulted on a failed mmap."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    """Outside the GPU tier, the `gpu` cases are skipped with the command that runs them; in it,
    on a machine without a GPU, with that reason."""
    if GPU_TIER and jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="no GPU here" if GPU_TIER else "compiled kernels on a GPU: python -m pytest -m gpu")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

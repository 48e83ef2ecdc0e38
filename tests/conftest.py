import gc
import os
import sys

import pytest


def gpu_tier(argv=None) -> bool:
    """`python -m pytest -m gpu`: the kernel tests' compiled (`pallas`) cases, on the machine's GPU.
    Any other run is the CPU suite (interpret mode), whatever devices the machine has."""
    argv = sys.argv if argv is None else argv
    for i, a in enumerate(argv):
        if a == "-m" and i + 1 < len(argv):
            return argv[i + 1].strip() == "gpu"
        if a.startswith("-m") and a[2:].strip() == "gpu":
            return True
    return os.environ.get("LING_TEST_TIER") == "gpu"  # set below for pytest-xdist's workers


# The CPU suite runs on CPU only; fp32 matmuls at full precision in both tiers (the oracle
# comparisons are fp32). The GPU tier does not preallocate, so that two workers share the device.
if gpu_tier():
    os.environ["LING_TEST_TIER"] = "gpu"
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
    """Outside the GPU tier, the `gpu` cases are skipped with the command that runs them."""
    if gpu_tier():
        return
    skip = pytest.mark.skip(reason="compiled kernels on a GPU: python -m pytest -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

import gc
import os
import sys

import pytest

# CPU only, and fp32 matmuls at full precision: the oracle comparisons are fp32.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402  (after the environment above)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops every compiled program after each test file. XLA:CPU maps memory for each executable
    it keeps, and the interpret-mode kernel tests compile thousands: in one process the whole suite
    passed Linux's vm.max_map_count (65530 mappings) and the compiler segfaulted on a failed mmap."""
    yield
    jax.clear_caches()
    gc.collect()

import gc
import os
import sys

import pytest

# CPU only, and fp32 matmuls at full precision: the oracle comparisons are fp32.
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

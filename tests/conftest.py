import os
import sys

# CPU only, and fp32 matmuls at full precision: the oracle comparisons are fp32.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, os.path.dirname(__file__))

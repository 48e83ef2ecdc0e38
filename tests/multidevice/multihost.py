"""One process of a two-process run on 127.0.0.1 (CPU devices, gloo collectives): joins JAX's
distributed runtime with the flags `python -m ling` takes, shards the experts over both processes
and prints the prefill logits' checksum. Run by tests/test_parallel.py.

    python tests/multidevice/multihost.py --coordinator-address 127.0.0.1:PORT --num-processes 2 --process-id I OUT
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ling  # noqa: E402
from ling.model import apply  # noqa: E402
from ling.state import init_state  # noqa: E402
from moe import parallel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator-address")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("out")
    args = ap.parse_args()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    parallel.initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    model = ling.load("ling-tiny", dtype="float32", seed=4, ep_size=len(jax.devices()))
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 24))
    state = parallel.replicate(init_state(model.cfg, 2, 24, jnp.float32), model.layers[1].mlp.mesh)
    logits, _, _ = apply(model, jnp.asarray(tokens), state, form="prefill")
    np.save(args.out, np.asarray(logits.addressable_data(0)))


if __name__ == "__main__":
    main()

"""Expert parallelism, each check in its own process: JAX fixes the device count (8 simulated CPU
devices) and the distributed runtime when it starts."""

import os
import socket
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(__file__)
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def test_ep_2_4_8_match_one_device_and_speculation_is_unchanged():
    """EP = 2, 4, 8 on 8 simulated devices: prefill and decode logits within 1e-5 (fp32) of one
    device, the all-to-all dispatch too, and greedy speculative output equal to plain output."""
    run = subprocess.run([sys.executable, os.path.join(HERE, "multidevice", "ep_checks.py")], env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_two_processes_give_the_logits_of_one(tmp_path):
    """Two processes on 127.0.0.1 (gloo), the experts split between them, against one process."""
    import jax.numpy as jnp

    import ling
    from ling.model import apply
    from ling.state import init_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multidevice", "multihost.py"),
                               "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(i), str(tmp_path / f"logits{i}.npy")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    a, b = (np.load(tmp_path / f"logits{i}.npy") for i in range(2))
    model = ling.load("ling-tiny", dtype="float32", seed=4)
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 24))
    ref = np.asarray(apply(model, jnp.asarray(tokens), init_state(model.cfg, 2, 24, jnp.float32), form="prefill")[0])
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - ref).max() / np.abs(ref).max() < 1e-5

"""Expert-parallel checks on simulated CPU devices. Run by tests/test_parallel.py in a subprocess
(XLA's device count is fixed when JAX starts): python tests/multidevice/ep_checks.py."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ling  # noqa: E402
from ling.model import apply  # noqa: E402
from ling.state import init_state  # noqa: E402
from moe import parallel  # noqa: E402
from spec.generate import generate_batch  # noqa: E402


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def logits_of(model, tokens, steps):
    """Prefill logits, then the logits of one-token decode steps."""
    state = init_state(model.cfg, tokens.shape[0], tokens.shape[1] + steps.shape[1], jnp.float32)
    out, _, state = apply(model, jnp.asarray(tokens), state, form="prefill")
    decoded = []
    for i in range(steps.shape[1]):
        lg, _, state = apply(model, jnp.asarray(steps[:, i : i + 1]), state, form="decode")
        decoded.append(np.asarray(lg[:, 0]))
    return np.asarray(out), np.stack(decoded, 1)


def main():
    assert len(jax.devices()) == 8, jax.devices()
    cfg = ling.preset("ling-tiny")
    r = np.random.default_rng(0)
    tokens = r.integers(0, cfg.vocab_size, (2, 24))
    steps = r.integers(0, cfg.vocab_size, (2, 3))
    ref = logits_of(ling.load("ling-tiny", dtype="float32", seed=4), tokens, steps)
    prompts = [r.integers(0, cfg.vocab_size, n).tolist() for n in (21, 9)]
    plain = generate_batch(ling.load("ling-tiny", dtype="float32", seed=4), prompts, 24, speculative=False)
    failures = []
    for ep in (2, 4, 8):
        model = ling.load("ling-tiny", dtype="float32", seed=4, ep_size=ep)
        w13 = model.layers[1].mlp.w13[...]
        if len(w13.sharding.device_set) != ep:
            failures.append(f"ep={ep}: experts on {len(w13.sharding.device_set)} devices")
        for name, a, b in zip(("prefill", "decode"), logits_of(model, tokens, steps), ref):
            err = rel_err(a, b)
            print(f"ep={ep} {name} rel err {err:.2e}")
            if err > 1e-5:
                failures.append(f"ep={ep} {name}: rel err {err:.2e} > 1e-5")
        spec = generate_batch(model, prompts, 24, speculative=True)
        if spec != plain:
            failures.append(f"ep={ep}: greedy speculative output differs from plain greedy")
    # The all-to-all dispatch (prefill sizes) against one device; new shapes, so nothing compiled
    # above with the psum path is reused.
    long_tokens = r.integers(0, cfg.vocab_size, (2, 32))
    single = logits_of(ling.load("ling-tiny", dtype="float32", seed=4), long_tokens, steps)[0]
    old = parallel.A2A_MIN_TOKENS
    parallel.A2A_MIN_TOKENS = 16
    try:
        model = ling.load("ling-tiny", dtype="float32", seed=4, ep_size=4)
        a2a = logits_of(model, long_tokens, steps)[0]
        err = rel_err(a2a, single)
        print(f"ep=4 all-to-all prefill rel err {err:.2e}")
        if err > 1e-5:
            failures.append(f"all-to-all prefill: rel err {err:.2e} > 1e-5")
    finally:
        parallel.A2A_MIN_TOKENS = old
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()

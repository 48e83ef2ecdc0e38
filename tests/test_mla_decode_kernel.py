"""MLA decode over the latent cache: the split + combine kernels (interpret mode) against the jnp
reference, and the reference (absorbed form) against explicit non-absorbed attention. Fresh
random inputs every run (seed in the failure message); cache rows at or past each sequence's
length hold NaN, so any read of them shows; interpret mode fills outputs with NaN before the
kernel runs, so any element left unwritten shows too."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels import mla_decode as md
from backends import KERNELS

H, R, P = 4, 32, 16  # heads, latent rank, rope dims (Ling: 32, 512, 64)


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


def make_inputs(rng, b, t, l_max, *, lengths=None, dtype=jnp.float32):
    q_lat = rng.standard_normal((b, t, H, R))
    q_rope = rng.standard_normal((b, t, H, P))
    c = rng.standard_normal((b, l_max, R))
    k_rope = rng.standard_normal((b, l_max, P))
    if lengths is None:
        lengths = rng.integers(t, l_max + 1, size=b)
    lengths = np.asarray(lengths, np.int32)
    dead = np.arange(l_max)[None, :] >= lengths[:, None]  # [B, L] rows not yet written
    c[dead] = np.nan
    k_rope[dead] = np.nan
    cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)  # noqa: E731
    return cast(q_lat), cast(q_rope), cast(c), cast(k_rope), jnp.asarray(lengths)


def test_reference_matches_unabsorbed_attention():
    """softmax((q_nope·k_nope + q_rope·k_rope)·scale) v with k_nope = c W_UK, v = c W_UV, done
    explicitly per head in float64, equals W_UV applied to the absorbed reference's output."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    b, t, l_max, dn, dv = 2, 3, 24, 8, 8
    scale = (dn + P) ** -0.5
    q_nope = rng.standard_normal((b, t, H, dn))
    w_uk = rng.standard_normal((H, R, dn)) / np.sqrt(R)
    w_uv = rng.standard_normal((H, R, dv)) / np.sqrt(R)
    _, q_rope, c, k_rope, lengths = make_inputs(rng, b, t, l_max, lengths=[t, 17])

    q_lat = np.einsum("bthd,hrd->bthr", q_nope, w_uk)  # W_UK absorbed into the query
    got = md.mla_decode(jnp.asarray(q_lat, jnp.float32), q_rope, c, k_rope, lengths, scale=scale,
                        backend="reference")
    got_v = np.einsum("bthr,hrd->bthd", np.asarray(got, np.float64), w_uv)

    want = np.zeros((b, t, H, dv))
    cn, kr, qr = (np.asarray(a, np.float64) for a in (c, k_rope, q_rope))
    for bi in range(b):
        n = int(lengths[bi])
        for hi in range(H):
            k_nope = cn[bi, :n] @ w_uk[hi]  # [n, dn]
            v = cn[bi, :n] @ w_uv[hi]  # [n, dv]
            for ti in range(t):
                vis = n - t + ti + 1  # positions 0 .. n-t+ti
                s = (k_nope[:vis] @ q_nope[bi, ti, hi] + kr[bi, :vis] @ qr[bi, ti, hi]) * scale
                p = np.exp(s - s.max())
                want[bi, ti, hi] = (p / p.sum()) @ v[:vis]
    np.testing.assert_allclose(got_v, want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


# T = 1..8 with ragged lengths; splits, blocks and dtype vary across cases.
CASES = [  # t, l_max, block_l, num_splits, block_rows, dtype
    (1, 64, 16, 1, 16, jnp.float32),
    (2, 100, 16, 4, 16, jnp.bfloat16),  # L not a multiple of the block
    (3, 96, 32, 2, 16, jnp.float32),  # 12 rows padded to 16
    (4, 128, 16, 8, 16, jnp.float32),
    (5, 80, 16, 4, 32, jnp.bfloat16),
    (6, 64, 16, 2, 16, jnp.float32),  # 24 rows -> two row blocks of 16 (one padded)
    (7, 120, 32, 8, 32, jnp.float32),
    (8, 256, 16, 16, 32, jnp.bfloat16),
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("t,l_max,block_l,num_splits,block_rows,dtype", CASES)
def test_interpret_matches_reference(backend, t, l_max, block_l, num_splits, block_rows, dtype):
    seed = _seed()
    rng = np.random.default_rng(seed)
    # Lengths include the shortest legal one (= T: splits with nothing to do) and a full cache.
    lengths = [t, l_max, int(rng.integers(t, l_max + 1))]
    q_lat, q_rope, c, k_rope, lengths = make_inputs(rng, 3, t, l_max, lengths=lengths, dtype=dtype)
    scale = (R + P) ** -0.5
    got = md.mla_decode(q_lat, q_rope, c, k_rope, lengths, scale=scale, block_l=block_l,
                        num_splits=num_splits, block_rows=block_rows, backend=backend)
    want = md.mla_decode(q_lat, q_rope, c, k_rope, lengths, scale=scale, backend="reference")
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    msg = f"T={t} L={l_max} lengths={np.asarray(lengths)} {jnp.dtype(dtype).name} seed {seed}"
    assert got.shape == (3, t, H, R)
    assert np.all(np.isfinite(got)), "non-finite output: " + msg
    # bf16: the kernel rounds p to bf16 for the p·c dot (as flash attention does), and the output.
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=msg)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("slotted", [False, True])
def test_lengths_past_the_cache_read_no_position_beyond_it(backend, slotted):
    """A prefill chunk of T queries whose padding runs past a nearly full cache (lengths[b] > L):
    each query sees the positions < L up to its own, as the reference over the L positions; a
    read past L (the neighbouring slot's rows, or clamped ones in interpret mode) shows."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    t, l_max = 16, 60  # L not a multiple of the block
    lengths = [l_max + 5, l_max + t, 20]
    q_lat, q_rope, c, k_rope, lengths = make_inputs(rng, 3, t, l_max, lengths=lengths)
    rows = jnp.asarray([2, 0, 1], jnp.int32) if slotted else None
    scale = (R + P) ** -0.5
    got = md.mla_decode(q_lat, q_rope, c, k_rope, lengths, scale=scale, block_l=16, num_splits=4, rows=rows,
                        backend=backend)
    pick = (lambda a: a) if rows is None else (lambda a: a[rows])  # noqa: E731
    want = md.mla_decode(q_lat, q_rope, pick(c), pick(k_rope), lengths, scale=scale, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


def test_default_splits_and_bad_blocks():
    assert md.default_num_splits(1, 1, 8192, 64) == 128  # one block a program, one program an SM
    assert md.default_num_splits(1, 6, 8192, 64) == 16  # T = 6: six row blocks share the SMs
    assert md.default_num_splits(1, 1, 1024, 64) == 16  # no program without a block
    assert md.default_num_splits(8, 6, 131072, 64) == 2
    rng = np.random.default_rng(0)
    args = make_inputs(rng, 1, 1, 32)
    with pytest.raises(ValueError):
        md.mla_decode(*args, scale=1.0, num_splits=3, backend="interpret")


@pytest.mark.parametrize("backend", ["reference", *KERNELS])
def test_slot_rows_read_the_named_slots(backend):
    """With rows (`slot_rows`, the last row padding) each sequence attends to its slot's cache
    in a larger one, as the same call over those slots' caches gathered."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    t, l_max, n = 2, 64, 5
    q_lat, q_rope, _, _, lengths = make_inputs(rng, 3, t, l_max, lengths=[t, l_max, 37])
    _, _, c, k_rope, _ = make_inputs(rng, n, t, l_max, lengths=[l_max] * n)
    rows = jnp.asarray([3, 0, n], jnp.int32)
    scale = (R + P) ** -0.5
    got = md.mla_decode(q_lat, q_rope, c, k_rope, lengths, scale=scale, block_l=16, num_splits=2, rows=rows,
                        backend=backend)
    pick = jnp.minimum(rows, n - 1)
    want = md.mla_decode(q_lat, q_rope, c[pick], k_rope[pick], lengths, scale=scale, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")

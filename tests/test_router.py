"""The router's group-limited top-k against a plain numpy statement of the rule, ties included
(equal scores rank by lower index, as top_k and torch.topk on CPU do): the reference (what CPU
serving runs) and the selection kernel in interpret mode."""

import jax.numpy as jnp
import numpy as np
import pytest

from moe.router import route
from pallas_kernels.router import select_experts
from backends import KERNELS


def numpy_route(x, w, bias, top_k, n_group, topk_group):
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.T.astype(np.float64))))
    choice = (scores + bias).astype(np.float32)
    ids = []
    for row in choice:
        groups = row.reshape(n_group, -1)
        group_scores = np.sort(groups, axis=1)[:, -2:].sum(1)
        kept = np.argsort(-group_scores, kind="stable")[:topk_group]
        masked = np.full_like(row, -np.inf).reshape(n_group, -1)
        masked[kept] = groups[kept]
        ids.append(np.argsort(-masked.reshape(-1), kind="stable")[:top_k])
    return np.array(ids)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("seed", range(6))
def test_group_limited_top_k(seed, backend):
    r = np.random.default_rng(seed)
    m, d, e = 9, 16, 64
    x = r.normal(size=(m, d)).astype(np.float32)
    w = r.normal(size=(e, d)).astype(np.float32)
    bias = (r.normal(size=e) * 3).astype(np.float32)
    if seed % 2:  # ties: zero rows give equal scores within and across groups
        w[::3] = 0.0
        bias = np.round(bias)
    weights, ids = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), top_k=4, n_group=8, topk_group=3,
                         routed_scaling_factor=2.5, norm_topk_prob=True, backend=backend)
    np.testing.assert_array_equal(np.asarray(ids), numpy_route(x, w, bias, 4, 8, 3))
    assert np.allclose(np.asarray(weights).sum(1), 2.5, rtol=1e-5)


@pytest.mark.parametrize("m,e,k,n_group,topk_group,norm", [(1, 512, 8, 8, 4, True), (6, 64, 2, 1, 1, False),
                                                             (3, 96, 4, 3, 2, True)])
@pytest.mark.parametrize("backend", KERNELS)
def test_kernel_matches_reference(backend, m, e, k, n_group, topk_group, norm):
    """Ling's shape (one token), no groups, unnormalised; 96 / 3 is not a power of two and runs the
    reference. Weights equal to the reference's up to the order of a k-term sum."""
    r = np.random.default_rng(m * e)
    logits = jnp.asarray(r.normal(size=(m, e)) * 2, jnp.float32)
    bias = jnp.asarray(r.normal(size=e) * 0.1, jnp.float32)
    opts = dict(top_k=k, n_group=n_group, topk_group=topk_group, scale=2.5, norm=norm)
    w, ids = select_experts(logits, bias, backend=backend, **opts)
    w_ref, ids_ref = select_experts(logits, bias, backend="reference", **opts)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6)
    assert ids.dtype == jnp.int32 and w.shape == (m, k)


def test_bad_groups_are_named():
    with pytest.raises(ValueError, match="n_group=5"):
        select_experts(jnp.zeros((1, 64)), jnp.zeros(64), top_k=2, n_group=5, topk_group=1)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("m,d,e,k,n_group,topk_group", [(1, 2560, 512, 8, 8, 4), (6, 2560, 512, 8, 8, 4),
                                                         (1, 512, 64, 4, 8, 3), (1, 1024, 128, 2, 1, 1)])
def test_gate_and_select_in_one_launch(backend, m, d, e, k, n_group, topk_group):
    """One token: the fused router (gate logits by every program, the selection by the last ticket)
    picks the experts of the gate matmul followed by the selection kernel, with the same weights,
    and leaves its counter zero; `route` takes it inside a tickets scope. Several tokens (Ling's
    verify, 6): `gate_and_select` declines and `route` runs the gate and a program a token."""
    import jax

    from pallas_kernels import tickets
    from pallas_kernels.router import gate_and_select

    r = np.random.default_rng([m, d, e])
    x = jnp.asarray(r.normal(size=(m, d)), jnp.bfloat16)
    gate = jnp.asarray(r.normal(size=(e, d)) * 0.05, jnp.float32)
    bias = jnp.asarray(r.normal(size=e) * 0.1, jnp.float32)
    opts = dict(top_k=k, n_group=n_group, topk_group=topk_group, scale=2.5, norm=True)
    logits = jnp.dot(x.astype(jnp.float32), gate.T, precision=jax.lax.Precision.HIGHEST)
    w_ref, ids_ref = select_experts(logits, bias, backend="reference", **opts)
    fused = gate_and_select(x, gate, bias, tickets.zeros(), backend=backend, **opts)
    if m == 1:
        w, ids, counters = fused
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5)
        assert not np.asarray(counters).any()
    else:
        assert fused is None

    def routed(x, counters):
        with tickets.scope(counters) as scope:
            out = route(x, gate, bias, top_k=k, n_group=n_group, topk_group=topk_group,
                        routed_scaling_factor=2.5, norm_topk_prob=True, backend=backend)
        return out, scope.buffer

    (w2, ids2), _ = jax.jit(routed)(x, tickets.zeros())
    np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w2), np.asarray(w_ref), rtol=1e-5)
    program = str(jax.make_jaxpr(routed)(x, tickets.zeros()))
    assert program.count("pallas_call") == 1 and ("dot_general" in program) == (m > 1)  # one token: no XLA gate

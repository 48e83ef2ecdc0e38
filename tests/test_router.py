"""The router's group-limited top-k against a plain numpy statement of the rule, ties included
(equal scores rank by lower index, as top_k and torch.topk on CPU do)."""

import jax.numpy as jnp
import numpy as np
import pytest

from moe.router import route


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


@pytest.mark.parametrize("seed", range(6))
def test_group_limited_top_k(seed):
    r = np.random.default_rng(seed)
    m, d, e = 9, 16, 64
    x = r.normal(size=(m, d)).astype(np.float32)
    w = r.normal(size=(e, d)).astype(np.float32)
    bias = (r.normal(size=e) * 3).astype(np.float32)
    if seed % 2:  # ties: zero rows give equal scores within and across groups
        w[::3] = 0.0
        bias = np.round(bias)
    weights, ids = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), top_k=4, n_group=8, topk_group=3,
                         routed_scaling_factor=2.5, norm_topk_prob=True)
    np.testing.assert_array_equal(np.asarray(ids), numpy_route(x, w, bias, 4, 8, 3))
    assert np.allclose(np.asarray(weights).sum(1), 2.5, rtol=1e-5)

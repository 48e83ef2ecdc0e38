"""The tile-aware latency model of an MoE layer (after ExpertPlex §6.2) and the prefill chunk
it allows next to a decode batch under a TPOT budget.

    t(x, s) = alpha + beta*x + gamma*x*s + delta*x*s^2        (µs, one kernel launch)

ExpertPlex fits this form per profiled component: for attention x is the batch and s the sequence
length; for the MoE, raw routed tokens mispredict (the same tokens cost more when they spread
over more experts), so x is the executed row tiles

    x_moe = sum over experts e with m_e > 0 of ceil(m_e / M_t)

(m_e: (token, slot) rows routed to expert e, M_t: the kernel's tile height `block_m`), and s = 1.
At s = 1 the three slopes merge into one (beta + gamma + delta): a fit on MoE samples keeps alpha
and beta and sets gamma = delta = 0, since they cannot be told apart there; samples with several
values of s (an attention profile) determine all four.

Run as two programs, decode and prefill make a step's x_moe the sum of the two classes'
tiles. The server's mixed iteration runs them as one, through the tile-scheduled kernel
(pallas_kernels/expert_tiles.py), which aligns their union instead: each expert's decode pairs
in hot blocks (filled up with its prefill pairs when hot and cold blocks are one height) and the
rest in cold blocks; `x_moe_tile_kernel` counts those.

Routing is unknown when the scheduler plans a step (it happens on device, per layer), so the
planner uses the expectation of x_moe under routing with per-expert probabilities p_e
(sum p_e = k): a token's k picks are distinct experts, so it adds 0 or 1 row to expert e; with
tokens routed independently, m_e ~ Binomial(tokens, p_e) and E[x_moe] = sum_e E[ceil(m_e / M_t)]
(linearity: the dependence between experts does not matter). The default is uniform routing, p_e = k / E (what the
expert-bias balancing trains for); observed loads can be passed instead. Exact per-expert counts
give the exact x_moe.

A fitted model is a JSON file (`TileModel.save` / `load`), written by
`python -m bench.fused_moe --profile-tiles --tile-model PATH` on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np

FORMAT = "ling-tile-model/1"
COEFFS = ("alpha", "beta", "gamma", "delta")


# ---------------------------------------------------------------------------------- the form
@dataclasses.dataclass(frozen=True)
class LatencyFit:
    """t(x, s) = alpha + beta*x + gamma*x*s + delta*x*s^2, in µs."""

    alpha: float
    beta: float
    gamma: float = 0.0
    delta: float = 0.0

    def __call__(self, x, s=1.0):
        x, s = np.asarray(x, np.float64), np.asarray(s, np.float64)
        t = self.alpha + x * (self.beta + self.gamma * s + self.delta * s * s)
        return float(t) if t.ndim == 0 else t

    @classmethod
    def fit(cls, x, t, s=None) -> LatencyFit:
        """Least squares over samples (x_i, s_i, t_i) in relative error (each row weighted by
        1 / t_i: timing noise grows with the time, and a small decode launch must be predicted as
        well as a large prefill one); s None means s = 1 throughout.

        Identifiability: with one distinct s the columns x, x*s, x*s^2 are proportional, so only
        alpha and beta are fitted (gamma = delta = 0); with two distinct s, delta is left 0.
        Raises ValueError when the samples cannot determine the kept coefficients."""
        x = np.asarray(x, np.float64).reshape(-1)
        t = np.asarray(t, np.float64).reshape(-1)
        s = np.ones_like(x) if s is None else np.asarray(s, np.float64).reshape(-1)
        if not (x.shape == t.shape == s.shape):
            raise ValueError(f"x, s and t must have one value per sample, got {x.shape}, {s.shape}, {t.shape}")
        n_s = len(np.unique(s))
        cols = [np.ones_like(x), x, x * s, x * s * s][: 2 + min(n_s - 1, 2)]
        a = np.stack(cols, axis=1)  # [n, 2..4]
        if np.linalg.matrix_rank(a) < a.shape[1]:
            raise ValueError(f"{len(x)} samples with {len(np.unique(x))} distinct x and {n_s} distinct s "
                             f"cannot determine {a.shape[1]} coefficients")
        if np.any(t <= 0):
            raise ValueError("times must be positive")
        coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
        return cls(*[float(c) for c in coef] + [0.0] * (4 - len(coef)))


# ---------------------------------------------------------------------------------- x_moe
def x_moe(counts, block_m: int) -> int:
    """Executed row tiles for per-expert row counts [E] (exact)."""
    c = np.asarray(counts, np.int64)
    return int(np.sum(-(-c // block_m)))


def x_moe_of_ids(topk_ids, n_experts: int, block_m: int) -> int:
    """Executed row tiles of one class's routing topk_ids [T, k] (exact)."""
    return x_moe(np.bincount(np.asarray(topk_ids).reshape(-1), minlength=n_experts), block_m)


def x_moe_tile_kernel(topk_ids, n_decode: int, n_experts: int, block_m: int, block_m_hot: int | None = None) -> int:
    """Executed row tiles of the tile-scheduled kernel on topk_ids [T, k] whose first n_decode
    tokens are decode tokens: per expert, ceil(d_e / BM_h) hot blocks (its d_e decode pairs, then,
    where BM_h = BM, its prefill pairs up to their capacity) and ceil(rest / BM) cold blocks
    (exact). BM_h: block_m_hot, default block_m."""
    bmh = block_m_hot or block_m
    ids = np.asarray(topk_ids)
    d = np.bincount(ids[:n_decode].reshape(-1), minlength=n_experts).astype(np.int64)
    n = np.bincount(ids.reshape(-1), minlength=n_experts).astype(np.int64)
    hot = -(-d // bmh)
    return int(hot.sum()) + x_moe(np.maximum(n - (d if bmh < block_m else hot * bmh), 0), block_m)


def _binomial_pmf(n: int, p: float) -> np.ndarray:
    """P(X = c) for c = 0 .. n, X ~ Binomial(n, p), from log-space terms (no overflow at large n)."""
    c = np.arange(n + 1, dtype=np.float64)
    if p <= 0.0:
        return (c == 0).astype(np.float64)
    if p >= 1.0:
        return (c == n).astype(np.float64)
    i = c[1:]
    log_choose = np.concatenate([[0.0], np.cumsum(np.log(n - i + 1) - np.log(i))])  # log C(n, c)
    return np.exp(log_choose + c * math.log(p) + (n - c) * math.log1p(-p))


def expected_x_moe(tokens: int, n_experts: int, top_k: int, block_m: int, probs=None) -> float:
    """E[x_moe] for `tokens` tokens routed top-k: m_e ~ Binomial(tokens, p_e); p_e = k / E
    (uniform) unless probs [E] (per-token probability of each expert, summing to k) is given."""
    if tokens <= 0:
        return 0.0
    if probs is None:
        p_all = np.full(n_experts, top_k / n_experts)
    else:
        p_all = np.asarray(probs, np.float64)
        if p_all.shape != (n_experts,) or np.any(p_all < 0) or np.any(p_all > 1):
            raise ValueError(f"probs must be {n_experts} probabilities in [0, 1], got shape {p_all.shape}")
        if not math.isclose(float(p_all.sum()), top_k, rel_tol=1e-3):
            raise ValueError(f"probs must sum to top_k={top_k} (each token picks k experts), got {p_all.sum():.4f}")
    tiles = np.ceil(np.arange(tokens + 1) / block_m)  # [tokens + 1]
    cache: dict[float, float] = {}
    total = 0.0
    for p in p_all:  # uniform: one distinct p, one pmf
        key = float(p)
        if key not in cache:
            cache[key] = float(_binomial_pmf(tokens, key) @ tiles)
        total += cache[key]
    return total


# ---------------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class TileModel:
    """A fitted MoE launch: t = moe(x_moe) µs per layer and class, for one kernel's tile height.

    step_overhead_us: the rest of a server iteration (attention, dense layers, drafting, lm_head,
    sampling), added once per iteration; the MoE profile does not measure it (0 unless set).
    chunk_us_per_token: the part of that rest that grows with the prefill chunk (the chunk rows'
    projections and attention), per token of its rows, padding included: an iteration with a
    chunk of rows x width = n costs step_overhead_us + chunk_us_per_token * n outside its MoE
    launches (0 unless set); the MoE launches take its prompt tokens only.
    info: provenance (device, kernel, samples, held-out error), informational."""

    moe: LatencyFit
    block_m: int
    n_experts: int
    top_k: int
    step_overhead_us: float = 0.0
    chunk_us_per_token: float = 0.0
    info: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def launch_us(self, x) -> float:
        """One MoE launch over x_moe = x tiles (s = 1); no launch (0) when there is no work."""
        return self.moe(x) if x > 0 else 0.0

    def expected_tiles(self, tokens: int, probs=None) -> float:
        return expected_x_moe(tokens, self.n_experts, self.top_k, self.block_m, probs)

    def iteration_us(self, *, decode_tiles: float, prefill_tiles: float, layers: int,
                     union_tiles: float | None = None, chunk_tokens: int = 0) -> float:
        """A server iteration plus the overhead outside its MoE launches (for a chunk of
        chunk_tokens prompt tokens). Separate programs for the decode step and the prefill chunk:
        each MoE layer is two launches (one per class present). A mixed iteration (union_tiles
        given: the x_moe of both classes' tokens aligned together, as the tile-scheduled kernel
        does): one launch a layer."""
        rest = self.step_overhead_us + self.chunk_us_per_token * chunk_tokens
        if union_tiles is not None:
            return rest + layers * self.launch_us(union_tiles)
        return rest + layers * (self.launch_us(decode_tiles) + self.launch_us(prefill_tiles))

    def save(self, path: str) -> None:
        doc = {"format": FORMAT, "moe": dataclasses.asdict(self.moe), "block_m": self.block_m,
               "n_experts": self.n_experts, "top_k": self.top_k, "step_overhead_us": self.step_overhead_us,
               "chunk_us_per_token": self.chunk_us_per_token, "info": self.info}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> TileModel:
        """Reads a model written by `save`; ValueError names the field that is missing or wrong."""
        with open(path) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path}: 'format' must be {FORMAT!r}")
        try:
            coeffs = doc["moe"]
            fit = LatencyFit(*[float(coeffs.get(c, 0.0)) for c in COEFFS])
            model = cls(fit, int(doc["block_m"]), int(doc["n_experts"]), int(doc["top_k"]),
                        float(doc.get("step_overhead_us", 0.0)), float(doc.get("chunk_us_per_token", 0.0)),
                        dict(doc.get("info", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: missing or malformed field ({type(e).__name__}: {e})") from None
        if model.block_m < 1 or not 0 < model.top_k <= model.n_experts:
            raise ValueError(f"{path}: block_m must be >= 1 and 0 < top_k <= n_experts, got block_m="
                             f"{model.block_m}, top_k={model.top_k}, n_experts={model.n_experts}")
        return model


def fit_overhead(model: TileModel, points, *, layers: int, info: dict | None = None) -> TileModel:
    """`model` with its iteration outside the MoE launches fitted to measured mixed iterations.

    points: (decode_tokens, chunk_tokens, iteration_us[, real_tokens]) of mixed iterations (one
    launch a layer over the union of the step's and the chunk's tokens, `layers` MoE layers);
    chunk_tokens counts the chunk's rows with their padding, real_tokens (default chunk_tokens)
    the prompt tokens among them, the only ones that take routed experts. Each point gives
    rest = iteration_us - layers * launch_us(expected_tiles(decode_tokens + real_tokens)). Two or
    more chunk sizes: rest = step_overhead_us + chunk_us_per_token * chunk_tokens by least squares
    (a slope below 0, noise over too narrow a spread, taken as 0: the overhead is then their mean);
    one size: the model's chunk_us_per_token kept and step_overhead_us set to match on average.
    info: merged into the model's info (provenance). ValueError without points."""
    pts = np.asarray([(p[0], p[1], p[2], p[3] if len(p) > 3 else p[1]) for p in points],
                     np.float64).reshape(-1, 4)
    if not len(pts):
        raise ValueError("no mixed iteration to fit the overhead to")
    chunks = pts[:, 1]
    rest = np.array([t - layers * model.launch_us(model.expected_tiles(int(d + r))) for d, _, t, r in pts])
    if len(set(chunks)) > 1:
        per_token, overhead = np.polyfit(chunks, rest, 1)
        if per_token < 0:
            per_token, overhead = 0.0, float(np.mean(rest))
    else:
        per_token = model.chunk_us_per_token
        overhead = float(np.mean(rest - per_token * chunks))
    return dataclasses.replace(model, step_overhead_us=float(overhead), chunk_us_per_token=float(per_token),
                               info=dict(model.info, **(info or {})))


# ---------------------------------------------------------------------------------- chunks
def chunk_candidates(max_chunk: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` below max_chunk, and max_chunk: the compiled chunk widths."""
    if max_chunk < 1:
        raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
    out, c = [], smallest
    while c < max_chunk:
        out.append(c)
        c *= 2
    return out + [max_chunk]


def largest_chunk(model: TileModel, *, budget_us: float, candidates, rows: int, layers: int,
                  decode_tokens: int = 0, decode_counts=None, probs=None, mixed: bool = False) -> int:
    """The largest chunk C in candidates whose predicted iteration fits budget_us, else 0.

    A chunk of width C runs rows*C prefill tokens (the chunk call is [rows, C]); its x_moe is
    their expectation (`expected_x_moe`, probs as there). The decode batch is decode_counts
    (per-expert rows [E]: the exact x_moe) or decode_tokens (its expectation). mixed: the chunk
    and the decode step are one program (one launch a layer over the union of their tokens,
    whose x_moe is the expectation for decode_tokens + rows*C tokens)."""
    best = 0
    for c in sorted(candidates):
        if predicted_iteration_us(model, c, rows=rows, layers=layers, decode_tokens=decode_tokens,
                                  decode_counts=decode_counts, probs=probs, mixed=mixed) <= budget_us:
            best = c
    return best


def predicted_iteration_us(model: TileModel, chunk: int, *, rows: int, layers: int, decode_tokens: int = 0,
                           decode_counts=None, probs=None, mixed: bool = False,
                           real_tokens: int | None = None) -> float:
    """The model's iteration with a chunk of width `chunk` (arguments as `largest_chunk`);
    real_tokens: the prompt tokens in the chunk's rows * chunk (default all of them), the only
    ones its MoE launches take (padding rows skip the routed experts, `moe.block.MoE`)."""
    if decode_counts is not None:
        x_d = float(x_moe(decode_counts, model.block_m))
        decode_tokens = int(np.sum(decode_counts))
    else:
        x_d = model.expected_tiles(decode_tokens, probs)
    real = rows * chunk if real_tokens is None else real_tokens
    x_p = model.expected_tiles(real, probs)
    x_u = model.expected_tiles(decode_tokens + real, probs) if mixed else None
    return model.iteration_us(decode_tiles=x_d, prefill_tiles=x_p, layers=layers, union_tiles=x_u,
                              chunk_tokens=rows * chunk)


@dataclasses.dataclass(frozen=True)
class ChunkSizer:
    """The scheduler's chunk width for the decode work of an iteration.

    No decode work: the widest candidate (nothing to protect). Otherwise the largest candidate
    whose predicted iteration fits budget_us. When none fits, the decode step and the least
    prefill already miss the budget: the largest candidate whose predicted iteration is within
    `slack` of the narrowest's. The streams then lose at most that share beyond what they must,
    and the prompts go on at the width that the iteration's fixed cost makes nearly free (a
    narrow chunk would cost almost as much time an iteration and prefill a fraction as much)."""

    model: TileModel
    budget_us: float
    candidates: tuple[int, ...]
    rows: int  # the chunk call's rows when the caller does not say: the server's slots
    layers: int  # MoE layers per step
    slack: float = 0.1

    def __post_init__(self):
        if not self.candidates or min(self.candidates) < 1:
            raise ValueError(f"candidates must be positive chunk widths, got {self.candidates}")
        if self.budget_us <= 0:
            raise ValueError(f"the TPOT budget must be positive, got {self.budget_us} µs")
        if self.slack < 0:
            raise ValueError(f"slack must be >= 0, got {self.slack}")

    @functools.lru_cache(maxsize=256)
    def __call__(self, decode_tokens: int, rows: int | None = None, mixed: bool = False) -> int:
        """rows: the prompts the chunk prefills (default `self.rows`); mixed: the chunk runs in
        one program with the decode step (`largest_chunk`)."""
        if decode_tokens <= 0:
            return max(self.candidates)
        shape = dict(rows=self.rows if rows is None else rows, layers=self.layers, decode_tokens=decode_tokens,
                     mixed=mixed)
        c = largest_chunk(self.model, budget_us=self.budget_us, candidates=self.candidates, **shape)
        if c:
            return c
        least = predicted_iteration_us(self.model, min(self.candidates), **shape)
        return largest_chunk(self.model, budget_us=least * (1 + self.slack), candidates=self.candidates, **shape)

"""The tile-aware latency model (moe/tiles.py): the fit, x_moe and its expectation, the chunk
picker, the server's scheduler sizing chunks with it, and bench.step's calibration of its overhead
(host arithmetic on measured figures)."""

import dataclasses
import types

import numpy as np
import pytest

from moe import tiles
from serve.request import Request, Sampling
from serve.run import StartupError, chunk_sizer, parse_args
from serve.scheduler import Scheduler

TRUE = tiles.LatencyFit(alpha=12.0, beta=0.8, gamma=0.05, delta=0.002)


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 2000, 400).astype(float)
    s = rng.choice([1.0, 8.0, 32.0, 128.0], 400)
    t = TRUE(x, s) * (1 + 1e-3 * rng.standard_normal(400))  # 0.1 % noise
    fit = tiles.LatencyFit.fit(x, t, s)
    for name in tiles.COEFFS:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=0.03), name


def test_fit_at_s_one_keeps_alpha_and_the_merged_slope():
    """MoE samples (s = 1): gamma and delta are not identifiable; beta takes all three slopes."""
    x = np.arange(1, 50, dtype=float) * 7
    fit = tiles.LatencyFit.fit(x, TRUE(x))
    assert fit.alpha == pytest.approx(TRUE.alpha) and fit.gamma == fit.delta == 0.0
    assert fit.beta == pytest.approx(TRUE.beta + TRUE.gamma + TRUE.delta)
    with pytest.raises(ValueError, match="cannot determine"):
        tiles.LatencyFit.fit([5.0, 5.0, 5.0], [1.0, 2.0, 3.0])


def test_x_moe_counts_tiles_and_its_expectation_matches_sampling():
    assert tiles.x_moe([0, 1, 64, 65, 130], 64) == 0 + 1 + 1 + 2 + 3
    ids = np.array([[0, 1], [0, 2], [0, 1]])
    assert tiles.x_moe_of_ids(ids, 4, 2) == 2 + 1 + 1
    e, k, bm, tokens = 16, 4, 8, 40
    rng = np.random.default_rng(1)
    samples = [tiles.x_moe_of_ids(np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]), e, bm)
               for _ in range(400)]
    assert tiles.expected_x_moe(tokens, e, k, bm) == pytest.approx(np.mean(samples), rel=0.02)
    skew = np.r_[[0.5] * 4, [2.0 / 12] * 12]  # sums to k = 4
    assert tiles.expected_x_moe(tokens, e, k, bm, probs=skew) < tiles.expected_x_moe(tokens, e, k, bm)
    grid = [tiles.expected_x_moe(n, 512, 8, 64) for n in (0, 1, 8, 64, 512, 4096)]
    assert grid[0] == 0 and grid[1] == pytest.approx(8) and np.all(np.diff(grid) > 0)


def test_x_moe_of_the_tile_kernel_counts_hot_and_cold_blocks():
    ids = np.array([[0, 2], [0, 4], [0, 4], [0, 1], [0, 4], [0, 4], [0, 4], [0, 4]])  # 3 decode tokens, BM 4:
    # expert 0: 3 decode + 5 prefill pairs -> a hot block (3 + 1) and a cold one (4); expert 1: 1 prefill
    # pair -> cold; expert 2: 1 decode pair -> hot; expert 4: 2 decode + 4 prefill -> hot (2 + 2), cold (2)
    assert tiles.x_moe_tile_kernel(ids, 3, 5, 4) == 2 + 1 + 1 + 2
    assert tiles.x_moe_tile_kernel(ids, 0, 5, 4) == tiles.x_moe_of_ids(ids, 5, 4)  # no decode: one class
    assert tiles.x_moe_tile_kernel(ids, 8, 5, 4) == tiles.x_moe_of_ids(ids, 5, 4)  # no prefill: one class
    # hot blocks of 2 (decode pairs only), cold of 4: expert 0 -> 2 hot (3 decode), 2 cold (5
    # prefill); expert 2 -> 1 hot; expert 1 -> 1 cold; expert 4 -> 1 hot (2 decode), 1 cold (4)
    assert tiles.x_moe_tile_kernel(ids, 3, 5, 4, block_m_hot=2) == 4 + 1 + 1 + 2


def _model(**kw):
    return tiles.TileModel(tiles.LatencyFit(20.0, 1.5), block_m=64, n_experts=512, top_k=8, **kw)


def test_json_round_trip_and_clear_errors(tmp_path):
    m = _model(step_overhead_us=300.0, chunk_us_per_token=12.5, info={"device": "test"})
    path = str(tmp_path / "tm.json")
    m.save(path)
    assert tiles.TileModel.load(path) == m
    (tmp_path / "bad.json").write_text('{"format": "ling-tile-model/1", "moe": {"alpha": 1}}')
    with pytest.raises(ValueError, match="block_m"):
        tiles.TileModel.load(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"alpha": 1}')
    with pytest.raises(ValueError, match="format"):
        tiles.TileModel.load(str(tmp_path / "other.json"))


CANDIDATES = tiles.chunk_candidates(1024)


def test_chunk_picker_is_correct_and_monotone():
    assert CANDIDATES == [16, 32, 64, 128, 256, 512, 1024]
    m, layers, rows = _model(step_overhead_us=500.0), 20, 4

    def predict(c, decode):
        return m.iteration_us(decode_tiles=m.expected_tiles(decode), prefill_tiles=m.expected_tiles(rows * c),
                              layers=layers)

    for decode in (8, 32, 64):
        previous = 0
        for budget in np.linspace(2_000, 80_000, 25):
            c = tiles.largest_chunk(m, budget_us=budget, candidates=CANDIDATES, rows=rows, layers=layers,
                                    decode_tokens=decode)
            assert c >= previous  # a larger budget never shrinks the chunk
            previous = c
            if c:  # it fits, and the next width does not
                assert predict(c, decode) <= budget
            nxt = [w for w in CANDIDATES if w > c]
            if nxt:
                assert predict(nxt[0], decode) > budget
    budget = 30_000.0
    sizes = [tiles.largest_chunk(m, budget_us=budget, candidates=CANDIDATES, rows=rows, layers=layers,
                                 decode_tokens=d) for d in (0, 1, 8, 64, 256, 1024)]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # more decode work never grows the chunk
    counts = np.zeros(512, int)
    counts[:8] = 1  # 8 tokens' rows on 8 experts: x = 8 exactly
    exact = tiles.largest_chunk(m, budget_us=budget, candidates=CANDIDATES, rows=rows, layers=layers,
                                decode_counts=counts)
    assert exact == tiles.largest_chunk(m, budget_us=budget, candidates=CANDIDATES, rows=rows, layers=layers,
                                        decode_tokens=1)  # 1 token top-8: 8 tiles as well


def _request(n_prompt, max_tokens=100):
    return Request(prompt_ids=list(range(1, n_prompt + 1)), sampling=Sampling(max_tokens=max_tokens))


@pytest.mark.parametrize("mixed", [False, True])
def test_scheduler_sizes_chunks_with_the_model(mixed):
    """One slot decodes (width tokens) while one prompt prefills: the chunk is the model's width
    for them, in one launch a layer when the iteration is mixed (a wider chunk then fits)."""
    slots, layers, width = 2, 20, 4
    m = _model(step_overhead_us=2_000.0)
    sizer = tiles.ChunkSizer(m, budget_us=13_000.0, candidates=tuple(tiles.chunk_candidates(256)), rows=slots,
                             layers=layers)
    expect = tiles.largest_chunk(m, budget_us=13_000.0, candidates=sizer.candidates, rows=1, layers=layers,
                                 decode_tokens=width, mixed=mixed)
    separate = tiles.largest_chunk(m, budget_us=13_000.0, candidates=sizer.candidates, rows=1, layers=layers,
                                   decode_tokens=width)
    assert 16 <= expect < 256  # the budget binds while a slot decodes
    assert expect > separate if mixed else expect == separate
    sched = Scheduler(slots, 256, eos_id=None, sizer=sizer, decode_width=width, mixed=mixed)
    short, long = _request(40), _request(600)
    sched.add(short)
    first = sched.next_chunk()  # nobody decodes yet: the widest chunk, narrowed to the 40 tokens
    assert first.tokens.shape == (slots, 64) and first.valid[0] == 40 and first.ends[0]
    assert sched.decoding()[0] is short
    sched.add(long)
    second = sched.next_chunk()  # the short request decodes now: the model's width
    assert second.tokens.shape == (slots, expect) and second.valid[1] == expect
    sched.remove(short)
    third = sched.next_chunk()  # decoding finished: wide again
    assert third.tokens.shape == (slots, 256) and third.valid[1] == 256
    fixed = Scheduler(slots, 64, eos_id=None)  # no model: the fixed chunk, as before
    fixed.add(_request(200))
    assert fixed.next_chunk().tokens.shape == (slots, 64)


@pytest.mark.parametrize("interval", [None, 96])
def test_a_prompts_last_chunk_takes_the_narrowest_width_that_holds_it(interval):
    """What a prompt has left, up to its end (or, with the prefix cache, its next grid point),
    runs at the narrowest of the sizer's widths that holds it, never wider than the sizer's pick:
    no padding rows through the layers. Two prompts in one chunk: the longer rest decides."""
    from serve.prefix_cache import PrefixIndex

    m = _model(step_overhead_us=2_000.0)
    sizer = tiles.ChunkSizer(m, budget_us=1e9, candidates=(32, 128, 256), rows=2, layers=4)
    prefix = None if interval is None else PrefixIndex(entries=64, interval=interval)
    sched = Scheduler(2, 256, eos_id=None, sizer=sizer, prefix=prefix)
    sched.add(_request(300))
    widths, valid = [], []
    while (chunk := sched.next_chunk()) is not None:
        widths.append(chunk.tokens.shape[1])
        valid.append(int(chunk.valid[0]))
    # 300 = 256 + 44; with checkpoints every 96 tokens: 96 + 96 + 96 + 12
    assert (widths, valid) == (([256, 128], [256, 44]) if interval is None else
                               ([128, 128, 128, 32], [96, 96, 96, 12]))
    both = Scheduler(2, 256, eos_id=None, sizer=sizer)
    both.add(_request(20))
    both.add(_request(100))
    chunk = both.next_chunk()
    assert chunk.tokens.shape == (2, 128) and list(chunk.valid) == [20, 100]


@pytest.mark.parametrize("decode,overhead_us,expect", [(16, 0.0, "narrowest"), (96, 1e6, "widest"),
                                                       (96, 5_000.0, "between")])
def test_sizer_beyond_reach_takes_the_widest_chunk_within_slack_of_the_narrowest(decode, overhead_us, expect):
    """The budget below even the narrowest chunk's iteration: the widest chunk whose predicted
    iteration is within the slack (10%) of the narrowest's. What the chunk adds to the iteration
    decides: much (few decode tokens, no fixed part: the chunk's experts are the MoE's work) keeps
    the narrowest, little (a dominant fixed part) the widest. The served int4 cut's fit (one tile
    launch a layer over 16 speculative streams' 96 tokens and the chunk)."""
    m = tiles.TileModel(tiles.LatencyFit(31.09, 2.948), block_m=16, n_experts=512, top_k=8,
                        step_overhead_us=overhead_us)
    widths = tuple(tiles.chunk_candidates(256))
    sizer = tiles.ChunkSizer(m, budget_us=1.0, candidates=widths, rows=1, layers=14)
    it = {c: tiles.predicted_iteration_us(m, c, rows=1, layers=14, decode_tokens=decode, mixed=True) for c in widths}
    c = sizer(decode, 1, True)
    assert it[c] <= 1.1 * it[16] and all(it[w] > 1.1 * it[16] for w in widths if w > c)
    assert c == {"narrowest": 16, "widest": 256}.get(expect, c)
    if expect == "between":
        assert 16 < c < 256
    assert sizer(0) == 256  # nothing decodes: the widest


def test_chunk_tokens_cost_narrows_the_chunk():
    """The overhead's part per chunk token is the sizer's too: a budget that the widest chunk
    fits on its MoE work alone takes a narrower one once each prompt token costs outside the MoE."""
    widths = tuple(tiles.chunk_candidates(256))
    free = tiles.TileModel(tiles.LatencyFit(17.3, 2.273), block_m=16, n_experts=512, top_k=8, step_overhead_us=15_000.0)
    costly = dataclasses.replace(free, chunk_us_per_token=25.0)
    budget = tiles.predicted_iteration_us(free, 256, rows=1, layers=14, decode_tokens=96, mixed=True)
    assert tiles.ChunkSizer(free, budget, widths, rows=1, layers=14)(96, 1, True) == 256
    c = tiles.ChunkSizer(costly, budget, widths, rows=1, layers=14)(96, 1, True)
    assert 16 <= c < 256
    for w in (16, 256):  # the per-token part of the prediction, exactly
        assert tiles.predicted_iteration_us(costly, w, rows=2, layers=14, decode_tokens=96) == pytest.approx(
            tiles.predicted_iteration_us(free, w, rows=2, layers=14, decode_tokens=96) + 25.0 * 2 * w)


@pytest.mark.parametrize("widths", [(16, 64, 256), (256,)])
def test_step_calibration_fits_the_overhead_from_mixed_iterations(tmp_path, widths):
    """bench.step's calibration: mixed iterations made of a known overhead line and the model's own
    launches give that line back (two or more widths); one width keeps the model's slope."""
    from bench.step import calibrate
    from ling.config import MOE, preset

    path = str(tmp_path / "tm.json")
    base = tiles.TileModel(tiles.LatencyFit(17.3, 2.273), block_m=16, n_experts=512, top_k=8, chunk_us_per_token=9.0,
                           info={"launch": "grouped"})
    base.save(path)
    run = dict(preset="ling-3-flash", layers=16, batch=16, num_steps=5, chunk=list(widths), mixed_moe=["grouped"])
    layers = sum(t == MOE for t in preset("ling-3-flash").mlp_types[:16])
    a, b = 15_000.0, 20.0 if len(widths) > 1 else 9.0
    results = {f"mixed {c}": dict(chunk=c, mixed_moe="grouped", stream={"kernels": []},
                                  served_us=a + b * c + layers * base.launch_us(base.expected_tiles(96 + c)))
               for c in widths}
    results["spec"] = dict(chunk=None, mixed_moe=None, served_us=1.0, stream={"kernels": []})  # not a mixed one
    calibrate(path, run, results, "test")
    fitted = tiles.TileModel.load(path)
    assert fitted.step_overhead_us == pytest.approx(a) and fitted.chunk_us_per_token == pytest.approx(b)
    assert [p["chunk"] for p in fitted.info["step_overhead"]["points"]] == list(widths)
    for c in widths:
        assert tiles.predicted_iteration_us(fitted, c, rows=1, layers=layers, decode_tokens=96, mixed=True) == (
            pytest.approx(results[f"mixed {c}"]["served_us"]))


def test_server_flags_build_the_sizer(tmp_path):
    path = str(tmp_path / "tm.json")  # a model of the default mixed launch's
    tiles.TileModel(tiles.LatencyFit(5.0, 1.0), block_m=16, n_experts=8, top_k=2, info={"launch": "grouped"}).save(
        path)
    cfg = types.SimpleNamespace(mlp_types=("dense", "moe", "moe"), num_experts=8, num_experts_per_tok=2)
    args = parse_args(["--tile-model", path, "--tpot-slo-ms", "50", "--prefill-chunk", "64", "--max-batch", "3"])
    sizer = chunk_sizer(args, cfg)
    assert sizer.candidates == (16, 32, 64) and sizer.rows == 3 and sizer.layers == 2
    assert sizer.budget_us == 50_000.0
    assert chunk_sizer(parse_args([]), cfg) is None
    with pytest.raises(StartupError, match="fitted for 8 experts top-2"):
        chunk_sizer(args, types.SimpleNamespace(mlp_types=("moe",), num_experts=16, num_experts_per_tok=2))
    chosen = parse_args(["--tile-model", path, "--tpot-slo-ms", "50", "--prefill-chunk", "256", "--chunk-widths",
                         "128,64"])
    assert chunk_sizer(chosen, cfg).candidates == (64, 128, 256)  # the widest always among them
    too_wide = parse_args(["--tile-model", path, "--tpot-slo-ms", "50", "--prefill-chunk", "64", "--chunk-widths",
                           "128"])
    with pytest.raises(StartupError, match="at most --prefill-chunk 64"):
        chunk_sizer(too_wide, cfg)
    for bad in (["--chunk-widths", "64"], ["--tile-model", path, "--tpot-slo-ms", "5", "--chunk-widths", "a"],
                ["--tile-model", path, "--tpot-slo-ms", "5", "--chunk-widths", "0,16"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(SystemExit):
        parse_args(["--tile-model", path])  # without a budget
    kernel = str(tmp_path / "tiles.json")  # fitted before models named their launch: the tile kernel's
    tiles.TileModel(tiles.LatencyFit(5.0, 1.0), block_m=16, n_experts=8, top_k=2).save(kernel)
    flags = ["--tile-model", kernel, "--tpot-slo-ms", "50", "--prefill-chunk", "64"]
    with pytest.raises(StartupError, match="models the tiles launch, but .* --mixed-moe grouped"):
        chunk_sizer(parse_args(flags), cfg)
    assert chunk_sizer(parse_args(flags + ["--mixed-moe", "tiles"]), cfg).model.info.get("launch") is None
    assert chunk_sizer(parse_args(flags + ["--mixed-iteration", "off"]), cfg) is not None  # no mixed launch
    assert chunk_sizer(parse_args(flags), cfg, mixed=False) is not None  # auto, resolved off (the reference)


def test_the_overhead_fit_takes_a_line_or_keeps_the_slope():
    """`fit_overhead`: the rest outside the model's launches as a line over two or more chunk sizes;
    one size keeps the model's slope; a falling line (noise) is taken as flat; no point is refused."""
    base = tiles.TileModel(tiles.LatencyFit(17.3, 2.273), block_m=16, n_experts=512, top_k=8, chunk_us_per_token=9.0)

    def points(a, b, chunks):
        return [(96, c, a + b * c + 14 * base.launch_us(base.expected_tiles(96 + c))) for c in chunks]

    two = tiles.fit_overhead(base, points(15e3, 20.0, (128, 192, 256)), layers=14, info={"x": 1})
    assert (two.step_overhead_us, two.chunk_us_per_token) == (pytest.approx(15e3), pytest.approx(20.0))
    assert two.info["x"] == 1 and two.moe == base.moe
    one = tiles.fit_overhead(base, points(15e3, 20.0, (256,)), layers=14)
    assert one.chunk_us_per_token == 9.0 and one.step_overhead_us == pytest.approx(15e3 + 11.0 * 256)
    flat = tiles.fit_overhead(base, points(15e3, -3.0, (128, 256)), layers=14)
    assert flat.chunk_us_per_token == 0.0 and flat.step_overhead_us == pytest.approx(15e3 - 3.0 * 192)
    with pytest.raises(ValueError, match="no mixed iteration"):
        tiles.fit_overhead(base, [], layers=14)

"""`python -m serve.bench`: a load generator for an OpenAI-compatible server, in the manner of
SGLang's bench_serving: streamed requests (SSE), random prompts of given lengths or a JSONL file,
a fixed concurrency or a Poisson request rate; reports TTFT, TPOT, ITL, throughput and the mean
accepted length of speculative decoding (from the server's /metrics, before and after).

    python -m serve.bench --num-prompts 64 --random-input-len 128 --random-output-len 64 --concurrency 8
    python -m serve.bench --dataset jsonl --dataset-path prompts.jsonl --request-rate 4 --output-json out.json
    python -m serve.bench --num-prompts 64 --concurrency 8 --plot run.png
    python -m serve.bench --multi-turn --num-prompts 8 --turns 4 --random-input-len 4096 --turn-input-len 128
    python -m serve.bench --streams 16 --num-prompts 8 --random-input-len 8192 --random-range-ratio 0.25 \\
        --random-output-len 16 --request-rate 0.5

TTFT and ITL are taken at the chunks that bring new tokens: the requests ask for the usage on
every chunk (`stream_options.continuous_usage_stats`, as vLLM has it), so tokens that make no text
yet (a byte of an unfinished character, or ids past a mismatched tokenizer's vocabulary, as with a
preset's random weights) still count; from a server that ignores it, the chunks with text.

Datasets (`--dataset`, or SGLang's `--dataset-name`): `random` and `random-ids` both send uniform
random token ids (this tool has no ShareGPT text to draw `random`'s prompts from offline), `jsonl`
reads a file. A JSONL line is {"prompt": "text" | [token ids]} or {"messages": [...]}, with an optional
"max_tokens" (default --random-output-len).

`--streams N`: decode tokens waiting behind prefill. N running streams (short prompts, long outputs)
run alone, then again while the --num-prompts prompts (e.g. --random-input-len 8192
--random-range-ratio 0.25: 2k-8k tokens) arrive at --request-rate. Reported per phase: the streams'
TPOT and median / P99 ITL (the gaps that begin once every stream decodes, from the last stream's
first token; with arrivals, of those the ones that end between the first arrival and the last
one's completion), the arrivals' TTFT, throughput, and the ratio of the streams' P99 ITL with
arrivals to without.

`--multi-turn`: synthetic chats for the prefix cache. --num-prompts conversations, each opening with
a --random-input-len prompt; turn t + 1 resends turn t's prompt, its output (re-tokenised from the
streamed text) and --turn-input-len new tokens. Turns go in rounds (every conversation's turn t,
at most --concurrency at once, then turn t + 1), and the whole workload runs twice in the same run:
without the cache (the server's /flush_cache before every round) and with it (flushed once at the
start). Reported per mode: TTFT of first and of follow-up turns, TPOT, throughput, and the ratio
of follow-up TTFTs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time

import httpx
import numpy as np

DEFAULT_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


@dataclasses.dataclass
class Item:
    prompt: str | list[int] | None  # for /v1/completions
    messages: list[dict] | None  # for /v1/chat/completions
    max_tokens: int


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # when it was sent (time.perf_counter())
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    text: str = ""  # the streamed output

    def token_times(self) -> np.ndarray:
        """When each streamed chunk with new tokens arrived (time.perf_counter())."""
        if not self.ok or not self.ttft:
            return np.zeros(0)
        return self.start + self.ttft + np.concatenate([[0.0], np.cumsum(self.itl)])


# -- prompts -------------------------------------------------------------------------------------


def random_items(args, tokenizer) -> list[Item]:
    """Uniform random token ids (special tokens excluded) of lengths in [ratio * L, L]: exact input
    lengths for /v1/completions (sent as ids), decoded to text for chat."""
    rng = np.random.default_rng(args.seed)
    special = {i for t, i in tokenizer.tok.get_vocab(with_added_tokens=True).items() if tokenizer.tok.decode([i]) == ""}
    pool = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    lens_in = rng.integers(max(1, int(args.random_input_len * args.random_range_ratio)), args.random_input_len + 1,
                           args.num_prompts)
    lens_out = rng.integers(max(1, int(args.random_output_len * args.random_range_ratio)),
                            args.random_output_len + 1, args.num_prompts)
    items = []
    for n_in, n_out in zip(lens_in, lens_out):
        ids = rng.choice(pool, n_in).tolist()
        if args.endpoint == "chat":
            items.append(Item(None, [{"role": "user", "content": tokenizer.decode(ids)}], int(n_out)))
        else:
            items.append(Item(ids, None, int(n_out)))
    return items


def jsonl_items(args) -> list[Item]:
    items = []
    with open(args.dataset_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            max_tokens = int(d.get("max_tokens", d.get("output_len", args.random_output_len)))
            if "messages" in d:
                messages, prompt = d["messages"], None
            elif "prompt" in d:
                prompt = d["prompt"]
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else None
            else:
                raise SystemExit(f"error: {args.dataset_path}:{n}: a line needs 'prompt' or 'messages'")
            if args.endpoint == "chat" and messages is None:
                raise SystemExit(f"error: {args.dataset_path}:{n}: token-id prompts need --endpoint completions")
            if args.endpoint == "completions" and prompt is None:
                raise SystemExit(f"error: {args.dataset_path}:{n}: 'messages' need --endpoint chat")
            items.append(Item(prompt, messages, max_tokens))
    return items[: args.num_prompts] if args.num_prompts else items


# -- one request ---------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, args, model: str, item: Item) -> Result:
    chat = args.endpoint == "chat"
    body = {"model": model, "max_tokens": item.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": not args.disable_ignore_eos}
    body.update({"messages": item.messages} if chat else {"prompt": item.prompt})
    start = time.perf_counter()
    res, last = Result(start=start), None
    try:
        async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", str(chunk))
                    return res
                use, choices = chunk.get("usage"), chunk.get("choices", [])
                texts = [c.get("delta", {}).get("content") if chat else c.get("text") for c in choices]
                res.text += "".join(t for t in texts if t)
                # tokens arrived: the usage grew (a server that sends it on every chunk; tokens that
                # make no text yet count), else the chunk has text
                if choices and (use["completion_tokens"] > res.output_tokens if use else any(texts)):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if use:
                    res.prompt_tokens, res.output_tokens = use["prompt_tokens"], use["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# -- the run -------------------------------------------------------------------------------------


async def spec_counters(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """(decode steps, tokens) from the server's /metrics, or None if it does not export them."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    if "ling:spec_decode_steps_total" not in values:
        return None
    return values["ling:spec_decode_steps_total"], values["ling:spec_decode_tokens_total"]


async def run(args, items: list[Item]) -> dict:
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency or len(items) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            if r.status_code != 200:
                raise SystemExit(f"error: GET /v1/models: HTTP {r.status_code}: {r.text[:300]}")
            model = r.json()["data"][0]["id"]
        for item in items[: args.warmup_requests]:  # compiles / warms caches outside the measurement
            warm = await send(client, args, model, dataclasses.replace(item, max_tokens=min(item.max_tokens, 8)))
            if not warm.ok:
                raise SystemExit(f"error: the warm-up request failed: {warm.error}")

        before = await spec_counters(client)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        bar = tqdm(total=len(items), disable=args.disable_tqdm, unit="req")
        rng = np.random.default_rng(args.seed + 1)

        async def one(item):
            if sem is None:
                res = await send(client, args, model, item)
            else:
                async with sem:
                    res = await send(client, args, model, item)
            bar.update()
            return res

        start = time.perf_counter()
        tasks = []
        for item in items:
            tasks.append(asyncio.create_task(one(item)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        after = await spec_counters(client)

    accept = None
    if before is not None and after is not None and after[0] > before[0]:
        accept = (after[1] - before[1]) / (after[0] - before[0])
    if args.plot:
        plot(args.plot, results, start, duration)
    return summarize(args, model, results, duration, accept)


async def multi_turn(args, tokenizer) -> dict:
    """The --multi-turn workload without and with the prefix cache (module docstring); returns
    {mode: summary} with first- and follow-up-turn TTFTs added to each summary."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency or args.num_prompts, max_keepalive_connections=None)
    out = {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]

        async def flush():
            r = await client.post("/flush_cache")
            if r.status_code != 200:
                raise SystemExit(f"error: POST /flush_cache: HTTP {r.status_code}: {r.text[:300]} (--multi-turn "
                                 "compares runs with and without the server's prefix cache)")

        warm = await send(client, args, model, Item(list(range(2, 10)), None, 4))
        if not warm.ok:
            raise SystemExit(f"error: the warm-up request failed: {warm.error}")
        sem = asyncio.Semaphore(args.concurrency or args.num_prompts)

        async def one(item):
            async with sem:
                return await send(client, args, model, item)

        for mode in ("no-cache", "cache"):
            rng = np.random.default_rng(args.seed)
            ids = lambda n: rng.integers(2, tokenizer.vocab_size, n).tolist()  # noqa: E731
            history = [ids(args.random_input_len) for _ in range(args.num_prompts)]
            results, turn_of = [], []
            await flush()
            before = await spec_counters(client)
            start = time.perf_counter()
            for turn in range(args.turns):
                if mode == "no-cache" and turn:
                    await flush()
                texts = {}

                async def run_one(c, prompt):
                    res = await one(Item(prompt, None, args.random_output_len))
                    texts[c] = res.text
                    return res

                done = await asyncio.gather(*(run_one(c, h) for c, h in enumerate(history)))
                results += done
                turn_of += [turn] * len(done)
                history = [h + tokenizer.encode(texts[c], special=False) + ids(args.turn_input_len)
                           for c, h in enumerate(history)]
            duration = time.perf_counter() - start
            after = await spec_counters(client)
            accept = None
            if before is not None and after is not None and after[0] > before[0]:
                accept = (after[1] - before[1]) / (after[0] - before[0])
            s = summarize(args, model, results, duration, accept)
            ttft = lambda first: [r.ttft * 1e3 for r, t in zip(results, turn_of) if r.ok and (t == 0) == first]  # noqa: E731
            for name, xs in (("first_turn", ttft(True)), ("follow_up", ttft(False))):
                s[f"mean_ttft_{name}_ms"] = float(np.mean(xs)) if xs else float("nan")
                s[f"median_ttft_{name}_ms"] = float(np.median(xs)) if xs else float("nan")
            out[mode] = s
    return out


def gaps_within(results: list[Result], lo: float = -math.inf, hi: float = math.inf,
                since: float = -math.inf) -> list[float]:
    """The inter-token gaps of `results` that end within [lo, hi] and begin at `since` or later
    (time.perf_counter())."""
    return [g for r in results for t, g in zip(r.token_times()[1:], r.itl) if lo <= t <= hi and t - g >= since]


def steady_from(streams: list[Result]) -> float:
    """When every stream decodes: the last one's first token. A gap that begins before it spans
    the streams' own start (their prompts prefilled one after another), not the decode they wait
    on."""
    return max((r.start + r.ttft for r in streams if r.ok), default=-math.inf)


async def with_streams(args, items: list[Item], tokenizer) -> dict:
    """The --streams workload (module docstring): the streams alone, then the streams again with
    `items` arriving at --request-rate beside them. Returns {"alone": ..., "arrivals": ...}: the
    streams' TPOT and ITL (the gaps that begin once every stream decodes, `steady_from`; in the
    second phase only those that end between the first arrival and the last one's completion),
    the arrivals' TTFT, and each phase's output throughput."""
    stream_args = argparse.Namespace(**{**vars(args), "num_prompts": args.streams, "random_output_len":
                                        args.stream_output_len, "random_input_len": args.stream_input_len,
                                        "random_range_ratio": 1.0, "seed": args.seed + 1})
    stream_items = random_items(stream_args, tokenizer)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.streams + len(items), max_keepalive_connections=None)
    ms = lambda xs, f: float(f(np.asarray(xs)) * 1e3) if len(xs) else float("nan")  # noqa: E731
    p99 = lambda a: np.percentile(a, 99)  # noqa: E731
    out = {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        for item in (stream_items[0], items[0]):  # compiles / warms outside the measurement
            warm = await send(client, args, model, dataclasses.replace(item, max_tokens=4))
            if not warm.ok:
                raise SystemExit(f"error: the warm-up request failed: {warm.error}")
        rng = np.random.default_rng(args.seed + 2)
        for phase in ("alone", "arrivals"):
            start = time.perf_counter()
            running = [asyncio.create_task(send(client, args, model, it)) for it in stream_items]
            arrivals = []
            if phase == "arrivals":
                await asyncio.sleep(args.streams_lead_s)  # the streams decode before the first arrival
                for item in items:
                    arrivals.append(asyncio.create_task(send(client, args, model, item)))
                    if math.isfinite(args.request_rate):
                        await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
            new = await asyncio.gather(*arrivals)
            streams = await asyncio.gather(*running)
            duration = time.perf_counter() - start
            ok = [r for r in streams if r.ok]
            steady = steady_from(ok)
            if phase == "arrivals" and new:
                lo = min(r.start for r in new)
                hi = max((r.start + r.latency for r in new if r.ok), default=lo)
                gaps = gaps_within(ok, lo, hi, since=steady)
                covered = max((r.start + r.latency for r in ok), default=lo) >= hi
            else:
                gaps, covered = gaps_within(ok, since=steady), True
            tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
            done = [r for r in (*streams, *new) if r.ok]
            failed = [r for r in (*streams, *new) if not r.ok]
            out[phase] = {
                "streams": args.streams, "arrivals": len(new), "failed": len(failed),
                "first_error": failed[0].error if failed else None, "duration_s": duration,
                "stream_mean_tpot_ms": ms(tpot, np.mean), "stream_median_itl_ms": ms(gaps, np.median),
                "stream_p99_itl_ms": ms(gaps, p99), "stream_max_itl_ms": ms(gaps, np.max), "itl_samples": len(gaps),
                "streams_outlast_arrivals": bool(covered),
                "arrival_mean_ttft_ms": ms([r.ttft for r in new if r.ok], np.mean),
                "arrival_p99_ttft_ms": ms([r.ttft for r in new if r.ok], p99),
                "output_throughput": sum(r.output_tokens for r in done) / duration,
                "total_throughput": sum(r.output_tokens + r.prompt_tokens for r in done) / duration,
            }
    a, b = out["alone"], out["arrivals"]
    out["p99_itl_ratio"] = b["stream_p99_itl_ms"] / a["stream_p99_itl_ms"] if a["stream_p99_itl_ms"] else None
    return out


def streams_report(runs: dict) -> str:
    a, b = runs["alone"], runs["arrivals"]
    rows = [("Streams / arrivals", None), ("Benchmark duration (s)", "duration_s"),
            ("Streams: mean TPOT (ms)", "stream_mean_tpot_ms"), ("Streams: median ITL (ms)", "stream_median_itl_ms"),
            ("Streams: P99 ITL (ms)", "stream_p99_itl_ms"), ("Streams: max ITL (ms)", "stream_max_itl_ms"),
            ("Arrivals: mean TTFT (ms)", "arrival_mean_ttft_ms"), ("Arrivals: P99 TTFT (ms)", "arrival_p99_ttft_ms"),
            ("Output token throughput (tok/s)", "output_throughput"),
            ("Total token throughput (tok/s)", "total_throughput"), ("Failed requests", "failed")]
    fmt = lambda v: f"{v:>12.2f}" if isinstance(v, float) else f"{v!s:>12}"  # noqa: E731
    lines = [f"{' Streams With Arrivals Benchmark Result ':=^64}", f"{'':<40}{'alone':>12}{'arrivals':>12}"]
    for name, key in rows:
        lines.append(f"{name + ':':<40}" + (f"{a['streams']:>12}{b['streams']:>7} / {b['arrivals']}" if key is None
                                             else f"{fmt(a[key])}{fmt(b[key])}"))
    if runs["p99_itl_ratio"] is not None:
        lines.append(f"{'Streams: P99 ITL, arrivals / alone:':<40}{runs['p99_itl_ratio']:>24.2f}")
    if not b["streams_outlast_arrivals"]:
        lines.append("note: the streams ended before the last arrival did: raise --stream-output-len")
    lines.append("=" * 64)
    for phase in ("alone", "arrivals"):
        if runs[phase]["first_error"]:
            lines.append(f"first error ({phase}): {runs[phase]['first_error']}")
    return "\n".join(lines)


def multi_turn_report(runs: dict) -> str:
    a, b = runs["no-cache"], runs["cache"]
    rows = [("Successful requests", "completed"), ("Failed requests", "failed"), ("Benchmark duration (s)", "duration_s"),
            ("Total input tokens", "total_input_tokens"), ("Total generated tokens", "total_output_tokens"),
            ("Mean TTFT, first turns (ms)", "mean_ttft_first_turn_ms"),
            ("Median TTFT, first turns (ms)", "median_ttft_first_turn_ms"),
            ("Mean TTFT, follow-up turns (ms)", "mean_ttft_follow_up_ms"),
            ("Median TTFT, follow-up turns (ms)", "median_ttft_follow_up_ms"),
            ("Mean TPOT (ms)", "mean_tpot_ms"), ("Median TPOT (ms)", "median_tpot_ms"),
            ("Output token throughput (tok/s)", "output_throughput"),
            ("Total token throughput (tok/s)", "total_throughput")]
    fmt = lambda v: f"{v:>12.2f}" if isinstance(v, float) else f"{v!s:>12}"  # noqa: E731
    lines = [f"{' Multi-turn Benchmark Result ':=^70}", f"{'':<38}{'no cache':>12}{'cache':>12}{'ratio':>8}"]
    for name, key in rows:
        ratio = a[key] / b[key] if isinstance(a[key], float) and b[key] else None
        lines.append(f"{name + ':':<38}{fmt(a[key])}{fmt(b[key])}" + ("" if ratio is None else f"{ratio:>8.2f}"))
    lines.append("=" * 70)
    for mode, s in runs.items():
        if s["first_error"]:
            lines.append(f"first error ({mode}): {s['first_error']}")
    return "\n".join(lines)


def plot(path: str, results: list[Result], start: float, duration: float) -> None:
    """Writes a figure of the run: TTFT and TPOT distributions (histograms of the successful
    requests) and output throughput over time (streamed chunks per one-second bin, and requests in
    flight)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)") from None
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    for ax, xs, name in ((a, ttft, "TTFT"), (b, tpot, "TPOT")):
        ax.hist(xs, bins=min(30, max(len(xs), 1)), color="tab:blue")
        ax.set(title=f"{name} ({len(xs)} requests)", xlabel="ms", ylabel="requests")
        if xs:
            ax.axvline(float(np.median(xs)), color="k", ls="--", label=f"median {np.median(xs):.1f} ms")
            ax.legend()
    bins = np.arange(0.0, max(duration, 1e-3) + 1.0, 1.0)
    times = np.concatenate([r.token_times() - start for r in ok] or [np.zeros(0)])
    chunks, _ = np.histogram(times, bins)
    c.step(bins[:-1], chunks, where="post", color="tab:green", label="streamed chunks/s")
    c.set(title="output over time", xlabel="s since the first request", ylabel="chunks per second")
    live = [sum(r.start - start <= t < r.start - start + r.latency for r in ok) for t in bins[:-1]]
    c2 = c.twinx()
    c2.step(bins[:-1], live, where="post", color="tab:orange", label="requests in flight")
    c2.set_ylabel("requests in flight")
    c.legend(loc="upper left")
    c2.legend(loc="upper right")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(args, model: str, results: list[Result], duration: float, accept: float | None) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs, f: float(f(np.asarray(xs)) * 1e3) if len(xs) else float("nan")
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.latency for r in ok]
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    p = lambda q: (lambda a: np.percentile(a, q))
    return {
        "model": model, "endpoint": args.endpoint, "request_rate": args.request_rate,
        "max_concurrency": args.concurrency, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "first_error": next((r.error for r in results if not r.ok), None),
        "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
        "concurrency": sum(e2e) / duration, "accept_length": accept,
        "mean_e2e_latency_ms": ms(e2e, np.mean), "median_e2e_latency_ms": ms(e2e, np.median),
        "mean_ttft_ms": ms(ttft, np.mean), "median_ttft_ms": ms(ttft, np.median), "p99_ttft_ms": ms(ttft, p(99)),
        "mean_tpot_ms": ms(tpot, np.mean), "median_tpot_ms": ms(tpot, np.median), "p99_tpot_ms": ms(tpot, p(99)),
        "mean_itl_ms": ms(itl, np.mean), "median_itl_ms": ms(itl, np.median), "p95_itl_ms": ms(itl, p(95)),
        "p99_itl_ms": ms(itl, p(99)), "max_itl_ms": ms(itl, np.max),
    }


def report(s: dict) -> str:
    rows = [
        ("Model", s["model"]), ("Endpoint", s["endpoint"]), ("Traffic request rate", s["request_rate"]),
        ("Max request concurrency", s["max_concurrency"] or "none"),
        ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", s["duration_s"]), ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]), ("Request throughput (req/s)", s["request_throughput"]),
        ("Input token throughput (tok/s)", s["input_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_throughput"]), ("Concurrency", s["concurrency"]),
        ("Accept length", "n/a" if s["accept_length"] is None else s["accept_length"]),
        ("End-to-End Latency", None), ("Mean E2E Latency (ms)", s["mean_e2e_latency_ms"]),
        ("Median E2E Latency (ms)", s["median_e2e_latency_ms"]),
        ("Time to First Token", None), ("Mean TTFT (ms)", s["mean_ttft_ms"]),
        ("Median TTFT (ms)", s["median_ttft_ms"]), ("P99 TTFT (ms)", s["p99_ttft_ms"]),
        ("Time per Output Token (excl. 1st token)", None), ("Mean TPOT (ms)", s["mean_tpot_ms"]),
        ("Median TPOT (ms)", s["median_tpot_ms"]), ("P99 TPOT (ms)", s["p99_tpot_ms"]),
        ("Inter-Token Latency", None), ("Mean ITL (ms)", s["mean_itl_ms"]), ("Median ITL (ms)", s["median_itl_ms"]),
        ("P95 ITL (ms)", s["p95_itl_ms"]), ("P99 ITL (ms)", s["p99_itl_ms"]), ("Max ITL (ms)", s["max_itl_ms"]),
    ]
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    for name, v in rows:
        if v is None:
            lines.append(f"{' ' + name + ' ':-^50}")
        else:
            lines.append(f"{name + ':':<40} {v:>9.2f}" if isinstance(v, float) else f"{name + ':':<40} {v!s:>9}")
    lines.append("=" * 50)
    if s["first_error"]:
        lines.append(f"first error: {s['first_error']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m serve.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default=None, help="the 'model' to send (default: the server's first, /v1/models)")
    ap.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--dataset", "--dataset-name", default="random", choices=["random", "random-ids", "jsonl"],
                    help="random and random-ids: uniform random token ids; jsonl: --dataset-path")
    ap.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="directory with tokenizer.json, for random "
                    "prompts (default: the embedded default model's)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths drawn from [ratio * len, len]")
    ap.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson "
                    "arrivals; default inf: all at once, bounded by --concurrency)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS (by default they "
                    "generate exactly their max_tokens)")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="also write the results to this file")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--multi-turn", action="store_true", help="synthetic multi-turn chats, run without and with the "
                    "server's prefix cache (module docstring): --num-prompts conversations of --turns turns")
    ap.add_argument("--turns", type=int, default=4, help="with --multi-turn: turns per conversation")
    ap.add_argument("--turn-input-len", type=int, default=64, help="with --multi-turn: new tokens a follow-up turn "
                    "adds to the history")
    ap.add_argument("--streams", type=int, default=0, metavar="N", help="N running streams (--stream-input-len "
                    "prompts, --stream-output-len tokens each), alone and then with the --num-prompts prompts "
                    "arriving at --request-rate beside them (module docstring)")
    ap.add_argument("--stream-input-len", type=int, default=64, help="with --streams: each stream's prompt")
    ap.add_argument("--stream-output-len", type=int, default=1024, help="with --streams: each stream's output (make "
                    "it outlast the arrivals)")
    ap.add_argument("--streams-lead-s", type=float, default=1.0, help="with --streams: seconds the streams decode "
                    "before the first arrival")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw TTFT and TPOT distributions and output "
                    "throughput over time to this image (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.multi_turn and (args.endpoint != "completions" or args.dataset not in ("random", "random-ids")):
        ap.error("--multi-turn sends token-id prompts: --endpoint completions with a random dataset")
    if args.multi_turn and (args.turns < 1 or args.turn_input_len < 1):
        ap.error("--turns and --turn-input-len must be at least 1")
    if args.streams < 0 or (args.streams and (args.stream_input_len < 1 or args.stream_output_len < 2)):
        ap.error("--streams must be at least 0, --stream-input-len at least 1 and --stream-output-len at least 2")
    if args.streams and (args.multi_turn or args.endpoint != "completions"):
        ap.error("--streams sends token-id prompts to --endpoint completions, without --multi-turn")
    if args.dataset == "jsonl" and not args.dataset_path:
        ap.error("--dataset jsonl needs --dataset-path")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    if not args.request_rate > 0:
        ap.error("--request-rate must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    from serve.tokenizer import Tokenizer

    if args.multi_turn:
        return _finish(args, lambda: multi_turn(args, Tokenizer(args.tokenizer)), multi_turn_report,
                       lambda runs: sum(r["failed"] for r in runs.values()))
    if args.dataset == "jsonl":
        items = jsonl_items(args)
    else:
        items = random_items(args, Tokenizer(args.tokenizer))
    if not items:
        print("error: no prompts", file=sys.stderr)
        return 2
    if args.streams:
        return _finish(args, lambda: with_streams(args, items, Tokenizer(args.tokenizer)), streams_report,
                       lambda runs: runs["alone"]["failed"] + runs["arrivals"]["failed"])
    return _finish(args, lambda: run(args, items), report, lambda summary: summary["failed"])


def _finish(args, bench, render, failed) -> int:
    """Runs the coroutine bench() makes, prints render(result), writes it to --output-json; the
    exit status: 2 when the server cannot be reached, 1 when failed(result) > 0, else 0."""
    try:
        result = asyncio.run(bench())
    except httpx.ConnectError as e:
        print(f"error: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 2
    print(render(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if failed(result) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""The HTTP API (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health, /metrics and the profiler switches. Handlers admit (queue limit, shutdown), read the body
under a size limit, then parse, validate, render and tokenize in a worker thread (the event loop
keeps answering), hand a Request to the engine and relay its events, as one JSON body or as
server-sent events, until it ends, times out or the server's shutdown grace runs out.

Choices: `n` (both endpoints, 1..--max-batch) and `best_of` (completions, n..--max-batch, not
streamed) make one request a group of that many sequences, whose prompt is prefilled once and
copied on the device to the others' slots. Choice i samples with seed (seed + i) mod 2**32, seed
being the request's `seed` (random when absent), so choice i equals a separate n = 1 request with
that seed. best_of returns the n candidates with the highest cumulative log-probability (the
sum of their tokens' log-probabilities, as `logprobs` reports them), most likely first. `usage`
counts the prompt once and the completion tokens of every sequence generated (all best_of
candidates)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import random
import time
from collections.abc import Callable

import numpy as np

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import protocol
from serve.engine import Engine
from serve.metrics import Metrics
from serve.profiler import Profiler, ProfilerError
from serve.protocol import APIError, ChatRequest, CompletionRequest
from serve.request import Delta, Failed, Finished, Request, Sampling
from serve.tokenizer import TemplateError, Tokenizer
from spec.sampling import MAX_TOP_LOGPROBS

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
POLL_S = 0.5  # how often a waiting handler looks at its client, its deadline and the shutdown
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # sampling runs in float32: smaller top_p would flush to 0

access_log = logging.getLogger("serve.access")


@dataclasses.dataclass
class ServerInfo:
    model_name: str
    max_seq_len: int
    vocab_size: int  # the model's: token-id prompts must lie below it
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    max_request_bytes: int = 8 << 20  # larger bodies get 413 before they are read
    max_queue: int | None = None  # requests waiting for a slot beyond which new ones get 429 (None: no limit)
    request_timeout: float | None = None  # seconds; caps a request's own "timeout"
    shutdown_grace: float = 30.0  # seconds running requests may go on after SIGINT/SIGTERM


@dataclasses.dataclass
class Context:
    """What every handler reaches through `request.app.state.ctx`. in_flight and shutdown_at are
    touched on the event loop only."""

    engine: Engine
    tokenizer: Tokenizer
    metrics: Metrics
    profiler: Profiler
    info: ServerInfo
    in_flight: int = 0  # requests handed to the engine and not yet ended
    shutdown_at: float | None = None  # monotonic time after which running requests are ended

    def begin_shutdown(self) -> None:
        """Stop admitting; requests already running may finish within the grace period."""
        if self.shutdown_at is None:
            self.shutdown_at = time.monotonic() + self.info.shutdown_grace


def create_app(engine: Engine, tokenizer: Tokenizer, metrics: Metrics, profiler: Profiler, info: ServerInfo) -> FastAPI:
    app = FastAPI(title="ling-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = Context(engine, tokenizer, metrics, profiler, info)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    guarded = [Depends(authorized)]
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"], dependencies=guarded)
    app.add_api_route("/start_profile", start_profile, methods=["POST"], dependencies=guarded)
    app.add_api_route("/stop_profile", stop_profile, methods=["POST"], dependencies=guarded)
    app.add_api_route("/flush_cache", flush_cache, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], dependencies=guarded)
    return app


def _ctx(request: HTTPRequest) -> Context:
    return request.app.state.ctx


# -- errors, all in OpenAI's shape ---------------------------------------------------------------

async def _api_error(_, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(_, e: StarletteHTTPException):
    return JSONResponse(protocol.error_body(str(e.detail), "invalid_request_error", None, None),
                        status_code=e.status_code)


async def _internal_error(_, e: Exception):
    return JSONResponse(protocol.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                        status_code=500)


async def authorized(request: HTTPRequest) -> None:  # async: no threadpool hop per request
    key_wanted = _ctx(request).info.api_key
    if key_wanted is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), key_wanted.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


# -- service endpoints ---------------------------------------------------------------------------

async def health(request: HTTPRequest):
    engine = _ctx(request).engine
    if engine.error:
        return JSONResponse(protocol.error_body(engine.error, "server_error"), status_code=503)
    return {"status": "ok", **engine.stats()}


async def prometheus(request: HTTPRequest):
    return Response(_ctx(request).metrics.render(), media_type=Metrics.CONTENT_TYPE)


async def models(request: HTTPRequest):
    info = _ctx(request).info
    return {"object": "list", "data": [{"id": info.model_name, "object": "model", "created": info.created,
                                        "owned_by": "ling-serve", "max_model_len": info.max_seq_len}]}


async def start_profile(request: HTTPRequest):
    raw = await _body(_ctx(request), request)
    body = protocol.load(raw) if raw.strip() else {}
    output_dir = body.get("output_dir") if isinstance(body, dict) else None
    if output_dir is not None and not isinstance(output_dir, str):
        raise APIError(400, "'output_dir' must be a string", param="output_dir")
    try:
        path = await asyncio.to_thread(_ctx(request).profiler.start, output_dir)
    except ProfilerError as e:
        raise APIError(409, str(e), code="profiler_state") from None
    return {"message": "profiling started", "output_dir": path}


async def stop_profile(request: HTTPRequest):
    try:
        path, files = await asyncio.to_thread(_ctx(request).profiler.stop)
    except ProfilerError as e:
        raise APIError(409, str(e), code="profiler_state") from None
    return {"message": "profiling stopped", "output_dir": path, "files": files}


async def flush_cache(request: HTTPRequest):
    """Empties the prefix cache (as SGLang's /flush_cache): requests admitted after this response
    find no checkpoint. 400 when the server runs without one."""
    engine = _ctx(request).engine
    if engine.runner.pool is None:
        raise APIError(400, "the server runs without a prefix cache (--disable-prefix-cache)")
    await asyncio.wrap_future(engine.flush_prefix_cache())
    return {"message": "prefix cache flushed"}


# -- generation ----------------------------------------------------------------------------------

async def completions(request: HTTPRequest):
    return await _generate(request, _prepare_completion, "cmpl", COMPLETION_CHUNKS, protocol.completion)


async def chat_completions(request: HTTPRequest):
    return await _generate(request, _prepare_chat, "chatcmpl", CHAT_CHUNKS, protocol.chat_completion)


async def _generate(http: HTTPRequest, prepare: Callable, prefix: str, shape: "Chunks", whole: Callable):
    """Admits, reads the body, prepares it in a worker thread (prepare: (context, body) ->
    (request, prompt ids, sampling)), then runs its choices, streamed or whole."""
    c = _ctx(http)
    _admit(c)
    req, ids, sampling = await asyncio.to_thread(prepare, c, await _body(c, http))
    n, best_of = _choices(c, req)
    _admit(c, best_of)  # again, for every sequence: the queue may have filled, or shutdown begun, meanwhile
    asked = sampling.logprobs is not None
    if best_of > n and not asked:  # ranking needs each token's log-probability
        sampling = dataclasses.replace(sampling, logprobs=0)
    group = _group(ids, sampling, best_of, asyncio.get_running_loop())
    rid, timeout = protocol.new_id(prefix), _timeout(c, req)
    if req.stream:
        options = req.stream_options
        return _sse(_stream(c, group, shape, rid, timeout, bool(options and options.include_usage),
                            bool(options and options.continuous_usage_stats)))
    results = await _collect(c, http, group, rid, timeout)  # (text, reason, tokens, entries) per choice
    use = protocol.usage(len(ids), sum(tokens for _, _, tokens, _ in results))
    if best_of > n:
        results = sorted(results, key=lambda x: -sum(e.logprob for e in x[3]))[:n]  # stable: ties by index
    return whole(rid, c.info.model_name, [
        (text, reason, shape.logprobs(c.tokenizer.token_text, entries, 0) if asked else None)
        for text, reason, _, entries in results], use)


def _choices(c: Context, req) -> tuple[int, int]:
    """(n, best_of) of a request, checked: 1 <= n <= best_of <= the slots, best_of not streamed."""
    limit = c.engine.runner.max_batch
    if not 1 <= req.n <= limit:
        raise APIError(400, f"'n' must be in [1, {limit}] (this server's slots, --max-batch), got {req.n}", param="n")
    best_of = req.best_of if isinstance(req, CompletionRequest) else None  # chat refuses it while preparing
    if best_of is None:
        return req.n, req.n
    if not req.n <= best_of <= limit:
        raise APIError(400, f"'best_of' must be in ['n' = {req.n}, {limit}] (this server's slots, --max-batch), got "
                       f"{best_of}", param="best_of")
    if req.stream and best_of > 1:
        raise APIError(400, "'best_of' cannot be used with 'stream'", param="best_of")
    return req.n, best_of


def _group(ids: list[int], sampling: Sampling, count: int, loop) -> list[Request]:
    """count choices of one prompt, choice i with seed (sampling.seed + i) mod 2**32; choice 0
    carries the others as its copies and they share its events queue."""
    first = Request(ids, sampling, loop=loop)
    rest = [Request(ids, dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32), loop=loop,
                    events=first.events, choice=i) for i in range(1, count)]
    first.copies = tuple(rest)
    return [first, *rest]


def _prepare_completion(c: Context, raw: bytes):
    """Worker thread: the body -> (request, prompt ids, sampling)."""
    req = protocol.parse(CompletionRequest, protocol.load(raw))
    _check_model(c, req.model)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported (no batched prompts)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_length(c, prompt, "prompt")
        ids = c.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        _check_tokens(c, len(ids))  # before looking at each of a huge list
        bad = next((t for t in ids if not 0 <= t < c.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {c.info.vocab_size})",
                           param="prompt")
    return req, ids, _sampling(c, ids, req, req.max_tokens, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS,
                               _top_count(req.logprobs, "logprobs"))


def _prepare_chat(c: Context, raw: bytes):
    """Worker thread: the body -> (request, rendered prompt ids, sampling)."""
    req = protocol.parse(ChatRequest, protocol.load(raw))
    _check_model(c, req.model)
    best_of = (req.model_extra or {}).get("best_of")
    if best_of is not None and not (type(best_of) is int and best_of == 1):
        raise APIError(400, f"'best_of' = {best_of!r} is not supported by chat completions (only by /v1/completions)",
                       param="best_of")
    if not req.messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages.{i}.content")
            content = "".join(p.text for p in content)
        messages.append({"role": m.role, "content": content or ""})
    _check_length(c, "".join(m["content"] for m in messages), "messages")
    try:
        text = c.tokenizer.apply_chat_template(messages)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = c.tokenizer.encode(text, special=False)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = _top_count(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
    if req.max_completion_tokens is not None:
        return req, ids, _sampling(c, ids, req, req.max_completion_tokens, "max_completion_tokens", None, logprobs)
    return req, ids, _sampling(c, ids, req, req.max_tokens, "max_tokens", None, logprobs)


def _top_count(n: int | None, param: str) -> int | None:
    """How many alternatives a token's log-probabilities name, checked (None: logprobs off)."""
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"'{param}' must be in [0, {MAX_TOP_LOGPROBS}], got {n}", param=param)
    return n


# -- admission, limits, checks ---------------------------------------------------------------------

def _admit(c: Context, count: int = 1) -> None:
    """503 while shutting down or after an engine failure; 429 when `count` more sequences would
    overfill the queue."""
    if c.shutdown_at is not None:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if c.engine.error:
        raise APIError(503, c.engine.error)
    limit = c.info.max_queue
    if limit is not None and c.in_flight + count > c.engine.runner.max_batch + limit:
        raise APIError(429, f"the server is at capacity: every slot is busy and {limit} requests wait; retry later",
                       code="queue_full", type="rate_limit_error", headers={"Retry-After": "1"})


async def _body(c: Context, request: HTTPRequest) -> bytes:
    """The raw body, at most --max-request-bytes (413 beyond, before reading it when the client
    says its length)."""
    limit = c.info.max_request_bytes
    too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes)", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def _check_length(c: Context, text: str, param: str) -> None:
    """Refuses text that cannot fit the context whatever it tokenizes to, before tokenizing it."""
    least, limit = c.tokenizer.min_tokens(text), c.info.max_seq_len
    if least >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has {len(text)} "
                       f"characters, at least {least} tokens", param=param, code="context_length_exceeded")


def _check_tokens(c: Context, n: int) -> None:
    """The prompt's token count: at least one, and one fewer than the context at most."""
    limit = c.info.max_seq_len
    if n == 0:
        raise APIError(400, "the prompt is empty (it tokenizes to no tokens)", param="prompt")
    if n >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens "
                       "(at least one must be left for the completion)", param="prompt",
                       code="context_length_exceeded")


def _check_model(c: Context, name: str | None) -> None:
    if name is not None and name != c.info.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{c.info.model_name}'",
                       param="model", code="model_not_found")


def _sampling(c: Context, ids: list[int], req, max_tokens: int | None, max_name: str,
              default: int | None, logprobs: int | None) -> Sampling:
    """Checks the numbers against the limits, at the precision the device uses (float32), and
    names the field the client sent."""
    n, limit = len(ids), c.info.max_seq_len
    _check_tokens(c, n)
    if max_tokens is None:
        max_tokens = limit - n if default is None else min(default, limit - n)
    elif max_tokens <= 0:
        raise APIError(400, f"'{max_name}' must be at least 1, got {max_tokens}", param=max_name)
    elif n + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                       f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion)",
                       param=max_name, code="context_length_exceeded")
    temperature, top_p = float(np.float32(req.temperature)), float(np.float32(req.top_p))
    if not math.isfinite(temperature) or temperature < 0:
        raise APIError(400, f"'temperature' must be >= 0 and finite in float32, got {req.temperature}",
                       param="temperature")
    if not (FLOAT32_TINY <= top_p <= 1):
        raise APIError(400, f"'top_p' must be in [{FLOAT32_TINY:.3g}, 1] (float32, which sampling uses), got "
                       f"{req.top_p}", param="top_p")
    if req.top_k < -1:
        raise APIError(400, f"'top_k' must be -1 or 0 (off) or positive, got {req.top_k}", param="top_k")
    penalties = {name: float(np.float32(getattr(req, name)))
                 for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= penalties[name] <= 2:
            raise APIError(400, f"'{name}' must be in [-2, 2], got {getattr(req, name)}", param=name)
    if not (math.isfinite(penalties["repetition_penalty"]) and 0 < penalties["repetition_penalty"] <= 2):
        raise APIError(400, f"'repetition_penalty' must be in (0, 2] (1: off), got {req.repetition_penalty}",
                       param="repetition_penalty")
    if req.timeout is not None and not (math.isfinite(req.timeout) and req.timeout > 0):
        raise APIError(400, f"'timeout' must be a positive number of seconds, got {req.timeout}", param="timeout")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP:
        raise APIError(400, f"'stop' holds {len(stop)} strings; at most {MAX_STOP} are allowed", param="stop")
    seed = random.getrandbits(32) if req.seed is None else req.seed % 2**32
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                    top_k=min(max(req.top_k, 0), c.info.vocab_size), seed=seed,
                    presence=penalties["presence_penalty"], frequency=penalties["frequency_penalty"],
                    repetition=penalties["repetition_penalty"], stop=stop, ignore_eos=req.ignore_eos,
                    logprobs=logprobs)


def _timeout(c: Context, req) -> float | None:
    """Seconds the request may take: its own 'timeout', capped by --request-timeout."""
    limits = [t for t in (req.timeout, c.info.request_timeout) if t is not None]
    return min(limits) if limits else None


# -- relaying the engine's events ------------------------------------------------------------------

async def _events(c: Context, group: list[Request], rid: str, timeout: float | None):
    """The (choice, event) pairs of a group of choices (`_group`) until every choice ends.
    APIError 408 past its timeout and 503 past the shutdown grace. Aborts the choices that do not
    end here (the client disconnected: the stream task is cancelled or the generator closed; a
    timeout; the shutdown; the caller stopped after a failure), the copies before choice 0."""
    c.engine.submit(group[0])
    c.in_flight += len(group)
    deadline = None if timeout is None else time.monotonic() + timeout
    running, last = set(range(len(group))), [None] * len(group)
    try:
        while running:
            i, ev = await _next_event(c, group[0], deadline, timeout)
            last[i] = ev
            if isinstance(ev, (Finished, Failed)):
                running.discard(i)
            yield i, ev
    except APIError as e:
        last = [e if i in running else x for i, x in enumerate(last)]
        raise
    finally:
        c.in_flight -= len(group)
        for i in sorted(running, reverse=True):
            c.engine.abort(group[i])
        if access_log.isEnabledFor(logging.INFO):
            for i, r in enumerate(group):
                _log_request(rid if len(group) == 1 else f"{rid}/{i}", r, last[i], i not in running)


async def _next_event(c: Context, r: Request, deadline: float | None, timeout: float | None):
    while True:
        now = time.monotonic()
        if c.shutdown_at is not None and now >= c.shutdown_at:
            raise APIError(503, "the server is shutting down: the request was ended after the grace period",
                           code="shutting_down")
        if deadline is not None and now >= deadline:
            raise APIError(408, f"the request did not finish within its timeout of {timeout:g} s",
                           code="timeout")
        wait = min([POLL_S, *(t - now for t in (deadline, c.shutdown_at) if t is not None)])
        try:
            return await asyncio.wait_for(r.events.get(), wait)
        except TimeoutError:
            continue


def _log_request(rid: str, r: Request, last, ended: bool) -> None:
    """One access line: id, prompt / completion tokens, TTFT, duration and how it ended."""
    if isinstance(last, Finished):
        outcome, tokens = last.reason, last.completion_tokens
    else:
        outcome = ("error" if ended else "timeout" if isinstance(last, APIError) and last.status == 408 else
                   "shutdown" if isinstance(last, APIError) else "disconnect")
        tokens = last.completion_tokens if isinstance(last, Delta) else "-"
    ttft = "-" if r.first_token_time is None else f"{(r.first_token_time - r.arrival) * 1e3:.0f}ms"
    access_log.info("%s prompt_tokens=%d completion_tokens=%s ttft=%s e2e=%.0fms finish=%s", rid,
                    len(r.prompt_ids), tokens, ttft, (time.perf_counter() - r.arrival) * 1e3, outcome)


async def _collect(c: Context, http: HTTPRequest, group: list[Request], rid: str, timeout: float | None):
    """Per choice (text, finish reason, completion tokens, log-probability entries) of a
    non-streaming request; aborts it if the client disconnects."""
    parts, entries = [[] for _ in group], [[] for _ in group]
    ends: list[Finished | None] = [None] * len(group)
    events = _events(c, group, rid, timeout)

    async def gather():
        async for i, ev in events:
            if isinstance(ev, Delta):
                parts[i].append(ev.text)
                entries[i].extend(ev.logprobs or ())
            elif isinstance(ev, Finished):
                ends[i] = ev
            else:
                raise APIError(500, ev.message)

    task = asyncio.ensure_future(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                task.result()
                return [("".join(p), e.reason, e.completion_tokens, lp) for p, e, lp in zip(parts, ends, entries)]
            if await http.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await events.aclose()


def _sse(chunks) -> StreamingResponse:
    async def body():
        async for payload in chunks:
            yield f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclasses.dataclass(frozen=True)
class Chunks:
    """The shapes of one endpoint: the stream's opening chunk of a choice (before any text;
    None: none), a text chunk (with its logprobs object or None), the closing chunk with the
    finish reason, the usage chunk's object name, and the logprobs object of some tokens
    (token_text, entries, characters of text before them). The chunks take the choice's index
    last."""

    opening: Callable[[str, str, int], dict] | None
    text: Callable[[str, str, str, dict | None, int], dict]
    end: Callable[[str, str, str, int], dict]
    usage_object: str
    logprobs: Callable[[Callable, list, int], dict]


COMPLETION_CHUNKS = Chunks(opening=None,
                           text=lambda rid, model, t, lp, i: protocol.completion_chunk(rid, model, t, None, lp, i),
                           end=lambda rid, model, reason, i: protocol.completion_chunk(rid, model, "", reason,
                                                                                       index=i),
                           usage_object="text_completion",
                           logprobs=lambda token_text, entries, offset: protocol.completion_logprobs(
                               entries, token_text, offset))
CHAT_CHUNKS = Chunks(opening=lambda rid, model, i: protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""},
                                                                       None, index=i),
                     text=lambda rid, model, t, lp, i: protocol.chat_chunk(rid, model, {"content": t}, None, lp, i),
                     end=lambda rid, model, reason, i: protocol.chat_chunk(rid, model, {}, reason, index=i),
                     usage_object="chat.completion.chunk",
                     logprobs=lambda token_text, entries, _: protocol.chat_logprobs(entries, token_text))


async def _stream(c: Context, group: list[Request], shape: Chunks, rid: str, timeout: float | None,
                  include_usage: bool, continuous_usage: bool = False):
    """The payloads of one streamed request: per choice the opening chunk, a chunk per piece of
    text and the closing chunk with its finish reason, each tagged with the choice's index; then
    (if asked) the usage; an error payload if a choice fails (the others are ended), or the
    request times out or outlives the shutdown grace. continuous_usage: a chunk for every step's
    new tokens, text or not, each with the usage so far (the completion tokens of all choices)."""
    model = c.info.model_name
    events = _events(c, group, rid, timeout)
    sent = [0] * len(group)  # characters of text streamed so far, per choice
    tokens = [0] * len(group)
    try:
        if shape.opening is not None:
            for i in range(len(group)):
                yield shape.opening(rid, model, i)
        async for i, ev in events:
            if isinstance(ev, Delta):
                tokens[i] = ev.completion_tokens
                if ev.logprobs or ev.text or continuous_usage:
                    lp = shape.logprobs(c.tokenizer.token_text, ev.logprobs, sent[i]) if ev.logprobs else None
                    chunk = shape.text(rid, model, ev.text, lp, i)
                    if continuous_usage:
                        chunk["usage"] = protocol.usage(len(group[0].prompt_ids), sum(tokens))
                    yield chunk
                sent[i] += len(ev.text)
            elif isinstance(ev, Finished):
                tokens[i] = ev.completion_tokens
                yield shape.end(rid, model, ev.reason, i)
            else:
                yield protocol.error_body(ev.message, "server_error")
                return
        if include_usage:
            yield protocol.usage_chunk(rid, model, shape.usage_object,
                                       protocol.usage(len(group[0].prompt_ids), sum(tokens)))
    except APIError as e:
        yield e.body()
    finally:
        await events.aclose()

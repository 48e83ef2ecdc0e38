"""The HTTP API (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus
/health, /metrics and the profiler switches. Handlers validate, tokenize, hand a Request to the
engine and relay its events, as one JSON body or as server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import random
import time
from collections.abc import Callable

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

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
DISCONNECT_POLL_S = 0.5


@dataclasses.dataclass
class ServerInfo:
    model_name: str
    max_seq_len: int
    vocab_size: int  # the model's: token-id prompts must lie below it
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class Context:
    """What every handler reaches through `request.app.state.ctx`."""

    engine: Engine
    tokenizer: Tokenizer
    metrics: Metrics
    profiler: Profiler
    info: ServerInfo


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
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], dependencies=guarded)
    return app


def _ctx(request: HTTPRequest) -> Context:
    return request.app.state.ctx


# -- errors, all in OpenAI's shape ---------------------------------------------------------------

async def _api_error(_, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


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
    body = await _json(request, optional=True)
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


# -- generation ----------------------------------------------------------------------------------

async def completions(request: HTTPRequest):
    c = _ctx(request)
    req = protocol.parse(CompletionRequest, await _json(request))
    _check_model(c, req.model)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported (n=1, no batched prompts)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = c.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < c.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {c.info.vocab_size})",
                           param="prompt")
    r = _request(c, ids, req, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
    rid = protocol.new_id("cmpl")
    if req.stream:
        return _sse(_stream(c, r, COMPLETION_CHUNKS, rid, _include_usage(req)))
    text, reason, use = await _collect(c, request, r)
    return protocol.completion(rid, c.info.model_name, text, reason, use)


async def chat_completions(request: HTTPRequest):
    c = _ctx(request)
    req = protocol.parse(ChatRequest, await _json(request))
    _check_model(c, req.model)
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
    try:
        text = c.tokenizer.apply_chat_template(messages)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = c.tokenizer.encode(text, special=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    r = _request(c, ids, req, max_tokens, None)
    rid = protocol.new_id("chatcmpl")
    if req.stream:
        return _sse(_stream(c, r, CHAT_CHUNKS, rid, _include_usage(req)))
    text, reason, use = await _collect(c, request, r)
    return protocol.chat_completion(rid, c.info.model_name, text, reason, use)


# -- helpers -------------------------------------------------------------------------------------

def _check_model(c: Context, name: str | None) -> None:
    if name is not None and name != c.info.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{c.info.model_name}'",
                       param="model", code="model_not_found")


def _request(c: Context, ids: list[int], req, max_tokens: int | None, default: int | None) -> Request:
    """Checks the numbers against the limits and makes the engine request (not yet submitted)."""
    if c.engine.error:
        raise APIError(503, c.engine.error)
    n, limit = len(ids), c.info.max_seq_len
    if n == 0:
        raise APIError(400, "the prompt is empty (it tokenizes to no tokens)", param="prompt")
    if n >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens "
                       "(at least one must be left for the completion)", param="prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - n if default is None else min(default, limit - n)
    elif max_tokens <= 0:
        raise APIError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    elif n + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                       f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion)",
                       param="max_tokens", code="context_length_exceeded")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise APIError(400, f"'temperature' must be >= 0, got {req.temperature}", param="temperature")
    if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        raise APIError(400, f"'top_p' must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k < -1:
        raise APIError(400, f"'top_k' must be -1 or 0 (off) or positive, got {req.top_k}", param="top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) != 0:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    seed = random.getrandbits(32) if req.seed is None else req.seed % 2**32
    sampling = Sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                        top_k=max(req.top_k, 0), seed=seed, stop=stop, ignore_eos=req.ignore_eos)
    return Request(ids, sampling, loop=asyncio.get_running_loop())


async def _events(engine: Engine, r: Request):
    """The request's events until it ends; aborts it in the engine if the consumer stops early
    (the client disconnected: the stream task is cancelled, or the generator closed)."""
    engine.submit(r)
    ended = False
    try:
        while True:
            ev = await r.events.get()
            ended = isinstance(ev, (Finished, Failed))
            yield ev
            if ended:
                return
    finally:
        if not ended:
            engine.abort(r)


async def _collect(c: Context, http: HTTPRequest, r: Request):
    """The whole output of a non-streaming request; aborts it if the client disconnects."""
    parts, events = [], _events(c.engine, r)

    async def gather():
        async for ev in events:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Finished):
                return ev
            else:
                raise APIError(500, ev.message)

    task = asyncio.ensure_future(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                fin = task.result()
                return "".join(parts), fin.reason, protocol.usage(fin.prompt_tokens, fin.completion_tokens)
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
    """The chunk shapes of one streamed endpoint: opening (before any text; None: none), text,
    the closing chunk with the finish reason, and the usage chunk's object name."""

    opening: Callable[[str, str], dict] | None
    text: Callable[[str, str, str], dict]
    end: Callable[[str, str, str], dict]
    usage_object: str


COMPLETION_CHUNKS = Chunks(opening=None,
                           text=lambda rid, model, t: protocol.completion_chunk(rid, model, t, None),
                           end=lambda rid, model, reason: protocol.completion_chunk(rid, model, "", reason),
                           usage_object="text_completion")
CHAT_CHUNKS = Chunks(opening=lambda rid, model: protocol.chat_chunk(rid, model, {"role": "assistant", "content": ""},
                                                                    None),
                     text=lambda rid, model, t: protocol.chat_chunk(rid, model, {"content": t}, None),
                     end=lambda rid, model, reason: protocol.chat_chunk(rid, model, {}, reason),
                     usage_object="chat.completion.chunk")


async def _stream(c: Context, r: Request, shape: Chunks, rid: str, include_usage: bool):
    """The payloads of one streamed request: the opening chunk, a chunk per piece of text, the
    closing chunk and (if asked) the usage; an error payload if the request fails."""
    model = c.info.model_name
    events = _events(c.engine, r)
    try:
        if shape.opening is not None:
            yield shape.opening(rid, model)
        async for ev in events:
            if isinstance(ev, Delta):
                if ev.text:
                    yield shape.text(rid, model, ev.text)
            elif isinstance(ev, Finished):
                yield shape.end(rid, model, ev.reason)
                if include_usage:
                    yield protocol.usage_chunk(rid, model, shape.usage_object,
                                               protocol.usage(ev.prompt_tokens, ev.completion_tokens))
            else:
                yield protocol.error_body(ev.message, "server_error")
    finally:
        await events.aclose()


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _json(request: HTTPRequest, optional: bool = False):
    raw = await request.body()
    if optional and not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None

"""The OpenAI API's shapes: request bodies (validated strictly: a string where a number belongs is
an error, not a coercion), response bodies, stream chunks and the error body."""

from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class APIError(Exception):
    """Answered as {"error": {"message", "type", "param", "code"}} with this HTTP status (and
    these extra response headers)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send "user", "metadata", ...); known ones are type-checked.
    # null on an optional field means its default, as in OpenAI's API.
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            optional = {k for k, f in cls.model_fields.items() if not f.is_required()}
            data = {k: v for k, v in data.items() if v is not None or k not in optional}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    # an extension (vLLM): every chunk carries the usage so far, and a chunk is sent for every step's
    # tokens, also when they add no text yet (a character still incomplete, or an empty token)
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1  # choices, 1..--max-batch; choice i samples with seed (seed + i) mod 2**32
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (vLLM, SGLang): generate exactly max_tokens tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # an extension (vLLM, SGLang): over the prompt's and the output's tokens
    timeout: float | None = None  # seconds from arrival; an extension: the server's --request-timeout caps it


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None  # alternatives per token, 0..MAX_TOP_LOGPROBS
    best_of: int | None = None  # candidates (n..--max-batch) of which the n most likely are returned; not streamed


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token, 0..MAX_TOP_LOGPROBS; needs logprobs


# Fields that would change the output in ways this server does not implement: refused rather than
# silently ignored. Each maps to the values that mean "off". (`n` is served by both endpoints,
# `best_of` by /v1/completions; chat refuses best_of != 1 itself.)
UNSUPPORTED = {"echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
               "functions": (None, [])}


MAX_DEPTH = 64  # nesting of a request body: OpenAI's bodies need under 10, tool schemas a few more


def load(raw: bytes):
    """A request body as JSON, refused (400) when it is not JSON, nests deeper than MAX_DEPTH or
    holds a string that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800", which JSON
    can spell but no tokenizer can take); the error names the field."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    stack = [(body, (), 0)]  # iterative: a deep body cannot exhaust the stack here
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                field = ".".join(map(str, path)) or None
                raise APIError(400, f"'{field}' is not valid Unicode: it holds {value[e.start:e.end]!r} at "
                               f"character {e.start}, a lone UTF-16 surrogate", param=field) from None
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels",
                               param=".".join(map(str, path[:3])) or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str) and not k.isascii():
                    stack.append((k, path, depth + 1))
                if isinstance(v, (str, dict, list)):  # numbers need no look (a token-id prompt has millions)
                    stack.append((v, path + (k,), depth + 1))
    return body


def parse(model: type[_Strict], body) -> _Strict:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc", ())
        param = ".".join(str(x) for x in loc if not (isinstance(x, str) and x in _TYPE_TAGS)) or None
        if err.get("type") == "missing":
            raise APIError(400, f"'{param}' is a required property", param=param) from None
        raise APIError(400, f"'{param}': {err.get('msg')} (got {err.get('input')!r})", param=param) from None
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(o) and value == o for o in off if o is not None):
            raise APIError(400, f"'{name}' = {value!r} is not supported by this server", param=name)
    return req


# pydantic names the branch of a union in an error's location ("prompt.list[int].0"): dropped.
_TYPE_TAGS = {"str", "list[int]", "list[str]", "list[ContentPart]", "int", "float", "bool"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries, token_text, offset: int) -> dict:
    """The legacy completions' logprobs object for TokenLogprob entries; offset: characters of the
    completion's text before the first of them."""
    tokens = [token_text(e.token) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(i): lp for i, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries, token_text) -> dict:
    """Chat's logprobs object ({"content": [...]}) for TokenLogprob entries."""
    def one(token, logprob):
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                        for e in entries]}


def completion(id: str, model: str, choices: list[tuple], use: dict) -> dict:
    """choices: (text, finish reason, logprobs object or None) each, indexed in order."""
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
                        for i, (text, reason, logprobs) in enumerate(choices)], "usage": use}


def completion_chunk(id: str, model: str, text: str, reason: str | None, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}


def chat_completion(id: str, model: str, choices: list[tuple], use: dict) -> dict:
    """choices: (text, finish reason, logprobs object or None) each, indexed in order."""
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": reason} for i, (text, reason, logprobs) in enumerate(choices)],
            "usage": use}


def chat_chunk(id: str, model: str, delta: dict, reason: str | None, logprobs: dict | None = None,
               index: int = 0) -> dict:
    return {"id": id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def usage_chunk(id: str, model: str, object: str, use: dict) -> dict:
    return {"id": id, "object": object, "created": int(time.time()), "model": model, "choices": [], "usage": use}

"""The server over real HTTP on 127.0.0.1: `python -m serve.run` with the embedded default model in
float32 (greedy outputs are then exact, whatever shares the batch), a small batch, short prompts and
outputs. Nothing here asserts a timing."""

import asyncio
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.run import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from serve.tokenizer import Tokenizer
from serving import Server

KEY = "test-key"
BATCH = 4  # slots
CONTEXT = 384
CHUNK = 32  # prefill chunk: the longer prompts below take several, interleaved with decode steps
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    # Mixed iterations on (off by default on CPU): every HTTP test below runs through them too. One
    # batch bucket, a third of the programs to compile: the engine's tests cross the buckets' edges.
    # Drafts over half the vocabulary (--speculative-token-map): every greedy output below must still
    # be the model's own.
    np.save(tmp / "token_map.npy", np.arange(0, 4096, 2))
    s = Server(["--max-batch", str(BATCH), "--max-seq-len", str(CONTEXT), "--prefill-chunk", str(CHUNK), "--dtype",
                "float32", "--speculative-num-steps", "3", "--api-key", KEY, "--profile-dir", str(tmp / "profiles"),
                "--mixed-iteration", "on", "--batch-buckets", "off",
                "--speculative-token-map", str(tmp / "token_map.npy")], tmp)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server(running):
    return running.url


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEFAULT_MODEL)


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": DEFAULT_MODEL_NAME, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path, body):
    """(concatenated text, finish_reason, usage or None, number of data events) of an SSE response."""
    text, reason, use, events = "", None, None, []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        chunk = json.loads(e)
        use = chunk.get("usage") or use
        for c in chunk["choices"]:
            text += c["text"] if "text" in c else c["delta"].get("content") or ""
            reason = c["finish_reason"] or reason
    return text, reason, use, len(events) - 1


def health(client):
    r = client.get("/health")
    assert r.status_code == 200
    return r.json()


def wait_idle(client, deadline_s=120):
    """Until no request holds a slot or waits (the server settles after aborts)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        h = health(client)
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    pytest.fail(f"the server did not become idle: {health(client)}")


def metric(client, name, labels=None):
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    return 0.0


# -- generation ---------------------------------------------------------------------------------


def test_a_token_map_the_model_cannot_use_stops_the_start(running, tmp_path):
    """The running server drafts over its map; a map with an id past the vocabulary stops the start
    with the reason."""
    import subprocess
    import sys

    assert "draft vocabulary: 2048 of 4096 tokens" in running.log()
    (tmp_path / "bad.json").write_text("[1, 2, 4096]")
    r = subprocess.run([sys.executable, "-m", "serve.run", "--port", "0", "--speculative-token-map",
                        str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 2
    assert "--speculative-token-map: token map" in r.stderr and "id 4096 is outside" in r.stderr


def test_health_and_models(client):
    assert health(client) == {"status": "ok", "running": 0, "waiting": 0, "free_slots": BATCH, "max_batch": BATCH}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
    assert models["data"][0]["max_model_len"] == CONTEXT


def test_completion(client, tokenizer):
    prompt = "def fibonacci(n):\n    "
    out = complete(client, prompt=prompt, max_tokens=12, ignore_eos=True)
    assert out["object"] == "text_completion" and out["model"] == DEFAULT_MODEL_NAME
    (choice,) = out["choices"]
    assert isinstance(choice["text"], str) and choice["text"] and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(tokenizer.encode(prompt)), "completion_tokens": 12,
                            "total_tokens": len(tokenizer.encode(prompt)) + 12}
    # The same prompt as token ids gives the same greedy text.
    by_ids = complete(client, prompt=tokenizer.encode(prompt), max_tokens=12, ignore_eos=True)
    assert by_ids["choices"][0]["text"] == choice["text"]


def test_completion_stream_equals_non_stream(client):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "import os\nimport sys\n", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    whole = complete(client, **body)
    text, reason, use, n = stream(client, "/v1/completions", body)
    assert text == whole["choices"][0]["text"]
    assert reason == "length" and use == whole["usage"] and n >= 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_counts_every_steps_tokens(client, path):
    """`stream_options.continuous_usage_stats` (vLLM's): every chunk of tokens carries the usage so
    far, the completion tokens grow with each step's tokens to max_tokens, and the text is the same."""
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            **({"prompt": "x = 1\n"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    plain = stream_choices(client, path, body)[0][0][0]
    with client.stream("POST", path, json={**body, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}}) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and "usage" in c]
    assert counts and counts[-1] == 16 and all(b >= a for a, b in zip(counts, counts[1:])) and len(set(counts)) > 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    text = "".join(c["text"] if "text" in c else c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])
    assert text == plain


def stream_choices(client, path, body):
    """({index: (text, finish_reason)}, usage or None) of an SSE response with several choices."""
    texts, reasons, use = {}, {}, None
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        chunk = json.loads(e)
        use = chunk.get("usage") or use
        for c in chunk["choices"]:
            i = c["index"]
            texts[i] = texts.get(i, "") + (c["text"] if "text" in c else c["delta"].get("content") or "")
            assert reasons.get(i) is None, "a choice goes on after its finish_reason"
            reasons[i] = c["finish_reason"]
    return {i: (texts[i], reasons[i]) for i in texts}, use


CHAT_BODY = {"messages": [{"role": "user", "content": "Write a loop."}]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_equal_separate_seeded_requests(client, path):
    """n = 3 sampled choices, whole and streamed, equal three n = 1 requests with seeds seed + i
    (mod 2**32: the seed below wraps), text and token count; usage counts the prompt once."""
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 10, "temperature": 1.0, "top_p": 0.95, "ignore_eos": True,
            **({"prompt": "for x in "} if path == "/v1/completions" else CHAT_BODY)}
    seed = 2**32 - 2
    text = lambda choice: choice["text"] if "text" in choice else choice["message"]["content"]

    def post(**extra):
        r = client.post(path, json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    alone = [post(seed=(seed + i) % 2**32) for i in range(3)]
    want = [text(a["choices"][0]) for a in alone]
    assert len(set(want)) > 1  # the seeds matter
    out = post(seed=seed, n=3)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [text(c) for c in out["choices"]] == want
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    prompt_tokens = alone[0]["usage"]["prompt_tokens"]
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 30, "total_tokens": prompt_tokens + 30}
    got, use = stream_choices(client, path, {**body, "seed": seed, "n": 3, "stream_options": {"include_usage": True}})
    assert got == {i: (t, "length") for i, t in enumerate(want)} and use == out["usage"]
    assert wait_idle(client)["free_slots"] == BATCH


def test_best_of_returns_the_likeliest_candidates(client, tokenizer):
    """best_of = 4, n = 2: the two of the four seeded candidates (separate requests with seeds
    seed + i) with the highest summed token log-probability, most likely first; usage counts
    all four."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "def f(", "max_tokens": 8, "temperature": 1.0,
            "ignore_eos": True}
    alone = [complete(client, **body, seed=40 + i, logprobs=0) for i in range(4)]
    score = [sum(a["choices"][0]["logprobs"]["token_logprobs"]) for a in alone]
    best = sorted(range(4), key=lambda i: -score[i])[:2]
    ranked = sorted(score, reverse=True)
    assert ranked[1] - ranked[2] > 1e-3 and best != [0, 1], score  # unambiguous, and not the first two
    out = complete(client, **body, seed=40, n=2, best_of=4)
    assert [c["text"] for c in out["choices"]] == [alone[i]["choices"][0]["text"] for i in best]
    assert [c["index"] for c in out["choices"]] == [0, 1] and all(c["logprobs"] is None for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 32
    with_lp = complete(client, **body, seed=40, n=2, best_of=4, logprobs=1)
    got = [sum(c["logprobs"]["token_logprobs"]) for c in with_lp["choices"]]
    np.testing.assert_allclose(got, [score[i] for i in best], rtol=1e-5, atol=1e-5)


def test_chat(client, tokenizer):
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You write Python."},
                         {"role": "user", "content": [{"type": "text", "text": "Sort a list."}]}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "You write Python."},
                                              {"role": "user", "content": "Sort a list."}])
    assert out["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, special=False))
    assert out["usage"]["completion_tokens"] == 10
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        first = json.loads(next(l for l in s.iter_lines() if l.startswith("data: "))[6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    text, reason, _, _ = stream(client, "/v1/chat/completions", body)
    assert text == msg["content"] and reason == "length"


def test_stop_strings(client):
    body = {"prompt": "class Parser:\n", "max_tokens": 40, "ignore_eos": True}
    full = complete(client, **body)["choices"][0]["text"]
    stop = next(full[i:i + 3] for i in range(8, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    expect = full[: full.index(stop)]
    out = complete(client, **body, stop=[stop, "never-generated-string"])
    assert out["choices"][0]["text"] == expect and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 40
    text, reason, _, _ = stream(client, "/v1/completions", {**body, "temperature": 0, "stop": stop})
    assert text == expect and reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": "for i in range(", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50,
            "ignore_eos": True}
    a = complete(client, **body, seed=7)["choices"][0]["text"]
    assert complete(client, **body, seed=7)["choices"][0]["text"] == a
    others = {complete(client, **body, seed=s)["choices"][0]["text"] for s in (8, 9, 10)}
    assert others != {a}


def test_concurrent_greedy_equals_sequential(server, client, tokenizer):
    """16 requests, 4 slots: queueing, chunked prefills (prompts up to ~4 chunks) interleaved with
    speculative decode steps of the others, half of them streamed; each output equals the one the
    request gets alone."""
    words = "def class return import yield lambda async await with open(path) as f: print".split()
    prompts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(3 + 9 * i)) for i in range(16)]
    assert max(len(tokenizer.encode(p)) for p in prompts) > 3 * CHUNK
    bodies = [{"model": DEFAULT_MODEL_NAME, "prompt": p, "max_tokens": 8 + (i % 5) * 3, "temperature": 0}
              for i, p in enumerate(prompts)]
    alone = [complete(client, **b)["choices"][0]["text"] for b in bodies]

    async def one(c, i, b):
        if i % 2:
            r = await c.post("/v1/completions", json=b)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        async with c.stream("POST", "/v1/completions", json={**b, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def together():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(*(one(c, i, b) for i, b in enumerate(bodies)))

    assert asyncio.run(together()) == alone
    assert wait_idle(client)["free_slots"] == BATCH


# -- bad input ----------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, None),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [7] * CONTEXT, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x " * (2 * CONTEXT)}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": BATCH + 1}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": BATCH + 1}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": BATCH + 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": -1}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ("/v1/nothing", {}, 404, None),
    # Hostile bodies: each was once a 500.
    ("/v1/completions", b'{"prompt": "x", "foo": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("/v1/completions", b'{"prompt": "x", "foo": ' + b"[" * 70 + b"]" * 70 + b"}", 400, "foo.0.0"),
    ("/v1/completions", b'{"prompt": "abc \\ud800 def"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": ["abc \\udfff"]}', 400, "prompt.0"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', 400, "stop.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "abc \\ud800 def"}]}', 400,
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     400, "messages.0.content.0.text"),
    ("/v1/completions", {"prompt": "x", "top_p": 1e-44}, 400, "top_p"),  # 0 in float32
    ("/v1/completions", {"prompt": "x", "temperature": 1e39}, 400, "temperature"),  # inf in float32
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": CONTEXT},
     400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "timeout": 0}, 400, "timeout"),
    ("/v1/completions", {"prompt": None}, 400, "prompt"),
    ("/v1/completions", {"prompt": "y" * 2_000_000}, 400, "prompt"),  # refused before it is tokenized
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 2_000_000}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{p}:{b!r:.60}" for p, b, _, _ in BAD])
def test_bad_input_is_a_clear_4xx(client, path, body, status, param):
    r = (client.post(path, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes)
         else client.post(path, json=body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_is_required(server, headers):
    for path in ("/v1/models", "/v1/completions"):
        r = httpx.request("GET" if path == "/v1/models" else "POST", server + path, headers=headers,
                          json={"prompt": "x"})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(server + "/metrics").status_code == 200


def test_logprobs_are_the_models_own(client, tokenizer):
    """Log-probabilities of greedy tokens (speculative decoding on: the verify pass's) equal
    log_softmax of one full forward of the model over the prompt and the output, with the same
    top alternatives; streamed and whole answers agree, for completions and chat."""
    import jax
    import ling

    prompt = tokenizer.encode("def parse(line):\n    ")
    n, top = 10, 5
    out = complete(client, prompt=prompt, max_tokens=n, ignore_eos=True, logprobs=top)
    lp = out["choices"][0]["logprobs"]
    model = ling.load(DEFAULT_MODEL, dtype="float32", progress=False)
    ids = list(prompt)
    for _ in range(n):  # greedy, one full forward a token
        ids.append(int(np.argmax(ling.forward(model, ids)[-1])))
    ref = np.asarray(jax.nn.log_softmax(ling.forward(model, ids)[len(prompt) - 1:-1], axis=-1))  # [n, V]
    assert lp["tokens"] == [tokenizer.token_text(t) for t in ids[len(prompt):]]
    np.testing.assert_allclose(lp["token_logprobs"], ref[np.arange(n), ids[len(prompt):]], rtol=1e-4, atol=1e-4)
    for j, alternatives in enumerate(lp["top_logprobs"]):
        want = np.argsort(-ref[j])[:top]
        assert list(alternatives) == [tokenizer.token_text(int(t)) for t in want]
        np.testing.assert_allclose(list(alternatives.values()), ref[j, want], rtol=1e-4, atol=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": top, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    np.testing.assert_allclose(streamed, lp["token_logprobs"], rtol=1e-6)

    chat = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Sort a list."}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    whole = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(whole) == 6 and all(len(e["top_logprobs"]) == 3 for e in whole)
    assert all(e["top_logprobs"][0]["logprob"] == max(t["logprob"] for t in e["top_logprobs"]) for e in whole)
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in whole)
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for e in
                c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    np.testing.assert_allclose([e["logprob"] for e in streamed], [e["logprob"] for e in whole], rtol=1e-6)
    # Sampled tokens get the target's log-probabilities too (at most 0, the top first).
    sampled = complete(client, prompt=prompt, max_tokens=n, ignore_eos=True, logprobs=2, temperature=1.0, seed=5)
    sl = sampled["choices"][0]["logprobs"]
    assert len(sl["token_logprobs"]) == n and all(x <= 0 for x in sl["token_logprobs"])
    assert all(a >= b for t in sl["top_logprobs"] for a, b in zip(list(t.values()), list(t.values())[1:]))


def test_penalties(client, tokenizer):
    """presence, frequency and repetition penalties (speculation on) give plain greedy decoding's
    tokens under the same penalties; out-of-range values get 400 naming the field."""
    import ling
    from spec.generate import generate_batch

    prompt = tokenizer.encode("the cat and the cat and the")
    pen = {"presence_penalty": 0.6, "frequency_penalty": 1.1, "repetition_penalty": 1.3}
    out = complete(client, prompt=prompt, max_tokens=12, ignore_eos=True, logprobs=0, **pen)
    model = ling.load(DEFAULT_MODEL, dtype="float32", progress=False)
    ref = generate_batch(model, [prompt], 12, speculative=False, presence=0.6, frequency=1.1, repetition=1.3)[0]
    assert ref != generate_batch(model, [prompt], 12, speculative=False)[0]
    assert out["choices"][0]["logprobs"]["tokens"] == [tokenizer.token_text(t) for t in ref]
    for name, bad in (("presence_penalty", 2.5), ("frequency_penalty", 1e39), ("repetition_penalty", 0)):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, name: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_null_means_default(client):
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "stream",
                           "stream_options", "seed", "stop", "max_tokens", "logprobs", "echo", "timeout", "best_of"))
    out = complete(client, prompt="x = 1", **{**nulls, "temperature": 0})
    assert out["usage"]["completion_tokens"] >= 1  # max_tokens null: the default (16)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  **nulls, "max_completion_tokens": None})
    assert r.status_code == 200, r.text


def test_sampling_keeps_the_top_token_at_tiny_top_p(client):
    """top_p at float32's smallest normal samples the most likely token: greedy's output."""
    body = {"prompt": "def main(", "max_tokens": 8, "ignore_eos": True}
    greedy = complete(client, **body)["choices"][0]["text"]
    assert complete(client, **body, temperature=1.0, top_p=1.2e-38, seed=3)["choices"][0]["text"] == greedy


def test_body_limit_and_refusals_free_their_memory(running, client):
    """Bodies over --max-request-bytes (8 MiB) get 413; a huge prompt under it is refused by its
    length without being tokenized, while /health keeps answering; the server's memory comes back."""
    big = json.dumps({"prompt": "x" * (9 << 20)}).encode()
    r = client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    rss = running.rss_bytes()
    answers, posts, done = [], [], threading.Event()  # (sent, answered) of /health; (start, end) of the posts

    def poll_health():
        with httpx.Client(base_url=running.url) as h:
            while not done.is_set():
                sent = time.monotonic()
                assert h.get("/health").status_code == 200
                answers.append((sent, time.monotonic()))

    poller = threading.Thread(target=poll_health)
    poller.start()
    text = json.dumps({"prompt": "def f(x):\n" * 700_000}).encode()  # 7.7 MB as JSON
    ids = json.dumps({"prompt": [1] * 2_700_000}).encode()  # 8.1 MB: parsing and checking it takes a while
    try:
        while len(answers) < 2:
            time.sleep(0.01)
        for body in (text, ids, text, ids):
            start = time.monotonic()
            r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            posts.append((start, time.monotonic()))
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            if body is text:
                assert "characters" in r.json()["error"]["message"]  # the bound refused it, not the tokenizer
    finally:
        done.set()
        poller.join()
    # The event loop kept answering while the requests were parsed in a worker thread: no /health
    # sent during a post waited for most of that post (as it would behind a parse on the loop).
    during = [got - sent for sent, got in answers for s0, s1 in posts if s0 <= sent <= s1]
    assert during and max(during) < 0.5 * min(s1 - s0 for s0, s1 in posts[1::2])
    assert running.rss_bytes() - rss < 256 << 20


def test_timeout(client):
    body = {"prompt": "x", "max_tokens": CONTEXT - 8, "ignore_eos": True, "timeout": 0.5}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout", r.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
    assert wait_idle(client)["free_slots"] == BATCH


def test_bad_input_changed_nothing(client):
    assert wait_idle(client)["free_slots"] == BATCH
    assert complete(client, prompt="x = 1", max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3


# -- cancellation, metrics, profiles -------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_slot(server, client):
    aborted = metric(client, "ling:request_success_total", {"finish_reason": "abort"})
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "while True:", "max_tokens": CONTEXT - 10, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # leaving the block closes the connection mid-stream
    assert wait_idle(client)["free_slots"] == BATCH
    assert metric(client, "ling:request_success_total", {"finish_reason": "abort"}) == aborted + 1

    async def full_batch():  # every slot busy at once, each request served to its end
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": f"x = {i}", "max_tokens": 24, "temperature": 0, "ignore_eos": True}) for i in range(BATCH)))
        return [r.json()["usage"]["completion_tokens"] for r in rs]

    assert asyncio.run(full_batch()) == [24] * BATCH
    assert wait_idle(client)["free_slots"] == BATCH


def test_metrics_parse(client):
    complete(client, prompt="print(", max_tokens=6, ignore_eos=True)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("ling:request_success", "ling:prompt_tokens", "ling:generation_tokens",
                 "ling:time_to_first_token_seconds", "ling:time_per_output_token_seconds",
                 "ling:inter_token_latency_seconds", "ling:spec_accept_length", "ling:num_requests_waiting",
                 "ling:num_requests_running"):
        assert name in families, name
    assert families["ling:time_to_first_token_seconds"].type == "histogram"
    assert metric(client, "ling:time_to_first_token_seconds_count") >= 1
    assert metric(client, "ling:generation_tokens_total") >= 6
    assert metric(client, "ling:spec_accept_length") >= 1.0
    assert metric(client, "ling:num_requests_running") == 0


def test_prefix_cache_hits_a_repeated_prefix(client):
    """The prefix cache (on by default, a checkpoint every 64 tokens): a prompt sent again after
    it was prefilled restores its last checkpoint (hit tokens in /metrics), and its greedy output
    is the same."""
    assert metric(client, "ling:prefix_cache_entries_total") > 0
    rng = np.random.default_rng(9)
    prompt = rng.integers(2, 4096, 150).tolist()
    body = dict(prompt=prompt, max_tokens=12, ignore_eos=True, logprobs=1)
    hits = metric(client, "ling:prefix_cache_hits_total")
    cold = complete(client, **body)["choices"][0]
    assert metric(client, "ling:prefix_cache_hits_total") == hits
    warm = complete(client, **body)["choices"][0]
    assert warm["text"] == cold["text"] and warm["logprobs"]["tokens"] == cold["logprobs"]["tokens"]
    assert metric(client, "ling:prefix_cache_hits_total") == hits + 128  # the checkpoint at 128 of 150
    queried = metric(client, "ling:prefix_cache_queries_total")
    assert metric(client, "ling:prefix_cache_hit_rate") == pytest.approx(
        metric(client, "ling:prefix_cache_hits_total") / queried)
    assert metric(client, "ling:prefix_cache_entries_used") >= 2


def test_profile_writes_a_trace(client, tmp_path):
    assert client.post("/stop_profile").status_code == 409  # nothing to stop
    r = client.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 200, r.text
    assert client.post("/start_profile").status_code == 409  # already running
    complete(client, prompt="with open(", max_tokens=4)
    r = client.post("/stop_profile")
    assert r.status_code == 200, r.text
    files = r.json()["files"]
    assert any(f.endswith(".xplane.pb") and os.path.getsize(f) > 0 for f in files), files
    assert all(f.startswith(str(tmp_path)) for f in files)


def test_serve_bench_against_the_server(server, tmp_path):
    """`python -m serve.bench` end to end: SGLang's dataset name, every request completed with its
    exact output length, the JSON summary and the plot written."""
    from serve import bench

    out, png = tmp_path / "out.json", tmp_path / "run.png"
    rc = bench.main(["--base-url", server, "--api-key", KEY, "--dataset-name", "random-ids", "--num-prompts", "4",
                     "--random-input-len", "12", "--random-output-len", "5", "--concurrency", "2", "--disable-tqdm",
                     "--output-json", str(out), "--plot", str(png)])
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["completed"] == 4 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 4 * 12 and summary["total_output_tokens"] == 4 * 5
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_bench_streams_with_arrivals(server, tmp_path):
    """`python -m serve.bench --streams`: the streams alone, then with prompts arriving beside
    them; every request completed, the streams' gaps measured while the arrivals ran."""
    from serve import bench

    out = tmp_path / "streams.json"
    rc = bench.main(["--base-url", server, "--api-key", KEY, "--streams", "2", "--stream-output-len", "120",
                     "--streams-lead-s", "0.2", "--num-prompts", "2", "--random-input-len", "90",
                     "--random-output-len", "3", "--request-rate", "20", "--disable-tqdm", "--output-json", str(out)])
    runs = json.loads(out.read_text())
    assert rc == 0 and runs["alone"]["failed"] == runs["arrivals"]["failed"] == 0
    assert runs["alone"]["arrivals"] == 0 and runs["arrivals"]["arrivals"] == 2
    assert runs["alone"]["itl_samples"] > 0 and runs["arrivals"]["arrival_mean_ttft_ms"] > 0
    assert runs["arrivals"]["streams_outlast_arrivals"] and runs["p99_itl_ratio"] > 0


def test_serve_bench_streams_count_gaps_once_every_stream_decodes():
    """The streams' gaps are counted from the last stream's first token on (a gap that begins
    before it spans the others' prompts, not decode), those that end in the window."""
    from serve.bench import Result, gaps_within, steady_from

    a = Result(ok=True, start=0.0, ttft=0.1, itl=[0.01, 0.5, 0.01])  # tokens at 0.1, 0.11, 0.61, 0.62
    b = Result(ok=True, start=0.0, ttft=0.6, itl=[0.02, 0.02])  # tokens at 0.6, 0.62, 0.64
    late = Result(ok=False, start=0.0, ttft=9.0)
    assert steady_from([a, b, late]) == 0.6
    assert sorted(gaps_within([a, b], since=steady_from([a, b]))) == pytest.approx([0.01, 0.02, 0.02])
    assert gaps_within([a, b], 0.6, 0.63) == pytest.approx([0.5, 0.01, 0.02])  # by their ends only
    assert gaps_within([a, b], 0.6, 0.63, since=0.6) == pytest.approx([0.01, 0.02])
    assert steady_from([late]) == -float("inf") and len(gaps_within([a], since=steady_from([late]))) == 3


def test_serve_bench_multi_turn(server, client, tmp_path):
    """`python -m serve.bench --multi-turn`: the same conversations without and with the prefix
    cache (/flush_cache), every request completed; follow-up turns hit with the cache only."""
    from serve import bench

    out = tmp_path / "turns.json"
    hits = metric(client, "ling:prefix_cache_hits_total")
    rc = bench.main(["--base-url", server, "--api-key", KEY, "--multi-turn", "--num-prompts", "2", "--turns", "2",
                     "--random-input-len", "70", "--turn-input-len", "6", "--random-output-len", "4",
                     "--disable-tqdm", "--output-json", str(out)])
    runs = json.loads(out.read_text())
    assert rc == 0 and set(runs) == {"no-cache", "cache"}
    for s in runs.values():
        assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 4 * 4
        assert s["mean_ttft_first_turn_ms"] > 0 and s["mean_ttft_follow_up_ms"] > 0
    assert runs["no-cache"]["total_input_tokens"] == runs["cache"]["total_input_tokens"]
    # The cache run's follow-ups: at the prompt's checkpoint at 64, or at 73 (70 + 4 - 1) where the
    # re-tokenised output is the generated one (the finished request's checkpoint).
    assert hits + 2 * 64 <= metric(client, "ling:prefix_cache_hits_total") <= hits + 2 * 73

"""The server's admission and shutdown over real HTTP: --max-queue (429 with Retry-After),
--request-timeout, the access log, plain start-up lines in a log file, and SIGTERM ending running
streams after --shutdown-grace with an error event and [DONE]. One slot, so that a long request
holds it. Nothing here asserts a timing."""

import json
import signal
import threading
import time

import httpx
import pytest

from serving import Server

CONTEXT = 4096
GRACE_S = 2.0
# Holds the slot through every test here: at 1 ms a token (an idle fast CPU at 512 tokens of
# context) it still outlasts the grace twice over; 504 tokens did not.
LONG = {"prompt": "x", "max_tokens": CONTEXT - 8, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["--max-batch", "1", "--max-seq-len", str(CONTEXT), "--speculative-num-steps", "0", "--max-queue", "1",
                "--request-timeout", "300", "--shutdown-grace", str(GRACE_S), "--log-requests",
                "--disable-prefix-cache"],
               tmp_path_factory.mktemp("serve-limits"))
    try:
        yield s
    finally:
        s.stop()


def first_text(stream_lines) -> None:
    """Reads a stream until its first piece of text: the request holds its slot."""
    for line in stream_lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
            return


def test_startup_log_is_plain_lines(server):
    log = server.log()
    assert "\r" not in log  # stderr is a file here: no progress bars
    assert "[5/5] compiling decode step" in log


def test_disable_prefix_cache(server):
    """--disable-prefix-cache: no pool, and a prompt sent twice is prefilled twice."""
    assert "prefix cache off" in server.log()
    body = {"prompt": list(range(2, 202)), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(server.url + "/v1/completions", timeout=300, json=body).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    assert "ling:prefix_cache_entries_total 0.0" in text and "ling:prefix_cache_hits_total 0.0" in text


def test_logprobs_in_plain_decoding(server):
    """Plain decode steps report log-probabilities too: a greedy token is its own top alternative."""
    r = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "prompt": "import", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and list(top)[0] == token and top[token] == logprob <= 0


def test_queue_limit(server):
    """One slot and --max-queue 1: a running request, one waiting, the third refused."""
    with httpx.Client(base_url=server.url, timeout=300) as running, httpx.Client(base_url=server.url) as c:
        with running.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as s:
            lines = s.iter_lines()
            first_text(lines)
            waiting = threading.Thread(target=lambda: c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}))
            waiting.start()
            deadline = time.monotonic() + 60
            while c.get("/health").json()["waiting"] < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            with httpx.Client(base_url=server.url) as third:
                r = third.post("/v1/completions", json={"prompt": "z", "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        waiting.join()  # closing the stream aborted the first; the second ran
    log = server.log()
    assert "finish=disconnect" in log and "finish=length" in log and "prompt_tokens=1" in log


def test_sigterm_ends_running_streams_after_the_grace(server):
    events, started = [], threading.Event()

    def consume():
        with httpx.Client(base_url=server.url, timeout=300) as c:
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if line.startswith("data: {") and json.loads(line[6:]).get("choices", [{}])[0].get("text"):
                            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert not t.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down", error
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 0 < len(texts) < LONG["max_tokens"]  # cut by the grace, not finished
    with pytest.raises(httpx.TransportError):  # no longer listening
        httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    server.proc.wait(60)
    log = server.log()
    assert "shutting down" in log and "finish=shutdown" in log


def test_a_request_of_n_choices_counts_n_towards_the_queue_limit():
    """`--max-queue`: a group of n sequences is admitted only if all n fit."""
    from types import SimpleNamespace

    from serve.api import _admit
    from serve.protocol import APIError

    c = SimpleNamespace(shutdown_at=None, in_flight=7, engine=SimpleNamespace(error=None, runner=SimpleNamespace(
        max_batch=8)), info=SimpleNamespace(max_queue=0))
    _admit(c)  # one more sequence fits the eighth slot
    with pytest.raises(APIError) as e:
        _admit(c, 2)
    assert e.value.status == 429

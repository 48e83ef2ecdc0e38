"""The server's host-side text handling without a server: incremental detokenisation (UTF-8
characters split across tokens), stop strings split across tokens, the chat template, the
scheduler's chunk plan."""

import pytest

from serve.output import TextOutput
from serve.request import Request, Sampling
from serve.run import DEFAULT_MODEL
from serve.scheduler import Scheduler
from serve.tokenizer import PLAIN_TEMPLATE, IncrementalDetokenizer, TemplateError, Tokenizer

TEXT = "naïve café — 日本語のテキスト 🎉🐍 done\n\tdef f(x): return x ** 2  # ok"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_MODEL)


def test_incremental_detokenizer_emits_each_character_once_and_whole(tok):
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really splits characters across tokens
    for prompt in ([], tok.encode("x = '")):
        d = IncrementalDetokenizer(tok, prompt)
        deltas = [d.add(i) for i in ids]
        assert all("\ufffd" not in x for x in deltas)
        assert "".join(deltas) + d.flush() == TEXT


def test_flush_sends_an_unfinished_character_as_replacement(tok):
    ids = tok.encode("ok 🎉")
    d = IncrementalDetokenizer(tok, [])
    text = "".join(d.add(i) for i in ids[:-1])
    assert "\ufffd" not in text and (text + d.flush()).endswith("\ufffd")


def output(tok, max_tokens=100, stop=(), ignore_eos=False, stop_ids=frozenset()):
    return TextOutput(tok, Request([5], Sampling(max_tokens=max_tokens, stop=tuple(stop), ignore_eos=ignore_eos)),
                      set(stop_ids))


def run(out, ids):
    """Feeds ids one at a time as a stream would; returns what was sent."""
    sent = ""
    for i in ids:
        out.add([i])
        sent += out.take()
        if out.reason:
            break
    return sent


def test_stop_string_split_across_tokens_is_never_sent(tok):
    ids = tok.encode(TEXT)
    stop = "テキスト"
    out = output(tok, stop=[stop, "zzz"])
    sent = run(out, ids)
    assert out.reason == "stop" and sent == TEXT[: TEXT.index(stop)]
    assert out.tokens < len(ids)


def test_stop_token_and_max_tokens(tok):
    ids = tok.encode("a b c d e f")
    out = output(tok, stop_ids={ids[3]})
    assert run(out, ids) == tok.decode(ids[:3]) and out.reason == "stop" and out.tokens == 4
    out = output(tok, stop_ids={ids[3]}, ignore_eos=True, max_tokens=5)
    assert run(out, ids) == tok.decode(ids[:5]) and out.reason == "length" and out.tokens == 5
    out = output(tok, max_tokens=3)  # several tokens in one step: those past the limit are dropped
    out.add(ids)
    assert out.take() == tok.decode(ids[:3]) and out.reason == "length" and out.tokens == 3


def test_chat_templates(tok, tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "tokenizer.json").write_text(open(f"{DEFAULT_MODEL}/tokenizer.json").read())
    plain = Tokenizer(str(tmp_path))  # no tokenizer_config.json: the plain template
    assert plain.chat_template == PLAIN_TEMPLATE and plain.apply_chat_template(msgs) == "user: hi\nassistant:"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ raise_exception(\'no system role\') }}", "eos_token": {"content": "<|im_end|>"}}')
    strict = Tokenizer(str(tmp_path))
    assert strict.stop_token_ids(str(tmp_path)) == {tok.token_id("<|im_end|>")}
    with pytest.raises(TemplateError, match="no system role"):
        strict.apply_chat_template(msgs)


def test_scheduler_chunks_queue_and_frees():
    s = Scheduler(num_slots=2, chunk=4, eos_id=0)
    reqs = [Request(list(range(1, n + 1)), Sampling(max_tokens=3)) for n in (6, 2, 3)]
    for r in reqs:
        s.add(r)
    c = s.next_chunk()  # two admitted, the third waits
    assert c.start.tolist() == [True, True] and s.num_waiting == 1
    assert c.tokens.tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]] and c.valid.tolist() == [4, 2]
    assert c.next_tokens.tolist() == [[2, 3, 4, 5], [2, 0, 0, 0]]  # the last token's successor is sampled
    assert c.ends.tolist() == [False, True] and c.owners == [None, reqs[1]] and c.max_new.tolist() == [3, 3]
    assert s.decoding() == [None, reqs[1]]
    s.remove(reqs[1])  # finished: its slot takes the waiting request in the same chunk call
    c = s.next_chunk()
    assert c.start.tolist() == [False, True] and c.valid.tolist() == [2, 3]
    assert c.tokens[0, :2].tolist() == [5, 6] and c.ends.tolist() == [True, True]
    assert c.eos[1] == 0 and s.decoding() == [reqs[0], reqs[2]] and s.next_chunk() is None

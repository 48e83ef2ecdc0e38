"""One request's output: tokens in, text out, and the stop conditions that the host checks (stop
strings, stop token ids, max_tokens). EOS and max_tokens are also enforced on the device; checking
them here too lets the host finish a request the moment its last token arrives."""

from __future__ import annotations

from serve.request import Request
from serve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, request: Request, stop_ids: set[int]):
        s = request.sampling
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        self.max_tokens = s.max_tokens
        self.stop_ids = set() if s.ignore_eos else stop_ids
        self.stop = [x for x in s.stop if x]
        # While streaming, the last len(longest stop) - 1 characters are held back: they may be the
        # start of a stop string, which must never reach the client.
        self.hold = max((len(x) for x in self.stop), default=1) - 1
        self.text = ""  # stable text so far (cut before a stop string once one matched)
        self.sent = 0  # characters of text already sent
        self.checked = 0  # characters of text already searched for stop strings
        self.tokens = 0  # tokens generated, the stop token included
        self.ids: list[int] = []  # and their ids
        self.reason: str | None = None
        self._cut = False  # a stop string has cut the text: nothing after it counts

    def add(self, tokens) -> int:
        """Consumes new tokens in order until one finishes the request (the rest are dropped);
        returns how many it consumed."""
        used = 0
        for t in tokens:
            if self.reason is not None:
                break
            used += 1
            self.tokens += 1
            self.ids.append(t)
            if t in self.stop_ids:
                self._end("stop")
                continue
            self.text += self.detok.add(t)
            if self._stop_string():
                self.reason = "stop"
            elif self.tokens >= self.max_tokens:
                self._end("length")
        return used

    def finish(self, reason: str) -> None:
        """Ends the request for a reason the device reported (EOS or max_tokens reached there)."""
        if self.reason is None:
            self._end(reason)

    def take(self) -> str:
        """Text not yet sent that is safe to send."""
        end = len(self.text) if self.reason is not None else max(len(self.text) - self.hold, self.sent)
        delta, self.sent = self.text[self.sent:end], max(end, self.sent)
        return delta

    def _end(self, reason: str) -> None:
        self.reason = reason
        self.text += self.detok.flush()  # a character left unfinished is sent as U+FFFD
        if self._stop_string():
            self.reason = "stop"

    def _stop_string(self) -> bool:
        """Cuts the text before the first stop string, if one has appeared."""
        if not self.stop or self._cut:
            return False
        start = max(0, self.checked - self.hold)  # a match may begin in the already-searched tail
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self.checked = len(self.text)
        if not found:
            return False
        self.text, self._cut = self.text[: min(found)], True
        return True

"""Text <-> token ids for the server: the model directory's tokenizer.json, its chat template, its
end-of-sequence tokens, and incremental detokenisation of a growing output."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer

# When tokenizer_config.json has no chat template: one "role: content" line per message, then the
# assistant's cue.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


class TemplateError(ValueError):
    """The chat template rejected the messages (its own raise_exception, or a rendering error)."""


def _token_text(v):
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts."""
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{directory}: no tokenizer.json (the server needs the model's tokenizer there)")
        self.tok = _HFTokenizer.from_file(path)
        config = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = template or PLAIN_TEMPLATE
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._template = _compile(self.chat_template)
        # The most characters of text one token can stand for: its vocabulary string's length (one
        # character per byte or per character, whichever the model spells), four times that when
        # a normalizer may first fold several characters into one. `min_tokens` bounds with it.
        longest = max(map(len, self.tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars_per_token = longest * (1 if self.tok.normalizer is None else 4)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    def stop_token_ids(self, directory: str) -> set[int]:
        """Ids that end a generation: the tokenizer's eos_token and generation_config.json's
        eos_token_id (a list in several model families)."""
        ids = set()
        if (i := self.token_id(self.eos_token)) is not None:
            ids.add(i)
        gen = os.path.join(directory, "generation_config.json")
        if os.path.exists(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without encoding: a prompt whose bound already
        exceeds the context is refused before the (long) tokenisation of a huge text."""
        return -(-len(text) // self.max_chars_per_token)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """special=False for rendered chat prompts: the template already wrote BOS and friends."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included (log-probabilities name tokens so)."""
        return self.tok.decode([token], skip_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except TemplateError:
            raise
        except Exception as e:  # jinja2's own errors: a template that cannot take these messages
            raise TemplateError(f"the chat template failed on these messages: {e}") from e


def _compile(source: str):
    # Sandboxed, as transformers renders them: a template is data that came with the checkpoint.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only once it is stable.

    Decodes a short window (a few tokens already emitted, then the new ones) and emits what the
    new tokens added, holding it back while it ends in U+FFFD (a UTF-8 character split across
    tokens). Starting the window in the prompt's tail keeps tokenizers that drop a leading space
    at the start of a decode (SentencePiece) right."""

    CONTEXT = 5  # tokens of already-decoded text at the start of each window

    def __init__(self, tokenizer: Tokenizer, prompt_ids):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix = self.read = len(self.ids)  # window start; end of the emitted tokens
        self._prefix_text = ""

    def add(self, token: int) -> str:
        """Appends one token; returns the newly stable text (often "")."""
        self.ids.append(token)
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        delta = text[len(self._prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self._prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        return delta

    def flush(self) -> str:
        """At the end: whatever is held back, U+FFFD included."""
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        delta = text[len(self._prefix_text):]
        self._prefix_text = self.tok.decode(self.ids[self.prefix:])
        return delta

"""The training corpus, its tokenizer and fixed-length packing.

Corpus: the Python standard library's own `.py` sources (`sysconfig.get_paths()["stdlib"]`, its
test suite included; installed packages, `__pycache__`, and the generated tables of `encodings/`
and `pydoc_data/` left out). Every machine with Python has it, no download needed. It is licensed
under the Python Software Foundation License (PSF-2.0); a model trained on it ships with that
provenance. The corpus differs slightly between Python versions: what a trained checkpoint was
evaluated on is therefore stored next to it (`HELDOUT_FILE`), not recomputed.

Split: by file, deterministically: a file is held out when the first 8 bytes of the SHA-256 of
its path relative to the stdlib root (with '/' separators) fall below `heldout` of the range.
A file is in exactly one split, on every machine and every run. Training sets aside a validation
split of the train files (`validation_split`) and keeps the parameters with the lowest validation
loss, so the held-out figures are not chosen on.

Tokenizer: byte-level BPE (`tokenizers`) trained on the train split. Special tokens:
<|endoftext|> (id 0, appended to every document: the model's EOS),
<|im_start|> (1) and <|im_end|> (2) for the ChatML chat template.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
EOT_ID = 0
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
SKIP_TOP = {"encodings", "pydoc_data"}  # generated tables and docs, not code
HELDOUT_FILE = "heldout_tokens.npy"  # the held-out sequences a checkpoint's figures were measured on

# ChatML: each turn between <|im_start|>role\n and <|im_end|>\n; the generation prompt opens the
# assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Paths relative to the stdlib root, '/'-separated, sorted."""
    root = root or stdlib_root()
    out = []
    for d, dirs, names in os.walk(root):
        rel_dir = os.path.relpath(d, root)
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not (rel_dir == "." and x in SKIP_TOP))
        for n in names:
            if n.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/"))
    if not out:
        raise FileNotFoundError(f"no .py files under the standard library directory {root}")
    return sorted(out)


def is_heldout(rel_path: str, heldout: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h < heldout * 2**64


def split(files: Sequence[str], heldout: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, held-out), each in the order given."""
    train = [f for f in files if not is_heldout(f, heldout)]
    held = [f for f in files if is_heldout(f, heldout)]
    return train, held


def validation_split(train_files: Sequence[str], frac: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, validation): files of the train split set aside to choose the checkpoint by, so the
    held-out split stays unseen by every choice made in training. By a second hash of the path
    (salted), independent of the held-out one."""
    def is_val(f):
        return int.from_bytes(hashlib.sha256(b"validation:" + f.encode()).digest()[:8], "big") < frac * 2**64
    return [f for f in train_files if not is_val(f)], [f for f in train_files if is_val(f)]


def read_texts(files: Iterable[str], root: str | None = None, *, max_bytes: int | None = None) -> list[str]:
    """The files' texts (undecodable bytes replaced), stopping once max_bytes are read."""
    root = root or stdlib_root()
    out, total = [], 0
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        out.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [0, 1, 2]:
        raise AssertionError("the special tokens did not get ids 0, 1, 2")
    return tok


def load_tokenizer(directory: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))


def save_tokenizer(tok, directory: str, *, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json (EOS ids)."""
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                   "bos_token": None, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT,
                   "chat_template": CHAT_TEMPLATE}, f, indent=1)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)],
                   "pad_token_id": tok.token_to_id(ENDOFTEXT)}, f, indent=1)


def encode(tok, texts: Sequence[str]) -> np.ndarray:
    """One stream of ids [N] int32: every document followed by <|endoftext|>."""
    parts = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.array([EOT_ID], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def pack(stream: np.ndarray, seq_len: int, max_seqs: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows [N, seq_len] of the stream (the tail shorter than a
    window is dropped). Documents run on across windows, separated by <|endoftext|>."""
    n = len(stream) // seq_len
    if max_seqs is not None:
        n = min(n, max_seqs)
    if n == 0:
        raise ValueError(f"the stream has {len(stream)} tokens, fewer than one sequence of {seq_len}")
    return stream[: n * seq_len].reshape(n, seq_len)


class Batches:
    """Training batches [B, T] int32 cut at uniformly random offsets of the packed stream: every
    window of T consecutive tokens is a sample, so an epoch is not tied to one fixed cut."""

    def __init__(self, stream: np.ndarray, batch: int, seq_len: int, seed: int):
        if len(stream) <= seq_len:
            raise ValueError(f"the training stream has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.stream, self.batch, self.seq_len = stream, batch, seq_len
        self.rng = np.random.default_rng(seed)

    def __next__(self) -> np.ndarray:
        starts = self.rng.integers(0, len(self.stream) - self.seq_len + 1, self.batch)
        return self.stream[starts[:, None] + np.arange(self.seq_len)[None]]

    def __iter__(self):
        return self

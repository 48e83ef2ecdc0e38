"""Regenerates `serve/default_model/`: the model `python -m serve.run` serves when given no --model.

    python -m serve.make_default_model [--out serve/default_model] [--vocab-size 1024] [--seed 0]

It holds
- a byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat template),
  trained with `tokenizers` on the Python standard library's own .py sources: a corpus every
  machine with Python has, under the PSF licence;
- a converted checkpoint (ling_config.json + params/) of a `ling-tiny`-architecture model whose
  vocab_size matches the tokenizer. The weights are random (seeded): it exercises every layer kind
  and the NEXTN draft layer, but its text is noise until a trained checkpoint replaces it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
MAX_POSITIONS = 4096

# ChatML: each turn between <|im_start|>role\n and <|im_end|>\n; the generation prompt opens the
# assistant's turn. Documents in the base corpus are separated by <|endoftext|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

README = """# The default model of `python -m serve.run`

Regenerate with `python -m serve.make_default_model`.

- `tokenizer.json`: byte-level BPE, {vocab} tokens, trained with `tokenizers` on the Python standard
  library's own `.py` sources (Python {py}; the corpus is licensed under the Python Software
  Foundation License, PSF-2.0). Special tokens: `<|endoftext|>` (0, end of document, the model's
  EOS), `<|im_start|>` (1) and `<|im_end|>` (2, end of a chat turn; ChatML template in
  `tokenizer_config.json`).
- `ling_config.json`, `params/`: a converted checkpoint (`ling.load` reads it) of the `ling-tiny`
  architecture (4 layers: KDA, KDA, MLA, KDA; dense + MoE; one NEXTN draft layer) with
  vocab_size {vocab}, {dtype} weights. The weights are RANDOM (seed {seed}): the server runs end to
  end, but its text is noise until a trained checkpoint replaces this one.
"""


def stdlib_sources() -> list[str]:
    """The standard library's .py files, sorted (test suites and installed packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    if not files:
        raise SystemExit(f"error: no .py files under the standard library directory {root}")
    return files


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for path in stdlib_sources():
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()

    tok.train_from_iterator(texts(), trainer=trainer)
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.make_default_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model"))
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="stored weight dtype (the server casts on load)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a few MB of random weights: no accelerator needed

    from flax import nnx

    from ling import checkpoint
    from ling.config import preset
    from ling.model import LingModel

    tok = train_tokenizer(args.vocab_size)
    vocab = tok.get_vocab_size()
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [0, 1, 2]:
        raise SystemExit("error: the special tokens did not get ids 0, 1, 2")

    if os.path.exists(args.out):
        shutil.rmtree(args.out)  # orbax refuses to write into a stale params/ directory
    os.makedirs(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_POSITIONS,
                   "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT, "chat_template": CHAT_TEMPLATE},
                  f, indent=1)

    eos = tok.token_to_id(ENDOFTEXT)
    cfg = preset("ling-tiny").replace(vocab_size=vocab, max_position_embeddings=MAX_POSITIONS, eos_token_id=eos,
                                      pad_token_id=eos, bos_token_id=None)
    import jax.numpy as jnp

    model = LingModel(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(args.seed))
    checkpoint.save_converted(model, args.out)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(README.format(vocab=vocab, py=sys.version.split()[0], dtype=args.dtype, seed=args.seed))
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(args.out) for n in names)
    print(f"wrote {args.out}: tokenizer ({vocab} tokens) + ling-tiny checkpoint, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

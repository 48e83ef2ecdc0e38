"""A token map for `python -m serve.run --speculative-token-map`: the N most frequent tokens of a
corpus, which the drafters then score alone (`ling.draft_vocab`).

    python -m offline.token_map --tokenizer DIR --corpus FILE_OR_DIR ... --size 32768 --out map.npy
    python -m offline.token_map --tokenizer serve/default_model --stdlib-train --size 1024 \\
        --out map.npy --eval serve/default_model        # and what it costs the shipped model

The corpus: text files, and the files under directories (--pattern picks them, default every
file), read as UTF-8 (undecodable bytes replaced) and encoded without special tokens; or, with
--stdlib-train, the shipped model's own training split (`offline.data`). Ties between counts go to
the lower id. Writes the ids as sorted int32 .npy (or .json / .txt by --out's suffix).

--eval MODEL: greedy speculative decoding (NEXTN, --num-steps drafts) of MODEL's held-out prompts
(`offline.eval.heldout_sequences`) with the whole vocabulary and with the map: the accepted length
a step of each, and whether each output equals plain greedy (in float32 it must).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from ling.draft_vocab import most_frequent


def corpus_files(paths, pattern: str = "*") -> list[str]:
    """The files named, and those under the directories named whose names match pattern, sorted
    within each directory. FileNotFoundError naming a path that does not exist."""
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            for d, dirs, names in os.walk(p):
                dirs.sort()
                out += [os.path.join(d, n) for n in sorted(names) if fnmatch.fnmatch(n, pattern)]
        else:
            raise FileNotFoundError(f"--corpus {p}: no such file or directory")
    return out


def count_tokens(tok, texts, vocab_size: int, progress: bool = False, batch: int = 256) -> np.ndarray:
    """Occurrences [vocab_size] int64 of every id in the texts' encodings (no special tokens),
    encoded `batch` documents at a time (the tokenizer's threads)."""
    counts = np.zeros(vocab_size, np.int64)
    with tqdm(total=len(texts), desc="counting", unit="doc", disable=not progress) as bar:
        for i in range(0, len(texts), batch):
            encs = tok.encode_batch(list(texts[i:i + batch]), add_special_tokens=False)
            ids = np.concatenate([np.asarray(e.ids, np.int64) for e in encs] + [np.zeros(0, np.int64)])
            counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
            bar.update(len(encs))
    return counts


def save(ids: np.ndarray, path: str) -> None:
    suffix = os.path.splitext(path)[1]
    if suffix == ".npy":
        np.save(path, ids)
    elif suffix == ".json":
        with open(path, "w") as f:
            json.dump(ids.tolist(), f)
    elif suffix == ".txt":
        with open(path, "w") as f:
            f.write("\n".join(map(str, ids.tolist())) + "\n")
    else:
        raise ValueError(f"--out {path}: the suffix must be .npy, .json or .txt")


def evaluate(model_dir: str, ids: np.ndarray, *, num_steps: int, prompts: int, prompt_len: int,
             new_tokens: int, dtype: str) -> list[dict]:
    """Accepted length a verify step of NEXTN drafting over the whole vocabulary and over ids, on
    the model's held-out prompts (pooled), and how many outputs equal plain greedy."""
    import jax

    import ling
    from offline.eval import heldout_sequences
    from spec.generate import generate_batch

    model = ling.load(model_dir, dtype=dtype, progress=False)
    seqs = heldout_sequences(model_dir)
    starts = np.linspace(0, len(seqs) - 1, prompts).astype(int)
    ps = [seqs[i, :min(prompt_len, seqs.shape[1])].tolist() for i in starts]
    plain = [generate_batch(model, [p], new_tokens, speculative=False)[0] for p in ps]
    rows = []
    for name, vocab in (("whole vocabulary", None), (f"{ids.size} tokens", ids)):
        model.attach_draft_vocab(vocab)
        t0, steps, produced, same = time.perf_counter(), 0, 0, 0
        for p, ref in zip(ps, plain):
            out, slots = generate_batch(model, [p], new_tokens, speculative=True, num_steps=num_steps,
                                        return_slots=True)
            s, n = jax.device_get((slots.steps.sum(), slots.produced.sum()))
            steps, produced, same = steps + int(s), produced + int(n), same + (out[0] == ref)
        rows.append(dict(drafts_over=name, accepted_length=produced / max(steps, 1), prompts_matching=same,
                         prompts=len(ps), seconds=time.perf_counter() - t0))
    model.attach_draft_vocab(None)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offline.token_map", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    ap.add_argument("--corpus", nargs="+", default=[], metavar="PATH", help="text files and directories")
    ap.add_argument("--pattern", default="*", help="file names taken under --corpus directories (default: all)")
    ap.add_argument("--stdlib-train", action="store_true",
                    help="the shipped model's training split (offline.data) as the corpus, besides --corpus")
    ap.add_argument("--size", type=int, required=True, help="tokens in the map")
    ap.add_argument("--out", default="token_map.npy", help="output file: .npy, .json or .txt")
    ap.add_argument("--eval", metavar="MODEL", default=None,
                    help="also measure the accepted length with and without the map on MODEL's held-out prompts")
    ap.add_argument("--num-steps", type=int, default=5, help="--eval: NEXTN drafts a step")
    ap.add_argument("--prompts", type=int, default=8, help="--eval: held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="--eval: the model's dtype (float32: speculative output "
                    "equals plain greedy exactly; in bfloat16 the verify pass's sums may break near-ties otherwise)")
    args = ap.parse_args(argv)
    if not args.corpus and not args.stdlib_train:
        ap.error("give --corpus PATH ... and/or --stdlib-train")
    if os.path.splitext(args.out)[1] not in (".npy", ".json", ".txt"):
        ap.error(f"--out {args.out}: the suffix must be .npy, .json or .txt")
    if args.size < 1:
        ap.error(f"--size must be at least 1, got {args.size}")
    from offline import data

    try:
        tok = data.load_tokenizer(args.tokenizer)
    except Exception as e:  # tokenizers raises its own exception type for a bad file
        ap.error(f"--tokenizer {args.tokenizer}: {e}")
    try:
        files = corpus_files(args.corpus, args.pattern)
    except FileNotFoundError as e:
        ap.error(str(e))
    texts = data.read_texts(files, root=os.curdir) if files else []
    if args.stdlib_train:
        train, _ = data.split(data.stdlib_files())
        texts += data.read_texts(train)
    if not texts:
        ap.error("the corpus holds no files")
    vocab = tok.get_vocab_size()
    if args.size > vocab:
        ap.error(f"--size {args.size} exceeds the tokenizer's {vocab} tokens")
    counts = count_tokens(tok, texts, vocab, progress=sys.stderr.isatty())
    ids = most_frequent(counts, args.size)
    save(ids, args.out)
    total = counts.sum()
    print(f"{args.out}: {ids.size} of {vocab} tokens from {len(texts)} documents ({total} tokens); they cover "
          f"{counts[ids].sum() / max(total, 1):.1%} of the corpus's tokens")
    if args.eval:
        rows = evaluate(args.eval, ids, num_steps=args.num_steps, prompts=args.prompts, prompt_len=args.prompt_len,
                        new_tokens=args.new_tokens, dtype=args.dtype)
        print(f"{args.eval}, NEXTN {args.num_steps} drafts, greedy, {args.prompts} held-out prompts x "
              f"{args.new_tokens} tokens:")
        for r in rows:
            print(f"  drafts over {r['drafts_over']:<18} accepted length {r['accepted_length']:.3f}, = greedy "
                  f"{r['prompts_matching']}/{r['prompts']} ({r['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

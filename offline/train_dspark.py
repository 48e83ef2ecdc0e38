"""Train a DSpark block drafter (`ling.dspark`) against a frozen target and store it next to it.

    python -m offline.train_dspark --model serve/default_model --time-budget 900

Data: prompts cut from Python sources the target never trained on (the installed packages'; the
target's held-out files are never used), each continued by the target's own greedy decoding
(`spec.generate`), so every label is the token the target itself emits: the drafter learns the
target, not the corpus. (The target's own train split, `--prompt-source stdlib-train`, is text it
has learnt by heart: a drafter trained on its continuations there drafts worse on unseen code.) The
target's residual streams after the drafter's `feature_layers` are computed once over every
sequence (the target is frozen) and kept.

Loss, over random anchors n in the continuation (block [token_n, mask ...], labels token n+1 ..
n+B): position-weighted cross-entropy (weight exp(-j / decay): early positions decide the
accepted length) of base + Markov logits, the Markov head teacher-forced with the true previous
token; plus --base-weight x the same of the base logits alone (so the backbone drafts on its own,
the ablation without the sequential head); plus --conf-weight x the confidence head's binary
cross-entropy against whether the drafted argmax equals the label (its inputs stop-gradient: the
head only reads). AdamW, warmup then cosine, fp32. Kept: the parameters with the most accepted
drafts a block (teacher forced) on 32 held-back continuations (train-split prompts not trained on).

--time-budget bounds generation + training (seconds, compilation included): generation stops
adding batches past --gen-fraction of it, training is shortened to the steps that fit after a
measured warm-up (as `offline.train`). The drafter is written to --out (default: the model
directory) as dspark.json + dspark.safetensors (bf16; `ling.dspark.save`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ling
from ling import dspark
from offline import data
from offline.train import cpu_deadlock_workaround, lr_at


def site_packages_texts(max_bytes: int, seed: int) -> list[str]:
    """Python sources the target never saw: the installed packages' .py files (shuffled by seed),
    up to max_bytes."""
    import sysconfig

    root = sysconfig.get_paths()["purelib"]
    files = sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".py"))
    np.random.default_rng(seed).shuffle(files)
    texts, total = [], 0
    for f in files:
        try:
            t = open(f, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        if len(t) < 2000:
            continue
        texts.append(t)
        total += len(t)
        if total >= max_bytes:
            break
    return texts


def corpus_prompts(model_dir: str, count: int, length: int, seed: int, max_bytes: int,
                   source: str = "site-packages") -> np.ndarray:
    """count windows of length tokens (the target's tokenizer), [count, length], from `source`:
    "stdlib-train" (the target's own train split, which it has largely learnt by heart: its
    continuations there are recall, unlike its continuations of unseen code) or "site-packages"
    (`site_packages_texts`: Python the target never trained on, as its held-out files)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    if source == "stdlib-train":
        train_files, _ = data.split(data.stdlib_files())
        train_files, _ = data.validation_split(train_files)
        texts = data.read_texts(train_files, max_bytes=max_bytes)
    else:
        texts = site_packages_texts(max_bytes, seed)
    stream = data.encode(tok, texts)
    r = np.random.default_rng(seed)
    starts = r.integers(0, len(stream) - length, count)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def greedy_sequences(model, prompts: np.ndarray, new_tokens: int, batch: int, deadline: float, log=print):
    """prompts [N, P] continued greedily by the target: [M, P + new_tokens], M <= N (stops adding
    batches past the deadline)."""
    from spec.generate import generate_batch

    out = []
    for i in range(0, len(prompts), batch):
        if out and time.perf_counter() > deadline:
            break
        ps = prompts[i:i + batch]
        cont = generate_batch(model, ps.tolist(), new_tokens, speculative=False, prefill_chunk=prompts.shape[1])
        out.append(np.concatenate([ps, np.asarray(cont, np.int32)], axis=1))
        log(f"  generated {sum(len(o) for o in out)} sequences", flush=True)
    return np.concatenate(out)


def target_taps(model, seqs: np.ndarray, layers: tuple[int, ...], batch: int) -> np.ndarray:
    """The target's residual streams after `layers` over each sequence (one prefill from an empty
    state), concatenated: [N, T, len(layers) * D] float32."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(tokens):
        m = nnx.merge(graphdef, params)
        state = ling.init_state(m.cfg, tokens.shape[0], tokens.shape[1], m.embed_tokens[...].dtype)
        _, _, _, taps = m(tokens, state, form="prefill", logits=False, taps=layers)
        return jnp.concatenate(taps, axis=-1).astype(jnp.float32)

    return np.concatenate([np.asarray(run(jnp.asarray(seqs[i:i + batch]))) for i in range(0, len(seqs), batch)])


class DrafterTrainer:
    def __init__(self, target, cfg: dspark.DSparkConfig, *, lr: float, warmup: int, block: int, anchors: int,
                 prompt_len: int, decay: float, base_weight: float, conf_weight: float, seed: int,
                 weight_decay: float = 0.01):
        self.cfg, self.block, self.anchors, self.prompt_len = cfg, block, anchors, prompt_len
        drafter = dspark.DSparkDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
        self.graphdef, self.params = nnx.split(drafter)
        t_graph, t_params = nnx.split(target)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95),
                              optax.add_decayed_weights(weight_decay))
        self.opt_state = self.tx.init(self.params)
        weights = jnp.exp(-jnp.arange(block, dtype=jnp.float32) / decay)
        d = cfg.hidden_size

        def losses(params, taps, tokens, anchors_):
            """taps [b, T, k*D], tokens [b, T], anchors_ [b, A] -> (loss, metrics)."""
            drafter = nnx.merge(self.graphdef, params)
            tgt = nnx.merge(t_graph, t_params)
            k = taps.shape[-1] // d
            tap_list = [taps[..., i * d:(i + 1) * d] for i in range(k)]
            h = drafter.train_blocks(tgt.embed, tap_list, anchors_, jnp.take_along_axis(tokens, anchors_, 1), block)
            idx = anchors_[:, :, None] + jnp.arange(block + 1)[None, None]  # token_n .. token_{n+B}
            blk = jnp.take_along_axis(tokens[:, None], idx, axis=2)  # [b, A, B+1]
            prev, labels = blk[..., :-1], blk[..., 1:]
            base = tgt.logits(h)  # [b, A, B, V]
            final = base + drafter.markov_bias(h, prev)

            def ce(logits):
                lse = jax.nn.logsumexp(logits, axis=-1)
                return lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]  # [b, A, B]

            w = weights / weights.sum()
            main, base_ce = jnp.mean(jnp.sum(ce(final) * w, -1)), jnp.mean(jnp.sum(ce(base) * w, -1))
            hit = (jnp.argmax(final, axis=-1) == labels).astype(jnp.float32)
            z = drafter.confidence_logit(jax.lax.stop_gradient(h), prev)
            bce = jnp.mean(optax.sigmoid_binary_cross_entropy(z, jax.lax.stop_gradient(hit)))
            # Greedy accepted drafts of each block (teacher forced), the figure that matters.
            accepted = jnp.mean(jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1))
            conf_err = jnp.mean(jnp.abs(jnp.mean(jax.nn.sigmoid(z), (0, 1)) - jnp.mean(hit, (0, 1))))
            loss = main + base_weight * base_ce + conf_weight * bce
            return loss, {"loss": main, "base_loss": base_ce, "conf_bce": bce, "accepted": accepted,
                          "conf_calibration_err": conf_err, "conf_logit": z, "hit": hit}

        def train_step(params, opt_state, taps, tokens, anchors_, step, total):
            (_, metrics), grads = jax.value_and_grad(losses, has_aux=True)(params, taps, tokens, anchors_)
            metrics = {k: v for k, v in metrics.items() if v.ndim == 0}
            updates, opt_state = self.tx.update(grads, opt_state, params)
            rate = lr_at(step, total, peak=lr, warmup=warmup)
            params = jax.tree.map(lambda p, u: p - rate * u, params, updates)
            return params, opt_state, {**metrics, "lr": rate}

        self._step = jax.jit(train_step, donate_argnums=(0, 1))
        self._eval = jax.jit(lambda p, t, x, a: losses(p, t, x, a)[1])

    def anchors_for(self, r: np.random.Generator, n: int, t: int) -> np.ndarray:
        """Block anchors n with every label in the greedy continuation: n in [P - 1, T - B - 1]."""
        return np.sort(r.integers(self.prompt_len - 1, t - self.block, (n, self.anchors)), axis=1).astype(np.int32)

    def step(self, taps, tokens, anchors_, step: int, total: int) -> dict:
        self.params, self.opt_state, m = self._step(self.params, self.opt_state, jnp.asarray(taps),
                                                    jnp.asarray(tokens), jnp.asarray(anchors_), jnp.int32(step),
                                                    jnp.int32(total))
        return m

    def evaluate(self, taps, tokens, anchors_) -> dict:
        out = jax.device_get(self._eval(self.params, jnp.asarray(taps), jnp.asarray(tokens), jnp.asarray(anchors_)))
        return {k: float(v) for k, v in out.items() if np.ndim(v) == 0}

    def calibrate(self, taps, tokens, anchors_) -> dict:
        """Temperature scaling of the confidence head on held-back blocks: the scale a and shift b
        of its logit minimising the binary cross-entropy there, folded into its weights (the
        drafter overfits its few training sequences, so its raw confidence runs high elsewhere)."""
        out = jax.device_get(self._eval(self.params, jnp.asarray(taps), jnp.asarray(tokens), jnp.asarray(anchors_)))
        z, hit = np.asarray(out["conf_logit"], np.float64).ravel(), np.asarray(out["hit"], np.float64).ravel()

        def bce(a, b):
            x = a * z + b
            return float(np.mean(np.logaddexp(0, x) - hit * x))

        grid = [(a, b) for a in np.linspace(0.05, 2.0, 40) for b in np.linspace(-4, 2, 61)]
        a, b = min(grid, key=lambda ab: bce(*ab))
        before = bce(1.0, 0.0)
        drafter = self.drafter()
        drafter.conf_w.set_value(drafter.conf_w[...] * a)
        drafter.conf_b.set_value(drafter.conf_b[...] * a + b)
        self.params = nnx.split(drafter)[1]
        return {"scale": float(a), "shift": float(b), "bce_before": before, "bce_after": bce(a, b)}

    def drafter(self) -> dspark.DSparkDrafter:
        return nnx.merge(self.graphdef, self.params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offline.train_dspark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="serve/default_model", help="the frozen target (a checkpoint directory)")
    ap.add_argument("--out", default=None, help="where the drafter is written (default: --model)")
    ap.add_argument("--block", type=int, default=16, help="block size B trained (blocks <= B run at decode)")
    ap.add_argument("--feature-layers", default=None, help="target layers feeding the drafter (default: three "
                    "spread over the stack, the last included)")
    ap.add_argument("--num-layers", type=int, default=2, help="backbone layers")
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=512, help="prompts to continue (fewer if the budget ends)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=192, help="greedy tokens generated per prompt")
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--prompt-source", default="site-packages", choices=["site-packages", "stdlib-train"],
                    help="where the prompts come from (corpus_prompts; default site-packages: code the target "
                    "never trained on, like its held-out files)")
    ap.add_argument("--max-train-bytes", type=int, default=3_000_000, help="text the prompts are cut from")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=8, help="blocks per sequence per step")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--decay", type=float, default=8.0, help="position weight exp(-j / decay)")
    ap.add_argument("--base-weight", type=float, default=0.3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--conf-weight", type=float, default=0.2)
    ap.add_argument("--time-budget", type=float, default=900.0, help="seconds for generation and training "
                    "(0: none)")
    ap.add_argument("--gen-fraction", type=float, default=0.35, help="share of the budget generation may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default=None, help="an .npz keeping the generated sequences and the target's "
                    "features (fp16): written on the first run, read by later runs with the same data settings")
    args = ap.parse_args(argv)
    cpu_deadlock_workaround()
    t0 = time.perf_counter()
    budget = args.time_budget or math.inf
    out = args.out or args.model

    # The target in fp32: XLA:CPU cannot run the absorbed MLA reference's batched bf16 dot.
    target = ling.load(args.model, dtype="float32", progress=False)
    layers = (tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers
              else dspark.default_config(target.cfg).feature_layers)
    cfg = dspark.default_config(target.cfg, block_size=args.block, num_layers=args.num_layers,
                                intermediate_size=args.intermediate_size, markov_rank=args.markov_rank)
    cfg = dataclasses.replace(cfg, feature_layers=layers)
    prompts = corpus_prompts(args.model, args.prompts + 32, args.prompt_len, args.seed, args.max_train_bytes,
                             args.prompt_source)
    print(f"target {args.model}: {target.cfg.num_hidden_layers} layers; features from layers {layers}; "
          f"{len(prompts)} prompts of {args.prompt_len} tokens from {args.prompt_source} "
          f"({time.perf_counter() - t0:.0f} s)",
          flush=True)
    key = (args.model, args.prompt_source, args.prompts, args.prompt_len, args.new_tokens, args.seed,
           args.max_train_bytes, layers)
    if args.data_cache and os.path.exists(args.data_cache):
        z = np.load(args.data_cache, allow_pickle=False)
        if str(z["key"]) != repr(key):
            raise SystemExit(f"--data-cache {args.data_cache} was made with other settings ({z['key']})")
        seqs, taps, val_seqs, val_taps = z["seqs"], z["taps"], z["val_seqs"], z["val_taps"]
        print(f"data from {args.data_cache}", flush=True)
    else:
        val_seqs = greedy_sequences(target, prompts[:32], args.new_tokens, 32, math.inf)
        seqs = greedy_sequences(target, prompts[32:], args.new_tokens, args.gen_batch,
                                t0 + args.gen_fraction * budget)
        taps = target_taps(target, seqs, layers, 32)
        val_taps = target_taps(target, val_seqs, layers, 32)
        if args.data_cache:
            np.savez(args.data_cache, key=repr(key), seqs=seqs, taps=taps.astype(np.float16), val_seqs=val_seqs,
                     val_taps=val_taps.astype(np.float16))
    taps, val_taps = taps.astype(np.float32), val_taps.astype(np.float32)
    t_gen = time.perf_counter() - t0
    n_tok = seqs.shape[0] * args.new_tokens
    print(f"{len(seqs)} sequences of {seqs.shape[1]} tokens ({n_tok} generated); data ready in {t_gen:.0f} s; taps "
          f"{taps.nbytes / 1e6:.0f} MB ({time.perf_counter() - t0:.0f} s)", flush=True)

    tr = DrafterTrainer(target, cfg, lr=args.lr, warmup=args.warmup, block=args.block, anchors=args.anchors,
                        prompt_len=args.prompt_len, decay=args.decay, base_weight=args.base_weight,
                        conf_weight=args.conf_weight, seed=args.seed, weight_decay=args.weight_decay)
    n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(nnx.split(tr.drafter(), nnx.Param)[1]))
    print(f"drafter: {n_params / 1e6:.2f} M parameters ({cfg})", flush=True)
    r = np.random.default_rng(args.seed + 1)
    val_anchors = tr.anchors_for(np.random.default_rng(7), len(val_seqs), val_seqs.shape[1])
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "dspark_train_log.jsonl"), "w")
    total, step, t_loop, t_calib, last = args.steps, 0, time.perf_counter(), None, {}
    best = {"accepted": -1.0, "step": 0, "params": None}
    while step < total:
        pick = r.integers(0, len(seqs), args.batch)
        m = tr.step(taps[pick], seqs[pick], tr.anchors_for(r, args.batch, seqs.shape[1]), step, total)
        step += 1
        if step == 5:
            jax.block_until_ready(m)
            t_calib = time.perf_counter()
        if budget < math.inf and t_calib is not None and (step == 25 or step % 100 == 0):
            # Refitted as it goes (a shared machine's step time drifts), so the schedule ends in time.
            jax.block_until_ready(m)
            per_step = (time.perf_counter() - t_calib) / (step - 5)
            fit = min(args.steps, step + int(0.95 * (t0 + budget - time.perf_counter() - 30) / per_step))
            if fit != total:
                total = max(fit, step + 1)
                print(f"time budget: {per_step * 1e3:.0f} ms/step -> {total} steps", flush=True)
        if step % 50 == 0 or step == total:
            last = {k: float(v) for k, v in jax.device_get(m).items()}
            val = tr.evaluate(val_taps, val_seqs, val_anchors)
            rec = {"step": step, **last, **{f"val_{k}": v for k, v in val.items()},
                   "elapsed_s": round(time.perf_counter() - t_loop, 1)}
            if val["accepted"] > best["accepted"]:  # kept: the held-back sequences' best, as offline.train keeps
                best.update(accepted=val["accepted"], step=step, params=jax.tree.map(jnp.copy, tr.params))
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"step {step}/{total}: loss {last['loss']:.3f} base {last['base_loss']:.3f} "
                  f"conf {last['conf_bce']:.3f} | val loss {val['loss']:.3f} accepted/block {val['accepted']:.2f} "
                  f"calib err "
                  f"{val['conf_calibration_err']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if time.perf_counter() - t0 > budget * 1.1:
            print("hard stop at the time budget", flush=True)
            break
    log.close()
    final = tr.evaluate(val_taps, val_seqs, val_anchors)["accepted"]
    if best["params"] is not None and best["accepted"] > final:
        tr.params = best["params"]
    calib = tr.calibrate(val_taps, val_seqs, val_anchors)
    print(f"confidence head calibrated on the held-back blocks: {calib}", flush=True)
    val = tr.evaluate(val_taps, val_seqs, val_anchors)
    meta = {"target": os.path.normpath(args.model), "steps": step,
            "kept_step": best["step"] if best["accepted"] > final else step, "sequences": int(len(seqs)),
            "generated_tokens": int(n_tok), "seconds": round(time.perf_counter() - t0, 1),
            "device": jax.devices()[0].device_kind, "n_params": n_params, "val": val, "calibration": calib,
            "command": "python -m offline.train_dspark " + " ".join(sys.argv[1:] if argv is None else argv)}
    dspark.save(tr.drafter(), out, meta=meta)
    size = os.path.getsize(os.path.join(out, dspark.WEIGHTS_FILE))
    print(f"wrote {out}/{dspark.WEIGHTS_FILE} ({size / 1e6:.1f} MB): {step} steps, val accepted/block "
          f"{val['accepted']:.2f} of {args.block} (teacher forced), {meta['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

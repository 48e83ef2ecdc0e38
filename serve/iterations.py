"""The iteration log (`python -m serve.run --iteration-log PATH`): one JSON line per decode step
whose tokens the engine read back, saying what ran with it, so that a latency tail can be traced to
the iterations that made it.

A step's tokens are read one iteration late (`serve.engine`), once the next piece of work is
queued; while the device is the bottleneck the time between two reads is the later step's
iteration on the device, which is what every running stream waits between deliveries. A line:

  t            seconds since the log opened, when the step's tokens were read
  gap_ms       since the previous read (null for the first): the iteration a stream felt
  host_ms      the engine call that dispatched the next work and read these tokens (the read's
               wait for the device included)
  decoding     slots the step advanced; decode_tokens: the rows they ran (slots x the step's width)
  chunk        prefill tokens dispatched in the step's iteration (valid tokens, all prompts)
  width        the chunk's width C (0: no chunk)
  prompts      prompts the chunk prefilled; ended: those whose last chunk it was
  mixed        whether the chunk and the step were one program (`Runner.mixable`)
  predicted_ms the tile model's iteration for that work (`moe.tiles.predicted_iteration_us`; null
               without `--tile-model`), over moe_layers MoE layers
  gc_ms        the process's garbage collections since the previous read (every thread stops for
               them); gc_full: how many of them were full (generation 2)

`summary(path, over_ms)` reads a log back: the iterations beyond a time, grouped by what ran in
them; `python -m serve.iterations PATH --over-ms MS` prints it. `refit(path, model)` fits the tile
model's iteration outside its MoE launches to the log's mixed iterations (`moe.tiles.fit_overhead`),
so that the chunk sizer predicts what the server measured; `python -m serve.iterations PATH --refit
MODEL --out NEW` writes it.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time

import numpy as np


class IterationLog:
    """Writes the log; `sizer` (a `moe.tiles.ChunkSizer`, or None) supplies the predictions."""

    def __init__(self, path: str, sizer=None, decode_width: int = 1):
        self._file = open(path, "w", buffering=1)  # one line a write: readable while the server runs
        self._sizer, self._width = sizer, decode_width
        self._pending: collections.deque = collections.deque()  # steps dispatched, tokens not read
        self._t0 = time.perf_counter()
        self._last: float | None = None
        self._gc_start, self._gc_s, self._gc_full = 0.0, 0.0, 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        """`gc.callbacks`: times each collection (any thread's; all wait for it)."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start
            self._gc_full += info["generation"] == 2

    def record(self, chunk, owners: list, *, mixed: bool, stepped: bool, read: bool, host_s: float) -> None:
        """After one `Runner.iterate(chunk, owners)` that took host_s: `read` whether it returned a
        step's tokens (those of the oldest step dispatched and not yet read), `stepped` whether it
        dispatched a step (mixed: one program with the chunk)."""
        if stepped:
            self._pending.append(self._describe(chunk, owners, mixed))
        if not read or not self._pending:
            return
        now = time.perf_counter() - self._t0
        line = self._pending.popleft()
        line.update(t=round(now, 4), gap_ms=None if self._last is None else round((now - self._last) * 1e3, 3),
                    host_ms=round(host_s * 1e3, 3), gc_ms=round(self._gc_s * 1e3, 3), gc_full=self._gc_full)
        self._gc_s, self._gc_full = 0.0, 0
        self._last = now
        self._file.write(json.dumps(line) + "\n")

    def _describe(self, chunk, owners: list, mixed: bool) -> dict:
        decoding = sum(r is not None for r in owners)
        if chunk is None:
            tokens = width = prompts = ended = 0
        else:
            valid = np.asarray(chunk.valid)
            tokens, width = int(valid.sum()), int(chunk.tokens.shape[1])
            prompts, ended = int((valid > 0).sum()), int(np.asarray(chunk.ends).sum())
        line = dict(decoding=decoding, decode_tokens=decoding * self._width, chunk=tokens, width=width,
                    prompts=prompts, ended=ended, mixed=bool(mixed and chunk is not None), predicted_ms=None,
                    moe_layers=None)
        if self._sizer is not None:
            from moe.tiles import predicted_iteration_us

            us = predicted_iteration_us(self._sizer.model, width, rows=max(prompts, 1), layers=self._sizer.layers,
                                        decode_tokens=decoding * self._width, mixed=line["mixed"],
                                        real_tokens=tokens if prompts else None)
            line.update(predicted_ms=round(us / 1e3, 3), moe_layers=self._sizer.layers)
        return line

    def forget(self) -> None:
        """The steps dispatched and not read will never be (the engine reset its slots after a
        failure): the next line describes the next step dispatched."""
        self._pending.clear()

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._file.close()


def summary(path: str, over_ms: float) -> dict:
    """The iterations of the log at `path` whose gap exceeded over_ms, grouped by what ran in them
    ("step", "mixed", "step + chunk", each "ending a prompt" where its chunk did): per group the
    count, and the mean gap and prediction; with the total of lines and the gaps' median and P99."""
    lines = [json.loads(s) for s in open(path) if s.strip()]
    gaps = np.array([x["gap_ms"] for x in lines if x["gap_ms"] is not None])
    groups: dict[str, list] = {}
    for x in lines:
        if x["gap_ms"] is None or x["gap_ms"] <= over_ms:
            continue
        kind = "step" if not x["chunk"] else "mixed" if x["mixed"] else "step + chunk"
        groups.setdefault(kind + (", ending a prompt" if x["ended"] else ""), []).append(x)
    predicted = lambda xs: [x["predicted_ms"] for x in xs if x["predicted_ms"] is not None]  # noqa: E731
    return {
        "iterations": len(lines),
        "median_ms": float(np.median(gaps)) if gaps.size else None,
        "p99_ms": float(np.percentile(gaps, 99)) if gaps.size else None,
        "over": {k: {"count": len(xs), "mean_gap_ms": float(np.mean([x["gap_ms"] for x in xs])),
                     "mean_predicted_ms": float(np.mean(predicted(xs))) if predicted(xs) else None,
                     "mean_gc_ms": float(np.mean([x.get("gc_ms", 0.0) for x in xs])),
                     "full_gc": sum(x.get("gc_full", 0) for x in xs)}
                 for k, xs in sorted(groups.items())},
        "gc_ms": float(sum(x.get("gc_ms", 0.0) for x in lines)),
        "full_gc": sum(x.get("gc_full", 0) for x in lines),
    }


def refit(path: str, model):
    """`model` (a `moe.tiles.TileModel`) with its step_overhead_us and chunk_us_per_token fitted
    to the mixed iterations of the log at `path` (each a point (decode_tokens, prompts x width,
    gap, chunk): the time a stream waited is the iteration's cost while the device is the
    bottleneck; the chunk's padding counts in the line, only its prompt tokens in the MoE).
    The log must come from a server with a tile model (its lines name the MoE layers). Returns
    (the fitted model, the points' count, their mean gap and the fitted model's mean prediction,
    both in ms). The model's info records the mean relative error on every fourth point of the
    log, predicted by the line fitted to the others (None under four points). ValueError when
    the log has no mixed iteration to fit."""
    from moe.tiles import fit_overhead, predicted_iteration_us

    lines = [json.loads(s) for s in open(path) if s.strip()]
    try:
        mixed = [x for x in lines if x["mixed"] and x["gap_ms"] is not None]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an iteration log (a line without {e})") from None
    if not mixed:
        raise ValueError(f"{path}: no mixed iteration with a gap to fit (serve with --mixed-iteration on, and a "
                         f"chunk beside running streams)")
    if any(x.get("moe_layers") is None or x.get("decode_tokens") is None for x in mixed):
        raise ValueError(f"{path}: the lines do not name the MoE layers and decode tokens (a log written without "
                         f"--tile-model, or by an older server)")
    layers = {x["moe_layers"] for x in mixed}
    if len(layers) != 1:
        raise ValueError(f"{path}: lines of models with different MoE layers {sorted(layers)}")
    layers = layers.pop()
    # the chunk's rows with their padding for the line, its prompt tokens for the MoE launches
    points = [(x["decode_tokens"], x["prompts"] * x["width"], x["gap_ms"] * 1e3, x["chunk"]) for x in mixed]
    predict = lambda m, x: predicted_iteration_us(m, x["width"], rows=x["prompts"], layers=layers,  # noqa: E731
                                                  decode_tokens=x["decode_tokens"], mixed=True,
                                                  real_tokens=x["chunk"]) / 1e3
    # held out: every fourth point, predicted by the line fitted to the other three
    held = [i for i in range(len(points)) if i % 4 == 3]
    err = None
    if held:
        part = fit_overhead(model, [p for i, p in enumerate(points) if i % 4 != 3], layers=layers)
        err = float(np.mean([abs(predict(part, mixed[i]) / mixed[i]["gap_ms"] - 1) for i in held]))
    fitted = fit_overhead(model, points, layers=layers, info=dict(step_overhead=dict(
        fitted_to=path, iterations=len(points), layers=layers, held_out=len(held), held_out_mean_rel_err=err)))
    predicted = [predict(fitted, x) for x in mixed]
    return fitted, len(points), float(np.mean([x["gap_ms"] for x in mixed])), float(np.mean(predicted))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serve.iterations", description="Reads an iteration log "
                                 "(python -m serve.run --iteration-log PATH): the iterations longer than --over-ms, "
                                 "grouped by what ran in them; with --refit, the tile model fitted to its mixed "
                                 "iterations.")
    ap.add_argument("path")
    ap.add_argument("--over-ms", type=float, help="list the iterations longer than this")
    ap.add_argument("--refit", metavar="MODEL", help="a tile model (serve.run --tile-model) to fit to the log's mixed "
                    "iterations; written to --out")
    ap.add_argument("--out", metavar="PATH", help="with --refit: where the fitted model goes")
    args = ap.parse_args(argv)
    if args.over_ms is None and args.refit is None:
        ap.error("give --over-ms MS, --refit MODEL --out PATH, or both")
    if (args.refit is None) != (args.out is None):
        ap.error("--refit and --out go together")
    if args.over_ms is not None:
        print(describe(summary(args.path, args.over_ms), args.over_ms))
    if args.refit is not None:
        from moe.tiles import TileModel

        try:
            fitted, n, gap, predicted = refit(args.path, TileModel.load(args.refit))
        except (OSError, ValueError) as e:
            raise SystemExit(f"python -m serve.iterations: {e}") from None
        fitted.save(args.out)
        err = fitted.info["step_overhead"]["held_out_mean_rel_err"]
        held = "" if err is None else f"; held out (every fourth), mean error {err:.1%}"
        print(f"{n} mixed iterations, mean {gap:.2f} ms; fitted: step_overhead_us {fitted.step_overhead_us:.0f} + "
              f"chunk_us_per_token {fitted.chunk_us_per_token:.2f} x chunk tokens (mean prediction {predicted:.2f} "
              f"ms{held}); written to {args.out}")


def describe(s: dict, over_ms: float) -> str:
    """`summary`'s result as lines of text."""
    if s["median_ms"] is None:
        return f"{s['iterations']} iterations: too few to time (the first read has no gap)"
    lines = [f"{s['iterations']} iterations; gap median {s['median_ms']:.2f} ms, P99 {s['p99_ms']:.2f} ms; "
             f"garbage collection {s['gc_ms']:.1f} ms in all ({s['full_gc']} full); over {over_ms:g} ms:"]
    for kind, g in s["over"].items():
        pred = "—" if g["mean_predicted_ms"] is None else f"{g['mean_predicted_ms']:.2f} ms"
        lines.append(f"  {kind}: {g['count']}, mean {g['mean_gap_ms']:.2f} ms (predicted {pred}; garbage "
                     f"collection {g['mean_gc_ms']:.2f} ms, {g['full_gc']} full)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

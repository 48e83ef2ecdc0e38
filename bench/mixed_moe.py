"""`bench/fused_moe.py --mixed` and `--profile-tiles`: one MoE layer with decode and prefill tokens.

--mixed. Ling's MoE (E 512, top-8, D 2560, I 768), 8 decode tokens (--decode) plus a prefill chunk of 512,
2048 and 8192 tokens, three ways:
  (a) union   one grouped launch over all tokens (grouped_gemm.grouped_moe: the large-M path);
              the decode rows are done when it is (its combine sums at the end)
  (b) split   fused_moe over the decode tokens, then grouped_moe over the prefill chunk, one jit;
              decode done = fused_moe alone (timed separately), total = both
  (c) tiles   expert_tiles.tile_moe: one persistent launch over the union, the blocks holding decode
              pairs (hot) claimed first; total timed like the others; decode done = total - post -
              (kernel span - decode span), the spans read from the kernel's %globaltimer stamps in a
              separate traced run (first program start to the last hot tile's end, which rounds the
              decode rows, and to the last tile's end); post = the prefill rows' rounding after the
              launch, timed alone. The cold tiles after the last hot tile and the rounding of their
              rows do not count as decode latency. Also the decode-only tile launch (the exclusive
              time), at the same plan and at the decode tokens' own (plan_for's), and the hot blocks'
              align span (to the last align tile claimed before the first GEMM tile).
              --tile-per-sm N,.., --tile-bm BM,.., --tile-bm-hot BM,.. and --tile-warps W,.. time
              (c) at each persistent grid size, block height, hot block height and warp count
              (default: the kernel's own); --prefills picks the chunk sizes. Each traced run's
              claim record and stamps go to $OUT/traces.npz.
--profile-tiles. The tile kernel at one plan (BM 64) over a grid of (decode, prefill) token
counts (with --tile-fmt int4 or int8: the served format, over a server iteration's shapes at the
server's plan, plan_for's BM 16 there); x_moe from each call's routing (hot and cold blocks, as the kernel aligns them); a least-squares
fit of moe/tiles.py's model t = alpha + beta x (s = 1) on two thirds of the shapes, its error on
the held-out third, the model written as JSON (--tile-model PATH, default $OUT/tile_model.json).

Timing as bench/fused_moe.py: one jit of R calls, each with its own random routing (distinct
experts per token, uniform), many dispatches queued, the difference of two counts divided out.
Every kernel is checked against grouped_moe (itself checked against grouped_gemm.reference at the
smallest chunk) on the same routing before it is timed. --smoke: CPU, interpret mode, tiny
shapes (no timing, no stamps: decode completion is shown as the claim ticket of the last decode
tile instead).
Parts: bench/mixed_common.py (the base: inputs, timer, kernels, plans, spans), bench/mixed_profile.py
(--profile-tiles and the fit); the table is here.
"""

from __future__ import annotations

import json
import os
import traceback

import numpy as np

from bench.mixed_common import K, Part
from bench.mixed_profile import ProfilePart


class Bench(Part, ProfilePart):
    # ------------------------------------------------------------------ --mixed
    def mixed(self):
        from pallas_kernels.grouped_gemm import reference

        prefills = (32, 64) if self.smoke else self.prefills
        md = self.decode
        for mp in prefills:
            if self.left() < 0:
                self.log(f"budget spent: --mixed stopped before prefill {mp}")
                break
            row = dict(decode=md, prefill=mp)
            self.results["mixed"].append(row)
            try:
                r = 2
                x, ids, ws = self.routings(md, mp, r)
                plan = self.plan(mp)
                row["plan"] = str(plan)
                k = self.kernels(md, plan)
                row["union_us"], ys = self.timed(k["union"], x, ids, ws)
                base = ys[0]
                if mp == prefills[0] and mp <= 2048:  # the reference (ragged_dot) materialises every expert
                    w = self.weights()
                    row["union_err"] = self.check(base, reference(x, ids[0], ws[0], *w), "union vs reference")
                row["split_us"], ys = self.timed(k["split"], x, ids, ws)
                row["split_err"] = self.check(np.concatenate([np.asarray(a, np.float32) for a in ys[0]]),
                                              base, "split vs union")
                row["decode_us"], _ = self.timed(k["decode"], x, ids, ws)
                row["tiles"] = []
                post = self.post_us(md, mp)
                variants = ((n, bm, bh, nw) for bm in self.bms for bh in self.bm_hots for nw in self.warps
                            for n in self.per_sm)
                for n, bm, bh, nw in variants:
                    programs = self.sms * n  # (c) at each grid size, BM, hot BM and warps
                    tplan = self.plan(mp, bm or None, programs=programs, warps=nw or None, bm_hot=bh or None)
                    k = self.kernels(md, tplan)
                    c = dict(per_sm=n, bm=tplan.block_m, bm_hot=tplan.block_m_hot or tplan.block_m,
                             warps=tplan.num_warps)
                    row["tiles"].append(c)
                    c["tiles_us"], ys = self.timed(k["tiles"], x, ids, ws)
                    c["tiles_err"] = self.check(ys[0], base, f"tiles ({n} a SM) vs union")
                    c["tiles_decode_us"], _ = self.timed(k["tiles_decode"], x, ids, ws)
                    c["tiles_decode_own_us"], _ = self.timed(k["tiles_decode_own"], x, ids, ws)
                    traced_us, outs = self.timed(k["traced"], x, ids, ws)
                    spans = [self.spans(t, s, programs) for _, t, s in outs]
                    tag = f"{md}+{mp}_bm{tplan.block_m}_h{c['bm_hot']}_w{tplan.num_warps}_g{programs}"
                    self.raw[tag + "_trace"] = np.asarray(outs[0][1])
                    if outs[0][2] is not None:
                        self.raw[tag + "_stamps"] = np.asarray(outs[0][2])
                    if self.smoke:
                        c["decode_ticket"], c["tiles_claimed"], c["align_ticket"] = spans[0]
                    else:
                        dec, span, align = (float(np.mean([s[i] for s in spans])) for i in range(3))
                        c.update(traced_us=traced_us, decode_span_us=dec, kernel_span_us=span, align_span_us=align,
                                 post_us=post, tiles_decode_done_us=traced_us - post - (span - dec))
                        _, outs = self.timed(k["traced_decode"], x, ids, ws)  # the decode-only launch's span
                        c["decode_only_span_us"] = float(np.mean([self.spans(t, s, programs)[1] for _, t, s in outs]))
                    self.log(f"  tiles, {n} program(s) a SM: " + ", ".join(
                        f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in c.items()))
                row["x_moe"] = self.x_moe(ids, md, plan)
                self.log(f"mixed {md}+{mp}: " + ", ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}"
                                                          for a, b in row.items() if a not in ("plan", "tiles")))
            except Exception as e:
                self.log(f"FAILED mixed {md}+{mp}: {e!r}")
                self.results["errors"].append(f"mixed {md}+{mp}: " + traceback.format_exc(limit=6)[-2000:])

    # ------------------------------------------------------------------ report
    def table(self):
        lines = ["", f"mixed decode + prefill MoE, E={self.e} top-{K} D={self.d} I={self.i}, on "
                      f"{self.results['device']}"]
        if self.results["mixed"]:
            lines.append("decode+prefill  x_moe   (a) union µs | (b) split: decode done / total µs | "
                         "(c) tiles: decode done / total µs (decode-only tiles µs)")
            for r in self.results["mixed"]:
                if not r.get("tiles"):
                    lines.append(f"{r['decode']}+{r['prefill']}  (failed)")
                    continue
                for c in r["tiles"]:
                    if self.smoke:
                        done = f"ticket {c.get('decode_ticket')}/{c.get('tiles_claimed')}"
                    else:
                        done = f"{c.get('tiles_decode_done_us', float('nan')):8.1f}"
                    ratios = "" if self.smoke else (
                        f": decode done / decode-only {c['tiles_decode_done_us'] / c['tiles_decode_us']:.2f} "
                        f"(own plan {c['tiles_decode_done_us'] / c['tiles_decode_own_us']:.2f}; spans "
                        f"{c['decode_span_us']:.1f} / {c['decode_only_span_us']:.1f} = "
                        f"{c['decode_span_us'] / c['decode_only_span_us']:.2f}), "
                        f"total / (a) {c['tiles_us'] / r['union_us']:.2f}, align {c['align_span_us']:.1f} µs")
                    lines.append(f"{r['decode']:3}+{r['prefill']:<6} {r['x_moe']:7.1f} {r['union_us']:12.1f} | "
                                 f"{r['decode_us']:10.1f} / {r['split_us']:8.1f} | {done} / {c['tiles_us']:8.1f} "
                                 f"({c['tiles_decode_us']:.1f}), {c['per_sm']} a SM, BM {c['bm']} (hot {c['bm_hot']}), "
                                 f"{c['warps']} warps{ratios}")
            lines.append("(a) decode done = total. (c) decode done = total - rounding after the launch - "
                         "(kernel span - decode span), spans from %globaltimer stamps; decode-only: the "
                         "tile launch over the decode tokens alone at the same plan (own plan: plan_for's); "
                         "spans: the decode span over the decode-only launch's kernel span (one clock, no "
                         "host timing)")
        if self.results["profile"]:
            lines.append("profile (%s, BM %d): decode+prefill  x_moe  µs  predicted  err" %
                         (self.results["profile"][0]["launch"], self.results["profile"][0]["block_m"]))
            for r in self.results["profile"]:
                lines.append(f"  {r['decode']:3}+{r['prefill']:<6} {r['x_moe']:8.1f} {r['us']:9.1f} "
                             f"{r.get('pred_us', float('nan')):9.1f} {100 * r.get('err', float('nan')):+6.1f}%"
                             f"{'  held out' if r['held_out'] else ''}")
            if "fit" in self.results:
                f = self.results["fit"]
                lines.append(f"fit: t = {f['alpha']:.2f} + {f['beta']:.4f} * x_moe µs -> {f['path']}")
        for e in self.results["errors"]:
            lines.append("error: " + e.strip().splitlines()[-1])
        for line in lines:
            self.log(line)


def add_args(ap) -> None:
    """bench.fused_moe's flags for --mixed and --profile-tiles."""
    ap.add_argument("--mixed", action="store_true", help="decode + prefill tokens of one layer: one grouped "
                    "launch, two launches, the tile-scheduled kernel (bench/mixed_moe.py)")
    ap.add_argument("--profile-tiles", action="store_true", help="profile the tile kernel over (decode, prefill) "
                    "shapes and fit moe/tiles.py's latency model")
    ap.add_argument("--profile-launch", default="tiles", choices=("tiles", "grouped"),
                    help="--profile-tiles: the launch profiled and fitted: the tile-scheduled kernel, or the grouped "
                    "GEMM over the union of the tokens (serve.run's --mixed-moe)")
    ap.add_argument("--tile-model", metavar="PATH", help="--profile-tiles: where the fitted model goes "
                    "(default $OUT/tile_model.json)")
    ap.add_argument("--tile-fmt", default="bf16", choices=("bf16", "int4", "int8"),
                    help="--mixed / --profile-tiles: the experts' format; int4 and int8 profile the server's "
                    "shapes (16 slots' step beside a chunk) at the server's plan (plan_for's)")
    ap.add_argument("--tile-per-sm", help="--mixed: the tile kernel's persistent programs per SM (comma-separated: "
                    "each is timed; default expert_tiles.PROGRAMS_PER_SM)")
    ap.add_argument("--tile-bm", default="0", help="--mixed: the tile kernel's BM (comma-separated; 0: plan_for's)")
    ap.add_argument("--tile-warps", default="0",
                    help="--mixed: the tile kernel's warps (comma-separated; 0: plan_for's)")
    ap.add_argument("--tile-bm-hot", default="0",
                    help="--mixed: the tile kernel's hot-block BM (comma-separated; 0: plan_for's)")
    ap.add_argument("--decode", type=int, default=None, help="--mixed: decode tokens beside each chunk (default 8; "
                    "16 speculative slots of 5 drafts: 96)")
    ap.add_argument("--prefills", help="--mixed: prefill chunk sizes (comma-separated; default 512,2048,8192)")


def main(args, dims, out_dir, log):
    """Runs the requested modes, writes $OUT/tiles.json, prints the table last."""
    b = Bench(args, dims, out_dir, log)
    log("device:", b.results["device"], f"E={b.e} k={K} D={b.d} I={b.i}, {b.programs} programs")
    for flag, fn in (("mixed", b.mixed), ("profile_tiles", b.profile)):
        if getattr(args, flag):
            try:
                fn()
            except Exception:
                log(f"FAILED {flag}:", traceback.format_exc())
                b.results["errors"].append(f"{flag}: " + traceback.format_exc(limit=6)[-2000:])
    with open(os.path.join(out_dir, "tiles.json"), "w") as f:
        json.dump(b.results, f, indent=1, default=str)
    if b.raw:
        np.savez_compressed(os.path.join(out_dir, "traces.npz"), **b.raw)
    b.table()

"""`bench/fused_moe.py --mixed` and `--profile-tiles`: one MoE layer with decode and prefill tokens.

--mixed. Ling's MoE (E 512, top-8, D 2560, I 768), 8 decode tokens plus a prefill chunk of 512,
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
counts; x_moe from each call's routing (hot and cold blocks, as the kernel aligns them); a least-squares
fit of moe/tiles.py's model t = alpha + beta x (s = 1) on two thirds of the shapes, its error on
the held-out third, the model written as JSON (--tile-model PATH, default $OUT/tile_model.json).

Timing as bench/fused_moe.py: one jit of R calls, each with its own random routing (distinct
experts per token, uniform), many dispatches queued, the difference of two counts divided out.
Every kernel is checked against grouped_moe (itself checked against grouped_gemm.reference at the
smallest chunk) on the same routing before it is timed. --smoke: CPU, interpret mode, tiny
shapes (no timing, no stamps: decode completion is shown as the claim ticket of the last decode
tile instead).
"""

from __future__ import annotations

import json
import os
import time
import traceback

import numpy as np

from bench.common import queued_us

K = 8
DECODE = 8
PREFILLS = (512, 2048, 8192)
PROFILE = [(1, 0), (8, 0), (32, 0), (0, 512), (8, 512), (32, 512), (0, 2048), (8, 2048), (32, 2048),
           (8, 4096), (0, 8192), (8, 8192)]  # (decode, prefill); every third is held out
PROFILE_BM = 64


class Bench:
    def __init__(self, args, dims, out_dir, log):
        import jax

        self.args, self.log, self.out_dir = args, log, out_dir
        self.e, self.d, self.i = dims
        self.smoke = args.smoke
        self.backend = "interpret" if self.smoke else "pallas"
        self.key = jax.random.PRNGKey(1)
        self.deadline = time.time() + args.budget
        self.results = {"mixed": [], "profile": [], "errors": []}
        dev = jax.devices()[0]
        self.results["device"] = f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}"
        self.sms = 4 if self.smoke else (getattr(dev, "core_count", None) or 132)
        # (c) at each of these persistent grid sizes, in programs per SM (the first is the default)
        from pallas_kernels.expert_tiles import PROGRAMS_PER_SM

        self.per_sm = [int(v) for v in str(getattr(args, "tile_per_sm", None) or PROGRAMS_PER_SM).split(",")]
        self.programs = self.sms * self.per_sm[0]
        # ... and each of these BM (0: plan_for's), at the prefill sizes listed
        self.bms = [int(v) for v in str(getattr(args, "tile_bm", "0")).split(",")]
        self.warps = [int(v) for v in str(getattr(args, "tile_warps", None) or "0").split(",")]  # 0: the plan's
        self.bm_hots = [int(v) for v in str(getattr(args, "tile_bm_hot", None) or "0").split(",")]  # 0: the plan's
        self.raw = {}  # traced runs' records, for $OUT/traces.npz
        prefills = getattr(args, "prefills", None)
        self.prefills = [int(v) for v in prefills.split(",")] if prefills else list(PREFILLS)
        self._w = None

    # ------------------------------------------------------------------ inputs
    def weights(self):
        import jax
        import jax.numpy as jnp

        if self._w is None:
            k1, k2 = jax.random.split(self.key)
            self._w = (jax.random.normal(k1, (self.e, self.d, 2 * self.i), jnp.bfloat16) * 0.03,
                       jax.random.normal(k2, (self.e, self.i, self.d), jnp.bfloat16) * 0.05)
        return self._w

    def routings(self, md, mp, r, salt=0):
        """r random routings of md + mp tokens (decode first): x, [ids], [weights]."""
        import jax
        import jax.numpy as jnp

        m = md + mp
        key = jax.random.fold_in(self.key, 1000 * m + md + salt)
        x = jax.random.normal(key, (m, self.d), jnp.bfloat16)
        ids, ws = [], []
        for j in range(r):
            ka, kb = jax.random.split(jax.random.fold_in(key, j + 1))
            ids.append(jax.lax.top_k(jax.random.uniform(ka, (m, self.e)), K)[1].astype(jnp.int32))
            ws.append(jax.random.uniform(kb, (m, K), jnp.float32) / K + 0.05)
        return x, ids, ws

    # ------------------------------------------------------------------ timing
    def timed(self, fn, x, ids, ws):
        """(µs per call, outputs of the first dispatch): one jit of R calls, dispatched n times."""
        import jax

        r = len(ids)
        w = self.weights()
        f = jax.jit(lambda w, x, ids, ws: [fn(x, ids[j], ws[j], w) for j in range(r)])
        outs = jax.block_until_ready(f(w, x, ids, ws))
        if self.smoke:
            return 0.0, outs
        return queued_us(f, w, x, ids, ws, hi=8, lo=2) / r, outs

    def once(self, fn, x, ids, ws):
        import jax

        return jax.jit(fn)(x, ids, ws, self.weights())

    def check(self, y, ref, what):
        """Relative (Frobenius) error of y against ref; raises beyond 1e-2."""
        import jax.numpy as jnp

        y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        if not err < 1e-2:
            raise AssertionError(f"{what}: rel err {err:.2e}")
        return err

    def left(self):
        return self.deadline - time.time()

    # ------------------------------------------------------------------ kernels
    def kernels(self, md, plan):
        from pallas_kernels import expert_tiles as et
        from pallas_kernels.fused_moe import fused_moe
        from pallas_kernels.grouped_gemm import grouped_moe

        b = self.backend
        union = lambda x, i, s, w: grouped_moe(x, i, s, *w, backend=b)  # noqa: E731

        def split(x, i, s, w):
            yd = fused_moe(x[:md], i[:md], s[:md], *w, backend=b)
            yp = grouped_moe(x[md:], i[md:], s[md:], *w, backend=b)
            return yd, yp

        decode = lambda x, i, s, w: fused_moe(x[:md], i[:md], s[:md], *w, backend=b)  # noqa: E731
        tiles = lambda x, i, s, w: et.tile_moe(x, i, s, *w, n_decode=md, backend=b, plan=plan)  # noqa: E731
        tiles_decode = lambda x, i, s, w: et.tile_moe(x[:md], i[:md], s[:md], *w, n_decode=md, backend=b,  # noqa: E731
                                                      plan=plan)
        tiles_decode_own = lambda x, i, s, w: et.tile_moe(x[:md], i[:md], s[:md], *w, n_decode=md,  # noqa: E731
                                                          backend=b, plan=self.plan(0, programs=plan.programs))

        def traced(x, i, s, w, n=None):
            n = x.shape[0] if n is None else n  # tokens: the union, or the decode tokens alone
            run = et._run(x[:n], i[:n], s[:n], *w, n_decode=md, swiglu_limit=None, backend=b, plan=plan,
                          trace=True, stamps=not self.smoke)
            return run.y, run.trace, run.stamps

        traced_decode = lambda x, i, s, w: traced(x, i, s, w, md)  # noqa: E731

        return dict(union=union, split=split, decode=decode, tiles=tiles, tiles_decode=tiles_decode,
                    tiles_decode_own=tiles_decode_own, traced=traced, traced_decode=traced_decode)

    def plan(self, mp, bm=None, programs=None, warps=None, bm_hot=None):
        import dataclasses

        from pallas_kernels import expert_tiles as et

        p = et.plan_for((DECODE + mp) * K, self.e, False)
        bm = bm or p.block_m
        hot = bm_hot or p.block_m_hot
        return dataclasses.replace(p, block_m=bm, num_warps=warps or p.num_warps, programs=programs or self.programs,
                                   block_m_hot=min(hot, bm) if hot else None)

    def post_us(self, md, mp):
        """µs of the work after the tile launch: the prefill rows of y32 rounded to bf16 (in the
        kernel's y in place; timed here as fresh arrays: the same bytes). Eight in one jit, so
        that the GPU, not the host's dispatch of a ~20 µs call, sets the time."""
        import jax
        import jax.numpy as jnp

        from pallas_kernels.expert_tiles import ZERO_ROWS

        if self.smoke or mp == 0:
            return 0.0
        y32 = jnp.zeros((-(-(md + mp + 1) // ZERO_ROWS) * ZERO_ROWS, self.d), jnp.float32)
        f = jax.jit(lambda a: [(a[md:md + mp] + j).astype(jnp.bfloat16) for j in range(8)])
        jax.block_until_ready(f(y32))
        return queued_us(f, y32, hi=8, lo=2) / 8

    @staticmethod
    def spans(trace, stamps, programs):
        """(decode span, kernel span, align span) in µs from one traced call, or tickets (smoke): the
        last hot tile's finish ticket + 1, the tile count and the last align tile's ticket + 1. The
        align is the hot blocks': its tiles claimed before the first GEMM tile (with two align
        phases, the prefill pairs' align comes after the hot tiles)."""
        trace = np.asarray(trace)
        claimed = trace[trace[:, 0] >= 0]
        gemm = np.flatnonzero(claimed[:, 0] < 4)
        first = gemm[0] if len(gemm) else len(claimed)
        decode, align = claimed[:, 0] < 2, (claimed[:, 0] == 5) & (np.arange(len(claimed)) < first)
        if stamps is None:
            last = int(claimed[decode, 4].max()) + 1 if decode.any() else 0
            return last, len(claimed), int(claimed[align, 4].max()) + 1
        st = np.asarray(stamps).view(np.uint32)
        start = st[:programs].min()
        ends = (st[programs:programs + len(trace)][trace[:, 0] >= 0] - start).astype(np.uint32)  # mod 2^32
        dec = float(ends[decode].max()) if decode.any() else 0.0
        return dec / 1e3, float(ends.max()) / 1e3, float(ends[align].max()) / 1e3

    # ------------------------------------------------------------------ --mixed
    def mixed(self):
        from pallas_kernels.grouped_gemm import reference

        prefills = (32, 64) if self.smoke else self.prefills
        md = DECODE
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

    def x_moe(self, ids, md, plan):
        """Mean x_moe over the routings: the tile kernel's hot and cold blocks."""
        from moe.tiles import x_moe_tile_kernel

        return float(np.mean([x_moe_tile_kernel(np.asarray(i), md, self.e, plan.block_m, plan.block_m_hot)
                              for i in ids]))

    # ------------------------------------------------------------------ --profile-tiles
    def profile(self):
        from moe.tiles import LatencyFit, TileModel

        shapes = [(1, 0), (2, 16), (0, 32), (4, 64)] if self.smoke else PROFILE
        for n, (md, mp) in enumerate(shapes):
            if self.left() < 0:
                self.log(f"budget spent: --profile-tiles stopped before {md}+{mp}")
                break
            try:
                x, ids, ws = self.routings(md, mp, 2 if mp > 1024 else 3, salt=7)
                bm = PROFILE_BM if not self.smoke else 16
                plan = self.plan(mp, bm, bm_hot=bm)
                k = self.kernels(md, plan)
                us, ys = self.timed(k["tiles"], x, ids, ws)
                if n == 0 or mp >= 2048:  # spot checks against the union launch
                    self.check(ys[0], self.once(k["union"], x, ids[0], ws[0]), f"tiles {md}+{mp} vs union")
                row = dict(decode=md, prefill=mp, x_moe=self.x_moe(ids, md, plan), us=us,
                           held_out=n % 3 == 2, block_m=plan.block_m)
                self.results["profile"].append(row)
                self.log(f"profile {md}+{mp}: x_moe {row['x_moe']:.1f}, {us:.1f} µs")
            except Exception as e:
                self.log(f"FAILED profile {md}+{mp}: {e!r}")
                self.results["errors"].append(f"profile {md}+{mp}: " + traceback.format_exc(limit=6)[-2000:])
        rows = self.results["profile"]
        train = [r for r in rows if not r["held_out"]]
        if self.smoke:  # no times on CPU: fit the shape of the pipeline on a synthetic time
            for r in rows:
                r["us"] = 10.0 + 0.5 * r["x_moe"]
        if len({r["x_moe"] for r in train}) < 2:
            self.log("profile: too few shapes measured to fit")
            return
        fit = LatencyFit.fit([r["x_moe"] for r in train], [r["us"] for r in train])
        for r in rows:
            r["pred_us"] = fit(r["x_moe"])
            r["err"] = r["pred_us"] / r["us"] - 1
        held = [abs(r["err"]) for r in rows if r["held_out"]]
        info = dict(device=self.results["device"], kernel="pallas_kernels.expert_tiles.tile_moe (bf16)",
                    plan=str(self.plan(0, rows[0]["block_m"])), samples=rows,
                    held_out_max_rel_err=max(held) if held else None, date=time.strftime("%Y-%m-%d"),
                    synthetic=self.smoke)
        model = TileModel(fit, rows[0]["block_m"], self.e, K, 0.0, info)
        path = self.args.tile_model or os.path.join(self.out_dir, "tile_model.json")
        model.save(path)
        self.results["fit"] = dict(path=path, **{c: getattr(fit, c) for c in ("alpha", "beta")})
        self.log(f"profile: t = {fit.alpha:.2f} + {fit.beta:.4f} x µs, held-out max |rel err| "
                 f"{max(held) if held else float('nan'):.3f}; written to {path}")

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
            lines.append("profile (tiles, BM %d): decode+prefill  x_moe  µs  predicted  err" %
                         self.results["profile"][0]["block_m"])
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

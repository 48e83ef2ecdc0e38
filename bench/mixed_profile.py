"""bench.mixed_moe --profile-tiles: the tile kernel at one plan (BM 64; the server's plan with
--tile-fmt int4|int8) over a grid of (decode, prefill) token counts, or with --profile-launch
grouped the grouped GEMM over their union (the server's `--mixed-moe grouped`), timed as the mixed
runs (one jit of R routings, queued dispatches); x_moe from each call's routing (the tile kernel's
hot and cold blocks; the grouped GEMM's blocks of its plan's BM); spot checks of the tile kernel
against the union launch; a least-squares fit of
moe/tiles.py's model t = alpha + beta x on two thirds of the shapes, its error on the held-out
third, the model written as JSON (--tile-model PATH, default $OUT/tile_model.json). --smoke: a
synthetic time, to run the fit's pipeline.
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

from bench.mixed_common import K, PROFILE, PROFILE_BM, PROFILE_SERVED


class ProfilePart:
    def profile(self):
        from moe.tiles import LatencyFit, TileModel

        from moe.tiles import x_moe_of_ids
        from pallas_kernels import grouped_gemm

        served = self.fmt != "bf16"  # the server's format: its shapes and plan (plan_for's)
        grouped = self.args.profile_launch == "grouped"
        smoke = [(1, 0), (2, 8), (0, 16), (4, 16)] if served else [(1, 0), (2, 16), (0, 32), (4, 64)]
        shapes = smoke if self.smoke else PROFILE_SERVED if served else PROFILE
        for n, (md, mp) in enumerate(shapes):
            if self.left() < 0:
                self.log(f"budget spent: --profile-tiles stopped before {md}+{mp}")
                break
            try:
                x, ids, ws = self.routings(md, mp, 2 if mp > 1024 else 3, salt=7)
                if served:
                    plan = self.served_plan(md + mp)
                else:
                    bm = PROFILE_BM if not self.smoke else 16
                    plan = self.plan(mp, bm, bm_hot=bm)
                k = self.kernels(md, plan)
                if grouped:  # its own plan (grouped_gemm.plan_for's): x_moe counts its blocks
                    bm = grouped_gemm.plan_for((md + mp) * K, self.e, self.fmt != "bf16").block_m
                    us, _ = self.timed(k["union"], x, ids, ws)
                    x_moe = float(np.mean([x_moe_of_ids(i, self.e, bm) for i in ids]))
                    block = dict(block_m=bm, block_m_hot=None)
                else:
                    us, ys = self.timed(k["tiles"], x, ids, ws)
                    if n == 0 or mp >= 2048:  # spot checks against the union launch
                        self.check(ys[0], self.once(k["union"], x, ids[0], ws[0]), f"tiles {md}+{mp} vs union")
                    x_moe = self.x_moe(ids, md, plan)
                    block = dict(block_m=plan.block_m, block_m_hot=plan.block_m_hot)
                row = dict(decode=md, prefill=mp, x_moe=x_moe, us=us, held_out=n % 3 == 2,
                           launch=self.args.profile_launch, **block)
                self.results["profile"].append(row)
                self.log(f"profile {md}+{mp}: x_moe {row['x_moe']:.1f}, {us:.1f} µs")
            except Exception as e:
                self.log(f"FAILED profile {md}+{mp}: {e!r}")
                self.results["errors"].append(f"profile {md}+{mp}: " + traceback.format_exc(limit=6)[-2000:])
        rows = self.results["profile"]
        if len({(r["block_m"], r["block_m_hot"]) for r in rows}) > 1:
            self.log("profile: the shapes ran at several block heights; the model takes one")
            return
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
        m = rows[0]["decode"] + rows[0]["prefill"]
        if grouped:
            plan = grouped_gemm.plan_for(m * K, self.e, self.fmt != "bf16")
            kernel = f"pallas_kernels.grouped_gemm.grouped_moe ({self.fmt})"
        else:
            plan = self.served_plan(m) if served else self.plan(0, rows[0]["block_m"])
            kernel = f"pallas_kernels.expert_tiles.tile_moe ({self.fmt})"
        info = dict(device=self.results["device"], kernel=kernel, launch=self.args.profile_launch,
                    plan=str(plan), samples=rows,
                    held_out_max_rel_err=max(held) if held else None, date=time.strftime("%Y-%m-%d"),
                    synthetic=self.smoke)
        model = TileModel(fit, rows[0]["block_m"], self.e, K, info=info)
        path = self.args.tile_model or os.path.join(self.out_dir, "tile_model.json")
        model.save(path)
        self.results["fit"] = dict(path=path, **{c: getattr(fit, c) for c in ("alpha", "beta")})
        self.log(f"profile: t = {fit.alpha:.2f} + {fit.beta:.4f} x µs, held-out max |rel err| "
                 f"{max(held) if held else float('nan'):.3f}; written to {path}")

"""What bench.mixed_moe's parts share (`python -m bench.fused_moe --mixed / --profile-tiles`): Ling's
MoE shapes (top-K, the decode tokens, the prefill chunks, the profile grid), the parts' base: random
bf16 experts and routings (distinct experts per token, uniform), the timer (one jit of R calls, each
with its own routing, many dispatches queued, the difference of two counts divided out), the check
against the union launch (relative Frobenius error, 1e-2), the kernels (union, split, tiles and the
traced tile launch), the tile plans, the rounding after the launch, the spans from the kernel's
%globaltimer stamps and x_moe.
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import queued_us

K = 8
DECODE = 8
PREFILLS = (512, 2048, 8192)
PROFILE = [(1, 0), (8, 0), (32, 0), (0, 512), (8, 512), (32, 512), (0, 2048), (8, 2048), (32, 2048),
           (8, 4096), (0, 8192), (8, 8192)]  # (decode, prefill); every third is held out
PROFILE_BM = 64
# --tile-fmt int4|int8: the shapes a server iteration has (16 slots stepping 1 or 6 tokens each beside
# a chunk of one prompt), where plan_for picks BM 16; the plan is the server's (plan_for's). Ordered
# so that a budget that stops early still spans them; every third is held out.
PROFILE_SERVED = [(96, 0), (96, 128), (0, 256), (96, 256), (16, 64), (0, 512), (96, 512), (16, 0), (96, 64),
                  (0, 128), (16, 256), (0, 64), (16, 512), (96, 1024), (16, 128)]


class Part:
    """The parts' base: shapes, inputs, the timer and check, the kernels, the plans, the spans."""

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
        self.fmt = getattr(args, "tile_fmt", None) or "bf16"  # the experts' format (bf16 | int4 | int8)
        self.decode = getattr(args, "decode", None) or DECODE  # --mixed: decode tokens beside each chunk
        self.group_size = 128

    # ------------------------------------------------------------------ inputs
    def weights(self):
        import jax
        import jax.numpy as jnp

        if self._w is None:
            k1, k2 = jax.random.split(self.key)
            w = (jax.random.normal(k1, (self.e, self.d, 2 * self.i), jnp.bfloat16) * 0.03,
                 jax.random.normal(k2, (self.e, self.i, self.d), jnp.bfloat16) * 0.05)
            if self.fmt != "bf16":  # the served format (ling.quantize's)
                from ling.quantize import EXPERT_BLOCK_N
                from pallas_kernels.experts import quantize_experts

                q = quantize_experts(*w, bits=int(self.fmt[3:]), group_size=self.group_size, block_n=EXPERT_BLOCK_N)
                w = (q.w13, q.w2)
            self._w = w
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
            run = et.run_tiles(x[:n], i[:n], s[:n], *w, n_decode=md, swiglu_limit=None, backend=b, plan=plan,
                          trace=True, stamps=not self.smoke)
            return run.y, run.trace, run.stamps

        traced_decode = lambda x, i, s, w: traced(x, i, s, w, md)  # noqa: E731

        return dict(union=union, split=split, decode=decode, tiles=tiles, tiles_decode=tiles_decode,
                    tiles_decode_own=tiles_decode_own, traced=traced, traced_decode=traced_decode)

    def plan(self, mp, bm=None, programs=None, warps=None, bm_hot=None):
        import dataclasses

        from pallas_kernels import expert_tiles as et

        p = et.plan_for((self.decode + mp) * K, self.e, self.fmt != "bf16")
        bm = bm or p.block_m
        hot = bm_hot or p.block_m_hot
        return dataclasses.replace(p, block_m=bm, num_warps=warps or p.num_warps, programs=programs or self.programs,
                                   block_m_hot=min(hot, bm) if hot else None)

    def served_plan(self, tokens):
        """The plan of the server's launch over `tokens` tokens (plan_for's), on this part's grid."""
        import dataclasses

        from pallas_kernels import expert_tiles as et

        return dataclasses.replace(et.plan_for(tokens * K, self.e, self.fmt != "bf16"), programs=self.programs)

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

    def x_moe(self, ids, md, plan):
        """Mean x_moe over the routings: the tile kernel's hot and cold blocks."""
        from moe.tiles import x_moe_tile_kernel

        return float(np.mean([x_moe_tile_kernel(np.asarray(i), md, self.e, plan.block_m, plan.block_m_hot)
                              for i in ids]))

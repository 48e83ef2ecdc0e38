"""bench.qmatvec's peers on the torch side: the copy ceiling (torch device-to-device copy, read +
write), cuBLAS (torch F.linear bf16) and gemlite 0.6 A16W4 (int4: its own autotune at M = 1, its
H100-tuned config of the nearest shape above), each under a CUDA graph over rotating weights."""

from __future__ import annotations

import ast
import json
import math
import os
import statistics
import time

from bench.common import time_torch_graph


def torch_part(shapes, ms, g, args, results: dict, log, n_calls) -> dict:
    """The torch side of bench.qmatvec: the device and the copy ceiling into results, then per shape
    (N, K) and M in ms {(N, K, M): (cuBLAS µs, gemlite µs or None)}; gemlite's int4 weights in groups
    of g. n_calls(bytes): the distinct weight buffers a timed batch rotates over."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    results["device"] = f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}"
    log("device:", results["device"])

    # Copy ceiling: 1 GiB device-to-device, bytes read + written.
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    copy_bw = 2 * a.numel() / statistics.median(ts) / 1e12
    results["copy_tbs"] = copy_bw
    log(f"copy ceiling: {copy_bw:.2f} TB/s (1 GiB device copy, read + write)")
    del a, b

    gemlite = None
    try:
        import gemlite as gl
        from gemlite.helper import A16Wn

        # M = 1 (GEMV_REVSPLITK): gemlite's own "fast" autotune (the seeded H100 configs of other
        # shapes were 10-30x off in a first run); M = 6: its H100-tuned config of the nearest shape.
        gl.set_autotune({"GEMV": "default", "GEMV_REVSPLITK": "fast", "GEMV_SPLITK": "default",
                         "GEMM_SPLITK": "default", "GEMM": "default"})
        cfg_path = os.path.join(os.path.dirname(gl.__file__), "configs", "h100.json")
        with open(cfg_path) as f:
            h100 = json.load(f)
        gemlite = (gl, A16Wn, h100)
        results["gemlite"] = gl.__version__
    except Exception as e:  # gemlite missing: its columns read n/a
        log("gemlite unavailable:", repr(e))

    def seed_gemlite_config(h100, m, n, k):
        """Copy the H100-tuned config of the nearest (N, K) for gemlite's kernel choice at M."""
        import gemlite.core as gc

        from gemlite.triton_kernels.utils import get_closest_m

        mtype = gc.get_matmul_type(m, 4)
        mm = get_closest_m(m)
        key = str((mm, n, k, g, 8, 104))
        table = h100.get(mtype, {})
        best, best_d = None, None
        for kk, v in table.items():
            t = ast.literal_eval(kk)  # keys are tuple literals written by gemlite
            if t[0] != mm or t[3] != g or t[4] != 8 or t[5] != 104:
                continue
            d = abs(math.log(t[1] / n)) + abs(math.log(t[2] / k))
            if best_d is None or d < best_d:
                best, best_d = (kk, v), d
        if best is not None:
            gc.GEMLITE_TRITON_CONFIG_CACHE.setdefault(mtype, {})[key] = best[1]
        return mtype, None if best is None else best[0]

    out = {}
    gemlite_tuning_s = 0.0
    # lm_head and the fused KDA projection first: gemlite's M = 1 autotune is time-limited.
    order = sorted(shapes, key=lambda s: -s[0] if s[0] in (157184, 20480) else 0)
    for n, k in order:
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            nb = n * k * 2
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(n_calls(nb))]
            outs = [None] * len(ws)

            def mk(i):
                def f():
                    outs[i] = F.linear(x, ws[i])
                return f

            t_cublas = time_torch_graph([mk(i) for i in range(len(ws))])
            ref = F.linear(x.float(), ws[0].float())
            err = (F.linear(x, ws[0]).float() - ref).norm() / ref.norm()
            log(f"cuBLAS bf16 {n}x{k} M={m}: {t_cublas:.2f} µs ({nb / t_cublas / 1e6:.2f} TB/s), "
                f"rel err {err:.1e}")
            ws = outs = None  # free the buffers before the next shape
            t_gl = None
            if gemlite is not None and m == 1 and gemlite_tuning_s > args.gemlite_budget:
                log(f"gemlite {n}x{k} M=1 skipped: autotune time budget spent")
            elif gemlite is not None:
                t_start = time.time()
                try:
                    gl, A16Wn, h100 = gemlite
                    mtype, src = ("GEMV_REVSPLITK", "autotune") if m == 1 else \
                        seed_gemlite_config(h100, m, n, k)
                    nl = n_calls(n * k // 2)
                    layers = []
                    for _ in range(nl):
                        wq = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev)
                        sc = torch.rand(n, k // g, dtype=torch.bfloat16, device=dev) * 0.02 + 0.001
                        zr = torch.full((n, k // g), 8.0, dtype=torch.bfloat16, device=dev)
                        layers.append((A16Wn(device=dev, dtype=torch.bfloat16).from_weights(
                            wq, sc, zr, W_nbits=4, group_size=g), wq if not layers else None, sc))
                    lay, wq, sc = layers[0]
                    y = lay(x)
                    wd = ((wq.float() - 8) * sc.float().repeat_interleave(g, 1))
                    ref = x.float() @ wd.T
                    err = (y.float() - ref).norm() / ref.norm()
                    gouts = [None] * nl

                    def mkg(i):
                        def f():
                            gouts[i] = layers[i][0](x)
                        return f

                    t_gl = time_torch_graph([mkg(i) for i in range(nl)])
                    log(f"gemlite int4 {n}x{k} M={m}: {t_gl:.2f} µs ({mtype}, config of {src}), "
                        f"rel err {err:.1e}")
                    del layers, gouts
                except Exception as e:
                    log(f"gemlite {n}x{k} M={m} failed: {e!r}")
                    results["errors"].append(f"gemlite {n}x{k} M={m}: {e!r}")
                if m == 1:
                    gemlite_tuning_s += time.time() - t_start
            out[(n, k, m)] = (t_cublas, t_gl)
            torch.cuda.empty_cache()
    return out

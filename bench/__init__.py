"""Benchmarks for the GPU: `python -m bench.NAME` from the repository root (bench/RESULTS.md
holds the figures and the commands). `bench.common` is their shared harness (log, task loop under
a budget, copy ceiling, timers, rel_err); `bench.trace` reads device traces, `bench.sass` compiles
the kernels offline for sm_90a, `bench.peers` holds the MoE peers (XLA, torch)."""

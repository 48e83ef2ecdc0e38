"""Benchmarks for the GPU: `python -m bench.NAME` from the repository root (bench/RESULTS.md
holds the figures and the commands). `bench.common` is their shared harness: the copy ceiling,
timers, device traces, rel_err and the XLA peers."""

"""Loading a converted checkpoint: the restore's wall time against the disk's read speed of the
same files, each from a cold page cache.

    python -m bench.load --dir DIR          # a converted directory (python -m ling.convert)
    python -m bench.load --dir DIR --make ling-3-flash --layers 4 --quantize int4 --quantize-experts
                                            # first write a random cut of a preset there (once)

Measured, in this order:
  read        every file under DIR/params read once by --threads threads in 16 MiB blocks: the
              disk's speed for these files (the ceiling a load can reach)
  load, cold  `ling.load(DIR)` until every weight is on the device
  load, warm  the same with the files in the page cache: what the restore itself costs
              (decoding, host copies, the transfer to the device), the disk taken out
A file's cached pages are dropped with posix_fadvise(DONTNEED) before each cold figure (no root
needed; a page another process holds mapped stays cached, so the cold figures can only flatter).
Writes load.json under $OUT (or ./bench_out); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

BLOCK = 16 << 20


def files_under(directory: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(directory) for name in names)


def drop_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[str], threads: int) -> float:
    """Seconds to read every byte of paths, blocks of one file shared out over threads."""

    def read_range(job):
        path, offset, n = job
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            while n > 0:
                got = f.read(min(BLOCK, n))
                if not got:
                    break
                n -= len(got)

    jobs = []
    for path in paths:
        size = os.path.getsize(path)
        step = max(BLOCK, -(-size // threads))
        jobs += [(path, o, min(step, size - o)) for o in range(0, size, step)]
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_range, jobs))
    return time.perf_counter() - t


def load_once(directory: str) -> tuple[float, int]:
    """Seconds for ling.load(directory) with every weight on the device, and the weights' bytes."""
    import jax
    from flax import nnx

    import ling

    t = time.perf_counter()
    model = ling.load(directory, progress=False)
    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t
    nbytes = sum(x.nbytes for x in leaves)
    del model, leaves
    return seconds, nbytes


def make(args) -> None:
    import ling
    from ling import checkpoint

    t = time.perf_counter()
    model = ling.load(args.make, num_layers=args.layers, quantize=args.quantize, quantize_experts=args.quantize_experts,
                      quantize_lm_head=args.quantize is not None)
    checkpoint.save_converted(model, args.dir)
    print(f"wrote {args.dir}: {args.make} cut to {args.layers} layers, {args.quantize or 'bf16'} in "
          f"{time.perf_counter() - t:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a converted checkpoint directory")
    ap.add_argument("--make", metavar="PRESET", help="first write PRESET's random weights to --dir")
    ap.add_argument("--layers", type=int, default=4, help="with --make: the preset's first N layers")
    ap.add_argument("--quantize", choices=["int8", "int4"], default="int4", help="with --make")
    ap.add_argument("--quantize-experts", action="store_true", help="with --make: the routed experts too")
    ap.add_argument("--threads", type=int, default=8, help="readers for the disk's figure")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    if args.make:
        make(args)
    from ling import checkpoint

    if not checkpoint.is_converted(args.dir):
        ap.error(f"{args.dir} is not a converted checkpoint (no {checkpoint.CONFIG_FILE}); write one with --make "
                 "or python -m ling.convert")
    paths = files_under(os.path.join(args.dir, "params"))
    on_disk = sum(os.path.getsize(p) for p in paths)

    drop_cache(paths)
    read_s = read_all(paths, args.threads)
    drop_cache(paths)
    cold_s, weights = load_once(args.dir)
    read_all(paths, args.threads)  # into the page cache
    warm_s, _ = load_once(args.dir)

    import jax

    result = {"dir": args.dir, "files": len(paths), "bytes_on_disk": on_disk, "weights_bytes": weights,
              "device": jax.devices()[0].device_kind, "threads": args.threads,
              "read_s": read_s, "load_cold_s": cold_s, "load_warm_s": warm_s}
    with open(os.path.join(out_dir, "load.json"), "w") as f:
        json.dump(result, f, indent=1)
    gb = lambda s: on_disk / s / 1e9  # noqa: E731
    print(f"\n{args.dir}: {len(paths)} files, {on_disk / 1e9:.2f} GB on disk, weights {weights / 1e9:.2f} GB on "
          f"{result['device']}")
    print("| | s | GB/s | of the disk's read |\n|---|---|---|---|")
    print(f"| read ({args.threads} threads, cold) | {read_s:.2f} | {gb(read_s):.2f} | 1.00 |")
    print(f"| ling.load, cold | {cold_s:.2f} | {gb(cold_s):.2f} | {read_s / cold_s:.2f} |")
    print(f"| ling.load, warm (page cache) | {warm_s:.2f} | {gb(warm_s):.2f} | {read_s / warm_s:.2f} |")


if __name__ == "__main__":
    main()

"""The offline path: capture each pallas_call's Triton IR as it is lowered, compile it for sm_90a
with the triton package, report registers, spills, shared memory and the SASS mix. It runs on a
machine without a GPU, since Triton's compiler needs none: `pip install triton` there.
"""

from __future__ import annotations

import collections
import os
import re


def capture_triton(captured: list) -> None:
    """From now on every pallas_call lowered to Triton appends its module's text to `captured`;
    jax 0.11 asks the local GPU for its compute capability: it is told sm_90."""
    import types

    from jax._src.pallas.triton import lowering as tlow
    from jax._src.pallas.triton import pallas_call_registration as reg

    real = tlow.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        res = real(*a, **kw)
        captured.append(res.module.operation.get_asm())
        return res

    tlow.lower_jaxpr_to_triton_module = capture
    reg.lowering.lower_jaxpr_to_triton_module = capture
    if hasattr(reg, "gpu_info_lib"):
        reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)


def out_dir_arg(doc: str, prefix: str) -> str:
    """The directory an offline-compile script writes its Triton IR and compile.json to: --out,
    or a new temporary directory; doc's first paragraph is the command's description."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", help="where the Triton IR and compile.json go (default: a temporary directory)")
    out = ap.parse_args().out or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(out, exist_ok=True)
    return out


def kernel_name(ttir: str) -> str:
    """The kernel's name in a captured Triton module's text."""
    return re.search(r'(?:tt\.func (?:\w+ )?@|sym_name = ")(\w+)', ttir).group(1)


KEY_OPS = ("HGMMA", "HMMA", "LDGSTS", "STS", "ATOMG", "RED", "MUFU", "BAR", "LDL", "STL")


def opcodes(sass: str) -> collections.Counter:
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass, re.M))


def main_loop(sass: str, needs: str | None = "HGMMA") -> collections.Counter:
    """Opcode counts of the main loop: the longest loop (the SASS from a backward branch's target to
    the branch) that holds `needs` (the tensor cores' opcode); empty when the plan unrolls it (one
    iteration)."""
    pat = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)(.*)$")
    labels, pending, body = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = pat.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            body.append((addr, m.group(2), m.group(3)))
    best: list = []
    for addr, op, rest in body:
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op == "BRA" and target and labels.get(target.group(1), addr) < addr:
            loop = [o for a, o, _ in body if labels[target.group(1)] <= a <= addr]
            if needs is None or needs in loop:
                best = max(best, loop, key=len)
    return collections.Counter(best)


def compile_report(ttir_dir: str, log=print) -> list[dict]:
    """Compiles every `*_w{warps}_s{stages}.ttir` in ttir_dir with triton for sm_90a and logs,
    per kernel: shared memory, registers, spilled bytes, SASS instructions and the opcodes in
    KEY_OPS (tensor cores, async copies, atomics, MUFU, barriers, local memory), and the main
    loop's instructions (`main_loop`: a thread's share of one iteration) with its commonest opcodes. ok: it fits the
    H100/H200's shared memory. Returns the records (also written to compile.json there)."""
    import json
    import subprocess
    import tempfile

    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except Exception as e:  # noqa: BLE001
        log(f"triton not importable ({e!r}): lowered only, not compiled")
        return []
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    log(f"compiling for sm_90a with triton {triton.__version__}")
    records = []
    for name in sorted(os.listdir(ttir_dir)):
        if not name.endswith(".ttir"):
            continue
        nw, ns = map(int, re.search(r"_w(\d+)_s(\d+)\.ttir$", name).groups())
        try:
            k = triton.compile(os.path.join(ttir_dir, name), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=nw, num_stages=ns))
            with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True,
                                  text=True).stdout
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(k.asm["ptx"])
            ptxas = subprocess.run([os.path.join(bin_dir, "ptxas"), "--gpu-name", "sm_90a", "-v", f.name, "-o",
                                    os.devnull], capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", ptxas)
            spill = re.search(r"(\d+) bytes spill stores", ptxas)
            ops = collections.Counter(o.split(".")[0] for o in re.findall(
                r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M))
            loop = main_loop(sass, needs=None)
            rec = dict(kernel=name, ok=k.metadata.shared <= 232448, smem=k.metadata.shared,
                       regs=regs and int(regs.group(1)), spill=spill and int(spill.group(1)),
                       instructions=sum(ops.values()), ops={o: ops[o] for o in KEY_OPS if ops[o]},
                       loop=sum(loop.values()), loop_ops=dict(loop.most_common(8)))
            log(f"{'OK  ' if rec['ok'] else 'BAD '} {name}: smem {rec['smem']} B, {rec['regs']} regs, spill "
                f"{rec['spill']} B, {rec['instructions']} SASS instructions, {rec['ops']}; main loop "
                f"{rec['loop']} a thread an iteration, {rec['loop_ops']}")
        except Exception as e:  # noqa: BLE001
            rec = dict(kernel=name, ok=False, error=repr(e)[:1500])
            log(f"FAIL {name}: {repr(e)[:600]}")
        records.append(rec)
    log(f"compiled {sum(r['ok'] for r in records)} / {len(records)} kernels for sm_90a")
    with open(os.path.join(ttir_dir, "compile.json"), "w") as f:
        json.dump(records, f, indent=1)
    return records


def dump_fused_moe(lowered: list, out_dir: str, label: str, plan) -> None:
    """Write the fused MoE kernels lowered for one timed call (bench.fused_moe --lower), each once,
    named with their warps and stages (the up GEMM's from plan.up, the down's from plan.down, the
    align's 4 and 1); empties lowered."""
    seen = set()
    for text in lowered:
        name = kernel_name(text)
        if name in seen:
            continue
        seen.add(name)
        gp = plan.up if "_up_" in name else plan.down
        nw, ns = (4, 1) if name == "moe_align" else (gp.num_warps, gp.num_stages)
        with open(os.path.join(out_dir, f"{label}_{name}_w{nw}_s{ns}.ttir"), "w") as f:
            f.write(text)
    lowered.clear()

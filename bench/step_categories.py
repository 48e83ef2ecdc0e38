"""bench.step's kernel categories: device time by what a kernel does, from the named scopes of the ops
it runs (the model's `jax.named_scope`s, read from the compiled program's HLO metadata; first match
wins), our Pallas kernels by kernel name.
"""

from __future__ import annotations

import re

# Device time by what a kernel does: the named scopes of the ops the kernel runs (the model's
# `jax.named_scope`s, read from the compiled program's HLO metadata), first match wins.
SCOPES = (
    ("lm_head", "lm_head"),
    ("router", "router"),
    ("mlp", "shared expert, dense MLP"),
    ("experts", "routed experts"),
    ("proj", "projections"),
    ("kda", "attention"),
    ("mla", "attention"),
    ("norm", "norms"),
    ("sample", "sampling, accept, commit"),
    ("accept", "sampling, accept, commit"),
    ("emit", "sampling, accept, commit"),
    ("commit", "sampling, accept, commit"),
)
OTHER = "other glue"


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name (as a kernel is named in the trace: '.' -> '_') -> its op_name metadata."""
    out = {}
    for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=[^\n]*?metadata=\{[^}\n]*?op_name="([^"]*)"', hlo_text,
                         re.M):
        out[m.group(1).replace(".", "_").replace("-", "_")] = m.group(2)
    return out


PALLAS = (  # our kernels are custom calls, whose HLO names are not the kernels': by kernel name
    (r"kda_verify|kda_decode|mla_decode", "attention kernels"),
    (r"moe_align|fused_moe", "fused MoE: routed, shared, dense MLP"),
    (r"expert_tiles", "tile-scheduled MoE (decode and prefill tokens)"),
    (r"grouped_(up|down|gemm)", "grouped GEMM MoE (prefill)"),
    (r"^router", "router"),  # the fused gate and selection ("router"), or the selection alone
    (r"qmatvec", "low-bit matvec (projections, lm_head)"),
    (r"rows_kernel", "low-bit matvec and MoE GEMMs, row layout"),
    (r"rms_norm", "norms"),
)


def op_name(name: str, scopes: dict[str, str]) -> str:
    """The op_name metadata of the HLO instruction a trace kernel runs ('' if none is found)."""
    op, key = None, name
    while op is None and key:
        op = scopes.get(key)
        key = re.sub(r"_?\d+$", "", key) if re.search(r"\d$", key) else ""
    return op or ""


def category(name: str, scopes: dict[str, str]) -> str:
    for pat, cat in PALLAS:
        if re.search(pat, name):
            return f"{cat} (Pallas)"
    parts = set(re.split(r"[/()]", op_name(name, scopes)))
    return next((c for s, c in SCOPES if s in parts), OTHER)


def by_category(kernels: list[dict], scopes: dict[str, str]) -> dict:
    """Launches and µs a step by category; annotates each kernel row with its op_name."""
    out: dict[str, list[float]] = {}
    for r in kernels:
        r["op_name"] = op_name(r["name"], scopes)
        c = out.setdefault(category(r["name"], scopes), [0.0, 0.0])
        c[0] += r["count"]
        c[1] += r["us_per_call"]
    return out


_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(")


def big_copies(hlo_text: str, min_bytes: float = 8e6) -> list[dict]:
    """The copies of min_bytes or more a compiled program makes (its optimised HLO text): `copy`
    and `copy-start` instructions, and fusions named after a copy, outside fusion bodies, each
    {name, shape, bytes, op_name}, largest first. A copy of a whole slot state in a step is a
    buffer the compiler could not update in place (it was read by another op it could not order)."""
    fused = set(re.findall(r"\bfusion\([^\n]*?calls=%?([\w.\-]+)", hlo_text))
    out, body = [], None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            body = head.group(1)
            continue
        m = _INSTR.match(line)
        if not m or body in fused:
            continue
        name, dtype, dims, op = m.groups()
        if not (op in ("copy", "copy-start") or (op == "fusion" and "copy" in name)):
            continue
        size = _BYTES.get(dtype, 4)
        for d in filter(None, dims.split(",")):
            size *= int(d)
        if size >= min_bytes:
            scope = re.search(r'op_name="([^"]*)"', line)
            out.append(dict(name=name, shape=f"{dtype}[{dims}]", bytes=size, op_name=scope.group(1) if scope else ""))
    return sorted(out, key=lambda c: -c["bytes"])

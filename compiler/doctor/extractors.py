"""Extractors: read the numbers out of one matched log line (and the lines around it).

Each takes the regex match, the log's lines and the 0-based index of the matched line, and returns
the values (bytes as ints, ranks as lists of ints) or ``None`` to reject a match that does not
describe a failure (e.g. a logprob difference below its threshold).
"""
from __future__ import annotations

import re
from typing import Any, Optional

from rlc.compiler.doctor.sizes import SIZE, parse_size

Values = Optional[dict[str, Any]]

_OOM_FREE = re.compile(rf"(?:of which|free[:=]?)\s*({SIZE})(?:\s+is free)?", re.IGNORECASE)
_OOM_TOTAL = re.compile(rf"total(?: capacity)?(?: of)?\s*({SIZE})", re.IGNORECASE)
_OOM_ASK = re.compile(rf"Tried to allocate\s*({SIZE})", re.IGNORECASE)
_OOM_GPU = re.compile(r"GPU\s+(\d+)")
_PROCESS = re.compile(rf"(Megatron worker process|vLLM process|Process \d+ has|this process has)[^0-9]*({SIZE})",
                      re.IGNORECASE)


def _near(lines: list[str], i: int, before: int = 2, after: int = 4) -> str:
    return "\n".join(lines[max(0, i - before): i + after + 1])


def _size(m: re.Match, name: str) -> Optional[int]:
    text = m.groupdict().get(name)
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError:
        return None


def ranks(m: re.Match, lines: list[str], i: int) -> Values:
    """``[0, 7]`` (or ``on PP ranks [0, 7]``) -> ``ranks``; the parameter name when given."""
    found = [int(x) for group in re.findall(r"\[([0-9,\s]+)\]", m.group(0)) for x in group.split(",") if x.strip()]
    out: dict[str, Any] = {"ranks": sorted(set(found))}
    name = re.search(r"([\w.]*embedding[\w.]*|[\w.]+\.weight) on PP ranks", m.group(0))
    if name:
        out["name"] = name.group(1)
    elif m.groupdict().get("name"):
        out["name"] = m.group("name")
    return out


def buffer_sizes(m: re.Match, lines: list[str], i: int) -> Values:
    """Tensor bytes, half bytes (and free bytes at refit when the message has them)."""
    out: dict[str, Any] = {"name": m.group("name")}
    for key in ("tensor", "half", "free"):
        value = _size(m, key)
        if value is not None:
            out[f"{key}_bytes"] = value
    return out


def buffer_over_free(m: re.Match, lines: list[str], i: int) -> Values:
    return {"buffer_gb": float(m.group("gb")), "ask_bytes": parse_size(m.group("tensor")),
            "free_bytes": parse_size(m.group("free"))}


def oom(m: re.Match, lines: list[str], i: int) -> Values:
    """CUDA OOM: the failed allocation, free and total memory, per-process use, GPU index."""
    text = _near(lines, i, 0, 3)
    out: dict[str, Any] = {}
    for key, rx in (("ask_bytes", _OOM_ASK), ("free_bytes", _OOM_FREE), ("total_bytes", _OOM_TOTAL)):
        hit = rx.search(text)
        if hit:
            out[key] = parse_size(hit.group(1))
    gpu = _OOM_GPU.search(text)
    if gpu:
        out["gpu"] = int(gpu.group(1))
    procs = {p.group(1): parse_size(p.group(2)) for p in _PROCESS.finditer(text)}
    if procs:
        out["processes"] = procs
    return out


def sleep_residue(m: re.Match, lines: list[str], i: int) -> Values:
    return {"freed_gib": float(m.group("freed")), "in_use_gib": float(m.group("used"))}


def metadata_ranks(m: re.Match, lines: list[str], i: int) -> Values:
    out: dict[str, Any] = {k: int(v) for k, v in m.groupdict().items() if v is not None and v.isdigit()}
    if m.groupdict().get("name"):
        out["name"] = m.group("name")
    return out


def _number(text: str) -> float:
    return float("nan") if text.lower() == "nan" else float(text)


def gen_kl(m: re.Match, lines: list[str], i: int) -> Values:
    """rlc's gen-KL stop: the value, the step and the threshold."""
    return {"gen_kl": _number(m.group("kl")), "step": int(m.group("step")), "threshold": float(m.group("thr"))}


def threshold(key: str, limit: float) -> Any:
    """An extractor keeping metric ``key`` only above ``limit`` (a healthy run logs it too)."""

    def extract(m: re.Match, lines: list[str], i: int) -> Values:
        value = _number(m.group("value"))
        if value == value and value <= limit:  # NaN is kept: it is never healthy
            return None
        step = re.search(r"\bstep[ _:=]*(\d+)", _near(lines, i, 3, 0), re.IGNORECASE)
        out: dict[str, Any] = {key: value, "threshold": limit}
        if step:
            out["step"] = int(step.group(1))
        return out

    return extract


def ds_rlc(m: re.Match, lines: list[str], i: int) -> Values:
    out: dict[str, Any] = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    rate = re.search(r"Measured hit rate: ([0-9.]+)%", _near(lines, i, 0, 3))
    if rate:
        out["hit_rate"] = float(rate.group(1)) / 100
    return out


def ds_max(m: re.Match, lines: list[str], i: int) -> Values:
    return {k: int(v) for k, v in m.groupdict().items() if v is not None}


def ray_lost(m: re.Match, lines: list[str], i: int) -> Values:
    text = _near(lines, i, 0, 8)
    out: dict[str, Any] = {k: v for k, v in m.groupdict().items() if v is not None}
    for key, rx in (("ip", r"\bip: ([0-9.]+)"), ("pid", r"\bpid[: =]+([0-9]+)"),
                    ("exit_detail", r"Worker exit detail: ([^\n]+)"),
                    ("node_id", r"node(?: with node)? id:? ([0-9a-f]{16,})")):
        hit = re.search(rx, text)
        if hit:
            out.setdefault(key, hit.group(1).strip())
    if re.search(r"running low on memory|killed by SIGKILL by OOM killer|OOM killer", text, re.IGNORECASE):
        out["host_oom"] = True
    return out


def lengths(m: re.Match, lines: list[str], i: int) -> Values:
    """The values a length or size check named: each named group that matched, under its name less a trailing digit
    (one name per alternative of the regex); whole numbers as ints, decimals as floats, anything else (vLLM's
    ``key=value`` of the derived length) as text."""
    out: dict[str, Any] = {}
    for key, value in m.groupdict().items():
        if value is not None:
            out[key.rstrip("0123456789")] = _value(value)
    return out


def _value(text: str) -> Any:
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def block_shape(m: re.Match, lines: list[str], i: int) -> Values:
    """An FP8 block-scale shape failure: the width that is not a multiple of the block, and what it measures."""
    g = m.groupdict()
    out: dict[str, Any] = {"width": int(g.get("width") or g["width2"]), "block": int(g.get("block") or g["block2"])}
    if g.get("what"):
        out["what"] = g["what"]
    return out


def nothing(m: re.Match, lines: list[str], i: int) -> Values:
    return {}


#: Bytes per element of the dtypes logs name (torch spelling, without ``torch.``).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "uint8": 1, "int8": 1}


def _shape(text: str) -> list[int]:
    return [int(d) for d in re.findall(r"[0-9]+", text)]


def bucket_sizes(m: re.Match, lines: list[str], i: int) -> Values:
    """verl's bucket assertion: the tensor (name, shape, dtype -> bytes) and the bucket size."""
    shape = _shape(m.group("shape"))
    out: dict[str, Any] = {"name": m.group("name"), "shape": shape, "dtype": m.group("dtype")}
    per = DTYPE_BYTES.get(m.group("dtype"))
    if per is not None and shape:
        total = per
        for d in shape:
            total *= d
        out["tensor_bytes"] = total
    if m.group("mb"):
        out["bucket_bytes"] = int(m.group("mb")) << 20
    return out


_SYNC_TENSOR = re.compile(r"update weight: (?P<name>[^\s,]+), dtype: (?:torch\.)?(?P<dtype>\w+), shape: "
                          r"(?:torch\.Size\()?\[(?P<shape>[0-9, ]*)\]")
_HOST = re.compile(r"\bip=(?P<ip>[0-9a-fA-F.:]+)\)|^(?P<host>[A-Za-z0-9][\w.-]*):[0-9]+:[0-9]+ \[[0-9]+\]")


def network(m: re.Match, lines: list[str], i: int) -> Values:
    """An NCCL / InfiniBand / socket failure: what failed (peer, status, call, collective, timeout), the host that
    logged it, and the last tensor a weight sync named before it (OpenRLHF's ``update weight: NAME ...``)."""
    out: dict[str, Any] = {k: v.strip() for k, v in m.groupdict().items() if v is not None}
    for key in ("status", "seq", "timeout_ms", "secs"):
        if key in out:
            out[key] = int(out[key])
    line = lines[i]
    host = _HOST.search(line) or _HOST.search(line.split(") ", 1)[-1])
    if host:
        out["host"] = host.group("ip") or host.group("host")
    for j in range(i - 1, max(-1, i - 40), -1):
        sync = _SYNC_TENSOR.search(lines[j])
        if sync:
            out["name"], out["dtype"], out["shape"] = (
                sync.group("name"),
                sync.group("dtype"),
                _shape(sync.group("shape")),
            )
            break
    return out

"""Run the pattern table over a log: findings in the order they first appear, observations folded
into the failures they explain."""
from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable

from rlc.compiler.doctor.findings import Finding, Match
from rlc.compiler.doctor.patterns import PATTERNS, Pattern
from rlc.compiler.doctor.sizes import gib

MEMORY_FAILURES = ("refit-buffer-too-small", "export-stack-oom", "cumem-wake-oom", "cuda-oom")
#: Growth of vLLM's in-use memory after sleep (GiB) that counts as residue building up over steps.
RESIDUE_GROWTH_GIB = 1.0


def _near(lines: list[str], i: int, rx: re.Pattern, window: int) -> bool:
    return any(rx.search(line) for line in lines[max(0, i - window): i + window + 1])


def _new(p: Pattern) -> Finding:
    return Finding(p.id, p.rule, p.title, p.fix, p.reports)


def scan(text: str) -> list[Finding]:
    """Every recognised failure in ``text`` (empty when nothing is recognised)."""
    return scan_files([("", text)])


def scan_files(logs: list[tuple[str, str]]) -> list[Finding]:
    """Every recognised failure in the ``(file name, text)`` logs of one job, merged by pattern."""
    found: dict[str, Finding] = {}
    observed: dict[str, Finding] = {}
    for name, text in logs:
        _scan_one(name, text.splitlines(), found, observed)
    findings = list(found.values())
    _fold_residue(findings, observed.get("vllm-sleep-residue"), eager="vllm-eager" in observed)
    _fold_param_gather(findings, observed.get("overlap-param-gather-on"))
    for f in findings:
        f.summary = summarize(f)
    return findings


def _candidates(lines: list[str]) -> Iterable[int]:
    """Indices of the lines that hold a hint of some pattern (a row is only tried on those): each hint
    is looked for once in the whole log, so a long healthy log is passed over quickly."""
    joined = "\n".join(lines)
    lower = joined.lower()
    if len(lower) != len(joined):  # a character whose lower case is longer: positions would not line up
        return range(len(lines))
    starts, at = [], 0
    for line in lines:
        starts.append(at)
        at += len(line) + 1
    hits: set[int] = set()
    for hint in sorted({h for p in PATTERNS for h in p.hints}):
        i = lower.find(hint)
        while i >= 0:
            hits.add(bisect.bisect_right(starts, i) - 1)
            i = lower.find(hint, i + 1)
    return sorted(hits)


def _scan_one(name: str, lines: list[str], found: dict[str, Finding], observed: dict[str, Finding]) -> None:
    for i in _candidates(lines):
        line = lines[i]
        lower = line.lower()
        for p in PATTERNS:
            if not p.may_match(lower):
                continue
            m = p.regex.search(line)
            if m is None:
                continue
            if p.near is not None and not _near(lines, i, p.near, p.window):
                continue
            if p.not_near is not None and _near(lines, i, p.not_near, p.window):
                continue
            values = p.extract(m, lines, i)
            if values is None:
                continue
            target = observed if p.observation else found
            target.setdefault(p.id, _new(p)).matches.append(Match(i + 1, line.strip()[:400], values, name))
            break


def _fold_residue(findings: list[Finding], residue: Finding | None, eager: bool) -> None:
    """vLLM's sleep residue is a finding when it grows over steps or when a memory failure happened
    next to it (vLLM's memory while asleep, RLC213). Growth with CUDA graphs on is their
    residue (RLC212); with vLLM in eager mode, or ending in an OOM outside refit and wake-up (the
    logprob / loss pass), it is the vLLM version's own residue growth (RLC220)."""
    if residue is None:
        return
    used = [m.values["in_use_gib"] for m in residue.matches]
    growth = max(used) - used[0]
    memory_failure = any(f.pattern in MEMORY_FAILURES for f in findings)
    if growth >= RESIDUE_GROWTH_GIB:
        if eager or any(f.pattern == "cuda-oom" for f in findings):
            residue.rule, residue.candidates = "RLC220", ("RLC212",)
            residue.title = "vLLM's memory after sleep grows over steps (the vLLM version's residue)"
            residue.fix = ("raise parallelism.train.tp (with sequence_parallel: true and etp: 1) so the logprob / "
                           "loss pass needs less, or keep a vLLM version whose residue does not grow "
                           "(generation.vllm_version tells the planner which)")
            residue.reports = ("NeMo-RL #2619 (Qwen3.5-35B-A3B after the vLLM 0.17.1 -> 0.20.0 bump: residue "
                               "4.1 -> 11.6 -> 25 GiB per step, OOM in the logprob pass; fixed by trainer TP2)",)
        else:
            residue.rule, residue.candidates = "RLC212", ("RLC220",)
            residue.title = "vLLM's memory after sleep grows over steps (CUDA-graph residue)"
    elif not memory_failure:
        return
    findings.append(residue)


def _fold_param_gather(findings: list[Finding], gather: Finding | None) -> None:
    """A logprob mismatch with overlap_param_gather on points at stale shards (RLC202)."""
    mismatch = next((f for f in findings if f.pattern == "logprob-mismatch"), None)
    if mismatch is None:
        return
    if any(f.pattern == "ipc-metadata-mismatch" for f in findings):
        mismatch.rule, mismatch.candidates = "RLC203", ("RLC202", "RLC204")
    elif gather is not None:
        mismatch.rule, mismatch.candidates = "RLC202", ("RLC203", "RLC204")
        mismatch.evidence.extend(gather.matches[:1])
    else:
        mismatch.candidates = ("RLC202", "RLC203", "RLC204")


def summarize(f: Finding) -> str:
    """The numbers of a finding in one sentence."""
    v = f.values
    n = len(f.matches)
    times = f" ({n} times in the log)" if n > 1 else ""
    if f.pattern in ("mtp-duplicate-owner", "tensor-delivered-twice"):
        ranks = v.get("ranks")
        who = f"{v['name']} " if v.get("name") else ""
        if ranks:
            return f"{who}exported by pipeline ranks {ranks}: at least PP {max(ranks) + 1}, two owners{times}"
        return f"{who}exported twice in one refit{times}"
    if f.pattern == "refit-buffer-too-small":
        text = (f"{v.get('name')}: {gib(v['tensor_bytes'])} ({v['tensor_bytes']} bytes) does not fit a ping-pong "
                f"half of {gib(v['half_bytes'])} ({v['half_bytes']} bytes)")
        if "free_bytes" in v:
            text += f"; {gib(v['free_bytes'])} free at refit"
        return text + times
    if f.pattern == "refit-bucket-too-small":
        if "tensor_bytes" not in v:
            return f"one layer's expert bundle (one trainer rank to one rollout rank) exceeds the update buffer{times}"
        text = f"{v['name']} {v.get('shape')} {v.get('dtype')}: {gib(v['tensor_bytes'])} ({v['tensor_bytes']} bytes)"
        if "bucket_bytes" in v:
            text += f" does not fit the bucket of {v['bucket_bytes'] >> 20} MB ({gib(v['bucket_bytes'])})"
        return text + times
    if f.pattern in ("weight-sync-network", "nccl-network"):
        return _network_summary(f)
    if f.pattern == "refit-buffer-over-free":
        return f"refit.buffer_gb {v['buffer_gb']:g} asks for {gib(v['ask_bytes'])}, {gib(v['free_bytes'])} free{times}"
    if f.pattern in ("export-stack-oom", "cumem-wake-oom", "cuda-oom"):
        parts = []
        if "ask_bytes" in v:
            parts.append(f"tried to allocate {gib(v['ask_bytes'])}")
        if "free_bytes" in v:
            parts.append(
                f"{gib(v['free_bytes'])} free" + (f" of {gib(v['total_bytes'])}" if "total_bytes" in v else "")
            )
        if "gpu" in v:
            parts.append(f"GPU {v['gpu']}")
        for proc, size in (v.get("processes") or {}).items():
            parts.append(f"{proc} {gib(size)}")
        return ", ".join(parts) + times if parts else f"out of memory{times}"
    if f.pattern == "vllm-sleep-residue":
        used = [m.values["in_use_gib"] for m in f.matches]
        freed = [m.values["freed_gib"] for m in f.matches]
        if len(used) > 1:
            return (f"GPU memory in use after vLLM sleeps: {used[0]:.2f} -> {used[-1]:.2f} GiB over {len(used)} sleeps "
                    f"({used[-1] - used[0]:+.2f} GiB); sleep freed {freed[0]:.2f} -> {freed[-1]:.2f} GiB")
        return f"{used[0]:.2f} GiB in use after vLLM sleeps (sleep freed {freed[0]:.2f} GiB)"
    if f.pattern == "ipc-metadata-mismatch":
        if "got" in v:
            return f"the consumer of trainer rank {v['own']} received rank {v['got']}'s slicing metadata{times}"
        return f"tensor {v.get('name')} was not announced by trainer rank {v.get('rank')}{times}"
    if f.pattern == "logprob-mismatch":
        if "gen_kl" in v:
            kl = v["gen_kl"]
            shown = "nan" if math.isnan(kl) else f"{kl:.4g}"
            step = f" at step {v['step']}" if "step" in v else ""
            return f"gen-KL {shown}{step} > {v['threshold']:g}{times}"
        key = next(k for k in v if k not in ("threshold", "step"))
        step = f" at step {v['step']}" if "step" in v else ""
        return f"{key} {v[key]:.4g}{step} > {v['threshold']:g}{times}"
    if f.pattern == "dynamic-sampling-exhausted":
        parts = [f"max_gen_batches {v['max_gen_batches']}"] if "max_gen_batches" in v else []
        if "kept" in v:
            parts.append(f"kept {v['kept']}/{v['target']} groups at step {v['step']}")
        if "hit_rate" in v:
            parts.append(f"hit rate {v['hit_rate']:.1%}")
        return ", ".join(parts) or "generation batches exhausted"
    if f.pattern == "worker-lost":
        if "role" in v:
            return (f"{v['role']} worker {v['rank']} on node {v['node']} ({v['host']}), GPU {v['gpu']}, died during "
                    f"{v['phase']}{times}")
        where = ", ".join(f"{k} {v[k]}" for k in ("ip", "pid", "node_id") if k in v)
        host = "; the host ran out of memory" if v.get("host_oom") else ""
        return ("an actor or node died" + (f" ({where})" if where else "") + host + times)
    return f"{n} time(s) in the log"


def _network_summary(f: Finding) -> str:
    """What failed where: each distinct failure (NET/IB completion status, an ibverbs call, an NCCL error, a
    watchdog timeout, a socket timeout) with the host that logged it, and the tensor being synced."""
    parts: list[str] = []
    for m in f.matches:
        v = m.values
        host = f" on {v['host']}" if "host" in v else ""
        if "status" in v:
            text = f"InfiniBand completion error status={v['status']} from peer {v.get('peer', '?')}{host}"
        elif "call" in v:
            text = f"{v['call']} failed ({v.get('error', '')}){host}"
        elif "op" in v:
            text = f"NCCL {v['op']} (SeqNum {v['seq']}) timed out after {v['timeout_ms'] // 1000} s{host}"
        elif "secs" in v:
            text = f"socket connect to {v.get('peer')} timed out after {v['secs']} s{host}"
        elif "error" in v:
            text = f"NCCL error: {v['error']}{host}"
        else:
            text = f"the InfiniBand adapter (mlx5) reported a completion error{host}"
        if text not in parts:
            parts.append(text)
    v = f.values
    tensor = f"; while syncing {v['name']} {v.get('shape')}" if "name" in v and f.pattern == "weight-sync-network" \
        else ""
    return "; ".join(parts) + tensor

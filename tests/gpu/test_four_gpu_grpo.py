"""GPU proof (nvidia-h200-x4): a tiny MoE whose MTP layer shares the word embedding, trained with
Megatron TP1/PP2/EP2 and vLLM TP2/EP2 colocated on the same 4 GPUs, compiled from the shipped recipe.

1. ``build_workspace``: the tiny DeepSeek-V3 of ``rlc/recipes/models/tiny-moe-mtp/config.json`` made by
   ``rlc.runtime.toy_model.build_toy_model``, then ``add_mtp_layers`` (the MTP layer's weights, which
   transformers does not create, and the router bias in fp32 at a DeepSeek-like magnitude), and the toy data.
2. ``compile_bundle``: ``python -m rlc compile rlc/recipes/tiny-moe-mtp-4gpu.yaml -o ROOT/bundle --force``.
3. A private Ray head with 4 GPUs, then ``python -m rlc.runtime bundle/runtime.yaml`` with the bundle's own
   rlc first on PYTHONPATH, as ``node.sh driver`` runs it.
4. ``analyze``: >= 30 steps, gen-KL <= 0.01 on every step, reward rising, the MTP-embedding dedupe line from
   every last-stage rank, a per-rank refit manifest from every rank at every refit; prints the measured free
   memory at refit next to the ``plan.json`` prediction.

    python tests/gpu/test_four_gpu_grpo.py [--root /tmp/rlc-tiny-moe] [--out DIR] [--timeout 540]

What the runtime must emit for step 4 (``DEDUPE_RE``, ``REFIT_RANKS_FILE``) is listed in docs/four-gpu-run.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu.verdicts import FREE_AT_REFIT_TOLERANCE_GIB, free_at_refit_verdict

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "rlc" / "recipes" / "tiny-moe-mtp-4gpu.yaml"
MODEL_CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-moe-mtp" / "config.json"
DEFAULT_ROOT = "/tmp/rlc-tiny-moe"  # the recipe's paths live here; another root is passed with --set
GOAL_GEN_KL, MIN_STEPS, WINDOW, REWARD_MARGIN = 0.01, 30, 5, 0.05
SHARED_EMBEDDING = "embedding.word_embeddings.weight"
#: The line a last-stage trainer rank prints when it drops its MTP replica of the word embedding (NeMo-RL #2471).
DEDUPE_RE = re.compile(r"\[mtp-shared-embed-skip\] rank (\d+) pp_rank (\d+)/(\d+): dropped (\S+)")
#: ``<logging.dir>/refit_ranks.jsonl``: one ``RefitMetrics.to_dict()`` per trainer rank per refit, plus
#: ``step`` (0 = the initial refit), ``rank`` and ``pp_rank``.
REFIT_RANKS_FILE = "refit_ranks.jsonl"


# ------------------------------------------------------------------ checkpoint, bundle, processes

def with_mtp_layers(sd: dict, cfg: dict, *, seed: int = 0, bias_base: float = 30.0, bias_std: float = 0.05) -> dict:
    """``sd`` (a DeepSeek-V3 state dict) plus the MTP layer(s) ``model.layers.{L+i}.*``; router bias -> fp32.

    Names follow the released DeepSeek-V3 layout that Megatron-Bridge maps (deepseek/common.py): a full
    decoder layer (copied from the last one) plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and
    the copies of the word embedding and head the release also stores. Every ``e_score_correction_bias``
    becomes fp32 ``bias_base + N(0, bias_std)``: at ~30 bf16's step is 0.125, so a bias sent in bf16 reroutes
    tokens and shows up as gen-KL (SkyRL #1816); ``bias_base=0`` turns that stress off.
    """
    import torch  # noqa: PLC0415

    layers, n_mtp, hidden = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers") or 0, cfg["hidden_size"]
    if n_mtp < 1:
        raise ValueError("the config has no MTP layer (num_nextn_predict_layers < 1)")
    out = dict(sd)
    dtype = sd["model.embed_tokens.weight"].dtype
    g = torch.Generator().manual_seed(seed)
    src, std = f"model.layers.{layers - 1}.", float(cfg.get("initializer_range", 0.02))
    for i in range(n_mtp):
        dst = f"model.layers.{layers + i}."
        out.update({dst + k[len(src):]: v.clone() for k, v in sd.items() if k.startswith(src)})
        out.update({
            dst + "enorm.weight": torch.ones(hidden, dtype=dtype),
            dst + "hnorm.weight": torch.ones(hidden, dtype=dtype),
            dst + "eh_proj.weight": (torch.randn(hidden, 2 * hidden, generator=g) * std).to(dtype),
            dst + "shared_head.norm.weight": torch.ones(hidden, dtype=dtype),
            dst + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
            dst + "shared_head.head.weight": sd["lm_head.weight"].clone(),
        })
    for k in sorted(k for k in out if k.endswith("mlp.gate.e_score_correction_bias")):
        noise = torch.randn(out[k].shape, generator=g, dtype=torch.float64) * bias_std
        out[k] = (bias_base + noise).to(torch.float32)
    return out


def add_mtp_layers(ckpt: str | Path, **kwargs) -> dict:
    """``with_mtp_layers`` applied to a one-file safetensors checkpoint, in place."""
    from rlc.runtime.toy_model import transform_checkpoint  # noqa: PLC0415

    sd, new = transform_checkpoint(ckpt, lambda sd, cfg: with_mtp_layers(sd, cfg, **kwargs))
    fp32 = [k for k, v in new.items() if str(v.dtype) == "torch.float32"]
    return {"tensors": len(new), "mtp_tensors": len(new) - len(sd), "fp32_tensors": len(fp32)}


def build_workspace(root: str | Path, *, seed: int = 0, bias_base: float = 30.0,
                    init_std: dict[str, float] | None = None) -> dict:
    """The checkpoint and the toy data under ``root``. ``init_std`` (``rlc.runtime.toy_model.with_init_std``):
    ``None`` draws as the model's config.json says (its ``_init_std``), ``{}`` every matrix at
    ``initializer_range``."""
    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.toy_model import build_toy_model  # noqa: PLC0415

    root = Path(root)
    ckpt = build_toy_model(root / "deepseek_v3", config=MODEL_CONFIG, seed=seed, init_std=init_std)
    info = add_mtp_layers(ckpt, seed=seed, bias_base=bias_base)
    toy.write_dataset(root / "data" / "train.jsonl", 4096, seed)
    return {"checkpoint": str(ckpt), **info}


def _overrides(root: str, steps: int | None = None) -> list[str]:
    sets = [] if steps is None else [f"grpo.max_steps={steps}"]
    if root != DEFAULT_ROOT:
        sets += [f"model.checkpoint={root}/deepseek_v3", f"data.train={root}/data/train.jsonl",
                 f"cluster.log_dir={root}/logs"]
    return [w for s in sets for w in ("--set", s)]




def _env(first: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(first)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


def compile_bundle(root: str, steps: int | None = None) -> Path:
    bundle = Path(root) / "bundle"
    cmd = [sys.executable, "-m", "rlc", "compile", str(RECIPE), "-o", str(bundle), "--force", *_overrides(root, steps)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=_env(REPO))
    return bundle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(num_gpus: int, env: dict, log_path: Path) -> tuple[subprocess.Popen, dict]:
    """A Ray head of this test only (``--block``: terminating it stops its processes), protected by a
    token of its own, as a job's head is; returns it and what a process joining it sets (``RAY_ADDRESS``
    and the token). Nothing left on the machine (``~/.ray/auth_token``, an earlier head) decides its auth."""
    port = _free_port()
    token = log_path.parent / "ray-auth-token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
           f"--num-gpus={num_gpus}", "--disable-usage-stats", "--include-dashboard=false"]
    with open(log_path, "w") as log:  # the head keeps its own copy of the descriptor
        head = subprocess.Popen(cmd, env={**env, **auth}, stdout=log, stderr=subprocess.STDOUT)
    # `ray start` writes the head's GCS address here once the node is up
    current = Path(env.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and head.poll() is None:
        address = current.read_text().strip() if current.exists() else ""
        if address.endswith(f":{port}"):
            return head, {"RAY_ADDRESS": address, **auth}
        time.sleep(1)
    stop(head)
    raise RuntimeError(f"the Ray head (port {port}) did not come up; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_driver(bundle: Path, env: dict, log_path: Path, timeout_s: int) -> int:
    cmd = [sys.executable, "-m", "rlc.runtime", str(bundle / "runtime.yaml")]
    print("$", " ".join(cmd), f"> {log_path}", flush=True)
    with open(log_path, "w") as log:  # cwd: the bundle's rlc first on every Ray worker's sys.path (node.sh)
        try:
            return subprocess.run(cmd, cwd=bundle / "rlc_pkg", env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            return 124


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ------------------------------------------------------------------ the issue's checks (pure; CPU-tested)

def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def analyze(metrics: list[dict], log_text: str, rank_records: list[dict], *, world: int, pp: int, min_fp32: int,
            plan_free_bytes: int) -> dict:
    rows = sorted((r for r in metrics if "reward/mean" in r), key=lambda r: r["step"])
    steps = [int(r["step"]) for r in rows]
    rewards = [float(r["reward/mean"]) for r in rows]
    kls = [float(r.get("gen_kl", "nan")) for r in rows]
    c: dict = {}
    c["steps"] = {"logged": len(rows), "ok": len(rows) >= MIN_STEPS and steps == list(range(1, len(rows) + 1))}
    over = [(s, k) for s, k in zip(steps, kls) if not k <= GOAL_GEN_KL]  # NaN (missing) counts as over
    c["gen_kl"] = {"max": max(kls) if kls else None, "over_goal": over[:5], "goal": GOAL_GEN_KL,
                   "ok": bool(kls) and not over}
    first, last = _mean(rewards[:WINDOW]), _mean(rewards[-WINDOW:])
    c["reward_rising"] = {"first5": first, "last5": last, "margin": REWARD_MARGIN,
                          "ok": len(rewards) >= 2 * WINDOW and last > first + REWARD_MARGIN}
    hits = [(int(r), int(p), int(n), name) for r, p, n, name in DEDUPE_RE.findall(log_text)]
    wrong = [h for h in hits if h[1] != pp - 1 or h[2] != pp or not h[3].endswith(SHARED_EMBEDDING)]
    last_ranks = sorted({h[0] for h in hits if h not in wrong})
    c["mtp_dedupe"] = {"lines": len(hits), "last_stage_ranks": last_ranks, "wrong": wrong[:4],
                       "ok": len(last_ranks) == world // pp and not wrong}
    by_step: dict[int, dict[int, dict]] = defaultdict(dict)
    for rec in rank_records:
        by_step[int(rec["step"])][int(rec["rank"])] = rec
    problems = []
    for s in [0] + steps:
        recs = by_step.get(s, {})
        if sorted(recs) != list(range(world)):
            problems.append(f"refit {s}: manifests from ranks {sorted(recs)}, expected {list(range(world))}")
        if len({r.get("device_key") for r in recs.values()}) != len(recs):
            problems.append(f"refit {s}: two ranks report the same GPU")
        for rank, r in sorted(recs.items()):
            cons, src = r.get("consumer") or {}, (r.get("fixes") or {}).get("metadata_source_rank")
            if src != r.get("producer_rank"):
                problems.append(f"refit {s} rank {rank}: slicing metadata of producer {src}, not its own")
            if (cons.get("producer_rank"), cons.get("device_key")) != (r.get("producer_rank"), r.get("device_key")):
                problems.append(f"refit {s} rank {rank}: consumer paired with another producer/GPU")
            if (cons.get("num_tensors"), cons.get("bytes")) != (r.get("num_tensors"), r.get("bytes")):
                problems.append(f"refit {s} rank {rank}: consumer received a different manifest")
            if r.get("precision_lost") or int(r.get("fp32_tensors", 0)) < min_fp32:
                problems.append(f"refit {s} rank {rank}: fp32 {r.get('fp32_tensors')} (< {min_fp32}) "
                                f"lost {r.get('precision_lost')}")
    c["per_rank_manifests"] = {"refits": len(by_step), "records": len(rank_records), "problems": problems[:8],
                               "ok": bool(rank_records) and not problems}
    mins = {s: min(int(r["free_before_bytes"]) for r in recs.values())
            for s, recs in by_step.items() if recs and s >= 1}
    rank0 = [float(r["refit/free_before_gib"]) for r in rows if "refit/free_before_gib" in r]
    measured = min(mins.values()) / 2**30 if mins else (min(rank0) if rank0 else None)
    plan = plan_free_bytes / 2**30
    c["free_at_refit"] = {"measured_gib": measured, "source": "min over ranks and steps" if mins else "rank 0 only",
                          "rank0_step1_gib": rank0[0] if rank0 else None, "plan_gib": plan,
                          "measured_minus_plan_gib": None if measured is None else measured - plan,
                          "tolerance_gib": FREE_AT_REFIT_TOLERANCE_GIB}
    c["free_at_refit"]["ok"], c["free_at_refit"]["reasons"] = free_at_refit_verdict(measured, plan)
    c["passed"] = all(v["ok"] for v in c.values())
    return c


# ------------------------------------------------------------------ the run

def run(root: str = DEFAULT_ROOT, out: str | None = None, timeout_s: int = 540, bias_base: float = 30.0,
        steps: int | None = None) -> dict:
    from rlc.contract.runtime_config import load_runtime_config  # noqa: PLC0415
    from rlc.runtime.metrics import read_metrics  # noqa: PLC0415

    clock, rootp, res = Timer(), Path(root), {}
    for sub in ("logs", "bundle", "deepseek_v3"):
        shutil.rmtree(rootp / sub, ignore_errors=True)
    res["workspace"] = build_workspace(root, bias_base=bias_base)
    bundle = compile_bundle(root, steps)
    cfg = load_runtime_config(bundle / "runtime.yaml")
    plan = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
    mcfg = json.loads(MODEL_CONFIG.read_text(encoding="utf-8"))
    env = _env(bundle / "rlc_pkg")
    head, join = start_ray(cfg.cluster.world_size, env, rootp / "ray-head.log")
    env.update(join)
    try:
        res["rc"] = run_driver(bundle, env, rootp / "driver.log", timeout_s)
    finally:
        stop(head)
    logs = Path(cfg.logging.dir)
    metrics = read_metrics(logs / "metrics.jsonl") if (logs / "metrics.jsonl").exists() else []
    log_text = (rootp / "driver.log").read_text(encoding="utf-8", errors="replace")
    res["checks"] = analyze(
        metrics, log_text, read_jsonl(logs / REFIT_RANKS_FILE), world=cfg.cluster.world_size,
        pp=cfg.train_parallel.pp, min_fp32=mcfg["num_hidden_layers"] - mcfg["first_k_dense_replace"],
        plan_free_bytes=plan["refit"]["free_at_refit"])
    res["reward_curve"] = [round(float(r["reward/mean"]), 4) for r in metrics if "reward/mean" in r]
    res["passed"] = bool(res["rc"] == 0 and res["checks"]["passed"])
    f = res["checks"]["free_at_refit"]
    print(f"free at refit: measured {f['measured_gib']} GiB ({f['source']}) | "
          f"rlc plan predicted {f['plan_gib']:.2f} GiB", flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for src in (logs / "metrics.jsonl", logs / REFIT_RANKS_FILE, logs / "calibration.jsonl", rootp / "driver.log",
                    bundle / "plan.txt", bundle / "runtime.yaml"):
            if src.exists():
                shutil.copy(src, Path(out) / f"four_gpu_{src.name}")
    res["elapsed_s"] = clock()
    dump(res, out, "four_gpu")
    return res


@pytest.mark.gpu
def test_four_gpu_grpo(tmp_path):
    if not gpu_available():
        pytest.skip("needs CUDA GPUs with vLLM, Ray and Megatron-Bridge (GPU host only)")
    import torch  # noqa: PLC0415

    if torch.cuda.device_count() < 4:
        pytest.skip("needs four GPUs (nvidia-h200-x4)")
    res = run(str(tmp_path / "tiny-moe"))
    assert res["rc"] == 0, res
    assert res["checks"]["passed"], res["checks"]


# ------------------------------------------------------------------ CPU tests of the helpers above

def _synthetic(world: int = 4, pp: int = 2, steps: int = 32) -> dict:
    """A run that meets every check: what ``analyze`` must accept."""
    per_stage = world // pp
    metrics = [{"step": s, "reward/mean": 0.07 + 0.3 * s / steps, "gen_kl": 0.003, "refit/free_before_gib": 120.0}
               for s in range(1, steps + 1)]
    log = "\n".join(f"(MegatronPolicyWorker pid={r}) [mtp-shared-embed-skip] rank {r} pp_rank {pp - 1}/{pp}: "
                    f"dropped {SHARED_EMBEDDING}" for r in range(world - per_stage, world))
    ranks = [{"step": s, "rank": r, "pp_rank": r // per_stage, "producer_rank": r, "device_key": f"GPU-{r}",
              "num_tensors": 90, "bytes": 9000, "fp32_tensors": 4, "precision_lost": [],
              "free_before_bytes": (120 - r) * 2**30, "fixes": {"metadata_source_rank": r},
              "consumer": {"producer_rank": r, "device_key": f"GPU-{r}", "num_tensors": 90, "bytes": 9000}}
             for s in range(steps + 1) for r in range(world)]
    return {"metrics": metrics, "log": log, "ranks": ranks}


def _check(run: dict) -> dict:
    return analyze(run["metrics"], run["log"], run["ranks"], world=4, pp=2, min_fp32=3,
                   plan_free_bytes=run.get("plan_free_bytes", 119 * 2**30))


def test_analyze_accepts_a_run_that_meets_the_issue():
    c = _check(_synthetic())
    assert c["passed"], c
    assert c["free_at_refit"]["measured_gib"] == 117.0  # the worst GPU (rank 3), not rank 0's 120
    assert c["free_at_refit"]["measured_minus_plan_gib"] == -2.0


def _fault(name: str, run: dict) -> None:
    m, r = run["metrics"], run["ranks"]
    if name == "steps":
        del m[29:]
    elif name == "gen_kl":
        m[6]["gen_kl"] = 0.02
    elif name == "reward_rising":
        for row in m:
            row["reward/mean"] = 0.1
    elif name == "mtp_dedupe":
        run["log"] = run["log"].replace("pp_rank 1/2", "pp_rank 0/2", 1)
    elif name == "per_rank_manifests":
        r[4 * 5 + 2]["fixes"]["metadata_source_rank"] = 0  # SkyRL #1816: rank 0's slicing metadata on GPU 2
    elif name == "free_at_refit":
        run["plan_free_bytes"] = int((117 + FREE_AT_REFIT_TOLERANCE_GIB + 0.5) * 2**30)  # plan off by 5.5 GiB


@pytest.mark.parametrize("name", ["steps", "gen_kl", "reward_rising", "mtp_dedupe", "per_rank_manifests",
                                  "free_at_refit"])
def test_analyze_rejects_each_failure(name):
    run = _synthetic()
    _fault(name, run)
    c = _check(run)
    assert not c["passed"] and not c[name]["ok"]
    assert [k for k, v in c.items() if k != "passed" and not v["ok"]] == [name]


def test_analyze_needs_every_rank_at_every_refit_and_the_fp32_bias():
    run = _synthetic()
    run["ranks"] = [x for x in run["ranks"] if not (x["step"] == 0 and x["rank"] == 3)]
    assert "refit 0: manifests from ranks [0, 1, 2]" in _check(run)["per_rank_manifests"]["problems"][0]
    run = _synthetic()
    run["ranks"][9]["precision_lost"] = ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert not _check(run)["per_rank_manifests"]["ok"]
    run = _synthetic()
    run["log"] = ""
    assert _check(run)["mtp_dedupe"] == {"lines": 0, "last_stage_ranks": [], "wrong": [], "ok": False}


def test_mtp_layer_and_fp32_router_bias():
    import torch  # noqa: PLC0415

    cfg = json.loads(MODEL_CONFIG.read_text(encoding="utf-8"))
    h, last = cfg["hidden_size"], cfg["num_hidden_layers"] - 1
    sd = {"model.embed_tokens.weight": torch.randn(23, h).bfloat16(), "lm_head.weight": torch.randn(23, h).bfloat16(),
          f"model.layers.{last}.mlp.gate.weight": torch.randn(8, h).bfloat16(),
          f"model.layers.{last}.mlp.gate.e_score_correction_bias": torch.zeros(8).bfloat16(),
          f"model.layers.{last}.self_attn.kv_b_proj.weight": torch.randn(16, 8).bfloat16()}
    out = with_mtp_layers(sd, cfg, seed=1)
    mtp = f"model.layers.{last + 1}."
    assert torch.equal(out[mtp + "self_attn.kv_b_proj.weight"], sd[f"model.layers.{last}.self_attn.kv_b_proj.weight"])
    assert torch.equal(out[mtp + "embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert out[mtp + "eh_proj.weight"].shape == (h, 2 * h) and out[mtp + "enorm.weight"].shape == (h,)
    for k in (f"model.layers.{last}.mlp.gate.e_score_correction_bias", mtp + "mlp.gate.e_score_correction_bias"):
        b = out[k]
        assert b.dtype == torch.float32 and 29 < float(b.mean()) < 31
        assert not torch.equal(b.bfloat16().float(), b)  # bf16 on the wire would change the routing bias
    assert with_mtp_layers(sd, cfg, seed=1).keys() == out.keys()
    with pytest.raises(ValueError):
        with_mtp_layers(sd, {**cfg, "num_nextn_predict_layers": 0})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=DEFAULT_ROOT)
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--router-bias-base", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=None, help="override grpo.max_steps (>= 30 for the issue)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    sys.exit(0 if run(a.root, a.out, a.timeout, a.router_bias_base, a.steps).get("passed") else 1)

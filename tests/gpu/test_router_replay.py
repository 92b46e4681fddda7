"""GPU check: Rollout Routing Replay (``training.router_replay``) on the tiny DeepSeek-V3 MoE on one GPU, off vs on.

The shipped recipe ``tiny-moe-mtp-2gpu-ep2`` compiled for one GPU exactly as ``test_moe_one_gpu.py`` does (trainer
EP 1, one vLLM engine, MTP speculative decoding, sleep level 1, ``training.mtp_loss_scale: 0``; ``--no-specdec``
drops the drafter), run by the bundled runtime for ``--steps`` GRPO steps twice: ``training.router_replay.enabled``
true, then false, each from its own compiled bundle (checkpointing off). Reports, per step and side by side, the
gen-vs-train mismatch the driver logs (``gen_kl``, mean / max |logprob difference|) and the mean reward.

Passes when both runs finish every step (exit 0) and, with the replay on, the routing probe held on every step:
each decoder MoE router of the trainer's logprob pass returned, for every (token, layer), exactly the experts vLLM
recorded for that token (``router_replay/routes_mismatched == 0`` with ``routes_checked > 0``, no router call
without an armed route); the driver stops a run where it does not. Whether the replay lowers the mismatch is
measured and reported (``comparison``), not a pass condition.

    python tests/gpu/test_router_replay.py [--steps 40] [--only on,off] [--no-specdec] [--set KEY=VALUE ...]
                                           [--root /tmp/rlc-r3] [--out DIR]

``--only off`` and ``--only on`` split the pair over two device calls; each call adds to ``<out>/router_replay.json``,
or to ``--prior FILE`` (the first call's ``router_replay.json`` carried into the second) when given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available

RECIPE = "tiny-moe-mtp-2gpu-ep2"
SPECDEC = ("generation.speculative_decoding.method=mtp", "generation.speculative_decoding.num_speculative_tokens=1")
ONE_GPU = ("cluster.gpus_per_node=1", "parallelism.train.ep=1", "parallelism.generation.ep=1", *SPECDEC,
           "refit.sleep_level=1", "training.mtp_loss_scale=0", "checkpointing.enabled=false")
KL_KEYS = ("gen_kl", "gen_logprob_abs_diff_mean", "gen_logprob_abs_diff_max")
PROBE_KEYS = ("router_replay/routes_checked", "router_replay/routes_mismatched", "router_replay/layers_unarmed",
              "router_replay/unrouted_tokens")


def sets_for(replay: bool, steps: int, specdec: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """``--set`` values of one run: the one-GPU layout, the steps, the switch, then ``extra`` (both runs alike)."""
    base = [s for s in ONE_GPU if specdec or s not in SPECDEC]
    return [*base, f"grpo.max_steps={steps}", f"training.router_replay.enabled={'true' if replay else 'false'}",
            *extra]


# ------------------------------------------------------------------ verdicts (pure; CPU-tested below)

def _num(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def summarize(metrics: list[dict]) -> dict:
    """Per-step curves of one run's ``metrics.jsonl`` (rows with a reward)."""
    rows = sorted((r for r in metrics if "reward/mean" in r), key=lambda r: r["step"])
    out: dict = {"steps": [r["step"] for r in rows], "reward": [_num(r, "reward/mean") for r in rows]}
    for key in (*KL_KEYS, *PROBE_KEYS):
        out[key] = [_num(r, key) for r in rows]
    return out


def _mean(xs: list) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def verdict_run(rc: int, curves: dict, steps: int, replay: bool) -> dict:
    """One run: every step logged, exit 0; with the replay, the probe held on every step."""
    res = {"rc": rc, "steps": len(curves["steps"]), "reasons": []}
    if rc != 0:
        res["reasons"].append(f"exit code {rc}")
    if curves["steps"] != list(range(1, steps + 1)):
        res["reasons"].append(f"{len(curves['steps'])} of {steps} steps logged")
    if replay:
        checked, bad = curves["router_replay/routes_checked"], curves["router_replay/routes_mismatched"]
        unarmed = curves["router_replay/layers_unarmed"]
        res["routes_checked_total"] = int(sum(x or 0 for x in checked))
        res["routes_mismatched_total"] = int(sum(x or 0 for x in bad))
        res["layers_unarmed_total"] = int(sum(x or 0 for x in unarmed))
        res["unrouted_tokens_total"] = int(sum(x or 0 for x in curves["router_replay/unrouted_tokens"]))
        if not checked or any(x is None or x <= 0 for x in checked):
            res["reasons"].append("a step without routing checked (router_replay/routes_checked missing or 0)")
        if any(x for x in bad) or any(x for x in unarmed):
            res["reasons"].append(f"{res['routes_mismatched_total']} (token, layer) routings differ from vLLM's, "
                                  f"{res['layers_unarmed_total']} router calls unarmed")
    elif any(x is not None for x in curves["router_replay/routes_checked"]):
        res["reasons"].append("the run without replay logged replay metrics")
    res["passed"] = not res["reasons"]
    return res


def compare(off: dict, on: dict) -> dict:
    """Side by side, step by step (the common steps), with the means of each curve."""
    n = min(len(off["steps"]), len(on["steps"]))
    table = [{"step": off["steps"][i], "reward_off": off["reward"][i], "reward_on": on["reward"][i],
              **{f"{k}_off": off[k][i] for k in KL_KEYS}, **{f"{k}_on": on[k][i] for k in KL_KEYS}}
             for i in range(n)]
    means = {
        f"{k}_mean_{side}": _mean(c[k][:n]) for k in ("reward", *KL_KEYS) for side, c in (("off", off), ("on", on))
    }
    ratio = None
    if means["gen_kl_mean_off"] and means["gen_kl_mean_on"] is not None:
        ratio = means["gen_kl_mean_on"] / means["gen_kl_mean_off"]
    return {"steps_compared": n, **means, "gen_kl_mean_ratio_on_over_off": ratio, "per_step": table}


def plot(off: dict, on: dict, png: Path) -> str | None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for curves, label, color in ((off, "replay off", "#e6550d"), (on, "replay on", "#08519c")):
        a.plot(curves["steps"], curves["reward"], color=color, lw=1.5, label=label)
        b.plot(curves["steps"], [x if x and x > 0 else float("nan") for x in curves["gen_kl"]], color=color, lw=1.5,
               label=label)
    a.set(xlabel="GRPO step", ylabel="mean reward", title="reward", ylim=(0, 1.02))
    b.set(xlabel="GRPO step", ylabel="gen-KL (vLLM vs trainer)", title="gen-KL", yscale="log")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return str(png)


# ------------------------------------------------------------------ the runs

def run(root: str, out: str | None, steps: int, only: list[str], specdec: bool, timeout_s: int,
        prior: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    from tests.gpu import test_moe_two_gpu as moe  # noqa: PLC0415

    res: dict = {"check": "routing replay off vs on, tiny DeepSeek-V3 MoE, one GPU", "recipe": RECIPE, "runs": {}}
    earlier = Path(out) / "router_replay.json" if out else None
    if prior:  # the other half of the pair, from an earlier device call (--prior)
        earlier = Path(prior)
    if earlier and earlier.exists():  # two device calls (--only off, --only on) add to one file
        res = json.loads(earlier.read_text(encoding="utf-8"))
    res["command"] = f"python tests/gpu/test_router_replay.py --steps {steps} --only {','.join(only)}" + \
        ("" if specdec else " --no-specdec") + "".join(f" --set {x}" for x in extra)
    clock, lab = Timer(), moe.Lab(root, gpus=1)
    try:
        res["workspace"] = lab.workspace()
        for name in only:
            replay, t = name == "on", Timer()
            sets = sets_for(replay, steps, specdec, extra)
            entry: dict = {"sets": sets}
            try:
                bundle = lab.compile(RECIPE, f"r3_{name}", tuple(sets))
                got = lab.start_driver(bundle, [], "driver.log", timeout_s)
                curves = summarize(got["metrics"])
                entry.update(verdict_run(got["rc"], curves, steps, replay), curves=curves,
                             log_tail=moe._tail(got["log"], 8 if got["rc"] == 0 else 40))
                entry["replay_log"] = [line[:240] for line in got["log"].splitlines() if "routing replay" in line][:4]
            except Exception:  # noqa: BLE001 - the record says what broke
                entry.update(passed=False, error=traceback.format_exc()[-3000:])
            entry["seconds"] = t()
            res["runs"][name] = entry
            print(f"== router replay {name}: passed={entry.get('passed')} in {entry['seconds']} s", flush=True)
            dump(res, out, "router_replay")
    finally:
        lab.close()
    runs = res["runs"]
    if "curves" in runs.get("off", {}) and "curves" in runs.get("on", {}):
        res["comparison"] = compare(runs["off"]["curves"], runs["on"]["curves"])
        if out:
            res["plot"] = plot(runs["off"]["curves"], runs["on"]["curves"], Path(out) / "router_replay.png")
    res["passed"] = all(runs.get(n, {}).get("passed") for n in ("off", "on") if n in runs) and bool(runs)
    res["seconds_this_call"] = clock()
    dump(res, out, "router_replay")
    return res


@pytest.mark.gpu
def test_router_replay_on_and_off(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path), None, steps=10, only=["off", "on"], specdec=True, timeout_s=300)
    assert res["passed"], res


# ------------------------------------------------------------------ CPU checks of the verdicts

def _curves(steps, checked=5, mismatched=0, replay=True):
    rows = [{"step": s, "reward/mean": 0.1 * s, "gen_kl": 1e-4, "gen_logprob_abs_diff_mean": 0.01,
             "gen_logprob_abs_diff_max": 0.1} for s in range(1, steps + 1)]
    if replay:
        for r in rows:
            r.update({"router_replay/routes_checked": checked, "router_replay/routes_mismatched": mismatched,
                      "router_replay/layers_unarmed": 0, "router_replay/unrouted_tokens": 0})
    return summarize(rows + [{"step": 0, "refit/seconds": 1.0}])


def test_verdict_passes_a_clean_pair_and_compares_step_by_step():
    on, off = _curves(3), _curves(3, replay=False)
    assert verdict_run(0, on, 3, replay=True)["passed"] and verdict_run(0, off, 3, replay=False)["passed"]
    cmp = compare(off, on)
    assert cmp["steps_compared"] == 3 and cmp["per_step"][2]["reward_on"] == pytest.approx(0.3)
    assert cmp["gen_kl_mean_ratio_on_over_off"] == pytest.approx(1.0)


@pytest.mark.parametrize("rc,curves,words", [
    (0, _curves(3, mismatched=2), "6 (token, layer) routings differ"),
    (0, _curves(3, checked=0), "without routing checked"),
    (0, _curves(2), "2 of 3 steps"),
    (3, _curves(3), "exit code 3"),
    (0, _curves(3, replay=False), "without routing checked"),
])
def test_verdict_fails_on_each_kind_of_bad_evidence(rc, curves, words):
    res = verdict_run(rc, curves, 3, replay=True)
    assert not res["passed"] and any(words in r for r in res["reasons"]), res


def test_the_off_run_is_compiled_without_replay_and_the_drafter_can_be_dropped():
    assert "training.router_replay.enabled=false" in sets_for(False, 5, True)
    assert not set(SPECDEC) & set(sets_for(True, 5, False)) and set(SPECDEC) <= set(sets_for(True, 5, True))
    packed = sets_for(True, 5, True, ("training.sequence_packing.enabled=true",))
    assert packed[-1] == "training.sequence_packing.enabled=true"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/rlc-r3")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", default="on,off")
    ap.add_argument("--no-specdec", action="store_true")
    ap.add_argument("--timeout", type=int, default=280, help="seconds per run (startup included)")
    ap.add_argument("--prior", default=None, help="router_replay.json of the other half of the pair (earlier call)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="KEY=VALUE for both runs' rlc compile (e.g. training.sequence_packing.enabled=true)")
    a = ap.parse_args()
    names = [x for x in a.only.split(",") if x]
    if not names or set(names) - {"off", "on"}:
        ap.error("--only takes on, off or on,off")
    r = run(a.root, a.out, a.steps, names, not a.no_specdec, a.timeout, a.prior, tuple(a.sets))
    print({k: v for k, v in r.items() if k not in ("runs",)} | {"runs": {k: {kk: vv for kk, vv in v.items()
          if kk not in ("curves", "log_tail")} for k, v in r["runs"].items()}}, flush=True)
    sys.exit(0 if all(r["runs"].get(n, {}).get("passed") for n in names) else 1)

"""GPU check: GRPO on the tiny DeepSeek-V3 MoE on one GPU, with MTP speculative decoding in vLLM.

The shipped recipe ``tiny-moe-mtp-2gpu-ep2`` (a tiny random DeepSeek-V3: 8 routed experts, router bias kept in
fp32, one MTP layer) compiled for one GPU (trainer EP 1, one vLLM engine) with
``generation.speculative_decoding: {method: mtp, num_speculative_tokens: 1}`` at ``refit.sleep_level: 1`` and
``training.mtp_loss_scale: 0``, run by the bundled runtime for ``--steps`` GRPO steps with a bit-exact refit
check every ``--verify-every`` refits. Passes when the 10-step mean reward reaches the toy task's goal, every step
refits, gen-KL stays under the goal (speculative decoding must not change the sampled distribution) and the
verified refits are bit exact. Uses the two-GPU proofs' workspace and verdicts (``test_moe_two_gpu.py``).

    python tests/gpu/test_moe_one_gpu.py [--steps 200] [--root /tmp/rlc-moe1] [--out DIR] [--set KEY=VALUE ...]

``--set`` (or ``MOE1_SETS="k=v k=v"`` in the environment, e.g. for ``host_run.sh STAGE moe1``) compiles the same
check with more overrides, e.g. ``training.router_replay.enabled=true`` or ``loss.kl_penalty=0.01``.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu import test_moe_two_gpu as moe

RECIPE = "tiny-moe-mtp-2gpu-ep2"
ONE_GPU = ("cluster.gpus_per_node=1", "parallelism.train.ep=1", "parallelism.generation.ep=1",
           "generation.speculative_decoding.method=mtp", "generation.speculative_decoding.num_speculative_tokens=1",
           "refit.sleep_level=1", "training.mtp_loss_scale=0")


def run(root: str, out: str | None, steps: int, verify_every: int, extra: tuple[str, ...] = ()) -> dict:
    """``extra``: more ``--set KEY=VALUE`` for ``rlc compile`` (e.g. another feature switched on for the same check)."""
    from rlc.contract.runtime_config import load_runtime_config  # noqa: PLC0415

    clock, lab = Timer(), moe.Lab(root, gpus=1)
    sets = (*ONE_GPU, f"grpo.max_steps={steps}", *extra)
    res: dict = {"check": "tiny DeepSeek-V3 MoE GRPO on one GPU with MTP speculative decoding",
                 "command": "python tests/gpu/test_moe_one_gpu.py" + "".join(f" --set {s}" for s in extra),
                 "recipe": RECIPE, "sets": list(sets)}
    try:
        lab.workspace()
        bundle = lab.compile(RECIPE, "learn_1gpu_mtp", sets)
        cfg = load_runtime_config(bundle / "runtime.yaml")
        res["speculative_decoding"] = str(cfg.generation.speculative_decoding)
        got = lab.start_driver(bundle, [f"refit.verify_every={verify_every}"], "driver.log", 560)
        res["learning"] = moe.verdict_learning(got, steps, moe._switches(bundle))
        res["bit_exact"] = moe.verdict_bit_exact(got, refits=1 + steps // verify_every,
                                                 min_fp32=moe._router_biases_per_worker())
        res["calibration"] = got["calibration"]
        res["drafter_log"] = [line[:240] for line in got["log"].splitlines()
                              if "drafter" in line.lower() or "MTP model" in line][:6]
        res["passed"] = bool(res["learning"]["passed"] and res["bit_exact"]["passed"])
        res["log_tail"] = moe._tail(got["log"], 8 if res["passed"] else 40)
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-3000:]
        res["passed"] = False
    finally:
        lab.close()
    res["seconds"] = clock()
    dump(res, out, "moe_one_gpu_mtp")
    return res


@pytest.mark.gpu
def test_moe_one_gpu_mtp(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path), None, steps=60, verify_every=20)
    assert res["passed"], res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/rlc-moe1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--verify-every", type=int, default=25)
    ap.add_argument("--set", dest="sets", action="append", default=os.environ.get("MOE1_SETS", "").split(),
                    metavar="KEY=VALUE", help="one more recipe override for rlc compile (repeatable; default: "
                    "the space-separated MOE1_SETS, which host_run.sh's moe1 stage passes through)")
    a = ap.parse_args()
    r = run(a.root, a.out, a.steps, a.verify_every, tuple(a.sets))
    print({k: v for k, v in r.items() if k not in ("calibration",)}, flush=True)
    sys.exit(0 if r["passed"] else 1)

"""Mutation check of core behaviours: does the suite catch small, plausible bugs?

Each mutation is one textual change to one product file (a comparison flipped, a check dropped, a
normalisation removed). For each, the product tree is copied to a temporary folder, the mutation is
applied there (the checkout is never touched), and the tests that guard that behaviour run against
the copy. A mutation is *caught* when those tests fail, *survives* when they pass. A mutation whose
text no longer matches the product (the code moved on) is reported as stale, and counts as a failure
of this check: update its ``old`` text.

    python tests/mutation/check.py            # all mutations, a table, exit 1 if any survives or is stale
    python tests/mutation/check.py --list     # names only
    python tests/mutation/check.py NAME...    # some of them
    python tests/mutation/check.py -j 2       # two at a time

The score is reported in docs/testing.md; CI runs every mutation (tests/mutation/test_mutation_run.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    behaviour: str
    path: str  # product file, relative to the repository root
    old: str  # exact text replaced (must occur once)
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that must catch it


MUTATIONS = (
    Mutation(
        "advantages-batch-std",
        "advantages",
        "rlc/runtime/grpo/advantages.py",
        "std = s.std(dim=1, keepdim=True, unbiased=True)",
        "std = s.std(unbiased=True).expand_as(mean)",
        ("tests/runtime/test_grpo_advantages.py", "tests/runtime/test_grpo_reference.py"),
    ),
    Mutation(
        "advantages-biased-std",
        "advantages",
        "rlc/runtime/grpo/advantages.py",
        "std = s.std(dim=1, keepdim=True, unbiased=True)",
        "std = s.std(dim=1, keepdim=True, unbiased=False)",
        ("tests/runtime/test_grpo_advantages.py", "tests/runtime/test_grpo_reference.py"),
    ),
    Mutation(
        "advantages-loo-baseline",
        "advantages",
        "rlc/runtime/grpo/advantages.py",
        "baseline = (r.sum(dim=1, keepdim=True) - r) / (g - 1)",
        "baseline = r.sum(dim=1, keepdim=True) / g",
        ("tests/runtime/test_grpo_advantages.py", "tests/runtime/test_grpo_reference.py"),
    ),
    Mutation(
        "manifest-device-key",
        "refit manifest",
        "rlc/runtime/refit/manifest.py",
        "if meta.producer_rank != self.producer_rank or meta.device_key != self.device_key:",
        "if meta.producer_rank != self.producer_rank:",
        ("tests/refit/test_refit_manifest.py",),
    ),
    Mutation(
        "manifest-producer-rank",
        "refit manifest",
        "rlc/runtime/refit/manifest.py",
        "if meta.producer_rank != self.producer_rank or meta.device_key != self.device_key:",
        "if meta.device_key != self.device_key:",
        ("tests/refit/test_refit_manifest.py",),
    ),
    Mutation(
        "buffer-half-boundary",
        "RLC210 / refit buffer",
        "rlc/contract/refit_buffer.py",
        "return tensor_bytes <= half",
        "return tensor_bytes < half",
        ("tests/planner/test_rules_each.py",),
    ),
    Mutation(
        "rlc210-planner-strict",
        "RLC210 / refit buffer",
        "rlc/compiler/planner/memory.py",
        '"buffer", refit_buffer.half_holds(math.per_side, on_wire),',
        '"buffer", math.per_side > on_wire,',
        ("tests/planner/test_rules_each.py",),
    ),
    Mutation(
        "shell-del-allowed",
        "shell quoting",
        "rlc/compiler/shell.py",
        r'_CONTROL = re.compile(r"[\x00-\x1f\x7f]")',
        r'_CONTROL = re.compile(r"[\x00-\x1f]")',
        ("tests/bundle/test_bundle_shell.py",),
    ),
    Mutation(
        "shell-nul-allowed",
        "shell quoting",
        "rlc/compiler/shell.py",
        'if "\\x00" in text:',
        "if False:",
        ("tests/bundle/test_bundle_shell.py",),
    ),
    Mutation(
        "did-you-mean-dash",
        "did-you-mean",
        "rlc/compiler/suggest.py",
        'return text.lower().replace("-", "_")',
        "return text.lower()",
        ("tests/compiler/test_compiler_diagnostics.py",),
    ),
    Mutation(
        "did-you-mean-case",
        "did-you-mean",
        "rlc/compiler/suggest.py",
        'return text.lower().replace("-", "_")',
        'return text.replace("-", "_")',
        ("tests/compiler/test_compiler_diagnostics.py",),
    ),
    Mutation(
        "loss-dual-clip-off",
        "GRPO loss",
        "rlc/runtime/grpo/loss.py",
        "per_token = torch.where(dual_active, loss_dual, per_token)",
        "per_token = per_token",
        ("tests/runtime/test_grpo_loss.py", "tests/runtime/test_grpo_reference.py"),
    ),
    Mutation(
        "loss-padding-unmasked",
        "GRPO loss",
        "rlc/runtime/grpo/loss.py",
        "new = torch.where(keep, logprobs, zero)",
        "new = logprobs",
        ("tests/runtime/test_grpo_loss.py", "tests/runtime/test_grpo_reference.py"),
    ),
    Mutation(
        "reward-failure-raises",
        "rewards",
        "rlc/runtime/grpo/rewards.py",
        "    except Exception as exc:  # noqa: BLE001",
        "    except ArithmeticError as exc:  # noqa: BLE001",
        ("tests/runtime/test_grpo_rewards.py",),
    ),
    # ---- per-GPU shard math (the planner's stage shards)
    Mutation(
        "shards-experts-ignore-etp",
        "shard math",
        "rlc/compiler/planner/shards.py",
        "        expert = split.expert // expert_shards",
        "        expert = split.expert // layout.ep",
        ("tests/planner/test_shard_math.py",),
    ),
    Mutation(
        "shards-replicated-dropped",
        "shard math",
        "rlc/compiler/planner/shards.py",
        "        dense = split.tp // layout.tp + split.replicated + copies * vocab\n"
        "        out.append(StageShard(stage=s, layers=len(indices), dense=dense, expert=expert",
        "        dense = split.tp // layout.tp + copies * vocab\n"
        "        out.append(StageShard(stage=s, layers=len(indices), dense=dense, expert=expert",
        ("tests/planner/test_shard_math.py",),
    ),
    Mutation(
        "shards-mtp-replica-on-one-stage",
        "shard math",
        "rlc/compiler/planner/shards.py",
        "                elif not first and not facts.tied_embeddings:",
        "                elif not facts.tied_embeddings:",
        ("tests/planner/test_shard_math.py",),
    ),
    Mutation(
        "shards-vllm-experts-by-ep",
        "shard math",
        "rlc/compiler/planner/shards.py",
        "expert=split.expert // layout.expert_shards",
        "expert=split.expert // layout.ep",
        ("tests/planner/test_shard_math.py",),
    ),
    Mutation(
        "shards-vllm-drafter-embedding",
        "shard math",
        "rlc/compiler/planner/shards.py",
        "            if len(stages) > 1:\n                copies += 1  # the drafter",
        "            if len(stages) > 0:\n                copies += 1  # the drafter",
        ("tests/planner/test_shard_math.py",),
    ),
    # ---- shell quoting of #SBATCH values
    Mutation(
        "sbatch-hash-plain",
        "#SBATCH quoting",
        "rlc/compiler/shell.py",
        '_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:=,%+@-]+")',
        '_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:=,%+@#-]+")',
        ("tests/bundle/test_sbatch_tokenizer.py",),
    ),
    Mutation(
        "sbatch-backslash-unescaped",
        "#SBATCH quoting",
        "rlc/compiler/shell.py",
        """return Quoted('"' + text.replace("\\\\", "\\\\\\\\").replace('"', '\\\\"') + '"')""",
        """return Quoted('"' + text.replace('"', '\\\\"') + '"')""",
        ("tests/bundle/test_sbatch_tokenizer.py",),
    ),
    Mutation(
        "sbatch-percent-once",
        "#SBATCH quoting",
        "rlc/compiler/shell.py",
        'text = text.replace("%", "%%")',
        'text = text.replace("%", "%%", 1)',
        ("tests/bundle/test_sbatch_tokenizer.py",),
    ),
    # ---- the lock's verification of the file tree
    Mutation(
        "lock-added-entries-ignored",
        "bundle tree lock",
        "rlc/compiler/bundle/lock.py",
        '    problems += [f"{rel} was added" for rel in sorted(set(present) - set(recorded_tree))]',
        "    problems += []",
        ("tests/bundle/test_bundle_tree_lock.py",),
    ),
    Mutation(
        "lock-modes-ignored",
        "bundle tree lock",
        "rlc/compiler/bundle/lock.py",
        "            if now[1] != was[1]:",
        "            if False:",
        ("tests/bundle/test_bundle_tree_lock.py",),
    ),
    Mutation(
        "job-check-tree-skipped",
        "bundle tree lock",
        "rlc/templates/bundle/launch.sbatch.j2",
        '  [ "$tree" = "$(<files.tree)" ] || exit 1',
        "  true",
        ("tests/bundle/test_bundle_tree_lock.py",),
    ),
    Mutation(
        "job-check-links-listed-as-files",
        "bundle tree lock",
        "rlc/compiler/bundle/lock.py",
        '_TYPES = ((stat.S_ISREG, "f"), (stat.S_ISDIR, "d"), (stat.S_ISLNK, "l"),',
        '_TYPES = ((stat.S_ISREG, "f"), (stat.S_ISDIR, "d"), (stat.S_ISLNK, "f"),',
        ("tests/bundle/test_bundle_tree_lock.py",),
    ),
    # ---- the checkpoint fingerprint
    # (a policy declared wrong in rlc/compiler/recipe_types.py reaches the runtime through the generated types)
    Mutation(
        "fingerprint-fp8-dropped",
        "checkpoint fingerprint",
        "rlc/contract/runtime_types.py",
        'enabled: bool = runtime_key(EXPERIMENT, recipe="training.fp8.enabled")',
        'enabled: bool = runtime_key(_SPEED, recipe="training.fp8.enabled")',
        ("tests/runtime/test_checkpoint_fingerprint.py",),
    ),
    Mutation(
        "fingerprint-sections-not-flattened",
        "checkpoint fingerprint",
        "rlc/runtime/checkpoint.py",
        "        if isinstance(value, dict):\n            for k in sorted(value):",
        "        if False:\n            for k in sorted(value):",
        ("tests/runtime/test_checkpoint_fingerprint.py",),
    ),
    Mutation(
        "fingerprint-restart-key-counted",
        "checkpoint fingerprint",
        "rlc/contract/runtime_types.py",
        'max_steps: int = runtime_key(restart("how long the run goes"), recipe="grpo.max_steps")',
        'max_steps: int = runtime_key(EXPERIMENT, recipe="grpo.max_steps")',
        ("tests/runtime/test_checkpoint_fingerprint.py",),
    ),
    # ---- origin tracking through merged mappings
    Mutation(
        "origins-merged-mapping-keeps-parent",
        "origin tracking",
        "rlc/compiler/recipe.py",
        "                dst_origins[path] = src_origins[path]",
        "                pass",
        ("tests/compiler/test_origins_merge.py",),
    ),
    Mutation(
        "origins-replaced-not-pruned",
        "origin tracking",
        "rlc/compiler/recipe.py",
        "                _prune(dst_origins, path)",
        "                pass",
        ("tests/compiler/test_origins_merge.py",),
    ),
    Mutation(
        "origins-nested-not-grafted",
        "origin tracking",
        "rlc/compiler/recipe.py",
        "    for key in (prefix, *_subpaths(value, prefix)):",
        "    for key in (prefix,):",
        ("tests/compiler/test_origins_merge.py",),
    ),
    Mutation(
        "origins-set-not-pruned",
        "origin tracking",
        "rlc/compiler/recipe.py",
        "            _prune(origins, key_path)\n            node[part] = copy.deepcopy(value)",
        "            node[part] = copy.deepcopy(value)",
        ("tests/compiler/test_origins_merge.py",),
    ),
)

#: The behaviours whose mutations run in CI (tests/mutation/test_mutation_run.py).
CI_BEHAVIOURS = ("shard math", "#SBATCH quoting", "bundle tree lock", "checkpoint fingerprint", "origin tracking")

PRODUCT = ("rlc", "tests", "pyproject.toml")


def apply(mutation: Mutation, root: Path) -> bool:
    """Apply ``mutation`` under ``root``; False when its ``old`` text is not there exactly once."""
    target = root / mutation.path
    text = target.read_text(encoding="utf-8")
    if text.count(mutation.old) != 1:
        return False
    target.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")
    return True


def run_one(mutation: Mutation) -> str:
    """``caught``, ``survived`` or ``stale``."""
    with tempfile.TemporaryDirectory(prefix="rlc-mutation-") as tmp:
        root = Path(tmp)
        for name in PRODUCT:
            src = REPO / name
            if src.is_dir():
                shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
            else:
                shutil.copy2(src, root / name)
        if not apply(mutation, root):
            return "stale"
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slurm and not gpu",
               *mutation.tests]
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        # 1: tests failed (caught); 0: all passed (survived); anything else is a broken run
        if done.returncode == 1:
            return "caught"
        if done.returncode == 0:
            return "survived"
        raise RuntimeError(
            f"{mutation.name}: pytest exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def run_many(mutations: list[Mutation], jobs: int = 1) -> list[tuple[Mutation, str]]:
    """``(mutation, verdict)`` for each, ``jobs`` at a time (each runs in its own copy and process)."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(zip(mutations, pool.map(run_one, mutations)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutations run at a time")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:26} {m.behaviour:22} {m.path}")
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; see --list")
    chosen = [by_name[n] for n in args.names] if args.names else list(MUTATIONS)
    results = run_many(chosen, args.jobs)
    for m, verdict in results:
        print(f"{verdict:9} {m.name:26} {m.behaviour:22} {m.path}", flush=True)
    caught = sum(v == "caught" for _, v in results)
    print(f"score: {caught}/{len(results)} mutations caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

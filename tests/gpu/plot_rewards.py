"""Reward curve (and gen-KL) of a run's ``metrics.jsonl`` as a PNG (matplotlib, headless).

    python tests/gpu/plot_rewards.py METRICS.jsonl OUT.png [--title T]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(metrics_path: str | Path, png_path: str | Path, title: str = "GRPO reward") -> Path:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = []
    for line in Path(metrics_path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            r = json.loads(line)
            if "reward/mean" in r:
                rows.append(r)
    steps = [r["step"] for r in rows]
    reward = [float(r["reward/mean"]) for r in rows]
    smooth = [sum(reward[max(0, i - 9) : i + 1]) / len(reward[max(0, i - 9) : i + 1]) for i in range(len(reward))]
    kl = [float(r["gen_kl"]) if isinstance(r.get("gen_kl"), (int, float)) else float("nan") for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(steps, reward, color="#9ecae1", lw=1, label="mean reward (step)")
    ax.plot(steps, smooth, color="#08519c", lw=2, label="mean reward (10-step mean)")
    ax.axhline(0.8, color="gray", ls="--", lw=1, label="goal 0.8")
    ax.axhline(0.1, color="gray", ls=":", lw=1, label="chance 0.1")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax2 = ax.twinx()
    ax2.plot(steps, kl, color="#e6550d", lw=1, alpha=0.7, label="gen-KL")
    ax2.set_ylabel("gen-KL (vLLM vs trainer)", color="#e6550d")
    ax2.set_yscale("log")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("png")
    ap.add_argument("--title", default="GRPO reward")
    a = ap.parse_args()
    print(plot(a.metrics, a.png, a.title))

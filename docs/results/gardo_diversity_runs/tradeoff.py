"""The cost-against-diversity picture of docs/results.md §2.10, and the GARDO arm's own logs, from the kept runs.

Each run's final eval_watch_geneval (the trained score, as both arms are scored) against its final eval_diversity,
an arrow from the shared epoch-0 point (the shipped model) per run; then, per GARDO run, how often its reference was
reset, the KL gate's mean gated fraction and the mean diversity weight of its training images.
    python docs/results/gardo_diversity_runs/tradeoff.py [FIGURE]   # docs/results/gardo_diversity_tradeoff.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
COLOURS = {"outcome": "tab:blue", "gardo": "tab:orange"}


def evaluations(path: Path) -> dict[int, dict]:
    """{epoch evaluated: its eval_* figures}: a run logs its last evaluation on every line until the next one."""
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "eval_diversity" in row:
            out.setdefault(int(row.get("last_eval_epoch", row["epoch"])), row)
    return out


def main() -> None:
    figure = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "gardo_diversity_tradeoff.png"
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for arm, colour in COLOURS.items():
        for run in sorted((HERE / arm).glob("seed_*/metrics.jsonl")):
            evals = evaluations(run)
            first, last = evals[min(evals)], evals[max(evals)]
            x0, y0 = first["eval_diversity"], first["eval_watch_geneval"]
            x1, y1 = last["eval_diversity"], last["eval_watch_geneval"]
            ax.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "->", "color": colour, "alpha": 0.5})
            ax.plot(x1, y1, "o", color=colour, label=arm if run.parent.name == "seed_80" else None)
            ax.text(x1, y1, run.parent.name.removeprefix("seed_"), fontsize=7, color=colour)
            if arm == "gardo":
                rows = [json.loads(x) for x in run.read_text().splitlines()]
                rows = [r for r in rows if "kl_gated_fraction" in r]
                resets, n = sum(r["reference_reset"] for r in rows), len(rows)
                gated = sum(r["kl_gated_fraction"] for r in rows) / n
                weight = sum(r["reward_diversity_weight"] for r in rows) / n
                print(
                    f"gardo {run.parent.name}: reference reset after {resets:.0f} of {n} epochs, "
                    f"gated fraction {gated:.3f}, diversity weight {weight:.3f}"
                )
    ax.plot(x0, y0, "ks", label="epoch 0 (shipped model)")
    ax.set_xlabel("eval_diversity (final)")
    ax.set_ylabel("eval_watch_geneval (final; the trained score)")
    ax.set_title("GARDO against Flow-GRPO: each run from epoch 0 to 20")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    print(f"figure: {figure}")


if __name__ == "__main__":
    main()

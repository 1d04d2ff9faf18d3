"""Learning speed of the four credit assigners on the shapes task, everything else identical, several seeds.

    .venv/bin/python benchmarks/learning_curves.py [--epochs 12] [--eval-every 3] [--seeds 0 1 2] [--out runs/lc]

Runs ``recipes/shapes_{flowgrpo,incremental,turning_point,tp}.toml`` (they differ only in ``[credit]``) for a fixed
number of epochs per seed, interleaved (seed-major) so that any slow-down of the machine hits every assigner alike.
Each run's eval reward (ODE samples of the same held-out prompts) is read from its metrics.jsonl against epochs and
against cumulative training seconds (evaluation time excluded). For every seed, the target is the outcome
(Flow-GRPO) run's final eval reward; the table gives, per assigner, the epochs and seconds it needs to reach it
(mean ± std over the seeds that reach it, and how many do). Writes docs/results/learning_curves.{png,json,md}.
Finished runs are kept in --out and skipped on a re-run, so an interrupted benchmark continues where it stopped.
Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
ASSIGNERS = {  # label -> recipe
    "outcome (Flow-GRPO)": "shapes_flowgrpo",
    "incremental": "shapes_incremental",
    "turning_point": "shapes_turning_point",
    "consistent (TP-GRPO)": "shapes_tp",
}


def run_one(recipe: str, seed: int, epochs: int, every: int, out: Path) -> dict:
    """Train one recipe with one seed (or read its finished result); eval reward vs epoch and training seconds."""
    from tpflow.recipe import load_recipe
    from tpflow.train.run_logger import read_jsonl
    from tpflow.train.trainer import Trainer

    done = out / f"{recipe}_s{seed}.json"
    if done.exists():
        return json.loads(done.read_text())
    run_dir = out / f"{recipe}_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts over
    overrides = [f"train.seed={seed}", f"train.epochs={epochs}", f"eval.every={every}", "train.save_every=0"]
    trainer = Trainer(load_recipe(ROOT / "recipes" / f"{recipe}.toml", overrides), run_dir=run_dir, console=Console())
    trainer.fit()
    lines = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [line for line in lines if "epoch_s" in line]
    seconds, elapsed = [0.0], 0.0  # cumulative training seconds after e epochs
    for line in train_lines:
        elapsed += line["epoch_s"]
        seconds.append(elapsed)
    evals = {}  # epochs trained -> eval reward
    for line in train_lines:
        if line["epoch"] % every == 0:
            evals[line["epoch"]] = line["eval_reward"]
    evals[epochs] = next(line["eval_reward"] for line in reversed(lines) if "epoch_s" not in line)
    result = {
        "recipe": recipe,
        "seed": seed,
        "epochs": sorted(evals),
        "eval_reward": [evals[e] for e in sorted(evals)],
        "seconds": [seconds[e] for e in sorted(evals)],
        "epoch_s_mean": statistics.mean(line["epoch_s"] for line in train_lines),
        "nfe_per_traj": train_lines[0]["nfe_per_traj"],
    }
    done.write_text(json.dumps(result, indent=2))
    return result


def reach(result: dict, target: float) -> tuple[int, float] | None:
    """First evaluated (epochs, seconds) at which the eval reward is at least ``target``; None if never."""
    for epoch, reward, sec in zip(result["epochs"], result["eval_reward"], result["seconds"], strict=True):
        if reward >= target - 1e-12:
            return epoch, sec
    return None


def fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "—"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def table(results: dict[str, list[dict]], seeds: list[int]) -> str:
    base = {r["seed"]: r["eval_reward"][-1] for r in results["outcome (Flow-GRPO)"]}
    rows = [
        "| assigner | NFE / traj | s / epoch | eval reward at 0 | final eval reward | epochs to reach Flow-GRPO's "
        "final | seconds to reach it | seeds reaching |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in results.items():
        hits = [h for h in (reach(r, base[r["seed"]]) for r in runs) if h is not None]
        rows.append(
            f"| {label} | {runs[0]['nfe_per_traj']:g} | {fmt([r['epoch_s_mean'] for r in runs])} "
            f"| {fmt([r['eval_reward'][0] for r in runs], 3)} | {fmt([r['eval_reward'][-1] for r in runs], 3)} "
            f"| {fmt([h[0] for h in hits])} | {fmt([h[1] for h in hits], 0)} | {len(hits)}/{len(seeds)} |"
        )
    return "\n".join(rows)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (label, runs), color in zip(results.items(), ["tab:gray", "tab:blue", "tab:orange", "tab:red"], strict=True):
        for i, r in enumerate(runs):
            kw = {"color": color, "alpha": 0.8, "marker": "o", "markersize": 3, "label": label if i == 0 else None}
            axes[0].plot(r["epochs"], r["eval_reward"], **kw)
            axes[1].plot(r["seconds"], r["eval_reward"], **kw)
    axes[0].set_xlabel("epochs")
    axes[1].set_xlabel("training seconds (2 CPU cores, eval excluded)")
    for ax in axes:
        ax.set_ylabel("eval reward (partial GenEval, held-out prompts)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("shapes world: credit assigners, one line per seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_curves")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {label: [] for label in ASSIGNERS}
    for seed in args.seeds:
        for label, recipe in ASSIGNERS.items():
            results[label].append(run_one(recipe, seed, args.epochs, args.eval_every, args.out))
    text = table(results, args.seeds)
    print(text)
    args.docs.mkdir(parents=True, exist_ok=True)
    (args.docs / "learning_curves.json").write_text(json.dumps(results, indent=2))
    (args.docs / "learning_curves.md").write_text(text + "\n")
    plot(results, args.docs / "learning_curves.png")
    print(f"wrote {args.docs / 'learning_curves.png'}")


if __name__ == "__main__":
    main()

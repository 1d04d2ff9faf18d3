"""Analysis of Evidence II (``evidence.py``): per-run summaries, paired t intervals, Holm, and the report tables.

Statistics (docs/results.md §2.1): a comparison of arm X with ``outcome`` is the per-seed paired difference
(same seed: same prompts, noise, LoRA initialisation and eval noise), summarised by its mean and a two-sided 95%
Student t interval over every seed (n − 1 degrees of freedom); a percentile bootstrap of the same differences is
printed beside it as a cross-check only. Secondary comparisons are Holm-corrected together (p values from the same
paired t test). No seed is ever dropped: a run that has not finished makes the table say so.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
from scipy import stats

import tpflow.experiments.compare as experiment_stats
import tpflow.experiments.curves as curves
from tpflow.intervals import holm, t_interval  # noqa: F401  (re-exported: the sweep reports import them from here)

PRIMARY = "eval_reward_tags"  # soft reward, per-tag mean then mean over the six tags, on the distinct prompts
STRICT = "eval_strict_tags"
BASELINE = "outcome"
PILOT_GROUPS = {  # folder -> the eval set its runs were measured on
    "pilots": "round 1, eval on the 126 distinct prompts x 4 images, eval noise seeded train.seed + 12345",
    "pilots2": "eval on the 126 distinct prompts, small tags repeated to >= 24 prompts (195 x 4 = 780 images), "
    "one eval noise (12345) for every run",
}


# ---- one run ---------------------------------------------------------------------------------------------------


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(run_dir: Path, data: dict, base: dict | None = None) -> dict:
    """Every evaluation of one finished run (all ``eval_*`` figures, with the epoch and the training seconds spent
    before it), the per-epoch training figures, the credit diagnostics and the credit audit's verdict. ``base``: the
    shared epoch-0 evaluation, for a run that skipped its own (``eval.at_start = false``)."""
    from _learning_stats import trace_diagnostics
    from credit_audit import audit

    lines = _read(run_dir / "metrics.jsonl")
    train = [line for line in lines if "epoch_s" in line]
    seconds = np.concatenate([[0.0], np.cumsum([line["epoch_s"] for line in train])])  # before epoch e
    evals = [] if base is None else [dict(base)]
    for line in lines:  # an eval is logged on the line of the epoch it preceded, the final one on its own line
        if "eval_reward" in line and line.get("last_eval_epoch") == line["epoch"]:
            e = line["epoch"]
            figures = {k: v for k, v in line.items() if k.startswith("eval_")}
            evals.append({"epoch": e, "seconds": float(seconds[min(e, len(train))]), **figures})
    keys = ("reward_mean", "reward_std", "clip_fraction", "optimizer_steps", "trajectories_trained", "epoch_s",
            "approx_kl", "grad_norm")  # fmt: skip
    return {
        "evals": evals,
        "train": {k: [line.get(k) for line in train] for k in keys},
        "nfe_per_traj": train[0]["nfe_per_traj"],
        "epochs": data["train"]["epochs"],
        **trace_diagnostics(_read(run_dir / "traces.jsonl")),
        "audit": _audit(audit, run_dir),
    }


def _audit(audit, run_dir: Path) -> dict:
    try:
        return {"ok": True, **audit(run_dir)}
    except AssertionError as error:  # a mismatch: kept in the summary, reported, never hidden
        return {"ok": False, "error": str(error)}


def curve(run: dict, key: str = PRIMARY) -> tuple[list[int], list[float]]:
    """(epochs, values) of one eval figure over a run (``tpflow.experiments.curves.curve``)."""
    return curves.curve(run, key)


def auc(run: dict, key: str = PRIMARY) -> float:
    """Mean of the eval figure over training (``tpflow.experiments.curves.auc``)."""
    return curves.auc(run, key)


def gain(run: dict, key: str = PRIMARY) -> float:
    """Final eval figure minus the first (epoch 0: the base model)."""
    _, y = curve(run, key)
    return y[-1] - y[0]


# ---- across seeds ----------------------------------------------------------------------------------------------


def bootstrap(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean (``tpflow.experiments.compare.bootstrap``)."""
    return experiment_stats.bootstrap(values, resamples, seed)


def seeds_needed(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds a two-sided paired t test needs to detect a mean difference ``effect`` with ``power``, given the
    standard deviation ``sd`` of the per-seed differences (iterated on the t quantiles, at least 2)."""
    n = 2
    while n < 10_000:
        df = n - 1
        noncentral = effect / (sd / math.sqrt(n))
        crit = stats.t.ppf(1 - alpha / 2, df)
        if 1 - stats.nct.cdf(crit, df, noncentral) + stats.nct.cdf(-crit, df, noncentral) >= power:
            return n
        n += 1
    return n


# ---- report ----------------------------------------------------------------------------------------------------


def _load(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def _mean(values: list, digits: int = 3) -> str:
    """Mean of the logged values, "—" when the run's optimizer does not log the figure (NFT has no clip)."""
    present = [v for v in values if v is not None]
    return f"{statistics.mean(present):.{digits}f}" if present else "—"


def pilot_table(runs: list[dict], order: list[str]) -> str:
    """Markdown: one row per pilot run (every seed), eval figures at every evaluation, gain, training figures."""
    rows = [
        "| pilot | seed | eval reward (tag mean) by epoch | gain | strict (tags) first → last | held-out soft first → "
        "last | train reward first 3 → last 3 epochs | clip frac | steps/epoch | s/epoch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (order.index(r["name"]) if r["name"] in order else 99, r["seed"])):
        epochs, values = curve(run)
        _, strict = curve(run, STRICT)
        held = [e.get("eval_reward_held_out", math.nan) for e in run["evals"]]
        tr = run["train"]["reward_mean"]
        rows.append(
            f"| {run['name']} | {run['seed']} | "
            + " → ".join(f"{v:.3f}@{e}" for e, v in zip(epochs, values, strict=True))
            + f" | {values[-1] - values[0]:+.3f} | {strict[0]:.3f} → {strict[-1]:.3f} | {held[0]:.3f} → {held[-1]:.3f}"
            f" | {statistics.mean(tr[:3]):.3f} → {statistics.mean(tr[-3:]):.3f}"
            f" | {_mean(run['train']['clip_fraction'])}"
            f" | {_mean(run['train']['optimizer_steps'], 1)}"
            f" | {statistics.mean(run['train']['epoch_s']):.1f} |"
        )
    return "\n".join(rows)


TAGS = ("single_object", "two_object", "counting", "colors", "color_attr", "position")


def tag_trend_table(out: Path, runs: list[dict], order: list[str]) -> str:
    """Markdown: per run, each tag's mean training reward (the SDE samples' final reward, from traces.jsonl) over
    the first and the last quarter of the epochs: does the training reward rise, and on which tags?"""
    rows = ["| pilot | seed | " + " | ".join(TAGS) + " |", "|---|---|" + "---|" * len(TAGS)]
    for run in sorted(runs, key=lambda r: (order.index(r["name"]) if r["name"] in order else 99, r["seed"])):
        traces = out / run["group"] / f"{run['name']}_s{run['seed']}" / "traces.jsonl"
        if not traces.exists():
            continue
        quarter = max(1, run["epochs"] // 4)
        first: dict[str, list[float]] = {t: [] for t in TAGS}
        last: dict[str, list[float]] = {t: [] for t in TAGS}
        for t in _read(traces):
            if t["epoch"] < quarter:
                first[t["tag"]].append(t["trace"][-1])
            elif t["epoch"] >= run["epochs"] - quarter:
                last[t["tag"]].append(t["trace"][-1])
        cells = [
            f"{statistics.mean(first[t]):.2f} → {statistics.mean(last[t]):.2f}" if first[t] and last[t] else "—"
            for t in TAGS
        ]
        rows.append(f"| {run['name']} | {run['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(out: Path, pilots: dict, protocol: dict, docs: Path) -> None:
    """Print and write the pilot table (``docs/evidence_pilots.md``) and, once the sweep has runs, its tables
    (``docs/evidence_sweep.md``: per arm, the paired comparisons with the primary first, every seed)."""
    docs.mkdir(parents=True, exist_ok=True)
    every = {group: _load(out / group) for group in (*PILOT_GROUPS, "sweep")}
    (docs / "evidence_runs.json").write_text(json.dumps(every, indent=0))  # every run's summary, as committed data
    parts = ["# Evidence II pilots (outcome credit only)"]
    for group, label in PILOT_GROUPS.items():
        runs = _load(out / group)
        if runs:
            parts += ["", f"## {group}: {label}", "", pilot_table(runs, list(pilots)), "",
                      "Training reward (SDE samples) per tag, first quarter of the epochs → last quarter:", "",
                      tag_trend_table(out, runs, list(pilots))]  # fmt: skip
    if len(parts) > 1:
        text = "\n".join(parts) + "\n"
        print(text)
        (docs / "evidence_pilots.md").write_text(text)
    by_arm: dict[str, list[dict]] = {}
    for run in _load(out / "sweep"):
        by_arm.setdefault(run["name"], []).append(run)
    if by_arm:
        from _evidence_cost import cost_lines, phase_line

        # the round-2 outcome pilots, run with two seeds each: the spread the protocol's seed count was planned on
        outcome_pilots = [r for r in every["pilots2"] if not r["name"].startswith("nft")]

        nft = {arm: by_arm[arm] for arm in (BASELINE, "nft") if arm in by_arm}
        by_arm = {arm: by_arm[arm] for arm in protocol["arms"] if arm in by_arm}
        analysis = sweep_analysis(by_arm, protocol["primary_arm"])
        missing = [f"{a}_s{s}" for a in protocol["arms"] for s in protocol["seeds"]
                   if s not in {r["seed"] for r in by_arm.get(a, [])}]  # fmt: skip
        parts = [
            "# Evidence II sweep",
            "",
            arm_table(by_arm),
            "",
            comparison_table(analysis),
            "",
            seed_table(by_arm),
            "",
            f"Runs not finished: {', '.join(missing) or 'none'}.",
            "",
            per_seed_lines(by_arm),
            "",
            spread_line(by_arm, analysis, outcome_pilots),
            "",
            phase_line(out / "sweep", {**by_arm, **nft}),
            "",
            cost_lines(out / "sweep", {**by_arm, **nft}),
        ]
        if "nft" in nft:  # DiffusionNFT against outcome: its own protocol, its own Holm family
            parts += ["", "## DiffusionNFT (its own protocol)", "", arm_table(nft), "",
                      comparison_table(sweep_analysis(nft, "nft")), "", seed_table({"nft": nft["nft"]})]  # fmt: skip
        parts += ["", "![every run's eval reward against epochs and seconds](evidence_sweep.png)"]
        text = "\n".join(parts) + "\n"
        print(text)
        (docs / "evidence_sweep.md").write_text(text)
        from _evidence_plot import plot_sweep

        plot_sweep({**by_arm, **nft}, docs / "evidence_sweep.png", PRIMARY)


def at_seconds(run: dict, seconds: float, key: str = PRIMARY) -> float:
    """The eval figure at ``seconds`` of training (``tpflow.experiments.curves.at_seconds``)."""
    return curves.at_seconds(run, seconds, key)


def paired(runs: dict[str, list[dict]], arm: str, statistic) -> list[float]:
    """Per-seed ``statistic(arm run, outcome run)`` over the seeds both have finished, in seed order."""
    base = {r["seed"]: r for r in runs.get(BASELINE, [])}
    return [statistic(r, base[r["seed"]]) for r in sorted(runs[arm], key=lambda r: r["seed"]) if r["seed"] in base]


COMPARISONS = {  # name -> per-seed paired statistic (arm run, outcome run); the primary one is first
    "AUC": lambda a, o: auc(a) - auc(o),
    "final": lambda a, o: curve(a)[1][-1] - curve(o)[1][-1],
    "strict AUC": lambda a, o: auc(a, STRICT) - auc(o, STRICT),
    "at outcome's seconds": lambda a, o: at_seconds(a, o["evals"][-1]["seconds"]) - curve(o)[1][-1],
}


def sweep_analysis(runs: dict[str, list[dict]], primary_arm: str) -> dict:
    """The protocol's analysis: the primary endpoint (``primary_arm`` − outcome, paired AUC of ``PRIMARY``) with its
    t interval and p; every other (arm, comparison) pair is secondary, Holm-adjusted as one family."""
    rows: dict[tuple[str, str], dict] = {}
    for arm in runs:
        if arm == BASELINE:
            continue
        for name, statistic in COMPARISONS.items():
            values = paired(runs, arm, statistic)
            if len(values) < 2:
                continue
            mean, low, high, p = t_interval(values)
            rows[(arm, name)] = {"n": len(values), "mean": mean, "t": (low, high), "p": p,
                                 "bootstrap": bootstrap(values), "values": values}  # fmt: skip
    primary = (primary_arm, "AUC")
    secondary = {f"{a}|{c}": row["p"] for (a, c), row in rows.items() if (a, c) != primary}
    for key, p_holm in holm(secondary).items():
        arm, name = key.split("|")
        rows[(arm, name)]["p_holm"] = p_holm
    return {"primary": primary, "rows": rows}


def arm_table(runs: dict[str, list[dict]]) -> str:
    """Markdown: per arm, the seeds finished, cost and the eval figures (mean and t interval over seeds)."""

    def ci(values: list[float]) -> str:
        mean, low, high, _ = t_interval(values)
        return f"{mean:.3f} [{low:.3f}, {high:.3f}]" if len(values) > 1 else f"{mean:.3f}"

    rows = [
        "| arm | seeds | NFE/traj | s/epoch | optimizer steps/epoch | eval at 0 | final eval | gain | AUC "
        "| strict final | held-out final | turning points/traj | dropped | audit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, arm_runs in runs.items():
        rs = sorted(arm_runs, key=lambda r: r["seed"])
        rows.append(
            f"| {arm} | {', '.join(str(r['seed']) for r in rs)} | {rs[0]['nfe_per_traj']:.0f}"
            f" | {statistics.mean(statistics.mean(r['train']['epoch_s']) for r in rs):.1f}"
            f" | {statistics.mean(statistics.mean(r['train']['optimizer_steps']) for r in rs):.2f}"
            f" | {ci([curve(r)[1][0] for r in rs])} | {ci([curve(r)[1][-1] for r in rs])}"
            f" | {ci([gain(r) for r in rs])} | {ci([auc(r) for r in rs])}"
            f" | {ci([curve(r, STRICT)[1][-1] for r in rs])}"
            f" | {ci([r['evals'][-1].get('eval_reward_held_out', math.nan) for r in rs])}"
            f" | {statistics.mean(r['tp_per_traj'] for r in rs):.2f}"
            f" | {statistics.mean(r['dropped_share'] for r in rs):.3f}"
            f" | {sum(r['audit']['ok'] for r in rs)}/{len(rs)} ok |"
        )
    return "\n".join(rows)


def comparison_table(analysis: dict) -> str:
    """Markdown: every paired comparison with outcome, the primary first; t interval, bootstrap, p, Holm p."""
    rows = [
        "| arm − outcome | endpoint | n | mean | 95% t interval | bootstrap (cross-check) | p | Holm p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(analysis["rows"], key=lambda k: (k != analysis["primary"], k))
    for key in keys:
        row = analysis["rows"][key]
        label = " **(primary)**" if key == analysis["primary"] else ""
        holm_p = row.get("p_holm")
        rows.append(
            f"| {key[0]}{label} | {key[1]} | {row['n']} | {row['mean']:+.4f}"
            f" | [{row['t'][0]:+.4f}, {row['t'][1]:+.4f}]"
            f" | [{row['bootstrap'][0]:+.4f}, {row['bootstrap'][1]:+.4f}] | {row['p']:.3g}"
            f" | {'—' if holm_p is None else f'{holm_p:.3g}'} |"
        )
    return "\n".join(rows)


def per_seed_lines(runs: dict[str, list[dict]]) -> str:
    """Markdown: for each arm, every seed's AUC beside outcome's of the same seed, and how many seeds favour it."""
    base = {r["seed"]: auc(r) for r in runs.get(BASELINE, [])}
    lines = []
    for arm, arm_runs in runs.items():
        if arm == BASELINE:
            continue
        pairs = [(r["seed"], auc(r), base[r["seed"]]) for r in sorted(arm_runs, key=lambda r: r["seed"])
                 if r["seed"] in base]  # fmt: skip
        if pairs:
            favour = sum(a > o for _, a, o in pairs)
            cells = ", ".join(f"s{seed} {a:.4f} / {o:.4f}" for seed, a, o in pairs)
            lines.append(f"- AUC per seed, {arm} / outcome: {cells} ({favour} of {len(pairs)} favour {arm}).")
    return "\n".join(lines)


def seed_table(runs: dict[str, list[dict]]) -> str:
    """Markdown: every seed of every arm, eval curve of the primary figure (no seed is dropped)."""
    rows = ["| arm | seed | eval reward (tag mean) by epoch | AUC | strict (tags) by epoch |", "|---|---|---|---|---|"]
    for arm, arm_runs in runs.items():
        for r in sorted(arm_runs, key=lambda r: r["seed"]):
            epochs, values = curve(r)
            _, strict = curve(r, STRICT)
            rows.append(
                f"| {arm} | {r['seed']} | "
                + " → ".join(f"{v:.3f}@{e}" for e, v in zip(epochs, values, strict=True))
                + f" | {auc(r):.4f} | "
                + " → ".join(f"{v:.3f}" for v in strict)
                + " |"
            )
    return "\n".join(rows)


def pilot_spread(runs: list[dict]) -> tuple[float, int]:
    """Pooled seed-to-seed standard deviation of one run's AUC, from pilots run with several seeds (each pilot's
    sample variance, weighted by its degrees of freedom), and those degrees of freedom."""
    by_name: dict[str, list[float]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(auc(run))
    groups = [v for v in by_name.values() if len(v) > 1]
    dof = sum(len(v) - 1 for v in groups)
    if not dof:
        return math.nan, 0
    return math.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in groups) / dof), dof


def t_test_power(sd: float, effect: float, n: int, alpha: float = 0.05) -> float:
    """Power of a two-sided paired t test (``tpflow.experiments.compare``'s)."""
    return experiment_stats.t_test_power(sd, effect, n, level=1 - alpha)


def detectable_effect(sd: float, n: int, power: float = 0.8) -> float:
    """The smallest mean difference the seeds detect with ``power`` (``tpflow.experiments.compare``)."""
    return experiment_stats.detectable_effect(sd, n, power)


def spread_line(runs: dict[str, list[dict]], analysis: dict, pilot_runs: list[dict]) -> str:
    """Markdown: the spread the protocol's seed count was planned on (the pilots') against the sweep's own, and what
    the sweep's seeds can detect at that spread: a sensitivity statement, not a post-hoc power of the result."""
    planned, dof = pilot_spread(pilot_runs)
    row = analysis["rows"].get(analysis["primary"])
    if row is None or row["n"] < 3:
        return ""
    sd = statistics.stdev(row["values"])
    per_arm = ", ".join(
        f"{arm} {statistics.stdev([auc(r) for r in rs]):.4f}" for arm, rs in runs.items() if len(rs) > 1
    )
    n, mean = row["n"], row["mean"]
    needed = seeds_needed(sd, abs(mean)) if mean else math.inf
    return (
        f"Spread, planned and observed: the seed count was planned on a paired AUC difference sd of "
        f"{math.sqrt(2) * planned:.4f} (√2 × the pilots' {planned:.4f} per run, {dof} degrees of freedom). Observed "
        f"sd of a run's AUC over its seeds: {per_arm}; of the primary's paired differences: {sd:.4f}. At that spread "
        f"{n} seeds detect an AUC difference of {detectable_effect(sd, n):.4f} with 80% power (two-sided 5%); the "
        f"observed {mean:+.4f} would need {needed} seeds."
    )


def power_note(runs: list[dict], effect: float, budget_seeds: int) -> str:
    """The seeds a paired t test needs for ``effect`` (AUC difference) at 80% power, from the pilots' spread, with
    the paired difference's sd taken as √2 × a run's (no pairing correlation assumed: conservative), and the power
    the budget's seeds give."""
    sd, dof = pilot_spread(runs)
    sd_diff = math.sqrt(2) * sd
    needed = seeds_needed(sd_diff, effect)
    crit = stats.t.ppf(0.975, budget_seeds - 1)
    nc = effect / (sd_diff / math.sqrt(budget_seeds))
    power = 1 - stats.nct.cdf(crit, budget_seeds - 1, nc) + stats.nct.cdf(-crit, budget_seeds - 1, nc)
    return (
        f"pilots' seed-to-seed sd of a run's AUC: {sd:.4f} ({dof} degrees of freedom); assumed sd of a paired "
        f"difference: {sd_diff:.4f}; seeds for 80% power at an AUC difference of {effect}: {needed}; power with "
        f"{budget_seeds} seeds: {power:.2f}"
    )

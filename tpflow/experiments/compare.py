"""``tpflow compare``: the experiment's primary endpoint and secondary family from its finished runs.

Per run, the evaluation curve of the endpoint's metric (one point per evaluation, from metrics.jsonl: the value at
each ``last_eval_epoch``) and its statistic: ``auc``, the trapezoid area under the curve over the evaluated epochs
divided by their span (the mean level over training), or ``final``, the last evaluation. Arms are paired by seed:
the primary is the mean of the per-seed differences with its two-sided 95% t interval and p value
(``tpflow.intervals``), a percentile bootstrap of the same differences beside it as a cross-check (too narrow at a
few seeds: the t interval is the one to read), and the smallest difference these seeds detect at 80% power from the
spread observed. The secondary comparisons (each arm − the baseline) are one Holm family. Cost per epoch: NFE per
trajectory, seconds, optimizer steps. Every seed is listed; a run that is missing or unfinished is named and its
seed left out of the pairs that need it.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from tpflow.experiments import lock
from tpflow.experiments.spec import Endpoint, Experiment
from tpflow.experiments.sweep import DONE
from tpflow.intervals import holm, t_interval


def curve(metrics_path: Path, metric: str) -> tuple[list[int], list[float]]:
    """(eval epochs, values) of one run's metrics.jsonl."""
    points: dict[int, float] = {}
    for line in Path(metrics_path).read_text().splitlines():
        row = json.loads(line)
        if metric in row and row.get("last_eval_epoch") is not None and row[metric] is not None:
            points[int(row["last_eval_epoch"])] = float(row[metric])
    epochs = sorted(points)
    return epochs, [points[e] for e in epochs]


def statistic(epochs: list[int], values: list[float], kind: str) -> float:
    """auc: trapezoid area over the span of the evaluated epochs divided by it; final: the last value."""
    if not values:
        return math.nan
    if kind == "final" or len(values) == 1:
        return values[-1]
    area = sum((b - a) * (u + w) / 2 for a, b, u, w in zip(epochs, epochs[1:], values, values[1:], strict=False))
    return area / (epochs[-1] - epochs[0])


def cost(metrics_path: Path) -> dict[str, float]:
    """Mean per epoch: NFE per trajectory, seconds, optimizer steps."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines()]
    epochs = [r for r in rows if "epoch_s" in r]

    def mean(key: str) -> float:
        values = [float(r[key]) for r in epochs if r.get(key) is not None]
        return sum(values) / len(values) if values else math.nan

    return {
        "nfe_per_traj": mean("nfe_per_traj"),
        "epoch_s": mean("epoch_s"),
        "optimizer_steps": mean("optimizer_steps"),
    }


def detectable_effect(sd: float, n: int, power: float = 0.8, level: float = 0.95) -> float:
    """The smallest true mean difference a two-sided paired t test at ``level`` detects with ``power`` over n
    pairs of spread sd: (t_{1−α/2, n−1} + t_{power, n−1})·sd/√n (the usual approximation)."""
    from scipy import stats

    if n < 2 or not math.isfinite(sd):
        return math.nan
    return (stats.t.ppf(1 - (1 - level) / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n)


def bootstrap(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% interval of the mean by resampling the pairs."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


@dataclass
class Comparison:
    name: str
    seeds: list[int]
    differences: list[float]
    mean: float
    low: float
    high: float
    p: float
    bootstrap_low: float
    bootstrap_high: float
    sd: float
    detectable: float
    holm_p: float | None = None


def compare(experiment: Experiment) -> dict:
    """Everything the report shows, as plain data (``--json`` prints it)."""
    spec = experiment.spec
    endpoint: Endpoint = spec.primary
    table: dict[str, dict[int, dict]] = {}
    missing = []
    for run in experiment.runs():
        metrics = run.run_dir / "metrics.jsonl"
        if not (run.run_dir / DONE).exists() or not metrics.exists():
            missing.append(f"{run.arm}/seed_{run.seed}")
            continue
        epochs, values = curve(metrics, endpoint.metric)
        table.setdefault(run.arm, {})[run.seed] = {
            "epochs": epochs, "values": values, "statistic": statistic(epochs, values, endpoint.statistic),
            **cost(metrics),
        }  # fmt: skip

    def paired(arm: str) -> Comparison | None:
        mine, base = table.get(arm, {}), table.get(endpoint.baseline, {})
        seeds = [s for s in spec.experiment.seeds if s in mine and s in base]
        if len(seeds) < 2:
            return None
        diffs = [mine[s]["statistic"] - base[s]["statistic"] for s in seeds]
        mean, low, high, p = t_interval(diffs)
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
        b_low, b_high = bootstrap(diffs)
        return Comparison(f"{arm} − {endpoint.baseline}", seeds, diffs, mean, low, high, p, b_low, b_high, sd,
                          detectable_effect(sd, len(diffs)))  # fmt: skip

    primary = paired(endpoint.arm)
    secondary = [c for c in (paired(a) for a in spec.secondary.arms) if c is not None]
    adjusted = holm({c.name: c.p for c in secondary}) if secondary else {}
    for c in secondary:
        c.holm_p = adjusted[c.name]
    registration = lock.read(experiment.out)
    return {
        "experiment": spec.experiment.name,
        "endpoint": endpoint.model_dump(),
        "primary": None if primary is None else asdict(primary),
        "secondary": [asdict(c) for c in secondary],
        "runs": {arm: {str(s): row for s, row in seeds.items()} for arm, seeds in table.items()},
        "missing": missing,
        "registered": None if registration is None else registration["registered"],
        "git_commit": None if registration is None else registration["git_commit"],
        "amendments": [] if registration is None else [
            {k: a[k] for k in ("time", "reason", "runs_existing")} for a in registration["amendments"]],
    }  # fmt: skip


def markdown(result: dict) -> str:
    """The report: the registration, the primary, the secondary family, every seed, the cost, what is missing."""
    e = result["endpoint"]
    lines = [f"# Experiment {result['experiment']}", "",
             f"Endpoint: {e['statistic']} of {e['metric']}, {e['arm']} − {e['baseline']}, paired over seeds.",
             f"Registered {result['registered'] or '(not yet: no sweep has run)'}"
             + (f" at commit {result['git_commit']}" if result["git_commit"] else "") + "."]  # fmt: skip
    for a in result["amendments"]:
        lines.append(f"- **Amendment** {a['time']}: {a['reason']} (runs that existed then: "
                     f"{', '.join(a['runs_existing']) or 'none'})")  # fmt: skip
    p = result["primary"]
    lines.append("")
    if p is None:
        lines.append("**Primary**: not computable yet (fewer than two seeds with both arms finished).")
    else:
        lines.append(f"**Primary** ({p['name']}, {len(p['seeds'])} seeds): {p['mean']:+.4f}, 95% t "
                     f"[{p['low']:+.4f}, {p['high']:+.4f}], p = {p['p']:.3g}; bootstrap (cross-check) "
                     f"[{p['bootstrap_low']:+.4f}, {p['bootstrap_high']:+.4f}]. Spread of the differences "
                     f"{p['sd']:.4f}: these seeds detect {p['detectable']:.4f} at 80% power.")  # fmt: skip
    if result["secondary"]:
        lines += ["", "| secondary | difference [95% t] | p | Holm p |", "|---|---|---|---|"]
        for c in result["secondary"]:
            lines.append(f"| {c['name']} | {c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] | {c['p']:.3g} | "
                         f"{c['holm_p']:.3g} |")  # fmt: skip
    lines += ["", f"| arm | seed | {e['statistic']} | evaluations | NFE/traj | s/epoch | steps/epoch |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, seeds in result["runs"].items():
        for seed, row in seeds.items():
            curve_text = ", ".join(f"{x}: {y:.4f}" for x, y in zip(row["epochs"], row["values"], strict=True))
            lines.append(f"| {arm} | {seed} | {row['statistic']:.4f} | {curve_text} | {row['nfe_per_traj']:.1f} | "
                         f"{row['epoch_s']:.1f} | {row['optimizer_steps']:.1f} |")  # fmt: skip
    if result["missing"]:
        lines += ["", "Missing or unfinished runs (left out of the pairs): " + ", ".join(result["missing"]) + "."]
    return "\n".join(lines) + "\n"

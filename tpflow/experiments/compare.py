"""``tpflow compare``: the experiment's primary endpoint and secondary family from its finished runs.

Each run is read as a summary: every evaluation with its epoch and the training seconds before it (from its
metrics.jsonl, or from the committed summaries the file names). An endpoint is a metric and a statistic (``auc``:
the trapezoid area under the curve over the evaluated epochs divided by their span, the mean level over training;
``final``: the last evaluation; ``at_baseline_seconds``: the arm's curve at the training seconds the baseline's run
took, against the baseline's final value; ``auc_seconds``: the area under the curve against training seconds over
the baseline's training seconds, divided by them, for both: the reward gained per second of training). Arms are
paired by seed: the primary is the mean of the per-seed differences with its two-sided 95% t interval and p value
(``tpflow.intervals``), a percentile bootstrap of the same differences beside it as a cross-check (too narrow at a
few seeds: the t interval is the one to read), and the smallest difference these seeds detect at 80% power from
the spread observed (noncentral t). The secondary family, every (arm, baseline, endpoint) of ``[secondary]`` but
the primary (its arms against the primary's baseline and any further ``baselines``), is Holm-adjusted together.
Cost per epoch: NFE per trajectory, seconds, optimizer steps. Every seed is listed; a run that is missing or
unfinished is named and its seed left out of the pairs that need it. Each arm is also summarised over its seeds
(``arm_summary``): the mean statistic with its t interval, the mean cost, and its seconds per epoch as a paired
ratio to the baseline's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tpflow.errors import UserError
from tpflow.experiments import lock
from tpflow.experiments.curves import auc, auc_seconds, axis_of, curve, paired_statistic, time_to
from tpflow.experiments.spec import Endpoint, Experiment, check_scorers
from tpflow.experiments.sweep import DONE
from tpflow.intervals import holm, t_interval


def summarise(metrics_path: Path) -> dict:
    """One finished run's summary from its metrics.jsonl, in the format of committed run summaries
    (docs/results/evidence_runs.json): every evaluation with its epoch and the training seconds spent before it, and
    the per-epoch training figures."""
    lines = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [line for line in lines if "epoch_s" in line]
    before = [0.0]
    for line in train:
        before.append(before[-1] + float(line["epoch_s"]))  # training seconds before epoch e
    evals = []
    for line in lines:  # an evaluation is logged on the line of the epoch it preceded, the final one on its own
        if line.get("last_eval_epoch") is not None and line.get("last_eval_epoch") == line.get("epoch"):
            e = int(line["epoch"])
            figures = {k: v for k, v in line.items() if k.startswith("eval_")}
            evals.append({"epoch": e, "seconds": before[min(e, len(train))], **figures})
    keys = ("epoch_s", "optimizer_steps", "nfe_per_traj")
    return {
        "evals": evals,
        "train": {k: [line.get(k) for line in train] for k in keys},
        "nfe_per_traj": train[0].get("nfe_per_traj") if train else None,
    }


def cost(run: dict) -> dict[str, float]:
    """Mean per epoch: NFE per trajectory, seconds, optimizer steps."""

    def mean(key: str) -> float:
        values = [float(v) for v in run["train"].get(key, []) if v is not None]
        return sum(values) / len(values) if values else math.nan

    nfe = run.get("nfe_per_traj")
    return {"nfe_per_traj": math.nan if nfe is None else float(nfe), "epoch_s": mean("epoch_s"),
            "optimizer_steps": mean("optimizer_steps")}  # fmt: skip


def arm_summary(rows: dict[str, dict], base_rows: dict[str, dict]) -> dict[str, float]:
    """One arm over its seeds (``rows``: the report's {seed: row}): the mean of its own statistic with a 95% t
    interval over the seeds, the mean NFE per trajectory and seconds per epoch, and the mean over the seeds both
    finished of its seconds per epoch divided by the baseline's. The ratio is paired because a seed's runs of every
    arm ran at about the same time, so a machine's load that slows one slows the other alike."""
    mean, low, high, _ = t_interval([row["statistic"] for row in rows.values()])
    ratios = [row["epoch_s"] / base_rows[seed]["epoch_s"] for seed, row in rows.items() if seed in base_rows]
    return {"seeds": len(rows), "mean": mean, "low": low, "high": high,
            "nfe_per_traj": float(np.mean([row["nfe_per_traj"] for row in rows.values()])),
            "epoch_s": float(np.mean([row["epoch_s"] for row in rows.values()])),
            "epoch_s_ratio": float(np.mean(ratios)) if ratios else math.nan}  # fmt: skip


def t_test_power(sd: float, effect: float, n: int, level: float = 0.95) -> float:
    """Power of a two-sided paired t test over n pairs at mean difference ``effect`` (noncentral t)."""
    from scipy import stats

    crit = stats.t.ppf(1 - (1 - level) / 2, n - 1)
    nc = effect / (sd / math.sqrt(n))
    return float(1 - stats.nct.cdf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc))


def detectable_effect(sd: float, n: int, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided 5% paired t test over n pairs of spread sd detects with
    ``power`` (bisection on the noncentral t power, which rises with the effect); NaN for n < 2 or sd 0."""
    if n < 2 or not math.isfinite(sd) or sd <= 0:
        return math.nan
    low, high = 0.0, 20 * sd
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_test_power(sd, mid, n) < power else (low, mid)
    return high


def bootstrap(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean, resampling the pairs (the cross-check; too narrow at small n)."""
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(resamples, len(v)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


@dataclass
class Comparison:
    name: str  # "arm − baseline: statistic of metric"
    arm: str
    metric: str
    statistic: str
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


def load_runs(experiment: Experiment, summaries: Path | None = None) -> tuple[dict[str, dict[int, dict]], list[str]]:
    """{arm: {seed: run summary}} of the finished runs, and the names of the missing or unfinished ones: from
    ``summaries`` (a JSON ``write_summaries`` wrote), else from the committed summaries the file names, else from the
    run folders."""
    spec = experiment.spec
    runs: dict[str, dict[int, dict]] = {}
    missing = []
    if summaries is not None or spec.experiment.summaries:
        path = Path(summaries) if summaries is not None else (experiment.path.parent / spec.experiment.summaries)
        try:
            data = json.loads(path.resolve().read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"Cannot read the run summaries {path}: {exc}.") from None
        group = spec.experiment.summaries_group if summaries is None else "sweep"
        if group not in data:
            raise UserError(f"{path} has no {group!r} list of run summaries (it has: {', '.join(data) or 'none'}).")
        for run in data[group]:
            if run["name"] in spec.arms and run["seed"] in spec.experiment.seeds:
                runs.setdefault(run["name"], {})[run["seed"]] = run
        missing = [f"{a}/seed_{s}" for s in spec.experiment.seeds for a in spec.arms if s not in runs.get(a, {})]
        return runs, missing
    for run in experiment.runs():
        metrics = run.run_dir / "metrics.jsonl"
        if not (run.run_dir / DONE).exists() or not metrics.exists():
            missing.append(f"{run.arm}/seed_{run.seed}")
            continue
        runs.setdefault(run.arm, {})[run.seed] = summarise(metrics)
    return runs, missing


def write_summaries(runs: dict[str, dict[int, dict]], experiment: Experiment, path: Path) -> Path:
    """The finished runs' summaries as one JSON (docs/results/evidence_runs.json's format, group "sweep"), to commit
    beside a report: ``tpflow compare EXPERIMENT --summaries PATH`` reproduces the report from it without the run
    folders. Written atomically."""
    import os

    rows = [{"group": "sweep", "name": arm, "seed": seed, **summary} for arm, seeds in runs.items()
            for seed, summary in sorted(seeds.items())]  # fmt: skip
    data = {"experiment": experiment.spec.experiment.name, "sweep": rows}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def compare(experiment: Experiment, loaded: tuple[dict[str, dict[int, dict]], list[str]] | None = None) -> dict:
    """Everything the report shows, as plain data (``--json`` prints it); ``loaded``: ``load_runs``' result when
    the caller has read the runs already (the figure draws from the same summaries)."""
    spec = experiment.spec
    endpoint: Endpoint = spec.primary
    per_arm = check_scorers(experiment)  # refuses arms scored unlike on an endpoint's metric, before any figure
    runs, missing = load_runs(experiment) if loaded is None else loaded

    def paired(arm: str, metric: str, kind: str, baseline: str = endpoint.baseline,
               threshold: float | None = endpoint.threshold) -> Comparison | None:  # fmt: skip
        mine, base = runs.get(arm, {}), runs.get(baseline, {})
        seeds = [s for s in spec.experiment.seeds if s in mine and s in base]
        if len(seeds) < 2:
            return None
        diffs = [paired_statistic(kind, metric, mine[s], base[s], threshold) for s in seeds]
        mean, low, high, p = t_interval(diffs)
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
        b_low, b_high = bootstrap(diffs)
        name = f"{arm} − {baseline}: {kind} of {metric}"
        return Comparison(name, arm, metric, kind, seeds, diffs, mean, low, high, p, b_low, b_high, sd,
                          detectable_effect(sd, len(diffs)))  # fmt: skip

    primary = paired(endpoint.arm, endpoint.metric, endpoint.statistic)
    endpoints = spec.secondary.endpoints or [endpoint]
    primary_key = (endpoint.arm, endpoint.baseline, endpoint.metric, endpoint.statistic)
    family = [
        paired(arm, e.metric, e.statistic, baseline, e.threshold)
        for baseline in [endpoint.baseline, *spec.secondary.baselines]
        for arm in spec.secondary.arms
        for e in endpoints
        if arm != baseline and (arm, baseline, e.metric, e.statistic) != primary_key
    ]
    secondary = [c for c in family if c is not None]
    adjusted = holm({c.name: c.p for c in secondary}) if secondary else {}
    for c in secondary:
        c.holm_p = adjusted[c.name]
    table = _runs_table(runs, endpoint, list(spec.arms))
    registration = lock.read(experiment.out)
    base_rows = table.get(endpoint.baseline, {})
    guard = watched_report(runs, spec.experiment.seeds, endpoint, list(spec.arms), set(per_arm))
    return {
        "experiment": spec.experiment.name,
        "endpoint": endpoint.model_dump(),
        "primary": None if primary is None else asdict(primary),
        "secondary": [asdict(c) for c in secondary],
        "runs": table,
        "arms": {arm: arm_summary(rows, base_rows) for arm, rows in table.items()},
        "missing": missing,
        "watched": guard,
        "per_arm": per_arm,  # the guard's figures each arm scores its own way (not compared across arms), with why
        "source": spec.experiment.summaries or str(experiment.out),
        "registered": None if registration is None else registration["registered"],
        "git_commit": None if registration is None else registration["git_commit"],
        "amendments": [] if registration is None else [
            {k: a[k] for k in ("time", "reason", "runs_existing")} for a in registration["amendments"]],
    }  # fmt: skip


def _runs_table(runs: dict[str, dict[int, dict]], endpoint: Endpoint, arms: list[str]) -> dict:
    """Per arm (in the file's order) and seed: the endpoint's curve, the run's own statistic, its cost, and with a
    threshold whether it reached it (the others are censored at their end)."""
    table = {
        arm: {str(seed): {"epochs": curve(run, endpoint.metric)[0], "values": curve(run, endpoint.metric)[1],
                          "statistic": _own(run, endpoint), **cost(run)} for seed, run in sorted(seeds.items())}
        for arm, seeds in sorted(runs.items(), key=lambda item: arms.index(item[0]))
    }  # fmt: skip
    if endpoint.threshold is not None:
        axis = axis_of(endpoint.statistic)
        for arm, seeds in runs.items():
            for seed, run in seeds.items():
                table[arm][str(seed)]["reached"] = time_to(run, endpoint.metric, endpoint.threshold, axis)[1]
    return table


def watched_report(
    runs: dict[str, dict[int, dict]],
    seeds: list[int],
    endpoint: Endpoint,
    arms: list[str],
    per_arm: Collection[str] = (),
) -> dict:
    """The hacking guard over the runs (docs/rewards.md, "Watching for reward hacking"): when their evaluations hold
    watched rewards (``eval_watch_<label>``) or the diversity within groups (``eval_diversity``), each of those and
    ``eval_reward`` under the endpoint's statistic, per arm (mean over its seeds, 95% t) and per arm − the
    baseline (paired over seeds, 95% t, and the standard error of the mean difference), with the warnings of
    ``tpflow.scoring.watched.hacking_warnings``: an arm whose trained reward rose over the baseline's while a
    watched figure fell, each beyond twice the standard error of its paired difference, and a run whose trained
    reward rose from its first evaluation to its last while a watched figure fell. Empty when nothing is watched.
    ``per_arm``: figures each arm scores its own way (``check_scorers``), never differenced across arms."""
    from tpflow.scoring.watched import DIVERSITY, PREFIX, hacking_warnings

    every = [run for by_seed in runs.values() for run in by_seed.values()]
    watched = {k for run in every for e in run["evals"] for k in e if k.startswith("eval_" + PREFIX)}
    watched |= {f"eval_{DIVERSITY}"} & {k for run in every for e in run["evals"] for k in e}
    names = sorted(k for k in watched if not k.endswith("_se"))
    if not names:
        return {}
    metrics, kind, base = ["eval_reward", *names], endpoint.statistic, runs.get(endpoint.baseline, {})
    kind = "auc" if endpoint.threshold is not None else kind  # a threshold is the trained reward's level only

    def level(run: dict, metric: str) -> float:  # a run's own value: auc, else its last evaluation
        values = curve(run, metric)[1]
        return auc(run, metric) if kind == "auc" else (values[-1] if values else math.nan)

    levels = {}
    for arm in (a for a in arms if a in runs):
        spans = {m: t_interval([level(run, m) for run in runs[arm].values()]) for m in metrics}
        levels[arm] = {m: {"mean": v[0], "low": v[1], "high": v[2]} for m, v in spans.items()}
    differences, warnings = {}, []
    for arm in (a for a in arms if a != endpoint.baseline and a in runs):
        paired = [s for s in seeds if s in runs[arm] and s in base]
        rows, zero, now = {}, {}, {}
        for m in (m for m in metrics if m not in per_arm):
            diffs = [paired_statistic(kind, m, runs[arm][s], base[s]) for s in paired]
            mean, low, high, p = t_interval(diffs)
            se = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else math.nan
            rows[m] = {"mean": mean, "low": low, "high": high, "p": p, "se": se, "seeds": len(diffs)}
            zero.update({m: 0.0, f"{m}_se": 0.0})
            now.update({m: mean, f"{m}_se": se})
        differences[arm] = rows
        warnings += hacking_warnings(zero, now, since=f"in {arm} over {endpoint.baseline} ({kind}, paired over seeds)")
    for arm in (a for a in arms if a in runs):
        for seed, run in sorted(runs[arm].items()):
            if len(run["evals"]) > 1:
                since = f"in {arm}/seed_{seed} from its first evaluation to its last"
                warnings += hacking_warnings(run["evals"][0], run["evals"][-1], since=since)
    return {"statistic": kind, "metrics": metrics, "arms": levels, "differences": differences, "warnings": warnings}


def _own(run: dict, endpoint: Endpoint) -> float:
    """A run's own value of the endpoint's statistic (the last evaluation for at_baseline_seconds; for auc_seconds
    its area over its own training seconds)."""
    if endpoint.statistic == "auc":
        return auc(run, endpoint.metric)
    if endpoint.statistic == "auc_seconds":
        return auc_seconds(run, endpoint.metric, run["evals"][-1]["seconds"]) if run["evals"] else math.nan
    if endpoint.threshold is not None:  # its own time to the threshold (censored: its total)
        axis = axis_of(endpoint.statistic)
        return time_to(run, endpoint.metric, endpoint.threshold, axis)[0]
    values = curve(run, endpoint.metric)[1]
    return values[-1] if values else math.nan


def markdown(result: dict) -> str:
    """The report: the registration, the primary, the secondary family, every seed, the cost, what is missing."""
    e = result["endpoint"]
    lines = [f"# Experiment {result['experiment']}", "",
             f"Endpoint: {e['statistic']} of {e['metric']}, {e['arm']} − {e['baseline']}, paired over seeds.",
             (f"Runs: the committed summaries {result['source']}." if result["source"].endswith(".json") else
              f"Registered {result['registered'] or '(not yet: no sweep has run)'}"
              + (f" at commit {result['git_commit']}" if result["git_commit"] else "") + ".")]  # fmt: skip
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
        if e.get("threshold") is not None:  # a log speed-up: its exp is the ratio of times
            censored = [f"{arm} seed {seed}" for arm, seeds in result["runs"].items() for seed, row in seeds.items()
                        if not row.get("reached", True)]  # fmt: skip
            lines.append(f"Speed-up to {e['threshold']:g} ({e['baseline']}'s time ÷ {e['arm']}'s): "
                         f"×{math.exp(p['mean']):.2f}, 95% t [×{math.exp(p['low']):.2f}, ×{math.exp(p['high']):.2f}]. "
                         f"Never reached it (censored at their last evaluation): "
                         f"{', '.join(censored) or 'none'}.")  # fmt: skip
    if result["secondary"]:
        lines += ["", "| secondary | difference [95% t] | p | Holm p |", "|---|---|---|---|"]
        for c in result["secondary"]:
            lines.append(f"| {c['name']} | {c['mean']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] | {c['p']:.3g} | "
                         f"{c['holm_p']:.3g} |")  # fmt: skip
    if result["arms"]:
        lines += ["", f"| arm | seeds | {e['statistic']}, mean [95% t] | NFE/traj | s/epoch | s/epoch ÷ "
                  f"{e['baseline']}'s (paired) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for arm, a in result["arms"].items():
            lines.append(f"| {arm} | {a['seeds']} | {a['mean']:.4f} [{a['low']:.4f}, {a['high']:.4f}] | "
                         f"{a['nfe_per_traj']:.1f} | {a['epoch_s']:.1f} | {a['epoch_s_ratio']:.2f} |")  # fmt: skip
    lines += ["", f"| arm | seed | {e['statistic']} | evaluations | NFE/traj | s/epoch | steps/epoch |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, seeds in result["runs"].items():
        for seed, row in seeds.items():
            curve_text = ", ".join(f"{x}: {y:.4f}" for x, y in zip(row["epochs"], row["values"], strict=True))
            lines.append(f"| {arm} | {seed} | {row['statistic']:.4f} | {curve_text} | {row['nfe_per_traj']:.1f} | "
                         f"{row['epoch_s']:.1f} | {row['optimizer_steps']:.1f} |")  # fmt: skip
    lines += _watched_markdown(result.get("watched") or {}, e["baseline"])
    for metric, why in (result.get("per_arm") or {}).items():
        lines += ["", f"{metric} is per arm by design: the arms' recipes score it differently ({why}), so it is "
                  "not compared across arms; the endpoints read figures every arm is scored by alike."]  # fmt: skip
    if result["missing"]:
        lines += ["", "Missing or unfinished runs (left out of the pairs): " + ", ".join(result["missing"]) + "."]
    return "\n".join(lines) + "\n"


def _watched_markdown(guard: dict, baseline: str) -> list[str]:
    """The hacking guard's lines of the report (``watched_report``): one table, a row per figure, the arms' levels
    and each arm − baseline with its interval; then its warnings, or that there are none."""
    if not guard:
        return []
    arms, others, differences = list(guard["arms"]), list(guard["differences"]), guard["differences"].values()
    lines = ["", f"Watched, not trained on ({guard['statistic']}; the trained reward first): each arm's mean over its "
             "seeds [95% t], each arm − baseline paired over seeds [95% t].", "",
             "| figure | " + " | ".join(arms) + " | " + " | ".join(f"{a} − {baseline}" for a in others) + " |",
             "|---" * (1 + len(arms) + len(others)) + "|"]  # fmt: skip
    for m in guard["metrics"]:
        cells = [f"{a[m]['mean']:.4f} [{a[m]['low']:.4f}, {a[m]['high']:.4f}]" for a in guard["arms"].values()]
        cells += [f"{d[m]['mean']:+.4f} [{d[m]['low']:+.4f}, {d[m]['high']:+.4f}]" if m in d else "(per arm)"
                  for d in differences]  # fmt: skip
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [""] + ([f"- **Warning**: {w}" for w in guard["warnings"]] or [
        "No hacking warning: no trained reward rose while a watched figure fell, each beyond twice its standard "
        "error, and no watched figure fell beyond three times its own."
    ])  # fmt: skip
    return lines

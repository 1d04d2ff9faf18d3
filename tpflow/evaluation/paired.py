"""How sure one eval set is about a difference between two targets: a paired t interval over its prompts.

``tpflow eval A --baseline B`` samples both on the same prompts (and, with the same seed, from the same noise rows),
so a prompt's mean figure under A and under B form a pair. The interval over those per-prompt differences says
whether *this eval set* separates the two models. It does not cover what makes a training result uncertain: another
training seed gives another model. On the shapes task (docs/results.md §2.5) a run's mean eval reward over training
varies from seed to seed with sd 0.007-0.009, and 8 seeds resolve only differences of about 0.017. Runs over seeds
are compared with ``tpflow sweep`` / ``tpflow compare`` (docs/experiments.md); ``SEEDS_NOTE`` says so wherever the
interval is printed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tpflow.intervals import t_interval

OVERALL = "overall"  # the category of every prompt (tpflow.evaluation.run's table row of that name)

SEEDS_NOTE = (
    "[ ]: 95% t interval over the prompts, paired by prompt. It covers this eval set's sampling, not training's "
    "seed-to-seed spread: to compare training runs, use several seeds (tpflow sweep / tpflow compare, "
    "docs/experiments.md)."
)


def per_prompt(result: Any, key: str) -> dict[int, float]:
    """Prompt index -> mean of figure ``key`` ("reward" or a detail) over that prompt's images (``result``: an
    ``EvalResult``)."""
    values = result.scored.scores if key == "reward" else result.scored.details[key]
    rows: dict[int, list[float]] = defaultdict(list)
    for j, k in enumerate(result.scored.prompt_index):
        rows[k].append(float(values[j]))
    return {k: sum(v) / len(v) for k, v in rows.items()}


def paired_intervals(result: Any, baseline: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category (the prompt's tag, or "all"; and "overall") and figure: the paired t interval of target −
    baseline over the prompts both evaluated, ``{"mean", "low", "high", "p", "prompts"}``. Empty when the two prompt
    lists differ (no pairs); NaN bounds for a category of one prompt. ``result``, ``baseline``: ``EvalResult``s."""
    if [i.prompt for i in result.items] != [i.prompt for i in baseline.items]:
        return {}
    keys = ["reward", *(k for k in result.scored.details if k in baseline.scored.details)]
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for key in keys:
        mine, theirs = per_prompt(result, key), per_prompt(baseline, key)
        shared = sorted(set(mine) & set(theirs))
        groups: dict[str, list[int]] = defaultdict(list)
        for k in shared:
            groups[result.items[k].metadata.get("tag") or "all"].append(k)
        groups[OVERALL] = shared
        for category, prompts in groups.items():
            mean, low, high, p = t_interval([mine[k] - theirs[k] for k in prompts])
            out[category][key] = {"mean": mean, "low": low, "high": high, "p": p, "prompts": len(prompts)}
    return dict(out)

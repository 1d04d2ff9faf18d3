"""Rewards the evaluation watches but the run does not train on (``[eval] rewards``): a guard against reward hacking.

A policy trained on one reward learns what that reward pays for, wanted or not: PickScore rises while images grow
over-saturated, GenEval's detector is fooled by grids of objects. Watching other rewards on the same evaluation
images shows it: ``eval_watch_<label>`` beside ``eval_reward``, in metrics.jsonl, eval.json and the trackers, and a
warning (``hacking_warnings``) when, between two evaluations, a watched one fell beyond its noise: by more than twice
the standard error of the difference while the trained reward rose as far, or by more than three times it whatever
the trained reward did (the evaluation images are the same noise each time, so these are conservative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from tpflow.interfaces import capability
from tpflow.scoring.call import check_output
from tpflow.types import RewardOutput

PREFIX = "watch_"  # the details key (and eval_ metric) of a watched reward's scores
DIVERSITY = "diversity"  # eval.diversity's details key (tpflow.train.diversity), watched as a reward is


class WatchedRewards:
    """RewardModel: the trained reward's output, with each watched reward's scores added as ``watch_<label>``."""

    def __init__(self, reward: Any, watched: list[tuple[str, Any]]) -> None:
        self.reward, self.watched = reward, watched
        self.accepts_clips = capability(reward, "accepts_clips")

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        out = self.reward(images, prompts, metadata)
        scores, details = check_output(out, len(images), self.reward)
        for label, model in self.watched:
            watched, _ = check_output(model(images, prompts, metadata), len(images), label)
            details[PREFIX + label] = watched
        return RewardOutput(scores=scores, details=details)


def build_watched(settings: Any) -> list[tuple[str, Any]]:
    """The watched rewards of ``settings`` (``[eval] rewards``), built (each loads its weights at its first call)."""
    from tpflow import registry

    return [(w.key, registry.build("reward", w.name, **w.options)) for w in settings.rewards]


def with_watched(reward: Any, settings: Any, watched: list[tuple[str, Any]] | None = None) -> Any:
    """``reward`` wrapped with the watched rewards of ``settings`` (or ``watched``, built already), or as it is
    without any."""
    watched = build_watched(settings) if watched is None else watched
    return WatchedRewards(reward, watched) if watched else reward


def recipe_problems(sections: dict[str, Any]) -> list[str]:
    """One sentence per ``[eval] rewards`` entry whose name or options the registry refuses, or a repeated label."""
    from tpflow import registry

    problems, labels = [], []
    for i, watched in enumerate(sections["eval"].rewards):
        where = f"[eval] rewards[{i}] ({watched.name!r})"
        labels.append(watched.key)
        try:
            registry.validate_options("reward", watched.name, watched.options)
        except Exception as exc:  # an unknown name or bad options: the registry's own sentence
            problems.append(f"{where}: {exc}")
    repeated = sorted({k for k in labels if labels.count(k) > 1})
    if repeated:
        problems.append(f"[eval] rewards: labels must be unique, {', '.join(repeated)} repeats: give a label.")
    return problems


def standard_errors(details: dict[str, list[float]], scores: list[float]) -> dict[str, float]:
    """``eval_reward_se`` and ``eval_watch_<label>_se``: the standard error of each mean over the images (only
    when the evaluation watches a reward or the diversity, whose own standard error is over the prompts:
    ``tpflow.train.evaluation.summarize``)."""
    watched = {k: v for k, v in details.items() if k.startswith(PREFIX)}
    if not watched and DIVERSITY not in details:
        return {}
    return {"eval_reward_se": _se(scores), **{f"eval_{k}_se": _se(v) for k, v in watched.items()}}


def _se(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return math.nan
    mean = sum(finite) / len(finite)
    return math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1) / len(finite))


HACKING_SE = 2.0  # a watched figure's fall beside a rise of the trained reward: each beyond this many SEs
FALL_SE = 3.0  # a watched figure's fall on its own, whatever the trained reward did: beyond this many SEs


def hacking_warnings(
    before: dict[str, float], now: dict[str, float], since: str = "since the last evaluation"
) -> list[str]:
    """One sentence per watched reward (and the diversity within groups, ``eval_diversity``) that fell between two
    evaluations beyond its noise, the standard error of the change √(se₀² + se₁²):

    - by more than ``HACKING_SE`` of it while the trained reward rose by more than ``HACKING_SE`` of its own:
      possible reward hacking;
    - by more than ``FALL_SE`` of it, whatever the trained reward did: a run that falls apart (blank images at too
      high a learning rate) need not raise its trained reward first, and a watched reward is there to see it.

    ``before`` and ``now`` may also be differences: ``{"eval_x": 0, "eval_x_se": 0}`` against a mean paired
    difference and its standard error (``tpflow compare``'s arms over seeds); ``since`` says against what."""
    trained = _change(before, now, "reward")
    rose = trained is not None and trained[0] > HACKING_SE * trained[1]
    out = []
    for key in now:
        if not (key.startswith("eval_" + PREFIX) or key == f"eval_{DIVERSITY}") or key.endswith("_se"):
            continue
        name = key.removeprefix("eval_")
        moved = _change(before, now, name)
        if moved is None:
            continue
        fell, se = moved
        what = f"the watched reward {name.removeprefix(PREFIX)}"
        if name == DIVERSITY:
            what = "the diversity within groups (eval_diversity: do a prompt's images collapse to one?)"
        if rose and fell < -HACKING_SE * se:
            out.append(
                f"possible reward hacking: the trained reward rose by {trained[0]:+.4f} {since} while {what} fell "
                f"by {fell:+.4f} (each beyond twice its standard error); look at the evaluation's sample grid."
            )
        elif fell < -FALL_SE * se:
            out.append(
                f"{what} fell by {fell:+.4f} {since}, beyond {FALL_SE:g} times its standard error ({se:.4f}), while "
                f"the trained reward {_trained_words(trained)}: the model may be falling apart (a learning rate too "
                "high?) or learning what the trained reward does not see; look at the evaluation's sample grid."
            )
    return out


def guard_lines(first: dict[str, float], last: dict[str, float], now: dict[str, float]) -> list[str]:
    """The training run's guard at an evaluation: against the last evaluation, and, when that says nothing, against
    the first one (``first``, with its ``last_eval_epoch``): a slide of a few tenths over many evaluations can stay
    inside every single step's noise (a watched GenEval falling 0.639 → 0.266 over a run)."""
    out = hacking_warnings(last, now)
    if not out and first and first.get("last_eval_epoch") != last.get("last_eval_epoch"):
        out = hacking_warnings(first, now, since=f"since the evaluation at epoch {int(first['last_eval_epoch'])}")
    return out


def _change(before: dict[str, float], now: dict[str, float], name: str) -> tuple[float, float] | None:
    """(change of ``eval_<name>``, the standard error of the change), or None when either side lacks a finite one."""
    a, b = before.get(f"eval_{name}"), now.get(f"eval_{name}")
    sa, sb = before.get(f"eval_{name}_se"), now.get(f"eval_{name}_se")
    if None in (a, b, sa, sb) or not all(map(math.isfinite, (a, b, sa, sb))):
        return None
    return b - a, math.hypot(sa, sb)


def _trained_words(trained: tuple[float, float] | None) -> str:
    if trained is None:
        return "has no standard error to compare"
    change, se = trained
    verdict = "a fall beyond its noise" if change < -HACKING_SE * se else "within its noise"  # never a rise here
    return f"changed by {change:+.4f} ({verdict}, its standard error {se:.4f})"

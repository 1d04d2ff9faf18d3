"""A run's eval curve and the statistics of it an endpoint takes (``STATISTICS`` in ``tpflow.experiments.spec``).

A run is its summary (``tpflow.experiments.compare.summarise``): every evaluation with its epoch and the training
seconds before it. ``auc``: the trapezoid area under the curve over the evaluated epochs divided by their span;
``auc_seconds``: the same against training seconds up to a given time; ``final``; ``at_baseline_seconds``: the
curve at the baseline's training seconds; ``*_to_threshold``: ln(baseline's time / arm's) to reach a level fixed in
advance, a run that never reaches it counting its last evaluation's time (censored, a lower bound).
"""

from __future__ import annotations

import math

import numpy as np


def curve(run: dict, metric: str) -> tuple[list[int], list[float]]:
    """(eval epochs, values) of one run summary."""
    points = [(e["epoch"], e[metric]) for e in run["evals"] if e.get(metric) is not None]
    return [p[0] for p in points], [float(p[1]) for p in points]


def auc(run: dict, metric: str) -> float:
    """The trapezoid area under the curve over its epochs divided by their span (NaN without two evaluations)."""
    x, y = curve(run, metric)
    if len(x) < 2:
        return math.nan
    return float(np.trapezoid(y, x) / (x[-1] - x[0]))


def at_seconds(run: dict, seconds: float, metric: str) -> float:
    """The curve at ``seconds`` of training, linearly interpolated between evaluations (the last one held after)."""
    points = [(e["seconds"], e[metric]) for e in run["evals"] if e.get(metric) is not None]
    return float(np.interp(seconds, [p[0] for p in points], [p[1] for p in points]))


def auc_seconds(run: dict, metric: str, until: float) -> float:
    """The trapezoid area under the curve against training seconds, from its first evaluation to ``until`` seconds
    (interpolated between evaluations, the last one held after), divided by that span: the mean level over the first
    ``until`` seconds of training (NaN without two evaluations or a positive span)."""
    points = [(e["seconds"], float(e[metric])) for e in run["evals"] if e.get(metric) is not None]
    if len(points) < 2 or until <= points[0][0]:
        return math.nan
    px, py = [p[0] for p in points], [p[1] for p in points]
    xs = sorted({x for x in px if x < until} | {until})
    return float(np.trapezoid(np.interp(xs, px, py), xs) / (until - xs[0]))


def time_to(run: dict, metric: str, threshold: float, axis: str = "seconds") -> tuple[float, bool]:
    """When the curve first reaches ``threshold``, in training ``axis`` ("seconds" or "epoch"), linearly
    interpolated between the evaluations around the crossing, and whether it did: a run that never does gives its
    last evaluation's (a lower bound of its time: censored)."""
    points = [(float(e[axis]), float(e[metric])) for e in run["evals"] if e.get(metric) is not None]
    if not points:
        return math.nan, False
    for (x0, y0), (x1, y1) in zip([(points[0][0], -math.inf), *points], points, strict=False):
        if y1 >= threshold:
            if y0 == -math.inf:  # at the first evaluation already
                return x1, True
            return x0 + (threshold - y0) / (y1 - y0) * (x1 - x0), True
    return points[-1][0], False


def axis_of(statistic: str) -> str:
    """The summary key a *_to_threshold statistic times along: training seconds or epochs."""
    return "seconds" if statistic == "seconds_to_threshold" else "epoch"


def paired_statistic(kind: str, metric: str, arm: dict, base: dict, threshold: float | None = None) -> float:
    """One seed's difference arm − baseline for an endpoint (``STATISTICS`` in tpflow.experiments.spec)."""
    if kind in ("seconds_to_threshold", "epochs_to_threshold"):  # ln(baseline's time / arm's): the log speed-up
        axis = axis_of(kind)
        return math.log(time_to(base, metric, threshold, axis)[0] / time_to(arm, metric, threshold, axis)[0])
    if kind == "auc":
        return auc(arm, metric) - auc(base, metric)
    if kind == "auc_seconds":  # both over the baseline's training seconds
        until = base["evals"][-1]["seconds"]
        return auc_seconds(arm, metric, until) - auc_seconds(base, metric, until)
    if kind == "final":
        return curve(arm, metric)[1][-1] - curve(base, metric)[1][-1]
    last = base["evals"][-1]["seconds"]  # at_baseline_seconds: equal training seconds
    return at_seconds(arm, last, metric) - curve(base, metric)[1][-1]

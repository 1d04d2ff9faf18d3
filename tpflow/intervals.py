"""Intervals and multiplicity corrections that tpflow's reports share (the probe's, the benchmarks' sweeps).

Student t intervals over independent repeats or paired seeds, and Holm's step-down correction: the project's rule
for every comparison it reports (a percentile bootstrap over a handful of seeds is too narrow).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """(mean, low, high, two-sided p of mean = 0) of a one-sample Student t interval; NaNs when n < 2."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return (float(v.mean()) if len(v) else math.nan, math.nan, math.nan, math.nan)
    mean, sem = float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v)))
    half = float(stats.t.ppf(0.5 + level / 2, len(v) - 1)) * sem
    p = float(stats.ttest_1samp(v, 0.0).pvalue) if sem > 0 else (0.0 if mean != 0 else 1.0)
    return mean, mean - half, mean + half, p


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p values (step-down, monotone, capped at 1)."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    adjusted, running = {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[name]))
        adjusted[name] = running
    return adjusted


def repeats_for_half_width(sd: float, half_width: float, level: float = 0.95) -> int:
    """The fewest independent repeats n (at least 2) whose t interval of a mean, at spread ``sd``, is no wider
    than ±``half_width``: t_{n-1}·sd/√n ≤ half_width."""
    n = 2
    while float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n) > half_width and n < 100_000:
        n += 1
    return n

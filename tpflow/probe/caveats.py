"""What a probe's size cannot show: the report's warnings for figures that are undefined or noise at this size.

A small probe (a few prompts, 2 repeats, 2 reference draws) is how docs/probe.md suggests measuring the cost first,
and its report then printed "bias ceiling 6.265", nan and a split-half cosine of 0.000 as if they were results. The
figures are what the estimators give; this module says, in the report, which ones carry no information at this size
and what size would make them meaningful, from the same quantities docs/probe.md explains.
"""

from __future__ import annotations

import math
from typing import Any

GOOD_REPEATS = 8  # a jackknife and a paired t interval with 7 degrees of freedom (docs/probe.md's example has 12)
TARGET_RELIABILITY = 0.8  # Spearman-Brown reliability of the whole reference worth aiming at


def caveats(result: dict[str, Any]) -> list[str]:
    """One sentence per figure of ``result`` (``tpflow.probe.report.figures``) that this probe's size leaves
    undefined or meaningless, each with the size that would fix it; [] when none."""
    notes = []
    repeats = min(a["repeats"] for a in result["arms"])
    if repeats < 3:
        notes.append(
            f"At {repeats} repeats the bias ceilings and SNRs have no jackknife interval, and each paired "
            f"comparison's t interval has {repeats - 1} degree of freedom: it cannot separate arms. Run --repeats "
            f"{GOOD_REPEATS} or more (a rerun with a larger --repeats extends this probe)."
        )
    broken = [a["key"] for a in result["arms"] if not all(_is_cosine(a[k][0]) for k in ("bias_ceiling",
              "bias_ceiling_normalised"))]  # fmt: skip
    if broken:
        notes.append(
            f"The bias ceiling of {', '.join(broken)} is undefined (nan) or outside [−1, 1]: its draws' noise hides "
            "their mean (a negative U-statistic of the squared norm), so the figure says nothing. It needs more "
            "repeats, or more prompts per draw, until the U-statistics are clearly positive."
        )
    snr = [a["key"] for a in result["arms"] if not math.isfinite(a["snr_per_trajectory"][0])]
    if snr:
        notes.append(f"The SNR of {', '.join(snr)} is undefined at this size (fewer than 2 repeats with a spread).")
    notes += _reference_notes(result["reference"])
    return notes


def _reference_notes(ref: dict[str, Any]) -> list[str]:
    """The reference g★: its split-half cosine r (halves of D/2 draws each) and what Spearman-Brown asks for."""
    r, _ = ref["split_half"]
    draws = ref["draws"]
    if not math.isfinite(r) or r <= 0:
        return [
            f"The reference's split-half cosine is {r:.3f}: its two halves share no direction, so g★ is noise at "
            f"{draws} draws and every cosine to it is near 0 whatever the arm. Increase --reference-draws (and "
            "--prompts) until the split-half cosine is clearly positive; Spearman-Brown then says how many more."
        ]
    if 2 * r / (1 + r) >= TARGET_RELIABILITY:
        return []
    halves = TARGET_RELIABILITY * (1 - r) / (r * (1 - TARGET_RELIABILITY))  # in units of half the draws
    needed = math.ceil(halves * draws / 2)
    return [
        f"The reference's split-half cosine is {r:.3f} (Spearman-Brown {2 * r / (1 + r):.3f} for all {draws} draws): "
        "g★ is largely noise, which shrinks every cosine to it and the differences between arms. A reliability of "
        f"{TARGET_RELIABILITY} needs about {needed} reference draws (--reference-draws {needed})."
    ]


def _is_cosine(value: float) -> bool:
    return math.isfinite(value) and -1.0 <= value <= 1.0

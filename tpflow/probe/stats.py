"""The probe's figures from gradients (or their sketches): cosine, the bias ceiling, SNR, split-half reliability.

Every figure is a function of plain vectors, so it can be checked on toys whose answer is known. Noise-free versions
come from products of independent estimates: for independent unbiased estimates x̂ᴬ, x̂ᴮ of x, E⟨x̂ᴬ, x̂ᴮ⟩ = ‖x‖²,
which ⟨x̂, x̂⟩ overstates by the estimate's variance.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def cosine(a: Tensor, b: Tensor) -> float:
    """cos(a, b) of two vectors [d] (0 when either is 0)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    norms = float(a.norm() * b.norm())
    return float(a @ b) / norms if norms > 0 else 0.0


def bias_ceiling(arm_a: Tensor, arm_b: Tensor, ref_a: Tensor, ref_b: Tensor) -> float:
    """cos(E ĝ, g★) freed of both estimators' noise, from two independent halves of each (means over disjoint
    repeats): ½(⟨ĝᴬ, g★ᴮ⟩ + ⟨ĝᴮ, g★ᴬ⟩) / √(⟨ĝᴬ, ĝᴮ⟩·⟨g★ᴬ, g★ᴮ⟩). NaN when a noise-free squared norm estimates
    ≤ 0 (too few repeats to see the mean through the noise)."""
    ga, gb, ra, rb = (x.double().reshape(-1) for x in (arm_a, arm_b, ref_a, ref_b))
    signal, reference = float(ga @ gb), float(ra @ rb)
    if signal <= 0 or reference <= 0:
        return math.nan
    return 0.5 * (float(ga @ rb) + float(gb @ ra)) / math.sqrt(signal * reference)


def signal_to_noise(per_draw: Tensor) -> float:
    """‖E g‖² / E‖g − E g‖² per draw, from draws [n, d] (n ≥ 2): the unbiased ‖ḡ‖² − S/n over S, with
    S = Σ‖g_i − ḡ‖² / (n − 1) the unbiased total variance. It can come out < 0 when the mean is lost in the noise."""
    g = per_draw.double()
    n = g.shape[0]
    if n < 2:
        raise ValueError(f"signal_to_noise needs at least 2 draws, got {n}.")
    mean = g.mean(dim=0)
    spread = float((g - mean).square().sum()) / (n - 1)
    return (float(mean @ mean) - spread / n) / spread if spread > 0 else math.inf


def split_half_reliability(half_a: Tensor, half_b: Tensor) -> tuple[float, float]:
    """(cos of the two halves, the Spearman-Brown estimate 2r / (1 + r) for the whole): how far the reference
    gradient is from its own noise floor."""
    r = cosine(half_a, half_b)
    return r, 2 * r / (1 + r) if r > -1 else math.nan


def mean_of(draws: list[Tensor]) -> Tensor:
    """The mean [d] of equal-shaped draws."""
    return torch.stack([d.double() for d in draws]).mean(dim=0)


def _noise_free_square(draws: Tensor) -> float:
    """U-statistic of ‖E x‖² from independent draws [n, d]: the mean of ⟨x_i, x_j⟩ over pairs i ≠ j."""
    n = draws.shape[0]
    total = draws.sum(dim=0)
    return (float(total @ total) - float(draws.square().sum())) / (n * (n - 1))


def noise_free_cosine(arm: Tensor, reference: Tensor) -> float:
    """cos(E ĝ, E g★) from independent draws of each ([n, d] and [m, d], n, m ≥ 2), every pair used: the mean
    of ⟨ĝ_i, g★_k⟩ over all (i, k) over √(U(ĝ)·U(g★)), U the pairwise U-statistic of the squared norm. Unbiased
    numerator and denominator terms (a ratio, so consistent rather than unbiased); NaN when a U-statistic is ≤ 0
    (too few draws to see the mean through the noise, or fewer than 2 of either). The all-pairs
    form of :func:`bias_ceiling`."""
    g, r = arm.double(), reference.double()
    if g.shape[0] < 2 or r.shape[0] < 2:
        return math.nan  # no pair of independent draws (a jackknife of 2 repeats leaves one)
    signal, ref = _noise_free_square(g), _noise_free_square(r)
    if signal <= 0 or ref <= 0:
        return math.nan
    return float(g.mean(dim=0) @ r.mean(dim=0)) / math.sqrt(signal * ref)


def jackknife(statistic, draws: Tensor, level: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high): ``statistic(draws)`` with a delete-one jackknife t interval over the draws [n, ...]
    (n − 1 degrees of freedom); NaN bounds when a leave-one-out value is NaN."""
    from scipy import stats

    n = draws.shape[0]
    full = statistic(draws)
    if n < 3:  # a leave-one-out sample of one draw has no spread: no interval
        return full, math.nan, math.nan
    keep = torch.ones(n, dtype=torch.bool, device=draws.device)
    leave = []
    for i in range(n):
        keep[i] = False
        leave.append(statistic(draws[keep]))
        keep[i] = True
    values = torch.tensor(leave, dtype=torch.float64, device="cpu")
    if not torch.isfinite(values).all() or math.isnan(full):
        return full, math.nan, math.nan
    se = math.sqrt((n - 1) / n * float((values - values.mean()).square().sum()))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
    return full, full - half, full + half

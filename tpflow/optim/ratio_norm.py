"""GRPO-Guard's RatioNorm: the log-ratio re-centred and re-scaled so that its mean is 0 at every step.

GRPO-Guard (arXiv 2510.22319; ``scripts/train_sd3_GRPO_Guard.py`` in flow_grpo, docs/algorithm.md §10.2) finds
that Flow-GRPO's importance ratio drifts below 1 at the low-noise steps, where the Gaussian log-density is sharpest,
so the clip acts one-sidedly. It replaces the log-ratio of a step with std s by

    log r̂ = s · (ℓ_θ − ℓ_old + mean_d (μ_θ − μ_old)² / (2 s²)),

which, with z' = μ_old + s·ξ the stored sample, equals mean_d ξ ⊙ (μ_θ − μ_old): 0 in expectation over ξ, and of a
scale that no longer grows as s shrinks. It needs the transition mean μ_old of the rollout (``Rollout.means``) and a
log-probability that is the Gaussian density the sampler samples from (flow-sde, dance-sde; not cps, whose log-prob
is a surrogate without 1/(2s²)). Its optional gradient reweight divides each step's loss by Δσ = σ − σ⁺, because
∂μ/∂v is proportional to Δσ (flow-sde: −Δσ(1 + η²/2)), so without it the steps' gradients scale with their length;
Flow-Factory ships RatioNorm without the reweight, hence a switch of its own (``GRPOOptions.ratio_norm_reweight``).

The reference takes s as the product of batch means of σ^sde and sqrt(Δσ); here s is each row's own std, the same
value whenever the rows of a step share σ (one window per batch, as in GRPO-Guard's rollouts).
"""

from __future__ import annotations

import torch
from torch import Tensor


def normalised_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor
) -> Tensor:
    """log r̂ [N] (module docstring) from ℓ_θ [N] (with grad), ℓ_old [N], μ_θ [N, ...] (with grad), μ_old [N, ...]
    and the step's std s [N] (detached); 0 with no gradient where s is 0 (an ODE step, never trained)."""
    dtype = torch.promote_types(log_prob.dtype, torch.float32)  # float32, or wider when the inputs are
    s = std.detach().to(dtype)
    positive = s > 0
    safe = torch.where(positive, s, torch.ones_like(s))
    diff = (mean.to(dtype) - old_mean.detach().to(dtype)).reshape(mean.shape[0], -1)
    bias = diff.square().mean(dim=1) / (2 * safe.square())  # [N] mean_d (μ_θ − μ_old)² / (2 s²)
    log_ratio = safe * (log_prob - old_log_prob.detach() + bias)
    return torch.where(positive, log_ratio, torch.zeros_like(log_ratio))

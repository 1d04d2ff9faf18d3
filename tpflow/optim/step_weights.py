"""TempFlow-GRPO's noise-aware step weight: each trained step's policy loss weighted by its transition std.

TempFlow-GRPO (docs/algorithm.md §10.3) multiplies the clipped surrogate of step k by w_k = c·s_k, where s_k is
the std of the SDE transition at that step (for flow-sde, σ^sde_k·sqrt(Δσ_k)): steps that inject more noise carry
more of the update. Its code hard-codes c per model (2.25 for SD3.5-M, 1.73 for FLUX, 1.53 for Qwen-Image); for
SD3.5-M at η = 0.7 on the 10-step shift-3 schedule that constant is 1/mean_k s_k over the nine trained steps, the
normalisation that makes the mean weight 1. tpflow derives c that way for the recipe's own schedule and noise level
instead of hard-coding it: per trajectory, c = (number of its trained steps) / Σ_{trained k} s_k, so its trained
steps' weights average to 1 whatever the sampler, schedule or plan (FLUX's 1.73 matches η = 0.9
while its code samples at η = 0.7: the constant there is off by that mismatch, a quirk not reproduced). The KL term
is not weighted, as in the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpflow.interfaces import Sampler


def transition_std(sampler: Sampler, sigmas: Tensor, noise_level: float) -> Tensor:
    """The std s [N, W] of every stored step's transition from the step grid ``sigmas`` [N, W + 1] (host): the
    sampler's own ``StepOutput.std``, which depends on σ, σ⁺ and α only, read off a scoring of zero latents."""
    n, width = sigmas.shape[0], sigmas.shape[1] - 1
    s, s_next = sigmas[:, :-1].reshape(-1), sigmas[:, 1:].reshape(-1)  # [N·W] each
    zeros = torch.zeros((n * width, 1), dtype=torch.float32, device="cpu")  # host bookkeeping (tpflow.devices)
    return sampler.log_prob(zeros, zeros, zeros, s, s_next, noise_level).std.reshape(n, width).cpu()


def noise_aware_weights(std: Tensor, trained: Tensor | None = None) -> Tensor:
    """w = c·s [N, W] with c per row making the mean weight over the row's trained steps 1 (``trained`` [N, W] bool,
    None: all); 0 for a row whose trained steps all have std 0 (none of them trains anyway)."""
    mask = torch.ones_like(std, dtype=torch.bool) if trained is None else trained.to(std.device)
    mass = (std * mask).sum(dim=1)  # [N] Σ_{trained} s
    count = mask.sum(dim=1).to(std.dtype)  # [N]
    c = torch.where(mass > 0, count / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.zeros_like(mass))
    return c[:, None] * std

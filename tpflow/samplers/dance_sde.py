"""DanceGRPO's SDE step: Flow-GRPO's drift and Gaussian log-density with a constant diffusion coefficient.

DanceGRPO (Xue et al., 2025, arXiv 2505.07818; ``flux_step`` in its training scripts, docs/algorithm.md §1.4b)
samples with the same Euler–Maruyama mean as Flow-GRPO, μ = z·(1 − η²h/(2σ)) − v·(1 + η²(1 − σ)/(2σ))·h, but with
the diffusion coefficient g(σ) = η constant in σ, where Flow-GRPO's α·sqrt(σ/(1 − σ)) grows without bound as σ → 1.
So std = η·√h, no σ = 1 guard is needed, and the log-density is the same full Gaussian averaged over the latent
elements. Its scripts use η = 0.3 (FLUX.1-dev, Wan, Qwen-Image) and 0.25 (HunyuanVideo) where Flow-GRPO uses 0.7:
``[rollout] noise_level`` is η. docs/algorithm.md §1.4 gives both steps.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tpflow.registry import register
from tpflow.samplers.flow_sde import FlowSdeSampler


class DanceSdeOptions(BaseModel):
    """Options of the ``dance-sde`` sampler: none (η is ``[rollout] noise_level``, 0.3 in DanceGRPO's scripts)."""

    model_config = ConfigDict(extra="forbid")


@register("sampler", "dance-sde", options=DanceSdeOptions)
class DanceSdeSampler(FlowSdeSampler):
    """DanceGRPO's SDE step (module docstring). Implements ``Sampler``; ``std_dev_t`` = η, ``std`` = η·√h.

    Options: none (``DanceSdeOptions``). At η = 0 the step is the Euler ODE step, bit for bit, as flow-sde's."""

    registered_name = "dance-sde"
    guards_sigma_one = False  # no 1/(1 − σ): a step from σ = 1 is an ordinary one

    def __init__(self, options: DanceSdeOptions | None = None) -> None:
        self.options = options or DanceSdeOptions()

    @staticmethod
    def diffusion(s: Tensor, s_next: Tensor, alpha: float) -> Tensor:
        """g(σ) = η for every row [N]: constant in σ."""
        return torch.full_like(s, alpha)

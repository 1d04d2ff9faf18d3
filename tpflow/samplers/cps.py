"""Coefficients-Preserving Sampling step with the reference's variance-free surrogate log-prob (docs/algorithm.md
§1.5).

This is the sampler every shipped TP-GRPO config uses.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from tpflow.registry import register
from tpflow.samplers._common import (
    check_latents,
    checked_sigmas,
    draw_noise,
    mean_over_latent,
    per_row,
)
from tpflow.types import StepOutput


class CpsOptions(BaseModel):
    """Options of the ``cps`` sampler: none.

    Coefficients-Preserving Sampling (Wang and Yu, 2025, arXiv 2509.05952), as implemented by Flow-GRPO and used by
    every TP-GRPO config; the noise level α is passed per step because rollouts switch it between window and ODE steps.
    """

    model_config = ConfigDict(extra="forbid")


@register("sampler", "cps", options=CpsOptions)
class CpsSampler:
    """One CPS step: re-noise the clean estimate so the noise coefficient stays σ⁺. Implements ``Sampler``.

    Options: none (``CpsOptions``). With σ = ``sigma``, σ⁺ = ``sigma_next`` and α = ``noise_level`` ∈ [0, 1]:

    * clean and noise estimates ``x̂_0 = z − σv`` and ``x̂_1 = z + (1 − σ)v``;
    * step std ``ρ = σ⁺·sin(απ/2)`` (returned as both ``std`` and ``std_dev_t``);
    * mean ``μ = (1 − σ⁺)·x̂_0 + σ⁺·cos(απ/2)·x̂_1``, where σ⁺·cos(απ/2) = sqrt(σ⁺² − ρ²). It is evaluated as
      ``[z + (σ⁺ − σ)v] + σ⁺·(cos(απ/2) − 1)·x̂_1``, algebraically the same, so that α = 0 gives the Euler step bit for
      bit (the reference's grouping differs from this one by float32 rounding only);
    * sample ``z' = μ + ρ·ξ``, ξ ~ N(0, I). At σ⁺ = 0 (the last step) ρ = 0 and z' = μ = x̂_0, deterministic.

    ``log_prob`` is **not** a normalised log-density. It is the reference's surrogate ``ℓ = −mean((z' − μ)²)`` over
    the non-batch dims, with the constants *and the variance 2ρ²* dropped. It is reproduced on purpose, to match the
    published TP-GRPO runs: importance ratios built from it are ``exp(mean((z' − μ_old)²) − mean((z' − μ_θ)²))``,
    whose sharpness (and so the effect of the PPO clip range) differs from a true Gaussian ratio by the factor 1/(2ρ²).
    It is finite at α = 0 but meaningless there (ODE steps are never trained).

    Everything is computed in float32; ``prev`` is cast back to the latent dtype, the other fields stay float32.
    """

    gaussian_log_prob = False  # log_prob is the reference's surrogate −mean (z' − μ)², no 1/(2ρ²): no RatioNorm

    def __init__(self, options: CpsOptions | None = None) -> None:
        self.options = options or CpsOptions()

    @staticmethod
    def check_recipe(options: CpsOptions, settings: dict) -> list[str]:
        """The recipe's limits for cps, checked by ``tpflow validate`` before anything loads."""
        alpha = settings["rollout"].noise_level
        if 0 <= alpha <= 1:
            return []
        return [
            f"[rollout] noise_level = {alpha} is outside the cps sampler's range [0, 1] (ρ = σ⁺·sin(απ/2) peaks at "
            "α = 1; the paper uses 0.7). Lower it, or use sampler flow-sde, whose α has no upper limit."
        ]

    def step(
        self,
        z: Tensor,
        v: Tensor,
        sigma: Tensor | float,
        sigma_next: Tensor | float,
        noise_level: float,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> StepOutput:
        """Sample z_{k+1} from z_k.

        Args:
            z: [N, ...] latent at ``sigma``.
            v: [N, ...] velocity prediction at (z, sigma).
            sigma: current noise level, float, 0-d or [N].
            sigma_next: next noise level (<= sigma), float, 0-d or [N].
            noise_level: α in [0, 1]; 1 puts all of σ⁺ into fresh noise.
            generator: RNG for ξ (``tpflow.devices.randn``: drawn on the generator's device, moved to z's); the
                CPU's global RNG when None. ξ is drawn even when α = 0. The rollout engine passes ``noise``
                instead, its own draw for the step (docs/algorithm.md §1.6).
            noise: explicit standard-normal ξ [N, ...] replacing the draw.

        Returns:
            StepOutput whose ``log_prob`` scores the float32 sample before its cast to ``z.dtype``.
        """
        check_latents(z, v)
        mean, rho = self._transition(z, v, sigma, sigma_next, noise_level)
        xi = draw_noise(z, generator, noise)  # [N, ...] float32
        prev = mean + per_row(rho, z) * xi  # [N, ...] float32
        return StepOutput(prev.to(z.dtype), mean, rho, _surrogate(prev, mean), rho)

    def log_prob(
        self,
        z_next: Tensor,
        z: Tensor,
        v: Tensor,
        sigma: Tensor | float,
        sigma_next: Tensor | float,
        noise_level: float,
    ) -> StepOutput:
        """Score a stored transition z -> z_next; the gradient flows through ``v`` (z_next is detached).

        Returns:
            StepOutput with ``prev = z_next`` as given and mean, std, log_prob [N], std_dev_t recomputed.
        """
        check_latents(z, v, z_next)
        mean, rho = self._transition(z, v, sigma, sigma_next, noise_level)
        return StepOutput(z_next, mean, rho, _surrogate(z_next.detach().float(), mean), rho)

    def _transition(
        self, z: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float, noise_level: float
    ) -> tuple[Tensor, Tensor]:
        """(mean [N, ...], ρ [N]), float32."""
        alpha = float(noise_level)
        if not 0 <= alpha <= 1:
            raise ValueError(
                f"noise_level (α) of cps must lie in [0, 1] (ρ = σ⁺·sin(απ/2) peaks at α = 1); got {noise_level!r}."
            )
        s, s_next = checked_sigmas(sigma, sigma_next, z)  # [N] each; checked on the host when they come from there
        rho = s_next * math.sin(alpha * math.pi / 2)  # [N]
        z32, v32 = z.float(), v.float()
        s_col, s_next_col = per_row(s, z), per_row(s_next, z)  # [N, 1, ...]
        euler = z32 + (s_next_col - s_col) * v32
        noise_estimate = z32 + (1 - s_col) * v32  # x̂_1
        mean = euler + s_next_col * (math.cos(alpha * math.pi / 2) - 1) * noise_estimate
        return mean, rho


def _surrogate(prev: Tensor, mean: Tensor) -> Tensor:
    """The reference's variance-free cps "log-prob": −mean over non-batch dims of (prev − mean)² -> [N]."""
    return -mean_over_latent((prev - mean) ** 2)

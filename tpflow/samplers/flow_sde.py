"""Flow-GRPO's marginal-preserving SDE step with its Gaussian log-density (docs/algorithm.md §1.4)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tpflow.registry import register
from tpflow.samplers._common import (
    check_latents,
    checked_sigmas,
    draw_noise,
    mean_over_latent,
    per_row,
    working_dtype,
)
from tpflow.types import StepOutput

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class FlowSdeOptions(BaseModel):
    """Options of the ``flow-sde`` sampler: the diffusion coefficient's dependence on σ.

    The step is the SDE of Flow-GRPO (Liu et al., 2025, arXiv 2505.05470), the TP-GRPO paper's Eq. 2; its scale, the
    noise level α, is passed per step because rollouts switch it between window (α) and ODE (0) steps. The mean and
    the log-density are the same for every schedule: only ε(σ) differs (docs/algorithm.md §1.4c).
    """

    model_config = ConfigDict(extra="forbid")

    noise_schedule: Literal["eta", "linear-sigma"] = Field(
        "eta",
        description="ε(σ): 'eta', Flow-GRPO's α·sqrt(σ/(1 − σ)); 'linear-sigma', α·(sigma_min + (sigma_max − "
        "sigma_min)·σ), the Wan2.1 step of flow_grpo's Wan script (zhtmike/flow_grpo at 9745241), which uses "
        "α = 1 (``[rollout] noise_level = 1.0``).",
    )
    sigma_min: float | None = Field(
        None,
        ge=0,
        description="linear-sigma only: ε at σ = 0 (over α); the fork reads its scheduler's last sigma, 0 for "
        "Wan2.1's UniPC (final_sigmas_type 'zero'); None: 0.",
    )
    sigma_max: float | None = Field(
        None,
        gt=0,
        description="linear-sigma only, required there: ε at σ = 1 (over α); the fork reads its scheduler's second "
        "sigma σ_1 (0.98242 for Wan2.1's UniPC flow sigmas at K = 20, shift 3).",
    )

    @model_validator(mode="after")
    def _schedule(self) -> FlowSdeOptions:
        given = [name for name in ("sigma_min", "sigma_max") if getattr(self, name) is not None]
        if self.noise_schedule == "eta" and given:
            raise ValueError(
                f"{' and '.join(given)} set the linear-sigma noise schedule, but noise_schedule is 'eta' (Flow-GRPO's "
                'α·sqrt(σ/(1 − σ)), which has no such parameter): set noise_schedule = "linear-sigma" or remove '
                f"{' and '.join(given)}"
            )
        if self.noise_schedule == "linear-sigma":
            if self.sigma_max is None:
                raise ValueError(
                    'noise_schedule = "linear-sigma" needs sigma_max, ε at σ = 1 over α (flow_grpo\'s Wan script '
                    "uses its schedule's second sigma: sigma_max = 0.982419 for K = 20 at shift 3)"
                )
            if self.lower > self.sigma_max:
                raise ValueError(f"sigma_min = {self.lower} exceeds sigma_max = {self.sigma_max}: ε would fall with σ")
        return self

    @property
    def lower(self) -> float:
        """σ_min as used: 0 when not given."""
        return 0.0 if self.sigma_min is None else float(self.sigma_min)


@register("sampler", "flow-sde", options=FlowSdeOptions)
class FlowSdeSampler:
    """Euler–Maruyama step of Flow-GRPO's SDE, which keeps the marginals of the flow ODE. Implements ``Sampler``.

    Options: ``FlowSdeOptions`` (the noise schedule). With σ = ``sigma``, σ⁺ = ``sigma_next``, the step length
    h = σ − σ⁺ and α = ``noise_level``:

    * diffusion coefficient ``ε = α·sqrt(σ / (1 − σ̄))`` with σ̄ = σ, except σ̄ = σ⁺ when σ = 1 (the reference's guard
      against dividing by zero, which uses the *second* schedule sigma σ_1: for a schedule starting at σ_0 = 1 that
      is exactly ``sigma_next`` of step 0, so a step from σ = 1 must end below 1); with ``noise_schedule =
      "linear-sigma"``, ``ε = α·(σ_min + (σ_max − σ_min)·σ)`` (flow_grpo's Wan step at α = 1; no guard needed);
    * mean ``μ = z·(1 − ε²h/(2σ)) − v·(1 + ε²(1 − σ)/(2σ))·h`` (Euler–Maruyama on
      ``dz = [v + ε²/(2σ)·(z + (1 − σ)v)] dσ + ε dW`` with σ decreasing);
    * sample ``z' = μ + ε·sqrt(h)·ξ``, ξ ~ N(0, I), so ``std = ε·sqrt(h)`` and ``std_dev_t = ε`` (no √h: the
      reference's KL divides by it, docs/algorithm.md §6.2);
    * ``log_prob`` = the Gaussian log-density ``−(z' − μ)²/(2ε²h) − log(ε√h) − ½log(2π)`` of every latent element,
      averaged (not summed) over the non-batch dims, giving [N].

    At α = 0 the mean is exactly the Euler step ``z − h·v`` (bit for bit ``euler_step``) and ``std = 0``. The density
    is then degenerate: rows with ``std = 0`` get ``log_prob = 0``, a placeholder that is meaningless (the reference
    yields −inf/NaN there) and harmless because ODE steps are never trained.

    Everything is computed in float32 (in float64 for float64 latents, so that a float64 transcription of a
    reference step can be matched to rounding); ``prev`` is cast back to the latent dtype, the other fields stay in
    the working dtype.
    """

    registered_name = "flow-sde"
    gaussian_log_prob = True  # log_prob is the density ``step`` samples from (GRPO-Guard's RatioNorm needs it)

    def __init__(self, options: FlowSdeOptions | None = None) -> None:
        self.options = options or FlowSdeOptions()
        self.guards_sigma_one = self.options.noise_schedule == "eta"  # linear-sigma has no 1/(1 − σ)

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
            noise_level: α >= 0.
            generator: RNG for ξ (``tpflow.devices.randn``: drawn on the generator's device, moved to z's); the
                CPU's global RNG when None. ξ is drawn even when α = 0. The rollout engine passes ``noise``
                instead, its own draw for the step (docs/algorithm.md §1.6).
            noise: explicit standard-normal ξ [N, ...] replacing the draw.

        Returns:
            StepOutput whose ``log_prob`` scores the float32 sample before its cast to ``z.dtype``.
        """
        check_latents(z, v)
        shift, std, eps = self._transition(z, v, sigma, sigma_next, noise_level)
        mean = z.to(shift.dtype) + shift  # [N, ...] float32 (float64 for float64 latents)
        xi = draw_noise(z, generator, noise)  # [N, ...] float32
        prev = mean + per_row(std, z) * xi.to(mean.dtype)  # [N, ...] float32 (float64 for float64 latents)
        return StepOutput(prev.to(z.dtype), mean, std, _log_prob(prev, z, shift, std), eps)

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
        shift, std, eps = self._transition(z, v, sigma, sigma_next, noise_level)
        mean = z.to(shift.dtype) + shift  # [N, ...] float32 (float64 for float64 latents)
        return StepOutput(z_next, mean, std, _log_prob(z_next.detach().to(mean.dtype), z, shift, std), eps)

    guards_sigma_one = True  # ε has 1/(1 − σ): a step from σ = 1 must end below 1 (``diffusion``)

    def diffusion(self, s: Tensor, s_next: Tensor, alpha: float) -> Tensor:
        """The diffusion coefficient ε [N] of steps from σ = ``s`` [N]: α·sqrt(σ / (1 − σ̄)), σ̄ = σ⁺ at σ = 1; or,
        with the linear-sigma schedule, α·(σ_min + (σ_max − σ_min)·σ)."""
        if self.options.noise_schedule == "linear-sigma":
            low, high = self.options.lower, float(self.options.sigma_max)
            return alpha * (low + (high - low) * s)
        s_bar = torch.where(s == 1, s_next, s)  # σ = 1 guard: σ̄ = σ_1 = sigma_next
        return alpha * torch.sqrt(s / (1 - s_bar))

    def _transition(
        self, z: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float, noise_level: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(μ − z [N, ...], std [N], ε [N]), all float32: the mean as a shift from z, which the log-density reads
        directly (``_log_prob``); at α = 0 ``z + shift`` is the Euler step bit for bit."""
        alpha = float(noise_level)
        if not alpha >= 0:
            raise ValueError(f"noise_level (α) of {self.registered_name} must be >= 0; got {noise_level!r}.")
        # [N] each, checked on the host when they come from there (σ = 1 -> 1 included: the guard below needs σ⁺ < 1)
        work = working_dtype(z)  # float32, or float64 for float64 latents (exact comparisons with a reference)
        s, s_next = checked_sigmas(sigma, sigma_next, z, leave_one=self.guards_sigma_one, dtype=work)
        h = s - s_next  # [N] step length, >= 0
        eps = self.diffusion(s, s_next, alpha)  # [N]
        s_safe = torch.where(s > 0, s, torch.ones_like(s))  # σ = 0 forces ε = 0 and h = 0: avoid 0/0
        drift = eps**2 / (2 * s_safe)  # [N] ε²/(2σ)
        z32, v32 = z.to(work), v.to(work)
        shift = -z32 * per_row(drift * h, z) - v32 * per_row((1 + drift * (1 - s)) * h, z)  # μ − z
        return shift, eps * torch.sqrt(h), eps


def _log_prob(prev: Tensor, z: Tensor, shift: Tensor, std: Tensor) -> Tensor:
    """Mean Gaussian log-density of prev [N, ...] under N(z + shift, std²) -> [N]; 0 where std [N] is 0.

    The deviation is read as (prev − z) − shift, not prev − μ: z′ and μ are both O(|z|) while their difference is
    std·ξ, so forming μ first rounds it at |z|'s scale (6e-8·|z| in float32, about 1e-6 of std·ξ at σ near 0.3);
    prev − z is exact for nearby values (Sterbenz) and shift is O(h), which leaves the deviation's rounding at its
    own scale. Measured against float64 in tests/test_samplers.py."""
    positive = std > 0
    safe = torch.where(positive, std, torch.ones_like(std))  # keeps gradients finite on the masked rows
    sd = per_row(safe, prev)
    deviation = (prev - z.to(prev.dtype)) - shift  # [N, ...] z′ − μ
    elementwise = -(deviation**2) / (2 * sd**2) - torch.log(sd) - _HALF_LOG_2PI
    return torch.where(positive, mean_over_latent(elementwise), torch.zeros_like(std))

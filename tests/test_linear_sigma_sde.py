"""flow-sde's ``noise_schedule = "linear-sigma"``: the SDE step of flow_grpo's Wan2.1 script (zhtmike/flow_grpo at
9745241, ``sde_step_with_logprob`` in flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py; docs/algorithm.md
§1.4c), checked against a float64 transcription of that function, with the invariants the other samplers keep: noise
0 is the Euler step bit for bit, the log-prob of the sample drawn is its Gaussian density, and scoring the stored
transition again gives the sampling log-prob (the on-policy ratio is 1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tomllib
import torch

import tpflow
from tpflow.errors import UserError
from tpflow.samplers import FlowSdeSampler, euler_step
from tpflow.samplers.flow_sde import FlowSdeOptions
from tpflow.samplers.schedules import flow_sigmas

WAN_SIGMA_MAX = 0.982419490814209  # the fork's sigma_max: Wan2.1's UniPC sigmas[1] at K = 20, shift 3 (float32)


def fork_step(z, v, sigma, sigma_prev, xi, sigma_min, sigma_max, prev_sample=None):
    """The fork's ``sde_step_with_logprob`` written out (float64 here): the scheduler's sigma_max = sigmas[1] and
    sigma_min = sigmas[-1] are passed in. Returns (prev_sample, log_prob [N], prev_sample_mean,
    std_dev_t·sqrt(−dt) [N])."""
    view = (-1,) + (1,) * (z.ndim - 1)
    sigma, sigma_prev = sigma.view(view), sigma_prev.view(view)
    dt = sigma_prev - sigma
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    prev_sample_mean = (
        z * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * xi
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=z.dtype)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, (std_dev_t * torch.sqrt(-1 * dt)).flatten()


def _linear(sigma_max: float = WAN_SIGMA_MAX, sigma_min: float | None = None) -> FlowSdeSampler:
    return tpflow.build("sampler", "flow-sde", noise_schedule="linear-sigma", sigma_max=sigma_max, sigma_min=sigma_min)


def _inputs(n: int = 6, seed: int = 0):
    """Video latents [N, C, F, H, W] in float64, per-row σ > σ⁺ (the last step's σ⁺ = 0 among them) and ξ."""
    g = torch.Generator().manual_seed(seed)
    z, v = torch.randn(n, 4, 3, 5, 6, generator=g, dtype=torch.float64), torch.randn(n, 4, 3, 5, 6, generator=g)
    sigma = torch.rand(n, generator=g, dtype=torch.float64) * 0.95 + 0.04
    sigma_next = sigma * torch.rand(n, generator=g, dtype=torch.float64)
    sigma_next[0] = 0.0
    xi = torch.randn(n, 4, 3, 5, 6, generator=g).double()  # float32 draws: draw_noise keeps them exactly
    return z, v.double(), sigma, sigma_next, xi


@pytest.mark.parametrize("sigma_min", [None, 0.05])
def test_the_step_is_the_forks_wan_step_in_float64(sigma_min):
    z, v, sigma, sigma_next, xi = _inputs()
    out = _linear(sigma_min=sigma_min).step(z, v, sigma, sigma_next, 1.0, noise=xi)
    prev, log_prob, mean, std = fork_step(z, v, sigma, sigma_next, xi, sigma_min or 0.0, WAN_SIGMA_MAX)
    assert out.prev.dtype == torch.float64
    for ours, theirs in ((out.mean, mean), (out.std, std), (out.prev, prev), (out.log_prob, log_prob)):
        assert float((ours - theirs).abs().max()) <= 1e-12
    eps = (sigma_min or 0.0) + (WAN_SIGMA_MAX - (sigma_min or 0.0)) * sigma  # the fork's std_dev_t
    assert float((out.std_dev_t - eps).abs().max()) <= 1e-15
    # the update scores the stored transition (the fork's compute_log_prob passes prev_sample)
    stored = prev + 1e-3 * torch.randn(prev.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scored = _linear(sigma_min=sigma_min).log_prob(stored, z, v, sigma, sigma_next, 1.0)
    _, log_prob, _, _ = fork_step(z, v, sigma, sigma_next, None, sigma_min or 0.0, WAN_SIGMA_MAX, prev_sample=stored)
    assert float((scored.log_prob - log_prob).abs().max()) <= 1e-12


def test_noise_level_scales_the_forks_std_and_zero_is_the_euler_step():
    z, v, sigma, sigma_next, xi = (t.float() for t in _inputs(seed=2))
    sigma, sigma_next = sigma[1:], sigma_next[1:]  # float32 rows from σ > 0
    z, v, xi = z[1:], v[1:], xi[1:]
    sampler = _linear()
    ode = sampler.step(z, v, sigma, sigma_next, 0.0, noise=xi)
    assert torch.equal(ode.prev, euler_step(z, v, sigma, sigma_next))  # bit for bit
    assert torch.equal(ode.std, torch.zeros_like(ode.std))
    half = sampler.step(z, v, sigma, sigma_next, 0.5, noise=xi)
    one = sampler.step(z, v, sigma, sigma_next, 1.0, noise=xi)
    torch.testing.assert_close(half.std_dev_t, 0.5 * one.std_dev_t, rtol=1e-6, atol=0)


def test_the_log_prob_of_the_sample_drawn_is_its_density_and_the_on_policy_ratio_is_one():
    z, v, sigma, sigma_next, _ = (t.float() for t in _inputs(seed=3))
    sampler = _linear(sigma_min=0.1)
    out = sampler.step(z, v, sigma, sigma_next, 1.0, generator=torch.Generator().manual_seed(4))
    view = (-1, 1, 1, 1, 1)
    density = torch.distributions.Normal(out.mean.double(), out.std.double().view(view)).log_prob(out.prev.double())
    torch.testing.assert_close(out.log_prob.double(), density.flatten(1).mean(1), rtol=0, atol=1e-4)
    again = sampler.log_prob(out.prev, z, v, sigma, sigma_next, 1.0)
    assert torch.equal(again.log_prob, out.log_prob)  # exp(log π_θ − log π_old) = 1 exactly on policy
    assert torch.equal(torch.exp(again.log_prob - out.log_prob), torch.ones_like(out.log_prob))


def test_a_step_from_sigma_one_needs_no_guard():
    """ε is finite at σ = 1 (no 1/(1 − σ)): a step from 1 to 1 is no step, not an error as under 'eta'."""
    z, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    out = _linear().step(z, v, 1.0, 1.0, 1.0, noise=torch.randn(2, 3, 4))
    assert torch.equal(out.prev, z) and torch.equal(out.std, torch.zeros(2))
    with pytest.raises(ValueError, match="must end below 1"):
        FlowSdeSampler().step(z, v, 1.0, 1.0, 0.7)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"noise_schedule": "linear-sigma"}, "needs sigma_max"),
        ({"sigma_max": 0.9}, "noise_schedule is 'eta'"),
        ({"noise_schedule": "linear-sigma", "sigma_max": 0.5, "sigma_min": 0.6}, "exceeds sigma_max"),
        ({"noise_schedule": "linear", "sigma_max": 0.9}, "noise_schedule"),
    ],
)
def test_bad_schedule_options_are_one_paragraph(options, match):
    with pytest.raises(UserError, match=match) as info:
        tpflow.build("sampler", "flow-sde", **options)
    assert "\n" not in str(info.value)


def test_the_wan_recipe_steps_as_the_fork():
    """wan_flowgrpo: linear-sigma at α = 1 with the fork's σ_max = its UniPC sigmas[1] and σ_min = sigmas[-1] = 0
    (final_sigmas_type "zero") for K = 20 at shift 3, and the fork's KL divided by the transition's std. The fork pins
    diffusers 0.33.1, whose UniPC ``use_flow_sigmas`` grid is φ(1 − linspace(1, 1/1000, K + 1))[::-1][:-1], the grid
    ``flow_sigmas`` reproduces (diffusers 0.36 and later start it at 1 − 1e-6 instead: σ_1 = 0.98278 there)."""
    recipe = tomllib.loads((Path(__file__).resolve().parents[1] / "recipes" / "wan" / "wan_flowgrpo.toml").read_text())
    k, shift = recipe["rollout"]["num_steps"], recipe["backbone"]["flow_shift"]
    sampler = recipe["sampler"]
    assert sampler["name"] == "flow-sde" and sampler["noise_schedule"] == "linear-sigma"
    assert sampler["sigma_max"] == float(flow_sigmas(k, shift)[1]) == WAN_SIGMA_MAX
    assert sampler.get("sigma_min", 0.0) == float(flow_sigmas(k, shift)[-1]) == 0.0
    assert recipe["rollout"]["noise_level"] == 1.0 and recipe["optimizer"]["kl_std"] == "transition"
    assert FlowSdeOptions(**{k: v for k, v in sampler.items() if k != "name"}).sigma_max == WAN_SIGMA_MAX

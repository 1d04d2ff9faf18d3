"""Monte Carlo state values (tpflow/probe/value.py) on toys whose answer is known.

A value estimate that continued from the wrong schedule index, took its SDE steps outside the window, or averaged
over the wrong rows would still return plausible numbers; these tests pin each of those to an exact answer."""

from __future__ import annotations

import pytest
import torch

import tpflow
from tpflow.devices import cpu_generator
from tpflow.probe.value import mc_values
from tpflow.rollout import Window, rollout
from tpflow.train.scoring import score_rollout
from tpflow.types import Conditioning, RewardOutput

SIGMAS = torch.tensor([1.0, 0.85, 0.7, 0.5, 0.3, 0.12, 0.0])  # K = 6
START, WIDTH = 1, 3  # window steps k = 1, 2, 3


class Affine:
    """v(z) = A·z + c in float64, decoded as a 3-pixel image; records the σ of every velocity call."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.weight = 0.8 * torch.randn(3, 3, generator=generator, dtype=torch.float64)
        self.offset = torch.randn(3, generator=generator, dtype=torch.float64)
        self.calls: list[float] = []

    def velocity(self, z, sigma, cond, guidance):
        self.calls.append(float(sigma[0]))
        return z @ self.weight.T + self.offset

    def decode(self, z):
        return z.reshape(z.shape[0], 3, 1, 1)


class Recording:
    """A sampler that records the σ and the noise level of each SDE step it is asked to take."""

    def __init__(self, name: str) -> None:
        self.inner = tpflow.build("sampler", name)
        self.steps: list[tuple[float, float]] = []

    def step(self, z, v, sigma, sigma_next, noise_level, generator=None, noise=None):
        self.steps.append((float(sigma), noise_level))
        return self.inner.step(z, v, sigma, sigma_next, noise_level, generator=generator, noise=noise)


WEIGHTS = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)


def linear_reward(images, prompts, metadata):
    """R(x) = w·x: its expectation is the reward of the expected final latent."""
    return RewardOutput(scores=(images.flatten(1).double() @ WEIGHTS).float())


def sampled(backbone, sampler, noise_level, n=2):
    cond = Conditioning({"rows": torch.arange(n)})
    z0 = torch.randn(n, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return rollout(backbone, sampler, cond, z0, SIGMAS, Window(START, WIDTH), noise_level, 1.0, "ode",
                   generator=cpu_generator(2))  # fmt: skip


def values(backbone, sampler, batch, samples, seed=5):
    n = len(batch)
    return mc_values(backbone, sampler, linear_reward, batch, SIGMAS, START, ["p"] * n, [{}] * n, samples,
                     cpu_generator(seed))  # fmt: skip


@pytest.mark.parametrize("name", ["flow-sde", "cps"])
def test_without_noise_the_values_are_the_exact_ode_completions(name):
    """At α = 0 every continuation is the Euler ODE from x_j: the MC mean is R_j of the exact completions for any M,
    with a zero standard error, and V_W is R_W."""
    backbone, sampler = Affine(), tpflow.build("sampler", name)
    batch = sampled(backbone, sampler, 0.0)
    trace = score_rollout(backbone.decode, linear_reward, batch.final, batch.completions, ["p"] * 2, [{}] * 2,
                          WIDTH).trace.double()  # fmt: skip
    got = values(backbone, sampler, batch, samples=3)
    torch.testing.assert_close(got.mean, trace, rtol=0, atol=1e-6)
    assert got.se.abs().max() < 1e-6
    assert got.mean.shape == got.se.shape == got.nfe.shape == (2, WIDTH + 1)
    # M·(K − s − j) evaluations for state j: the continuation runs to σ_K and no further
    expected_nfe = torch.tensor([3.0 * (6 - START - j) for j in range(WIDTH)] + [0.0], dtype=torch.float64)
    assert torch.equal(got.nfe, expected_nfe.expand(2, -1))


def test_continuations_start_at_the_states_schedule_index():
    """State j sits at σ_{s+j}: its continuation evaluates the velocity at σ_{s+j}..σ_{K−1} and takes its SDE steps,
    at the trajectory's noise level, at σ_{s+j}..σ_{s+W−1} only, where the trajectory took them."""
    backbone, sampler = Affine(), Recording("flow-sde")
    batch = sampled(backbone, sampler, 0.7, n=1)
    assert [s for s, _ in sampler.steps] == pytest.approx(SIGMAS[START : START + WIDTH].tolist())
    backbone.calls.clear()
    sampler.steps.clear()
    values(backbone, sampler, batch, samples=4)
    calls = [s for j in range(WIDTH) for s in SIGMAS[START + j : -1].tolist()]  # one call per step, M rows each
    steps = [s for j in range(WIDTH) for s in SIGMAS[START + j : START + WIDTH].tolist()]
    assert backbone.calls == pytest.approx(calls) and [s for s, _ in sampler.steps] == pytest.approx(steps)
    assert {level for _, level in sampler.steps} == {0.7}
    with pytest.raises(ValueError, match="wrong start"):  # states at σ_1..σ_4 are not at σ_0..σ_3
        mc_values(backbone, sampler, linear_reward, batch, SIGMAS, 0, ["p"], [{}], 4, cpu_generator(0))


def _expected_value(backbone, sampler, state, j):
    """E[R | x_j] exactly: the velocity is affine, so each step's mean is affine in z and E[x_{k+1}] = μ(E[x_k]); the
    ODE tail is deterministic and the reward linear."""
    z = state[None]
    for k in range(START + j, 6):
        v = backbone.velocity(z, SIGMAS[k : k + 1], None, 1.0)
        if k < START + WIDTH:
            z = sampler.step(z, v, SIGMAS[k], SIGMAS[k + 1], 0.7, noise=torch.zeros_like(z)).mean.double()
        else:
            z = z + (SIGMAS[k + 1] - SIGMAS[k]) * v
    return float(z[0] @ WEIGHTS)


def test_the_mean_is_the_sde_expectation_and_the_error_shrinks_as_one_over_root_m():
    """With noise, the MC mean lands within 4 standard errors of the exact SDE expectation (which the ODE completion
    misses by far more), and the standard error at M = 1024 is about a quarter of that at M = 64."""
    backbone, sampler = Affine(), tpflow.build("sampler", "flow-sde")
    batch = sampled(backbone, sampler, 0.7, n=4)
    trace = score_rollout(backbone.decode, linear_reward, batch.final, batch.completions, ["p"] * 4, [{}] * 4,
                          WIDTH).trace.double()  # fmt: skip
    small, large = values(backbone, sampler, batch, 64), values(backbone, sampler, batch, 1024)
    exact = torch.tensor(
        [[_expected_value(backbone, sampler, batch.latents[b, j], j) for j in range(WIDTH)] for b in range(4)],
        dtype=torch.float64,
    )
    z = (large.mean[:, :WIDTH] - exact) / large.se[:, :WIDTH]
    assert z.abs().max() < 4, z
    assert ((trace[:, :WIDTH] - exact).abs() > 10 * large.se[:, :WIDTH]).any()  # the test can tell SDE from ODE
    ratio = small.se[:, :WIDTH].mean() / large.se[:, :WIDTH].mean()
    assert 3.0 < ratio < 5.3, ratio
    assert torch.equal(large.se[:, WIDTH], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(values(backbone, sampler, batch, 64).mean, small.mean)  # fixed by the generator's seed

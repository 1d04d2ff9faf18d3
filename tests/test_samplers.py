"""Samplers (docs/algorithm.md §1.3–1.5): invariants, the reference's std tables, dtypes and input checks.

The SD3 K=10 and FLUX K=6 schedules are typed in from docs/algorithm.md §1.2 (tests/test_schedules.py checks them
against diffusers), so these tests do not import diffusers. The tests that take the ``device`` fixture also run on
CUDA in the GPU suite (tests/conftest.py); the samplers are elementwise float32 arithmetic, exact up to ~1 ulp on any
device.
"""

from __future__ import annotations

import math

import pytest
import torch

import tpflow
from tpflow.devices import cpu_generator
from tpflow.interfaces import Sampler
from tpflow.samplers import CpsSampler, DanceSdeSampler, FlowSdeSampler, euler_step
from tpflow.samplers._common import draw_noise

SD3_K10 = torch.tensor([1.0, 0.96013, 0.91335, 0.85769, 0.79037, 0.70728, 0.60215, 0.46488, 0.27805, 0.00893, 0.0])
FLUX_K6 = torch.tensor([1.0, 0.90374, 0.78970, 0.65249, 0.48422, 0.27300, 0.0])
SAMPLERS = [FlowSdeSampler, CpsSampler, DanceSdeSampler]
SIGMA_PAIRS = [(1.0, 0.96013), (0.79037, 0.70728), (0.27805, 0.00893), (0.00893, 0.0)]


def _latents(
    n: int = 3, shape: tuple[int, ...] = (4, 5, 6), seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g).to(device), torch.randn(n, *shape, generator=g).to(device)


def _table(sampler, sigmas: torch.Tensor, alpha: float, field: str) -> torch.Tensor:
    """One field ([1] per step) of a sampler run over every step of a schedule, as a [K] tensor."""
    z, v = _latents(n=1, shape=(2,))
    outs = [sampler.step(z, v, sigmas[k], sigmas[k + 1], alpha) for k in range(len(sigmas) - 1)]
    return torch.cat([getattr(o, field) for o in outs])


@pytest.mark.parametrize("cls", SAMPLERS)
@pytest.mark.parametrize("sigma,sigma_next", SIGMA_PAIRS)
def test_noise_level_zero_is_the_euler_step(cls, sigma, sigma_next, device):
    z, v = _latents(device=device)
    expected = z + (sigma_next - sigma) * v
    out = cls().step(z, v, sigma, sigma_next, 0.0)
    assert out.prev.device == z.device
    torch.testing.assert_close(out.prev, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.prev, euler_step(z, v, sigma, sigma_next), atol=0, rtol=0)  # bit for bit
    torch.testing.assert_close(out.mean, out.prev)
    assert torch.equal(out.std.cpu(), torch.zeros(3)) and torch.equal(out.std_dev_t.cpu(), torch.zeros(3))
    assert torch.isfinite(out.log_prob).all()


@pytest.mark.parametrize("cls", SAMPLERS)
def test_noise_level_zero_with_per_row_sigmas(cls):
    z, v = _latents(n=4)
    sigma, sigma_next = SD3_K10[[0, 3, 7, 9]], SD3_K10[[1, 4, 8, 10]]  # [N] each, one step per row
    expected = z + (sigma_next - sigma).view(-1, 1, 1, 1) * v
    out = cls().step(z, v, sigma, sigma_next, 0.0)
    torch.testing.assert_close(out.prev, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.prev, euler_step(z, v, sigma, sigma_next), atol=0, rtol=0)


def test_euler_step_keeps_dtype_and_accepts_tensor_sigmas():
    z, v = _latents()
    out = euler_step(z.half(), v.half(), torch.tensor(0.5), torch.tensor([0.25, 0.25, 0.25]))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), (z.half().float() - 0.25 * v.half().float()).half().float())


def test_cps_last_step_is_deterministic():
    z, v = _latents()
    sampler = CpsSampler()
    a = sampler.step(z, v, 0.27805, 0.0, 0.7, noise=torch.randn(z.shape))
    b = sampler.step(z, v, 0.27805, 0.0, 0.7, noise=torch.randn(z.shape))
    assert torch.equal(a.prev, b.prev)
    torch.testing.assert_close(a.prev, z - 0.27805 * v, atol=1e-6, rtol=0)
    assert torch.equal(a.std, torch.zeros(3))


@pytest.mark.parametrize("cls", SAMPLERS)
@pytest.mark.parametrize("alpha", [0.3, 0.7, 1.0])
def test_log_prob_of_own_sample_matches_step(cls, alpha, device):
    z, v = _latents(device=device)
    sampler = cls()
    sigma, sigma_next = torch.tensor([1.0, 0.60215, 0.27805]), torch.tensor([0.96013, 0.46488, 0.00893])
    out = sampler.step(z, v, sigma, sigma_next, alpha, generator=torch.Generator().manual_seed(1))
    assert out.prev.device == out.log_prob.device == z.device
    again = sampler.log_prob(out.prev, z, v, sigma, sigma_next, alpha)
    assert again.prev is out.prev
    torch.testing.assert_close(again.log_prob, out.log_prob, rtol=1e-6, atol=0)
    torch.testing.assert_close(again.mean, out.mean, rtol=0, atol=0)
    torch.testing.assert_close(again.std, out.std, rtol=0, atol=0)
    torch.testing.assert_close(again.std_dev_t, out.std_dev_t, rtol=0, atol=0)
    # A different sample scores lower under the same step (the surrogate and the density both peak at the mean).
    other = sampler.log_prob(out.prev + 0.5, z, v, sigma, sigma_next, alpha)
    assert (other.log_prob < out.log_prob).all()


@pytest.mark.parametrize("cls", SAMPLERS)
def test_explicit_noise_gives_mean_plus_std_xi(cls):
    z, v = _latents()
    xi = torch.randn(z.shape, generator=torch.Generator().manual_seed(2))
    out = cls().step(z, v, 0.85769, 0.79037, 0.7, noise=xi)
    torch.testing.assert_close(out.prev, out.mean + out.std.view(-1, 1, 1, 1) * xi, rtol=0, atol=0)
    assert out.std.shape == out.std_dev_t.shape == out.log_prob.shape == (3,)
    assert (out.std > 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cls", SAMPLERS)
def test_a_cpu_generator_draws_the_same_xi_on_cuda_latents(cls, cuda):
    """tpflow.devices rule 1: ξ comes from the CPU generator whatever the latent's device, so a step on CUDA latents
    draws, bit for bit, what the same seed draws on the CPU, and leaves the generator in the same state."""
    z, v = _latents()
    # a step whose std is far from 0 (0.70 for cps, 0.45 for flow-sde), so (prev - mean) / std recovers ξ closely
    sigma, sigma_next = torch.tensor([0.85769, 0.79037, 0.60215]), torch.tensor([0.79037, 0.70728, 0.46488])
    xi = torch.randn(z.shape, generator=cpu_generator(11))
    assert torch.equal(draw_noise(z.to(cuda), cpu_generator(11), None).cpu(), xi)
    g_cpu, g_gpu = cpu_generator(11), cpu_generator(11)
    a = cls().step(z, v, sigma, sigma_next, 0.7, generator=g_cpu)
    b = cls().step(z.to(cuda), v.to(cuda), sigma.to(cuda), sigma_next.to(cuda), 0.7, generator=g_gpu)
    assert b.prev.device.type == torch.device(cuda).type
    assert torch.equal(torch.randn(4, generator=g_cpu), torch.randn(4, generator=g_gpu))  # as much was drawn
    recovered = ((b.prev - b.mean) / b.std.view(-1, 1, 1, 1)).cpu()
    torch.testing.assert_close(recovered, xi, rtol=0, atol=1e-5)  # float32 rounding of prev, divided by std
    # The same inputs give the same step: elementwise float32 ops, ~1 ulp apart between CPU and CUDA.
    for field in ("prev", "mean", "std", "std_dev_t", "log_prob"):
        torch.testing.assert_close(getattr(b, field).cpu(), getattr(a, field), rtol=1e-6, atol=1e-6, msg=field)


@pytest.mark.parametrize("cls", SAMPLERS)
def test_generator_makes_draws_reproducible(cls):
    z, v = _latents()
    a = cls().step(z, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(3))
    b = cls().step(z, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(3))
    c = cls().step(z, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.prev, b.prev) and not torch.equal(a.prev, c.prev)


def test_flow_sde_std_tables_sd3():
    sampler = FlowSdeSampler()
    eps = [3.5057, 3.4351, 2.2726, 1.7185, 1.3592, 1.0881, 0.8612, 0.6524, 0.4344, 0.0664]
    transition = [0.700, 0.743, 0.536, 0.446, 0.392, 0.353, 0.319, 0.282, 0.225, 0.006]
    torch.testing.assert_close(_table(sampler, SD3_K10, 0.7, "std_dev_t"), torch.tensor(eps), atol=1e-4, rtol=0)
    torch.testing.assert_close(_table(sampler, SD3_K10, 0.7, "std"), torch.tensor(transition), atol=1e-3, rtol=0)


def test_cps_std_tables():
    sampler = CpsSampler()
    sd3 = [0.8555, 0.8138, 0.7642, 0.7042, 0.6302, 0.5365, 0.4142, 0.2477, 0.00796, 0.0]
    flux_08 = [0.8595, 0.7510, 0.6206, 0.4605, 0.2596, 0.0]
    flux_07 = [0.8052, 0.7036, 0.5814, 0.4314, 0.2432, 0.0]
    for sigmas, alpha, expected in [(SD3_K10, 0.7, sd3), (FLUX_K6, 0.8, flux_08), (FLUX_K6, 0.7, flux_07)]:
        rho = _table(sampler, sigmas, alpha, "std")
        torch.testing.assert_close(rho, torch.tensor(expected), atol=1e-4, rtol=0)
        torch.testing.assert_close(_table(sampler, sigmas, alpha, "std_dev_t"), rho, atol=0, rtol=0)


def test_flow_sde_log_prob_is_a_gaussian_density():
    sampler = FlowSdeSampler()
    z, v = torch.tensor([[0.3]]), torch.tensor([[-1.2]])  # a 1-element latent
    sigma, sigma_next = 0.79037, 0.70728
    ref = sampler.step(z, v, sigma, sigma_next, 0.7, noise=torch.zeros(1, 1))
    normal = torch.distributions.Normal(ref.mean[0, 0].double(), ref.std[0].double())
    grid = torch.linspace(-8, 8, 20001, dtype=torch.float64) * ref.std[0].double() + ref.mean[0, 0].double()
    lp = sampler.log_prob(
        grid[:, None].float(), z.expand(len(grid), 1), v.expand(len(grid), 1), sigma, sigma_next, 0.7
    )
    torch.testing.assert_close(lp.log_prob.double(), normal.log_prob(grid), atol=1e-4, rtol=1e-5)
    integral = torch.trapezoid(lp.log_prob.double().exp(), grid)
    assert abs(integral.item() - 1.0) < 1e-3
    # Monte Carlo: samples of the step have the mean and std the step reports.
    n = 200_000
    draws = sampler.step(
        z.expand(n, 1), v.expand(n, 1), sigma, sigma_next, 0.7, generator=torch.Generator().manual_seed(5)
    )
    assert abs(draws.prev.mean().item() - ref.mean.item()) < 4 * ref.std.item() / math.sqrt(n)
    assert abs(draws.prev.std().item() / ref.std.item() - 1) < 0.01


def test_flow_sde_log_prob_averages_over_latent_elements():
    z, v = _latents(n=2, shape=(3, 4))
    out = FlowSdeSampler().step(z, v, 0.5, 0.4, 0.9, generator=torch.Generator().manual_seed(6))
    normal = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1))
    torch.testing.assert_close(out.log_prob, normal.log_prob(out.prev).mean(dim=(1, 2)), rtol=1e-5, atol=1e-5)


def test_cps_log_prob_is_the_variance_free_surrogate():
    z, v = _latents(n=2)
    out = CpsSampler().step(z, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out.log_prob, -((out.prev - out.mean) ** 2).mean(dim=(1, 2, 3)), rtol=1e-6, atol=0)
    rho = out.std.view(-1, 1, 1, 1)
    mean_ref = (1 - 0.4) * (z - 0.5 * v) + torch.sqrt(rho.new_tensor(0.4) ** 2 - rho**2) * (z + 0.5 * v)
    torch.testing.assert_close(out.mean, mean_ref, rtol=0, atol=1e-6)  # the reference's grouping of the mean


@pytest.mark.parametrize("cls", SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_latents(cls, dtype, device):
    z, v = _latents(device=device)
    out = cls().step(z.to(dtype), v.to(dtype), 0.7, 0.6, 0.7, generator=torch.Generator().manual_seed(8))
    assert out.prev.dtype == dtype
    for t in (out.mean, out.std, out.log_prob, out.std_dev_t):
        assert t.dtype == torch.float32
    assert torch.isfinite(out.log_prob).all()
    again = cls().log_prob(out.prev, z.to(dtype), v.to(dtype), 0.7, 0.6, 0.7)
    assert again.prev.dtype == dtype and again.log_prob.dtype == torch.float32


@pytest.mark.parametrize("cls", SAMPLERS)
def test_log_prob_has_a_gradient_through_v(cls, device):
    z, v = _latents(device=device)
    out = cls().step(z, v, 0.7, 0.6, 0.7, generator=torch.Generator().manual_seed(9))
    v_train = v.clone().requires_grad_(True)
    lp = cls().log_prob(out.prev, z, v_train, 0.7, 0.6, 0.7).log_prob
    lp.sum().backward()
    assert v_train.grad is not None and torch.isfinite(v_train.grad).all() and v_train.grad.abs().sum() > 0


@pytest.mark.parametrize("cls", [FlowSdeSampler, DanceSdeSampler])
@pytest.mark.parametrize(("sigma", "sigma_next"), [(0.1, 0.07), (0.05, 0.03), (0.9, 0.8)])
def test_log_prob_gradient_is_float32_accurate_near_the_data_end(cls, sigma, sigma_next):
    """∂log p/∂v against float64: the deviation z′ − μ is read as (z′ − z) − (μ − z), so late steps, where std·ξ is
    a few hundredths of |z|, keep float32's accuracy (forming μ first rounded it at |z|'s scale: 1.6e-6 at σ = 0.05,
    2e-7 now)."""
    gen = torch.Generator().manual_seed(0)
    z, v = torch.randn(8, 4, 16, 16, generator=gen), torch.randn(8, 4, 16, 16, generator=gen)
    sampler = cls()
    z_next = sampler.step(z, v, sigma, sigma_next, 0.7, generator=torch.Generator().manual_seed(1)).prev
    grads = []
    for dtype in (torch.float32, torch.float64):
        vv = v.to(dtype).requires_grad_(True)
        h, eps = sigma - sigma_next, float(sampler.diffusion(torch.tensor([sigma]), torch.tensor([sigma_next]), 0.7))
        if dtype == torch.float32:
            log_prob = sampler.log_prob(z_next, z, vv, sigma, sigma_next, 0.7).log_prob
        else:  # docs/algorithm.md §1.4 in float64
            drift = eps**2 / (2 * sigma)
            mean = z.double() * (1 - drift * h) - vv * (1 + drift * (1 - sigma)) * h
            log_prob = (-((z_next.double() - mean) ** 2) / (2 * eps**2 * h)).flatten(1).mean(1)
        grads.append(torch.autograd.grad(log_prob.sum(), vv)[0].double())
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) <= 3e-7


def test_flow_sde_ode_rows_have_finite_zero_log_prob_and_gradient():
    z, v = _latents(n=2)
    v_train = v.clone().requires_grad_(True)
    out = FlowSdeSampler().step(z, v_train, torch.tensor([0.5, 0.3]), torch.tensor([0.4, 0.3]), 0.7)
    assert out.log_prob[1] == 0 and out.std[1] == 0 and out.log_prob[0] != 0
    out.log_prob.sum().backward()
    assert torch.isfinite(v_train.grad).all() and v_train.grad[1].abs().sum() == 0


@pytest.mark.parametrize(
    "name,cls", [("cps", CpsSampler), ("flow-sde", FlowSdeSampler), ("dance-sde", DanceSdeSampler)]
)
def test_build_by_name(name, cls):
    sampler = tpflow.build("sampler", name)
    assert isinstance(sampler, cls) and isinstance(sampler, Sampler)
    z, v = _latents()
    out = sampler.step(z, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(10))
    assert out.prev.shape == z.shape and torch.isfinite(out.prev).all()
    with pytest.raises(tpflow.errors.UserError, match="unknown option"):
        tpflow.build("sampler", name, noise_level=0.7)


@pytest.mark.parametrize("cls", SAMPLERS)
@pytest.mark.parametrize(
    "change,match",
    [
        ({"v": torch.zeros(3, 4, 5)}, "velocity v has shape"),
        ({"sigma": 0.4, "sigma_next": 0.5}, "must not exceed sigma"),
        ({"sigma": 1.5}, r"in \[0, 1\]"),
        ({"sigma": torch.ones(2) * 0.5}, "sigma must be a float"),
        ({"noise_level": -0.1}, "noise_level"),
        ({"noise": torch.zeros(3, 4)}, "noise has shape"),
    ],
)
def test_bad_inputs_raise(cls, change, match):
    z, v = _latents()
    kwargs = {"z": z, "v": v, "sigma": 0.5, "sigma_next": 0.4, "noise_level": 0.7} | change
    with pytest.raises(ValueError, match=match):
        cls().step(**kwargs)


def test_cps_rejects_noise_level_above_one_and_flow_sde_a_step_stuck_at_one():
    z, v = _latents()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        CpsSampler().step(z, v, 0.5, 0.4, 1.5)
    with pytest.raises(ValueError, match="must end below 1"):
        FlowSdeSampler().step(z, v, 1.0, 1.0, 0.7)
    with pytest.raises(ValueError, match="z_next has shape"):
        CpsSampler().log_prob(z[:2], z, v, 0.5, 0.4, 0.7)
    with pytest.raises(ValueError, match="batched"):
        euler_step(z[0, 0, 0], v[0, 0, 0], 0.5, 0.4)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.90374), *SIGMA_PAIRS[1:]])
def test_dance_sde_is_danceGRPOs_flux_step(sigma, sigma_next):
    """DanceGRPO's ``flux_step`` (docs/algorithm.md §1.4b) written out in float64: the Euler mean plus the
    score term, std η·√(σ − σ⁺), the full Gaussian log-density averaged over the latent; no guard at σ = 1."""
    eta = 0.3
    z, v = _latents(seed=4)
    xi = torch.randn(z.shape, generator=torch.Generator().manual_seed(9))
    x, u = z.double(), v.double()
    dsigma = sigma_next - sigma
    mean = x + dsigma * u
    x0hat = x - sigma * u
    score = -(x - x0hat * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    std = eta * math.sqrt(sigma - sigma_next)
    prev = mean + std * xi.double()
    logp = (-((prev - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean(
        dim=(1, 2, 3)
    )
    out = DanceSdeSampler().step(z, v, sigma, sigma_next, eta, noise=xi)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.prev.double(), prev, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.std.double(), torch.full((3,), std, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.log_prob.double(), logp, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.std_dev_t, torch.full((3,), eta))  # what the KL divides by: the constant η
    rescored = DanceSdeSampler().log_prob(out.prev, z, v, sigma, sigma_next, eta)
    torch.testing.assert_close(rescored.log_prob, out.log_prob, rtol=0, atol=1e-6)


def test_dance_sde_and_flow_sde_differ_only_in_the_diffusion_coefficient():
    """At σ = 0.5, flow-sde's ε = α·sqrt(σ / (1 − σ)) = α: the two steps are then the same, bit for bit; elsewhere
    they differ (DanceGRPO's g(σ) = η is constant)."""
    z, v = _latents(seed=2)
    xi = torch.randn(z.shape, generator=torch.Generator().manual_seed(3))
    same = [s.step(z, v, 0.5, 0.4, 0.7, noise=xi) for s in (FlowSdeSampler(), DanceSdeSampler())]
    assert torch.equal(same[0].prev, same[1].prev) and torch.equal(same[0].log_prob, same[1].log_prob)
    apart = [s.step(z, v, 0.8, 0.7, 0.7, noise=xi) for s in (FlowSdeSampler(), DanceSdeSampler())]
    assert (apart[0].std > apart[1].std).all()  # ε = 0.7·2 at σ = 0.8 against 0.7

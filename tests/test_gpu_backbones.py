"""GPU suite: what must hold on CUDA for the backbones (tpflow/devices.py), beyond the CPU suite run on CUDA.

* The same seed gives the same z_0 (bit for bit) and the same rollout (up to float32 rounding) on the CPU and on
  CUDA: draws come from a CPU generator and are moved (rule 1), so only the model's rounding differs.
* The batched rollout engine equals a sequential replay of one trajectory batch with tiny-sd3 / tiny-flux on CUDA,
  for every completion kind and with ``same_noise``; shapes-dit's version is tests/test_rollout.py, run on CUDA.
* fp16 / bf16 bases roll out finitely and give finite fp32 LoRA gradients through ``Sampler.log_prob``.
* Text encoders kept on the CPU feed a CUDA transformer.

Every test takes the ``cuda`` fixture (tests/conftest.py): skipped without CUDA, run on the CPU under
TPFLOW_GPU_TESTS_ON_CPU=1 (then "CPU vs CUDA" compares the CPU with itself: it checks this file, not CUDA).

Precision. ``exact_fp32`` switches TF32 off while a test runs: cuDNN convolutions (SD3's patch embedding, the VAE)
use TF32 by default on Ampere and later, and cuBLAS matmuls do once anything enables it. TF32 keeps 10 mantissa
bits (relative error ~5e-4 per op), which would move these rollouts by an estimated ~1e-3, as much as the
tolerances allow. In IEEE float32 a 4-step tiny-sd3 / tiny-flux rollout (latents up to ~4) drifts from a float64
one by ~2e-6 (measured on the CPU); CUDA differs from the CPU, and one cuBLAS kernel from another (kernels are
picked by problem shape, so a row's bits may depend on how many rows share the call), by rounding of that order.
``FP32`` (1e-4 absolute plus 1e-4 relative) leaves a 50x margin above it, and stays far below what a real device
bug causes (another z_0 or ξ, a row mixed up, a missing step: differences of 0.1 to 1). Half precision is checked
for finiteness and on-policy ratios only: its rounding (bf16: 8 significant bits) makes tight comparisons
meaningless.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tpflow.devices import cpu_generator, randn
from tpflow.registry import build
from tpflow.rollout import Window, rollout, rollout_from_settings
from tpflow.rollout.parts import baseline_generator
from tpflow.samplers import CpsSampler, euler_step
from tpflow.settings import RolloutSettings

from .conftest import exact_fp32

pytestmark = pytest.mark.gpu

PROMPTS = ["a photo of a red cat", 'a sign that says "OPEN"']
GUIDANCE = {"tiny-sd3": 4.5, "tiny-flux": 3.5, "shapes-dit": 2.0}  # CFG (sd3, shapes) or distilled (flux)
FP32 = {"rtol": 1e-4, "atol": 1e-4}  # float32 results of two devices or two kernel choices (module docstring)
LOG_PROB = {"rtol": 0.0, "atol": 1e-5}  # cps log-probs are ~-0.5; their float32 rounding is ~3e-8


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    with exact_fp32():
        yield


def _build(name: str, device: str, weights=None, **options):
    """A tiny backbone on ``device`` (shapes-dit from the ``tiny_weights`` checkpoint)."""
    if name == "shapes-dit":
        return build("backbone", name, weights=str(weights), device=device, **options)
    return build("backbone", name, seed=0, resolution=16, device=device, **options)


def _on(t: torch.Tensor, device: str) -> bool:
    return t.device.type == torch.device(device).type


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "shapes-dit"])
def test_initial_noise_is_the_same_on_cpu_and_cuda(cuda, name, tiny_weights):
    """Bit for bit, from a seeded CPU generator and from the CPU's global RNG (generator=None)."""
    cpu, gpu = _build(name, "cpu", tiny_weights), _build(name, cuda, tiny_weights)
    for seed in (0, 1234):
        a = cpu.initial_noise(3, torch.Generator().manual_seed(seed))
        b = gpu.initial_noise(3, torch.Generator().manual_seed(seed))
        assert _on(b, cuda) and b.dtype == torch.float32
        assert torch.equal(b.cpu(), a)
    if name == "tiny-sd3":  # what StableDiffusion3Pipeline draws from a CPU generator (diffusers' randn_tensor)
        expected = torch.randn((3, *cpu.latent_shape()), generator=torch.Generator().manual_seed(0))
        assert torch.equal(cpu.initial_noise(3, torch.Generator().manual_seed(0)), expected)
    torch.manual_seed(5)
    a = cpu.initial_noise(2)
    torch.manual_seed(5)
    b = gpu.initial_noise(2)
    assert torch.equal(b.cpu(), a)


def _window_rollout(backbone, name: str, noise_seed: int, completions="ode"):
    steps, window = (6, Window(1, 3)) if name == "shapes-dit" else (4, Window(1, 2))
    prompts = ["a photo of a red circle", "two blue squares"] if name == "shapes-dit" else PROMPTS
    cond = backbone.encode(prompts * 2)
    z0 = backbone.initial_noise(4, cpu_generator(0))
    return rollout(
        backbone,
        CpsSampler(),
        cond,
        z0,
        backbone.sigmas(steps),
        window,
        0.7,
        GUIDANCE[name],
        completions=completions,
        generator=cpu_generator(noise_seed),
    )


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "shapes-dit"])
def test_the_same_seed_gives_the_same_rollout_on_cpu_and_cuda(cuda, name, tiny_weights):
    """z_0 and every ξ are the same draws on both devices, so the rollouts differ by float32 rounding only; every
    stored tensor lives on the backbone's device (rule 2)."""
    cpu, gpu = _build(name, "cpu", tiny_weights), _build(name, cuda, tiny_weights)
    a, b = _window_rollout(cpu, name, 3), _window_rollout(gpu, name, 3)
    for field in ("latents", "next_latents", "final", "completions", "sigmas", "log_probs"):
        assert _on(getattr(b, field), cuda), field
    assert b.device.type == torch.device(cuda).type
    for field in ("latents", "next_latents", "final", "completions"):
        torch.testing.assert_close(getattr(b, field).cpu(), getattr(a, field), **FP32, msg=field)
    torch.testing.assert_close(b.sigmas.cpu(), a.sigmas, rtol=0, atol=0)
    torch.testing.assert_close(b.log_probs.cpu(), a.log_probs, **LOG_PROB)
    other = _window_rollout(gpu, name, 4)  # another ξ moves the result far beyond the tolerance: it has teeth
    assert (other.final - b.final).abs().max() > 1e-2
    assert torch.isfinite(b.final).all() and torch.isfinite(b.log_probs).all()


def _ode(backbone, z, cond, sigmas, start: int, guidance: float) -> torch.Tensor:
    for k in range(start, sigmas.shape[0] - 1):
        v = backbone.velocity(z, sigmas[k].expand(z.shape[0]), cond, guidance)
        z = euler_step(z, v, sigmas[k], sigmas[k + 1])
    return z


@pytest.mark.parametrize("completions", ["ode", "x0", None])
@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_batched_rollout_matches_a_sequential_replay_on_cuda(cuda, name, completions):
    """The engine batches main trajectory, baseline and branches per step; the replay runs the main trajectory
    alone, one step at a time (ξ from the same generator, in the same order), and each completion after it."""
    backbone, sampler, guidance = _build(name, cuda), CpsSampler(), GUIDANCE[name]
    cond = backbone.encode(PROMPTS * 2)
    n = len(cond)
    z0 = backbone.initial_noise(n, cpu_generator(0))
    sigmas, window = backbone.sigmas(5), Window(1, 3)
    out = rollout(
        backbone, sampler, cond, z0, sigmas, window, 0.7, guidance, completions=completions, generator=cpu_generator(3)
    )
    gen, z = cpu_generator(3), z0
    baseline_generator(gen)  # the engine's first draw: the independent baseline's seed (tpflow.rollout.parts)
    latents, next_latents, log_probs, ends = [], [], [], []
    with torch.no_grad():
        for k in range(sigmas.shape[0] - 1):
            v = backbone.velocity(z, sigmas[k].expand(n), cond, guidance)
            xi = randn(z.shape, gen, z.device)  # ξ_k is drawn at every step, in order (MainNoise)
            if window.start <= k < window.start + window.size:
                if completions == "x0":
                    ends.append(z - sigmas[k] * v)
                elif completions == "ode":
                    ends.append(_ode(backbone, z, cond, sigmas, k, guidance))
                step = sampler.step(z, v, sigmas[k], sigmas[k + 1], 0.7, noise=xi)
                latents.append(z)
                next_latents.append(step.prev)
                log_probs.append(step.log_prob)
                z = step.prev
            else:
                z = euler_step(z, v, sigmas[k], sigmas[k + 1])
    assert _on(out.latents, cuda) and out.latents.shape == (n, window.size, *z0.shape[1:])
    torch.testing.assert_close(out.latents, torch.stack(latents, dim=1), **FP32)
    torch.testing.assert_close(out.next_latents, torch.stack(next_latents, dim=1), **FP32)
    torch.testing.assert_close(out.log_probs, torch.stack(log_probs, dim=1), **LOG_PROB)
    torch.testing.assert_close(out.final, z, **FP32)
    if completions is None:
        assert out.completions is None and out.cost.nfe == 5
    else:
        assert _on(out.completions, cuda)
        torch.testing.assert_close(out.completions, torch.stack(ends, dim=1), **FP32)
        assert (out.completions[:, 0] - out.final).abs().max() > 1e-2  # the SDE steps matter: not vacuous


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_same_noise_on_cuda_shares_z0_and_equals_repeating_it(cuda, name):
    """``rollout_from_settings`` with ``same_noise`` draws z_0 per group on the CPU generator and dedupes the prefix
    and the baseline; the result is the engine's on z_0 repeated per copy, with fewer evaluations."""
    backbone, sampler = _build(name, cuda), CpsSampler()
    settings = RolloutSettings(
        num_steps=4, window_size=2, window_range=(0, 4), same_noise=True, guidance=GUIDANCE[name]
    )
    groups = [0, 0, 1, 1]
    cond = backbone.encode([PROMPTS[g] for g in groups])
    out = rollout_from_settings(backbone, sampler, cond, groups, Window(1, 2), settings, "ode", cpu_generator(7))
    gen = cpu_generator(7)  # the same draws in the same order: z_0 per group, then the window's ξ
    z_unique = backbone.initial_noise(2, gen)
    source = torch.tensor([0, 0, 1, 1], device=z_unique.device)
    repeated = rollout(
        backbone, sampler, cond, z_unique[source], backbone.sigmas(4), Window(1, 2), settings.noise_level,
        settings.guidance, "ode", generator=gen,
    )  # fmt: skip
    assert _on(out.final, cuda) and _on(out.completions, cuda)
    baseline = out.completions[:, 0]  # the ODE image from z_0: computed once per group
    assert torch.equal(baseline[0], baseline[1]) and torch.equal(baseline[2], baseline[3])
    assert (baseline[0] - baseline[2]).abs().max() > 1e-2
    torch.testing.assert_close(out.final, repeated.final, **FP32)
    torch.testing.assert_close(out.completions, repeated.completions, **FP32)
    torch.testing.assert_close(out.log_probs, repeated.log_probs, **LOG_PROB)
    assert out.cost.nfe < repeated.cost.nfe


@pytest.mark.parametrize("name,dtype", [("tiny-sd3", "fp16"), ("tiny-sd3", "bf16"), ("tiny-flux", "bf16")])
def test_half_precision_rollout_and_grpo_backward(cuda, name, dtype):
    """A half-precision base rolls out with finite float32 latents and log-probs, re-scores them on-policy, and a
    clipped GRPO surrogate through ``Sampler.log_prob`` gives finite float32 LoRA gradients (the adapter trains in
    fp32 over the fp16/bf16 base; the base gets none)."""
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    backbone, sampler, guidance = _build(name, cuda, dtype=dtype), CpsSampler(), GUIDANCE[name]
    assert next(backbone.transformer.parameters()).dtype == half
    params = backbone.trainable_parameters()
    assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
    cond = backbone.encode(PROMPTS * 2)
    n = len(cond)
    z0 = backbone.initial_noise(n, cpu_generator(0))
    out = rollout(
        backbone, sampler, cond, z0, backbone.sigmas(4), Window(0, 3), 0.7, guidance, completions=None,
        generator=cpu_generator(1),
    )  # fmt: skip
    for t in (out.latents, out.next_latents, out.final, out.log_probs):
        assert _on(t, cuda) and t.dtype == torch.float32 and torch.isfinite(t).all()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], device=out.device)
    for i in range(out.latents.shape[1]):
        v = backbone.velocity(out.latents[:, i], out.sigmas[:, i], cond, guidance)
        assert v.dtype == torch.float32 and v.requires_grad
        new = sampler.log_prob(
            out.next_latents[:, i], out.latents[:, i], v, out.sigmas[:, i], out.sigmas[:, i + 1], 0.7
        ).log_prob
        ratio = torch.exp(new - out.log_probs[:, i])
        # on-policy up to half-precision rounding (the grad-mode call may pick another attention kernel)
        assert torch.isfinite(ratio).all() and (ratio - 1).abs().max() < 1e-2, ratio
        clipped = torch.minimum(advantages * ratio, advantages * ratio.clamp(0.8, 1.2))
        (-clipped.mean()).backward()
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)  # B = 0 at init: A gets no gradient yet, B does
    assert all(p.grad is None for p in backbone.transformer.parameters() if not p.requires_grad)


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_text_encoders_on_the_cpu_feed_a_cuda_transformer(cuda, name):
    """``text_encoders_device = "cpu"`` (with the prompt cache): embeddings computed on the CPU land on CUDA and
    give the conditioning of encoders on the GPU."""
    gpu = _build(name, cuda)
    split = _build(name, cuda, text_encoders_device="cpu", prompt_cache=4)
    assert next(split.pipe.text_encoder.parameters()).device.type == "cpu"
    for prompts in (PROMPTS, PROMPTS[::-1], ["a dog", PROMPTS[0]]):  # the second and third come from the cache
        mine, theirs = split.encode(prompts), gpu.encode(prompts)
        for key in ("prompt_embeds", "pooled"):
            assert _on(mine.tensors[key], cuda)
            torch.testing.assert_close(mine.tensors[key], theirs.tensors[key], **FP32)
    z = split.initial_noise(2, cpu_generator(0))
    with torch.no_grad():
        v = split.velocity(z, torch.full((2,), 0.6, device=z.device), mine, GUIDANCE[name])
    assert _on(v, cuda) and torch.isfinite(v).all()

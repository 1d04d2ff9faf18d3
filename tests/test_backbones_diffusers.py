"""tiny-sd3 and tiny-flux behave exactly like diffusers pipelines: rollouts, schedules, LoRA export, load errors.

The tests that take the ``device`` fixture also run in the GPU suite with the backbone AND the diffusers pipeline on
CUDA (tests/conftest.py). There TF32 is off (``exact_fp32``, tests/conftest.py) and the two sides run
the same kernels on the same shapes, so the CPU tolerance of 1e-4 is kept: a float32 rollout of these models drifts
from a float64 one by ~2e-6, while a real mismatch (another schedule, a missing LoRA scale) is 0.1 or more.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from tpflow.backbones.tiny import tiny_flux_pipeline, tiny_sd3_pipeline
from tpflow.errors import UserError
from tpflow.registry import build
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler
from tpflow.weights import download_command

from .conftest import exact_fp32

PROMPTS = ["a photo of a red cat", 'a sign that says "OPEN"']
K = 4


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


@pytest.fixture(scope="module")
def backbones():
    """``get(name, device)``: one tiny backbone per name and device for the module (built on first use)."""
    built = {}

    def get(name: str, device: str = "cpu"):
        if (name, device) not in built:
            built[name, device] = build("backbone", name, seed=0, resolution=16, device=device)
        return built[name, device]

    return get


@pytest.fixture(scope="module")
def sd3(backbones):
    return backbones("tiny-sd3")


@pytest.fixture(scope="module")
def flux(backbones):
    return backbones("tiny-flux")


def _pipeline_latents(pipe, z0: torch.Tensor, guidance: float, **kwargs) -> torch.Tensor:
    out = pipe(
        prompt=PROMPTS,
        num_inference_steps=K,
        guidance_scale=guidance,
        latents=z0.clone(),
        output_type="latent",
        height=16,
        width=16,
        max_sequence_length=32,
        **kwargs,
    )
    return out.images


def test_tiny_sd3_has_the_sd35_flags(sd3):
    cfg = sd3.transformer.config
    assert tuple(cfg.dual_attention_layers) == (0,)
    assert cfg.qk_norm == "rms_norm"
    assert any(name.endswith("attn2.to_q") for name, _ in sd3.transformer.named_modules())


@pytest.mark.parametrize("name,guidance", [("tiny-sd3", 1.0), ("tiny-sd3", 4.5), ("tiny-sd3-large", 4.5)])
def test_sd3_rollout_at_noise_0_equals_the_diffusers_pipeline(backbones, device, name, guidance):
    """SD3.5-Medium's layout and SD3.5-Large's (no second attention): the same backbone, the pipeline's samples."""
    sd3 = backbones(name, device)
    large = name == "tiny-sd3-large"
    assert any(n.endswith("attn2.to_q") for n, _ in sd3.transformer.named_modules()) != large
    pipe = tiny_sd3_pipeline(seed=0, large=large).to(device)  # an independent copy: the LoRA (B = 0) changes nothing
    z0 = sd3.initial_noise(2, torch.Generator().manual_seed(3))
    assert z0.device.type == torch.device(device).type
    expected = _pipeline_latents(pipe, z0, guidance)
    assert expected.device == z0.device
    cond = sd3.encode(PROMPTS)
    sigmas = sd3.sigmas(K)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float().cpu(), rtol=0, atol=1e-6)  # the pipe's last run
    with torch.no_grad():
        ode = sample_ode(sd3, cond, z0, sigmas, guidance)
        sde = rollout(sd3, CpsSampler(), cond, z0, sigmas, Window(0, K - 1), 0.0, guidance, completions=None)
    torch.testing.assert_close(ode, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(sde.final, expected, rtol=0, atol=1e-4)
    assert (expected - z0).abs().max() > 0.1  # the comparison is not vacuous


def test_flux_rollout_at_noise_0_equals_the_diffusers_pipeline(backbones, device):
    flux = backbones("tiny-flux", device)
    pipe = tiny_flux_pipeline(seed=0).to(device)
    z0 = flux.initial_noise(2, torch.Generator().manual_seed(5))  # packed [2, 64, 4]
    assert z0.shape == (2, 64, 4) and z0.device.type == torch.device(device).type
    expected = _pipeline_latents(pipe, z0, 3.5)
    assert expected.device == z0.device
    cond = flux.encode(PROMPTS)
    sigmas = flux.sigmas(K)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float().cpu(), rtol=0, atol=1e-6)
    with torch.no_grad():
        ode = sample_ode(flux, cond, z0, sigmas, 3.5)
        sde = rollout(flux, CpsSampler(), cond, z0, sigmas, Window(1, 2), 0.0, 3.5, completions=None)
    torch.testing.assert_close(ode, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(sde.final, expected, rtol=0, atol=1e-4)
    with torch.no_grad():  # the distilled guidance really enters the model
        other = sample_ode(flux, cond, z0, sigmas, 1.0)
    assert (other - expected).abs().max() > 1e-4


def test_flux_pack_unpack_roundtrip(flux):
    z = torch.randn(3, flux.channels, flux.latent_side, flux.latent_side)
    packed = flux.pack(z)
    assert packed.shape == (3, (flux.latent_side // 2) ** 2, 4 * flux.channels)
    torch.testing.assert_close(flux.unpack(packed), z, rtol=0, atol=0)
    from diffusers import FluxPipeline  # the pipeline's own packing agrees

    torch.testing.assert_close(packed, FluxPipeline._pack_latents(z, 3, flux.channels, 16, 16), rtol=0, atol=0)


def test_decode_matches_the_pipeline_image(backbones, device):
    sd3 = backbones("tiny-sd3", device)
    pipe = tiny_sd3_pipeline(seed=0).to(device)
    z0 = sd3.initial_noise(2, torch.Generator().manual_seed(7))
    image = pipe(
        prompt=PROMPTS, num_inference_steps=K, guidance_scale=4.5, latents=z0.clone(), output_type="pt",
        height=16, width=16, max_sequence_length=32,
    ).images  # fmt: skip
    latents = _pipeline_latents(pipe, z0, 4.5)
    mine = sd3.decode(latents)
    assert mine.shape == (2, 3, 16, 16) and mine.dtype == torch.float32 and mine.device == z0.device
    torch.testing.assert_close(mine, image.float(), rtol=0, atol=1e-5)


def test_prompt_cache_gives_the_same_conditioning():
    cached = build("backbone", "tiny-sd3", seed=0, prompt_cache=2, text_encoders_device="cpu")
    plain = build("backbone", "tiny-sd3", seed=0)
    for prompts in (PROMPTS, PROMPTS[::-1] + ["a dog"], ["a dog", PROMPTS[0]]):
        a, b = cached.encode(prompts), plain.encode(prompts)
        for key in ("prompt_embeds", "pooled"):
            torch.testing.assert_close(a.tensors[key], b.tensors[key], rtol=0, atol=1e-6)
    assert len(cached.cache._rows) == 2  # bounded


def test_lora_starts_at_the_base_model_and_reference_disables_it(backbones, device):
    sd3 = backbones("tiny-sd3", device)
    z = sd3.initial_noise(2, torch.Generator().manual_seed(1))
    cond = sd3.encode(PROMPTS)
    sigma = torch.full((2,), 0.6)
    params = sd3.trainable_parameters()
    assert params and all("lora_" in n for n, p in sd3.transformer.named_parameters() if p.requires_grad)
    with torch.no_grad():
        base = sd3.velocity(z, sigma, cond, 4.5)
        saved = [p.clone() for p in params]
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
        adapted = sd3.velocity(z, sigma, cond, 4.5)
        with sd3.reference():
            reference = sd3.velocity(z, sigma, cond, 4.5)
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    assert (adapted - base).abs().max() > 1e-4
    torch.testing.assert_close(reference, base, rtol=0, atol=0)


def test_missing_local_weights_name_what_is_missing(tmp_path):
    with pytest.raises(UserError, match="model_index.json"):
        build("backbone", "sd3.5-medium", pretrained=str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X", "transformer": ["diffusers", "M"]}))
    with pytest.raises(UserError, match="lacks transformer"):
        build("backbone", "flux.1-dev", pretrained=str(tmp_path))


def test_missing_hub_weights_offline_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match=re.escape(download_command("stabilityai/stable-diffusion-3.5-medium"))):
        build("backbone", "sd3.5-medium")


def test_adapter_load_checks_rank(tmp_path):
    backbone = build("backbone", "tiny-sd3", seed=0)
    backbone.save_adapter(tmp_path)
    other = build("backbone", "tiny-sd3", seed=0, lora_rank=2)
    with pytest.raises(UserError, match="lora_rank"):
        other.load_adapter(tmp_path)
    with pytest.raises(UserError, match="No LoRA adapter"):
        other.load_adapter(tmp_path / "nothing")


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-sd3-large", "tiny-flux"])
def test_exported_adapter_and_merged_model_load_into_diffusers(tmp_path, device, name):
    """What ``tpflow export`` writes (``save_adapter``, and ``save_merged`` with --merge), read by diffusers on the
    device: ``pipe.load_lora_weights(dir)`` and ``from_pretrained`` of the merged transformer sample what the
    backbone samples, alpha / r included."""
    sd3 = name.startswith("tiny-sd3")
    backbone = build("backbone", name, seed=0, resolution=16, device=device)  # its own: its LoRA is changed
    with torch.no_grad():  # a trained-looking adapter (B != 0), drawn on the CPU so both devices get the same
        gen = torch.Generator().manual_seed(0)
        for p in backbone.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))
    backbone.save_adapter(tmp_path / "lora")
    backbone.save_merged(tmp_path / "merged")
    make_pipe = functools.partial(tiny_sd3_pipeline, large=name == "tiny-sd3-large") if sd3 else tiny_flux_pipeline
    pipe = make_pipe(seed=0).to(device)
    pipe.load_lora_weights(tmp_path / "lora")
    theirs, mine = [p for n, p in pipe.transformer.named_parameters() if "lora_" in n], backbone.trainable_parameters()
    assert len(theirs) == len(mine) and all(p.device == mine[0].device for p in theirs)  # peft moved them there
    transformer_cls = type(backbone.transformer)
    merged = transformer_cls.from_pretrained(tmp_path / "merged").to(device).eval()
    merged_pipe = type(pipe)(**{**make_pipe(seed=0).components, "transformer": merged}).to(device)

    guidance = 4.5 if sd3 else 3.5
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(11))
    cond = backbone.encode(PROMPTS)
    with torch.no_grad():
        ours = sample_ode(backbone, cond, z0, backbone.sigmas(K), guidance)
        with backbone.reference():
            base = sample_ode(backbone, cond, z0, backbone.sigmas(K), guidance)
    torch.testing.assert_close(_pipeline_latents(pipe, z0, guidance), ours, rtol=0, atol=1e-4)
    torch.testing.assert_close(_pipeline_latents(merged_pipe, z0, guidance), ours, rtol=0, atol=1e-4)
    assert (ours - base).abs().max() > 1e-2  # the adapter changes the samples: the comparisons have teeth


@pytest.mark.parametrize("steps", [12, 25])
def test_flux_time_shift_is_dancegrpo_and_mixgrpos_static_schedule(flux, steps):
    """MixGRPO's (K = 25) and DanceGRPO's (shift 3) static FLUX schedule, docs/algorithm.md §10 (below its table):
    σ = 3t/(1 + 2t), t = linspace(1, 0, K + 1), written out here in float64; without the option the schedule stays
    the pipeline's dynamic one, which differs."""
    static = build("backbone", "tiny-flux", seed=0, resolution=16, time_shift=3.0)
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    want = (3 * t / (1 + 2 * t)).float()
    torch.testing.assert_close(static.sigmas(steps), want, rtol=0, atol=1e-6)
    assert (flux.sigmas(steps) - want).abs().max() > 1e-2  # the default is not this schedule


def test_sigmas_follow_the_scheduler_config():
    sd3 = build("backbone", "tiny-sd3", seed=0)
    from tpflow.samplers.schedules import sd3_sigmas

    torch.testing.assert_close(sd3.sigmas(10), sd3_sigmas(10, 3.0), rtol=0, atol=1e-6)
    assert Path(__file__).exists()


@pytest.mark.parametrize("name", ["geneval_tp", "sd35/ocr_tp", "flux/flux_pickscore_tp"])
def test_paper_recipe_without_weights_exits_2_naming_them(monkeypatch, tmp_path, capsys, name):
    from tpflow.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    recipe = Path(__file__).resolve().parent.parent / "recipes" / f"{name}.toml"
    with pytest.raises(SystemExit) as exc:
        main(["train", str(recipe), "--run-dir", str(tmp_path / "run")])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    model = "black-forest-labs/FLUX.1-dev" if name.startswith("flux/") else "stabilityai/stable-diffusion-3.5-medium"
    assert download_command(model) in err
    assert "Traceback" not in err


def test_half_precision_base_trains_an_fp32_adapter():
    backbone = build("backbone", "tiny-sd3", seed=0, dtype="bf16")
    assert next(backbone.transformer.parameters()).dtype == torch.bfloat16
    params = backbone.trainable_parameters()
    assert params and all(p.dtype == torch.float32 for p in params)
    z = backbone.initial_noise(2, torch.Generator().manual_seed(0))
    v = backbone.velocity(z, torch.full((2,), 0.5), backbone.encode(PROMPTS), 4.5)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v.square().mean().backward()
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    "name", ["flux.1-kontext-dev", "qwen-image-edit", "flux.2-klein-4b", "flux.2-dev", "z-image", "z-image-turbo"]
)
def test_a_diffusers_without_the_pipeline_says_which_it_needs(monkeypatch, name):
    """The editing and 2026 pipelines came with diffusers 0.42: on an older one (a module without them), building the
    backbone is one paragraph naming the class and the version to install, not an ImportError."""
    import sys
    import types

    from tpflow import registry

    monkeypatch.setitem(sys.modules, "diffusers", types.SimpleNamespace(__version__="0.32.2"))
    entry = registry.get("backbone", name)
    with pytest.raises(UserError, match=r"needs diffusers' \w+Pipeline, which the installed diffusers 0.32.2"):
        entry.factory(entry.options())

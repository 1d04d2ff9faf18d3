"""tiny-wan and tiny-wan2.2 behave exactly like diffusers' WanPipeline: schedule, rollout at noise 0 (with and
without CFG; Wan2.2's switch from the high-noise to the low-noise expert, each with its guidance), the clip decode,
and the exported LoRA of either expert (docs/backbones.md, "Wan")."""

from __future__ import annotations

import pytest
import torch

from tpflow.backbones.tiny import tiny_wan22_pipeline, tiny_wan_pipeline
from tpflow.errors import UserError
from tpflow.registry import build
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler

from .conftest import exact_fp32

PROMPTS = ["a photo of a red cat", "two dogs"]
K = 3
CLIP = {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": 32}


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


def _pipeline(pipe, z0: torch.Tensor, guidance: float, output_type: str = "latent", **extra) -> torch.Tensor:
    return pipe(prompt=PROMPTS, num_inference_steps=K, latents=z0.clone(), output_type=output_type,
                guidance_scale=guidance, **CLIP, **extra).frames  # fmt: skip


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_a_noise_0_rollout_is_the_pipelines_sampling_loop(guidance):
    """UMT5 prompt encoding, the latent shape [N, C, (F − 1)/4 + 1, H/8, W/8] drawn as the pipeline draws it, the
    shifted Euler schedule, timestep 1000·σ and CFG: a noise-0 rollout is WanPipeline's loop to 1e-4."""
    backbone = build("backbone", "tiny-wan", seed=0)
    pipe = tiny_wan_pipeline(0)
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    drawn = pipe.prepare_latents(2, 4, 32, 32, 5, torch.float32, "cpu", torch.Generator().manual_seed(3))
    assert z0.shape == (2, 4, 2, 4, 4) and torch.equal(z0, drawn)
    expected = _pipeline(pipe, z0, guidance)
    sigmas = backbone.sigmas(K)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    cond = backbone.encode(PROMPTS)
    with torch.no_grad():
        out = rollout(backbone, CpsSampler(), cond, z0, sigmas, Window(0, K - 1), 0.0, guidance, completions=None)
        other = sample_ode(backbone, backbone.encode(["zzz", "qqq"]), z0, sigmas, guidance)
    torch.testing.assert_close(out.final, expected, rtol=0, atol=1e-4)
    assert (expected - z0).abs().max() > 0.1 and (other - out.final).abs().max() > 1e-3  # the prompt reaches it
    clips = backbone.decode(out.final)  # frames first: [N, F, 3, H, W] in [0, 1]
    theirs = _pipeline(tiny_wan_pipeline(0), z0, guidance, output_type="pt")
    assert clips.shape == (2, 5, 3, 32, 32) and 0 <= clips.min() and clips.max() <= 1
    torch.testing.assert_close(clips, theirs.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("low_noise_guidance", [None, 3.0])
def test_wan22_switches_experts_at_the_boundary_as_the_pipeline(low_noise_guidance):
    """Wan2.2 (shift 12): the first two of 3 steps (1000·σ = 1000, 925 ≥ 875) run the high-noise expert, the last
    the low-noise one, with its own guidance (the pipeline's guidance_scale_2); the noise-0 rollout is the
    pipeline's loop."""
    backbone = build("backbone", "tiny-wan2.2", seed=0, low_noise_guidance=low_noise_guidance)
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(4))
    extra = {} if low_noise_guidance is None else {"guidance_scale_2": low_noise_guidance}
    expected = _pipeline(tiny_wan22_pipeline(0), z0, 4.0, **extra)
    sigmas = backbone.sigmas(K)
    assert float(sigmas[1]) * 1000 >= 875 > float(sigmas[2]) * 1000
    cond = backbone.encode(PROMPTS)
    with torch.no_grad():
        ode = sample_ode(backbone, cond, z0, sigmas, 4.0)
        one_expert = tiny_wan_pipeline(0)  # the high-noise expert all the way: the switch has teeth
    torch.testing.assert_close(ode, expected, rtol=0, atol=1e-4)
    assert (_pipeline(one_expert, z0, 4.0) - expected).abs().max() > 1e-3


def test_rows_on_both_sides_of_the_boundary_go_to_their_own_expert():
    """One call whose rows have σ on both sides (DiffusionNFT's per-sample times) equals each row's own call."""
    backbone = build("backbone", "tiny-wan2.2", seed=0)
    z = backbone.initial_noise(3, torch.Generator().manual_seed(5))
    cond = backbone.encode(["a", "b", "c"])
    sigma = torch.tensor([0.95, 0.3, 0.9])
    with torch.no_grad():
        mixed = backbone.velocity(z, sigma, cond, 4.0)
        alone = torch.cat([backbone.velocity(z[i : i + 1], sigma[i], cond.index([i]), 4.0) for i in range(3)])
    torch.testing.assert_close(mixed, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "expert"), [("tiny-wan", None), ("tiny-wan2.2", "high"), ("tiny-wan2.2", "low")])
def test_an_exported_adapter_loads_into_the_pipeline(tmp_path, name, expert):
    """``save_adapter`` writes what ``WanPipeline.load_lora_weights`` reads (the low-noise expert's with
    ``load_into_transformer_2``): the pipeline then samples what tpflow samples."""
    options = {} if expert is None else {"train_expert": expert}
    backbone = build("backbone", name, seed=0, **options)
    make = tiny_wan_pipeline if expert is None else tiny_wan22_pipeline
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(11))
    cond, sigmas = backbone.encode(PROMPTS), backbone.sigmas(K)
    with torch.no_grad():
        before = sample_ode(backbone, cond, z0, sigmas, 4.5)
        gen = torch.Generator().manual_seed(0)
        for p in backbone.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        ours = sample_ode(backbone, cond, z0, sigmas, 4.5)
    backbone.save_adapter(tmp_path / "lora")
    pipe = make(0)
    pipe.load_lora_weights(tmp_path / "lora", **({"load_into_transformer_2": True} if expert == "low" else {}))
    torch.testing.assert_close(_pipeline(pipe, z0, 4.5), ours, rtol=0, atol=1e-4)
    assert (ours - before).abs().max() > 1e-3  # the adapter changes the samples: the comparison has teeth


def test_a_frame_count_or_size_the_vae_cannot_take_is_one_paragraph():
    with pytest.raises(UserError, match="4k \\+ 1"):
        build("backbone", "tiny-wan", num_frames=4)
    with pytest.raises(UserError, match="multiple of 16"):
        build("backbone", "tiny-wan", resolution=24)


@pytest.mark.parametrize("name", ["wan_flowgrpo", "wan_dancegrpo", "wan_tp", "wan22_mixgrpo"])
def test_a_wan_recipe_without_weights_is_one_paragraph_naming_them(monkeypatch, tmp_path, name):
    from pathlib import Path

    from tests.cli_run import tpflow
    from tpflow.weights import download_command

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "wan" / f"{name}.toml"
    out = tpflow("validate", str(recipe))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "Traceback" not in err
    model = "Wan-AI/Wan2.2-T2V-A14B-Diffusers" if name.startswith("wan22") else "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert download_command(model) in err

"""tiny-qwen-image behaves exactly like diffusers' QwenImagePipeline: schedule, rollout at noise 0 (with and without
true CFG), the decode, and the exported LoRA (docs/backbones.md, "Qwen-Image")."""

from __future__ import annotations

import pytest
import torch

from tpflow.backbones.tiny import tiny_qwen_image_pipeline
from tpflow.registry import build
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler

from .conftest import cuda_or_skip, exact_fp32

PROMPTS = ["a photo of a red cat", 'a sign that says "OPEN"']
K = 3


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


def _pipeline_latents(pipe, z0: torch.Tensor, guidance: float) -> torch.Tensor:
    cfg = {"negative_prompt": [" "] * len(PROMPTS), "true_cfg_scale": guidance} if guidance > 1 else {}
    out = pipe(prompt=PROMPTS, num_inference_steps=K, latents=z0.clone(), output_type="latent", height=32, width=32,
               max_sequence_length=32, **({"true_cfg_scale": 1.0} | cfg))  # fmt: skip
    return out.images


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_rollout_at_noise_0_equals_the_pipeline(device, guidance):
    """Prompt encoding (template, dropped tokens, mask), packing, the dynamic-shift schedule, the transformer call
    and true CFG with its norm rescale: a noise-0 rollout is QwenImagePipeline's sampling loop to 1e-4."""
    device = cuda_or_skip() if device == "cuda" else device
    backbone = build("backbone", "tiny-qwen-image", seed=0, device=device)
    pipe = tiny_qwen_image_pipeline(seed=0).to(device)
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    assert z0.shape == (2, 16, 16) and z0.device.type == torch.device(device).type
    expected = _pipeline_latents(pipe, z0, guidance)
    cond = backbone.encode(PROMPTS)
    sigmas = backbone.sigmas(K)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float().cpu(), rtol=0, atol=1e-6)
    with torch.no_grad():
        ode = sample_ode(backbone, cond, z0, sigmas, guidance)
        sde = rollout(backbone, CpsSampler(), cond, z0, sigmas, Window(0, K - 1), 0.0, guidance, completions=None)
        other = sample_ode(backbone, backbone.encode(["zzz", "qqq"]), z0, sigmas, guidance)
    torch.testing.assert_close(ode, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(sde.final, expected, rtol=0, atol=1e-4)
    assert (expected - z0).abs().max() > 0.1 and (other - ode).abs().max() > 1e-3  # the prompt reaches the model


def test_decode_is_the_pipelines_and_noise_is_drawn_as_it_draws():
    backbone = build("backbone", "tiny-qwen-image", seed=0)
    pipe = tiny_qwen_image_pipeline(seed=0)
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(5))
    drawn = pipe.prepare_latents(2, 4, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(5), None)
    torch.testing.assert_close(z0, drawn, rtol=0, atol=0)
    latents = _pipeline_latents(pipe, z0, 1.0)  # the pipeline's sampling, then its own decode of those latents
    theirs = pipe(prompt=PROMPTS, num_inference_steps=K, latents=z0.clone(), output_type="pt", height=32,
                  width=32, true_cfg_scale=1.0, max_sequence_length=32).images  # fmt: skip
    images = backbone.decode(latents)
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    torch.testing.assert_close(images, theirs.float(), rtol=0, atol=1e-5)


def test_an_exported_adapter_loads_into_the_pipeline(tmp_path):
    """``save_adapter`` writes what ``QwenImagePipeline.load_lora_weights`` reads: the same samples, alpha / r in."""
    backbone = build("backbone", "tiny-qwen-image", seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in backbone.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    backbone.save_adapter(tmp_path / "lora")
    pipe = tiny_qwen_image_pipeline(seed=0)
    pipe.load_lora_weights(tmp_path / "lora")
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(11))
    with torch.no_grad():
        ours = sample_ode(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(K), 4.0)
        with backbone.reference():
            base = sample_ode(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(K), 4.0)
    torch.testing.assert_close(_pipeline_latents(pipe, z0, 4.0), ours, rtol=0, atol=1e-4)
    assert (ours - base).abs().max() > 1e-2  # the adapter changes the samples


def test_lora_targets_are_the_attention_projections():
    backbone = build("backbone", "tiny-qwen-image", seed=0)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in backbone.transformer.named_parameters() if "lora_A" in n}
    names = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    assert adapted == {f"transformer_blocks.0.attn.{t}" for t in names}

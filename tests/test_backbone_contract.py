"""One contract for every diffusers backbone tpflow registers, through its tiny twin: a rollout at noise level 0 is
its pipeline's sampling loop, every LoRA target names layers, an exported adapter loads into the pipeline and
samples what tpflow samples. A new diffusers backbone adds a row to ``TWINS`` (docs/backbones.md, "Adding a
backbone"); ``test_every_diffusers_backbone_has_a_twin_here`` fails until it does."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from tpflow import registry
from tpflow.backbones import tiny, tiny_kontext
from tpflow.backbones.flux_kontext import source_images
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler
from tpflow.train.sharding import BLOCK_LISTS

from .conftest import exact_fp32
from .qwen_edit_pipeline import tiny_edit_reference  # QwenImageEditPlusPipeline, one prompt per call
from .test_backbone_flux2 import packed_pipeline  # the FLUX.2 pipelines in tpflow's packed latents
from .test_backbone_z_image import tpflow_scale_pipeline  # ZImagePipeline at tpflow's guidance scale

PROMPTS = ["a photo of a red cat", "two dogs"]
K = 3
WAN_CLIP = {"height": 32, "width": 32, "num_frames": 5}  # 5 frames: 2 latent frames
PX16 = {"height": 16, "width": 16}
PX64 = {"height": 64, "width": 64}  # FLUX.2: 4×4 tokens through its 8× VAE (flux2)


class Twin(NamedTuple):
    """A real backbone's tiny twin: its name, its pipeline, the pipeline call's options at the twin's size, the
    guidance, and the source images each prompt carries (0 for text-to-image)."""

    name: str
    make_pipe: Any
    options: dict
    guidance: float
    sources: int = 0


KONTEXT = {**PX16, "max_area": 16 * 16, "_auto_resize": False}  # the recipe's size, the source's kept
TWINS = {
    "sd3.5-medium": Twin("tiny-sd3", lambda: tiny.tiny_sd3_pipeline(0), PX16, 4.5),
    "sd3.5-large": Twin("tiny-sd3-large", lambda: tiny.tiny_sd3_pipeline(0, large=True), PX16, 4.5),
    "flux.1-dev": Twin("tiny-flux", lambda: tiny.tiny_flux_pipeline(0), PX16, 3.5),
    "flux.1-kontext-dev": Twin("tiny-flux-kontext", tiny_kontext.tiny_flux_kontext_pipeline, KONTEXT, 2.5, 1),
    "qwen-image-edit": Twin("tiny-qwen-image-edit", tiny_edit_reference,
                            {"height": 32, "width": 32, "negative_prompt": [" ", " "]}, 4.0, 2),
    "qwen-image": Twin("tiny-qwen-image", lambda: tiny.tiny_qwen_image_pipeline(0),
                       {"height": 32, "width": 32, "negative_prompt": [" ", " "]}, 4.0),
    "wan2.1-t2v-1.3b": Twin("tiny-wan", lambda: tiny.tiny_wan_pipeline(0), WAN_CLIP, 4.5),
    "wan2.1-t2v-14b": Twin("tiny-wan", lambda: tiny.tiny_wan_pipeline(0), WAN_CLIP, 4.5),
    "wan2.2-t2v-a14b": Twin("tiny-wan2.2", lambda: tiny.tiny_wan22_pipeline(0), WAN_CLIP, 4.0),
    "wan2.2-ti2v-5b": Twin("tiny-wan2.2-ti2v", lambda: tiny.tiny_wan_pipeline(0, expand_timesteps=True), WAN_CLIP,
                           5.0),
    "flux.2-dev": Twin("tiny-flux.2-dev", lambda: packed_pipeline("dev"), PX64, 4.0),
    "flux.2-klein-4b": Twin("tiny-flux.2-klein", lambda: packed_pipeline("klein"), PX64, 4.0),  # the base: CFG
    "flux.2-klein-9b": Twin("tiny-flux.2-klein", lambda: packed_pipeline("klein"), PX64, 4.0),
    "z-image": Twin("tiny-z-image", lambda: tpflow_scale_pipeline(0), PX16, 5.0),
    "z-image-turbo": Twin("tiny-z-image-turbo", lambda: tpflow_scale_pipeline(0, turbo=True), PX16, 1.0),
}  # fmt: skip


def _sources(twin: Twin) -> list[list[torch.Tensor]]:
    """Each prompt's source images at the twin's size, whole levels of 255 (a PIL round trip keeps them): prompt 0's
    dark, prompt 1's light, so that a model that ignored them would be caught by the parity with the pipeline."""
    gen = torch.Generator().manual_seed(5)
    size = (3, twin.options["height"], twin.options["width"])
    return [[(torch.randint(0, 128, size, generator=gen) + 128 * p).float() / 255 for _ in range(twin.sources)]
            for p in range(len(PROMPTS))]  # fmt: skip


def _encode(backbone, twin: Twin):
    return backbone.encode(PROMPTS, sources=_sources(twin)) if twin.sources else backbone.encode(PROMPTS)


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


def _pipeline(pipe, z0: torch.Tensor, twin: Twin) -> torch.Tensor:
    options = dict(twin.options)
    scale = {"true_cfg_scale": twin.guidance} if "negative_prompt" in options else {"guidance_scale": twin.guidance}
    if twin.sources:  # the pipeline takes PIL images, one per prompt (several: a list per prompt)
        per_prompt = [source_images(images) for images in _sources(twin)]
        options["image"] = [images[0] if twin.sources == 1 else images for images in per_prompt]
    out = pipe(prompt=PROMPTS, num_inference_steps=K, latents=z0.clone(), output_type="latent",
               max_sequence_length=32, **options, **scale)  # fmt: skip
    return out.frames if hasattr(out, "frames") else out.images  # a video pipeline's output holds frames


def test_every_diffusers_backbone_has_a_twin_here():
    # tpflow's own backbones (a benchmark imported earlier in the session may register one of its own)
    names = registry.names("backbone")
    own = {n for n in names if registry.get("backbone", n).factory.__module__.startswith("tpflow.")}
    shapes = {"shapes-dit", "shapes-video-dit", "shapes-edit-dit"}
    real = {n for n in own if n not in shapes and not n.startswith("tiny-")}
    assert real == set(TWINS)


@pytest.mark.parametrize("real", sorted(TWINS))
def test_the_contract(real, tmp_path):
    twin = TWINS[real]
    name, make_pipe, guidance = twin.name, twin.make_pipe, twin.guidance
    backbone = registry.build("backbone", name, seed=0, resolution=twin.options["height"])
    # LoRA targets: each names at least one layer of the transformer (peft's suffix rule), checked on the twin
    modules = [n for n, _ in backbone.transformer.named_modules()]
    for target in backbone.options.lora_targets:
        assert any(n == target or n.endswith("." + target) for n in modules), target
    # a rollout at noise level 0 is the pipeline's sampling loop
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    cond, sigmas = _encode(backbone, twin), backbone.sigmas(K)
    expected = _pipeline(make_pipe(), z0, twin)
    with torch.no_grad():
        out = rollout(backbone, CpsSampler(), cond, z0, sigmas, Window(0, K - 1), 0.0, guidance, completions=None)
    torch.testing.assert_close(out.final, expected, rtol=0, atol=1e-4)
    assert (expected - z0).abs().max() > 0.1
    # an exported (trained-looking) adapter loads into the pipeline and samples what tpflow samples
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in backbone.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    backbone.save_adapter(tmp_path / "lora")
    pipe = make_pipe()
    pipe.load_lora_weights(tmp_path / "lora")
    with torch.no_grad():
        ours = sample_ode(backbone, cond, z0, sigmas, guidance)
    theirs = _pipeline(pipe, z0, twin)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert (ours - expected).abs().max() > 1e-3  # the adapter changes the samples: the comparison has teeth


@pytest.mark.parametrize("real", sorted(TWINS))
def test_the_contract_of_full_fine_tuning(real, tmp_path):
    """``finetune = "full"``: every transformer weight trains (fp32 masters), nothing else; the KL reference is the
    model as built (the pipeline's samples); the saved model loads with ``from_pretrained`` into a fresh pipeline
    and samples what tpflow samples."""
    twin = TWINS[real]
    name, make_pipe, guidance = twin.name, twin.make_pipe, twin.guidance
    backbone = registry.build("backbone", name, seed=0, resolution=twin.options["height"], finetune="full")
    trained = backbone.trainable_parameters()
    assert [id(p) for p in trained] == [id(p) for p in backbone.transformer.parameters()]
    # FSDP2 shards each repeated block on its own (tpflow.train.sharding.BLOCK_LISTS): a list of blocks it did not
    # know would be gathered whole with the root, the model's largest share at once on a real-size model
    lists = {n for n, m in backbone.transformer.named_children() if isinstance(m, torch.nn.ModuleList) and len(m)}
    assert lists and lists <= set(BLOCK_LISTS), (real, lists - set(BLOCK_LISTS))
    assert all(p.requires_grad and p.dtype == torch.float32 for p in trained)
    frozen = list(backbone.vae.parameters())
    for encoder in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if getattr(backbone.pipe, encoder, None) is not None:
            frozen += list(getattr(backbone.pipe, encoder).parameters())
    assert frozen and not any(p.requires_grad for p in frozen)
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    cond, sigmas = _encode(backbone, twin), backbone.sigmas(K)
    expected = _pipeline(make_pipe(), z0, twin)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in trained:
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=gen))
        with backbone.reference():  # the initial weights, whatever training did since
            reference = sample_ode(backbone, cond, z0, sigmas, guidance)
        ours = sample_ode(backbone, cond, z0, sigmas, guidance)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-4)
    backbone.save_adapter(tmp_path / "transformer")
    pipe = make_pipe()
    pipe.transformer = type(pipe.transformer).from_pretrained(tmp_path / "transformer")
    theirs = _pipeline(pipe, z0, twin)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - expected).abs().max() > 1e-3  # the perturbed weights change the samples: the check has teeth
    fresh = registry.build("backbone", name, seed=0, resolution=twin.options["height"], finetune="full")
    fresh.load_adapter(tmp_path / "transformer")
    assert all(torch.equal(a, b) for a, b in zip(fresh.trainable_parameters(), trained, strict=True))

"""The FLUX.2 backbones behave exactly like diffusers' Flux2KleinPipeline and Flux2Pipeline, text-to-image and with a
reference image: noise-0 rollouts, schedule, noise, decode, the exported LoRA, the fp32 parts, and sources of
different sizes in one batch; the FLUX.2 recipes name their missing weights (docs/backbones.md, "FLUX.2")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tpflow import registry
from tpflow.backbones import flux2, tiny_flux2
from tpflow.backbones.flux2 import Flux2Backbone
from tpflow.errors import UserError
from tpflow.interfaces import capability
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler

from .conftest import exact_fp32

PROMPTS = ["a photo of a red cat", "two dogs"]
K = 3
SIZE = 64  # 4×4 image tokens
RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "flux"
PIPES = {"klein": tiny_flux2.tiny_flux2_klein_pipeline, "dev": tiny_flux2.tiny_flux2_dev_pipeline}
GUIDANCE = {"klein": 4.0, "dev": 4.0}  # klein base: CFG with the empty prompt; dev: the embedded scale


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


@pytest.fixture(scope="module")
def made():
    """``get(kind)``: the tiny backbone and a fresh pipeline of the same seed, built once per module."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = (registry.build("backbone", f"tiny-flux.2-{kind}", seed=0), packed_pipeline(kind))
        return built[kind]

    return get


def _image(height: int, width: int, seed: int) -> tuple[Image.Image, torch.Tensor]:
    """A random RGB picture, and the same as tpflow.sources loads it ([3, H, W] in [0, 1])."""
    pixels = torch.randint(
        0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    picture = Image.fromarray(pixels.numpy())
    return picture, torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1).float() / 255


class _Packed:
    """A FLUX.2 pipeline that takes and gives tpflow's packed latents [N, S, 4·C]: ``latents`` reshaped to the
    patchified [N, 4·C, h/2, w/2] the pipeline takes, and klein's ``output_type="latent"`` result (the VAE's
    [N, C, h, w]) patchified, batch-normalised and packed again by the pipeline's own helpers (dev's is packed)."""

    def __call__(self, *args, latents, output_type="pil", **kwargs):
        n, s, c = latents.shape
        side = math.isqrt(s)
        start = latents.permute(0, 2, 1).reshape(n, c, side, side)
        out = super().__call__(*args, latents=start, output_type=output_type, **kwargs)
        if output_type == "latent" and out.images.dim() == 4:
            patches, bn = self._patchify_latents(out.images), self.vae.bn
            std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
            out.images = self._pack_latents((patches - bn.running_mean.view(1, -1, 1, 1)) / std)
        return out


def packed_pipeline(kind: str, seed: int = 0, distilled: bool = False):
    """The tiny ``kind`` ("klein": the base variant unless ``distilled``, or "dev") pipeline in packed latents
    (tests/test_backbone_contract.py's rows call it too)."""
    pipe = PIPES[kind](seed, distilled) if kind == "klein" else PIPES[kind](seed)
    packed = type(f"Packed{type(pipe).__name__}", (_Packed, type(pipe)), {})
    flags = {"is_distilled": distilled} if kind == "klein" else {}
    return packed(**pipe.components, **flags)


def _pipeline(pipe, z0: torch.Tensor, guidance: float, image=None) -> torch.Tensor:
    """The pipeline's final latents from our z_0, packed [N, S, 4·C]."""
    return pipe(prompt=PROMPTS, image=image, num_inference_steps=K, latents=z0.clone(), output_type="latent",
                height=SIZE, width=SIZE, max_sequence_length=32, guidance_scale=guidance).images  # fmt: skip


@pytest.mark.parametrize("kind", ["klein", "dev"])
def test_noise_0_rollouts_are_the_pipelines_text_to_image_and_with_a_reference(kind, made):
    """Prompt encoding, packing and ids, the empirical-mu schedule, guidance (klein's CFG, dev's embedding), and a
    reference image appended with its own ids: a noise-0 rollout is the pipeline's sampling loop to 1e-4."""
    backbone, pipe = made(kind)
    guidance = GUIDANCE[kind]
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    drawn, _ = pipe.prepare_latents(2, 4, SIZE, SIZE, torch.float32, "cpu", torch.Generator().manual_seed(3))
    torch.testing.assert_close(z0, drawn, rtol=0, atol=0)  # the noise is drawn as the pipeline draws it
    picture, source = _image(80, 72, seed=1)  # cropped to 80×64 as the pipeline crops it
    sigmas = backbone.sigmas(K)
    for image, sources in ((None, None), ([picture], [[source], [source]])):
        expected = _pipeline(pipe, z0, guidance, image)
        torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
        cond = backbone.encode(PROMPTS, sources=sources)
        with torch.no_grad():
            out = rollout(backbone, CpsSampler(), cond, z0, sigmas, Window(0, K - 1), 0.0, guidance, completions=None)
            ode = sample_ode(backbone, cond, z0, sigmas, guidance)
        torch.testing.assert_close(out.final, expected, rtol=0, atol=1e-4)
        torch.testing.assert_close(ode, expected, rtol=0, atol=1e-4)
        if image is None:
            text_only = ode
            with torch.no_grad():
                other = sample_ode(backbone, backbone.encode(["zzz", "qqq"]), z0, sigmas, guidance)
            assert (other - ode).abs().max() > 1e-3  # the prompt reaches the model
    assert (ode - text_only).abs().max() > 1e-3  # so does the reference
    assert cond.tensors["ref_latents"].shape == (2, 20, 16) and cond.extras["ref_ids"][0][0].tolist() == [10, 0, 0, 0]


def test_rows_with_sources_of_different_sizes_or_none_sample_as_each_alone(made):
    """Rows whose references differ in size (or that have none) share a batch: each is what it is alone."""
    backbone, _ = made("klein")
    z0 = backbone.initial_noise(3, torch.Generator().manual_seed(4))
    sources = [[_image(64, 64, 1)[1]], [], [_image(96, 64, 2)[1], _image(64, 64, 3)[1]]]
    prompts = ["a", "b", "c"]
    sigmas = backbone.sigmas(2)
    with torch.no_grad():
        together = sample_ode(backbone, backbone.encode(prompts, sources=sources), z0, sigmas, 4.0)
        for i in range(3):
            one = backbone.encode(prompts[i : i + 1], sources=sources[i : i + 1] if sources[i] else None)
            alone = sample_ode(backbone, one, z0[i : i + 1], sigmas, 4.0)
            torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-5)


def test_the_decode_is_the_pipelines(made):
    backbone, pipe = made("klein")
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(5))
    theirs = pipe(prompt=PROMPTS, num_inference_steps=K, latents=z0.clone(), output_type="pt", height=SIZE,
                  width=SIZE, max_sequence_length=32, guidance_scale=1.0).images  # fmt: skip
    with torch.no_grad():
        images = backbone.decode(sample_ode(backbone, backbone.encode(PROMPTS), z0, backbone.sigmas(K), 1.0))
    assert images.shape == (2, 3, SIZE, SIZE)
    torch.testing.assert_close(images, theirs.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["klein", "dev"])
def test_an_exported_adapter_loads_into_the_pipeline(kind, made, tmp_path):
    """``save_adapter`` writes what the pipeline's ``load_lora_weights`` reads: the same samples, with a reference."""
    backbone, _ = made(kind)
    with torch.no_grad():
        saved = [p.clone() for p in backbone.trainable_parameters()]
        gen = torch.Generator().manual_seed(0)
        for p in backbone.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    try:
        backbone.save_adapter(tmp_path / "lora")
        pipe = packed_pipeline(kind)
        pipe.load_lora_weights(tmp_path / "lora")
        picture, source = _image(64, 64, seed=2)
        z0 = backbone.initial_noise(2, torch.Generator().manual_seed(11))
        cond = backbone.encode(PROMPTS, sources=[[source], [source]])
        with torch.no_grad():
            ours = sample_ode(backbone, cond, z0, backbone.sigmas(K), GUIDANCE[kind])
            with backbone.reference():
                base = sample_ode(backbone, cond, z0, backbone.sigmas(K), GUIDANCE[kind])
        expected = _pipeline(pipe, z0, GUIDANCE[kind], [picture])
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
        assert (ours - base).abs().max() > 1e-2  # the adapter changes the samples
    finally:
        with torch.no_grad():
            for p, before in zip(backbone.trainable_parameters(), saved, strict=True):
                p.copy_(before)


def test_the_step_distilled_klein_takes_no_guidance_as_its_pipeline():
    """``is_distilled`` (FLUX.2-klein-4B/-9B): the pipeline ignores the guidance scale, and so does the backbone."""
    pipe = packed_pipeline("klein", distilled=True)
    backbone = Flux2Backbone(tiny_flux2.tiny_flux2_klein_pipeline(0, distilled=True), tiny_flux2.TinyFlux2Options())
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(6))
    cond, sigmas = backbone.encode(PROMPTS), backbone.sigmas(K)
    assert "negative" not in cond.extras
    with torch.no_grad():
        guided, plain = sample_ode(backbone, cond, z0, sigmas, 4.0), sample_ode(backbone, cond, z0, sigmas, 1.0)
    torch.testing.assert_close(guided, plain, rtol=0, atol=0)
    torch.testing.assert_close(guided, _pipeline(pipe, z0, 4.0), rtol=0, atol=1e-4)


def test_fp32_parts_are_kept_as_the_pipeline_keeps_them():
    """Under bf16 the transformer and text encoder are bf16 (their classes keep no fp32 modules), the VAE and its
    batch-norm statistics fp32 (tpflow decodes in fp32); a full fine-tune's transformer is fp32."""
    for part in (tiny_flux2.tiny_flux2_transformer(True), tiny_flux2._vae()):
        assert not getattr(part, "_keep_in_fp32_modules", None)
    backbone = registry.build("backbone", "tiny-flux.2-klein", seed=0, dtype="bf16")
    assert {p.dtype for n, p in backbone.transformer.named_parameters() if "lora" not in n} == {torch.bfloat16}
    assert {p.dtype for p in backbone.pipe.text_encoder.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in [*backbone.vae.parameters(), backbone.vae.bn.running_var]} == {torch.float32}
    full = registry.build("backbone", "tiny-flux.2-dev", seed=0, dtype="bf16", finetune="full")
    assert {p.dtype for p in full.trainable_parameters()} == {torch.float32}


def test_capabilities_and_a_source_too_small(made):
    assert capability(flux2.flux_2_dev, "source_images") == (0, 6) and not capability(flux2.flux_2_dev, "cfg_branch")
    for klein in (flux2.flux_2_klein_4b, flux2.flux_2_klein_9b):
        assert capability(klein, "source_images") == (0, 4) and capability(klein, "cfg_branch")
    backbone, _ = made("klein")
    with pytest.raises(UserError, match="too small"):
        backbone.encode(["a"], sources=[[torch.rand(3, 32, 64)]])


@pytest.mark.parametrize("name", ["flux2_klein_flowgrpo", "flux2_klein_edit_flowgrpo", "flux2_dev_flowgrpo"])
def test_a_flux2_recipe_without_weights_is_one_paragraph_naming_them(monkeypatch, tmp_path, name):
    from tests.cli_run import tpflow
    from tpflow.weights import download_command

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    out = tpflow("validate", str(RECIPES / f"{name}.toml"))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "Traceback" not in err
    model = "black-forest-labs/FLUX.2-dev" if "dev" in name else "black-forest-labs/FLUX.2-klein-9B"
    assert download_command(model) in err


def test_the_memory_estimate_builds_the_published_sizes():
    """The estimate's FLUX.2 entries (tpflow.memory.flux2) give the models' published parameter counts: transformers
    of 32.2 B (dev), 3.9 B and 9.1 B (klein), text encoders of 24.0 B (Mistral-Small-3 with its vision tower),
    4.0 B and 8.2 B (Qwen3-4B and -8B)."""
    from diffusers import Flux2Transformer2DModel

    from tpflow.memory.configs import PUBLISHED
    from tpflow.memory.models import text_encoder_sizes

    expected = {"flux.2-dev": (32.2, 24.0), "flux.2-klein-4b": (3.9, 4.0), "flux.2-klein-9b": (9.1, 8.2)}
    for name, (transformer, encoder) in expected.items():
        with torch.device("meta"):
            model = Flux2Transformer2DModel(**PUBLISHED[name].transformer)
        assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == transformer
        ((count, nbytes),) = text_encoder_sizes(PUBLISHED[name].kind, "bf16").values()
        assert round(count / 1e9, 1) == encoder and nbytes == 2 * count


def test_guidance_asked_of_a_step_distilled_klein_is_refused_before_anything_loads(tmp_path):
    """A klein folder whose model_index.json says is_distilled: a recipe's guidance != 1 is one problem naming it (the
    pipeline would ignore the scale silently); guidance 1, or a base checkpoint, passes."""
    index = {"_class_name": "Flux2KleinPipeline", "is_distilled": True, "transformer": ["diffusers", "X"]}
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "weights").write_text("x")
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    options = flux2.Klein4BOptions(pretrained=str(tmp_path), device="cpu")

    def problems(rollout: float, evaluation: float) -> list[str]:
        settings = {"rollout": SimpleNamespace(guidance=rollout), "eval": SimpleNamespace(guidance=evaluation)}
        return flux2.flux_2_klein_4b.check_machine(options, settings)

    (found,) = problems(4.0, 1.0)
    assert "step-distilled" in found and "[rollout] guidance = 4" in found and "[eval]" not in found
    assert problems(1.0, 1.0) == []
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}))
    assert problems(4.0, 4.0) == []


def test_grpo_trains_an_epoch_on_edits_whose_sources_differ_in_size(tmp_path):
    """The trainer on tiny-flux.2-klein (CFG 4) with an edit-jsonl file of two instructions whose sources differ in
    size: each rollout batch holds both layouts (one transformer call each), TP-GRPO's completions included, and the
    LoRA moves."""
    from tpflow.recipe import validate_recipe
    from tpflow.train.trainer import Trainer

    lines = []
    for i, prompt in enumerate(["make the square red", "add a blue circle"]):
        Image.new("RGB", (64, 64 + 16 * i), (30 + 170 * i, 200, 90)).save(tmp_path / f"source{i}.png")
        lines.append(json.dumps({"prompt": prompt, "source": f"source{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    recipe = validate_recipe({
        "backbone": {"name": "tiny-flux.2-klein", "seed": 0, "lora_init": "gaussian"},
        "reward": {"name": "image-stat"},
        "optimizer": {"name": "grpo", "learning_rate": 1e-2, "beta": 0.0, "micro_batch_size": 4},
        "rollout": {"num_steps": 3, "window_size": 2, "window_range": [0, 2], "noise_level": 0.7, "guidance": 4.0},
        "train": {"epochs": 1, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch": 4, "save_every": 0,
                  "ema": False, "mixed_precision": "no", "run_dir": str(tmp_path / "run")},
        "eval": {"every": 0},
        "dataset": {"name": "edit-jsonl", "path": str(tmp_path / "edits.jsonl"), "min_side": 64},
    })  # fmt: skip
    trainer = Trainer(recipe)
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    assert recipe.components["credit"].name == "consistent" and metrics["optimizer_steps"] >= 1
    assert all(not torch.equal(a, p) for a, p in zip(before, trainer.backbone.trainable_parameters(), strict=True))


def test_per_row_gradients_hold_when_the_rows_sources_differ_in_size(made):
    """``recompute = "reweight"``'s per-row shares of one batched backward (tpflow.rollout.per_row_grads) equal each
    row's own backward on klein (CFG 4) when the rows' sources come in two sizes and one row has none."""
    from tpflow.rollout.parts import Branch, Velocity
    from tpflow.rollout.per_row_grads import PerRowGradients

    backbone, _ = made("klein")
    sources = [[_image(64, 64, 1)[1]], [_image(80, 64, 2)[1]], [], [_image(64, 64, 3)[1]]]
    cond = backbone.encode(["a", "b", "c", "d"], sources=sources)
    z = backbone.initial_noise(4, torch.Generator().manual_seed(2))
    engine = Velocity(backbone, cond, backbone.sigmas(3), 4.0, None)
    weights = torch.randn(z.shape, generator=torch.Generator().manual_seed(3))
    per_row = PerRowGradients.of(backbone)
    engine.on_chunk = per_row.chunk
    with per_row.recording(4):
        v = engine([Branch(z, torch.arange(4))], 1)[0]
    grads = per_row.gradients((v.float() * weights).flatten(1).sum(1), 4)
    for i in range(4):
        with per_row.recording(4):
            v = engine([Branch(z, torch.arange(4))], 1)[0]
        own = torch.autograd.grad((v.float()[i] * weights[i]).sum(), per_row.params, allow_unused=True)
        for g, ref in zip(grads, own, strict=True):
            if ref is not None:
                torch.testing.assert_close(g[i], ref, rtol=1e-4, atol=1e-6)

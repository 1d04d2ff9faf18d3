"""tiny-qwen-image-edit behaves exactly like diffusers' QwenImageEditPlusPipeline: a noise-0 rollout with true CFG
equals its sampling loop with one and with two sources (the text encoder seeing them, their latents appended), the
half-precision placement is the pipeline's, and what it cannot encode is refused in one paragraph
(docs/backbones.md, "Qwen-Image-Edit"). The exported LoRA and full fine-tuning: tests/test_backbone_contract.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpflow import registry
from tpflow.backbones.tiny_qwen_edit import tiny_qwen_image_edit_pipeline
from tpflow.errors import UserError
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler
from tpflow.sources import takes_sources
from tpflow.weights import download_command

from .conftest import exact_fp32
from .qwen_edit_pipeline import tiny_edit_reference

PROMPTS = ["make the cat red", "add a dog"]
K = 3


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


@pytest.fixture(scope="module")
def backbone():
    return registry.build("backbone", "tiny-qwen-image-edit", seed=0, prompt_cache=8)


def _sources(count: int, side: int = 40, seed: int = 5) -> list[list[torch.Tensor]]:
    """Each prompt's ``count`` square sources at ``side`` px (the pipeline resizes them to 32), whole levels of 255:
    prompt 0's dark, prompt 1's light."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 128, (3, side, side), generator=gen) + 128 * p).float() / 255 for _ in range(count)]
            for p in range(len(PROMPTS))]  # fmt: skip


def _pil(images: list[torch.Tensor]) -> list:
    """[3, H, W] in [0, 1] -> PIL images, as the pipeline takes its sources (the backbone converts them alike)."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(torch.stack(images).permute(0, 2, 3, 1).numpy())


@pytest.mark.parametrize("count", [1, 2])
def test_rollout_at_noise_0_equals_the_pipeline(backbone, count):
    """The edit template with one "Picture i" per source, the sources resized for the vision tower and for the VAE,
    their packed latents after z with ``img_shapes`` listing them, the velocity on z's tokens, true CFG whose
    negative prompt sees the sources too, the schedule from z's tokens: QwenImageEditPlusPipeline's loop to 1e-4."""
    sources = _sources(count)
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    cond, sigmas = backbone.encode(PROMPTS, sources=sources), backbone.sigmas(K)
    assert cond.tensors["image_latents"].shape == (2, count * 16, 16) and len(cond.extras["img_shapes"]) == count + 1
    reference = tiny_edit_reference()
    expected = reference(prompt=PROMPTS, image=[_pil(s) for s in sources], latents=z0.clone(),
                         negative_prompt=[" ", " "], true_cfg_scale=4.0, output_type="latent", height=32, width=32,
                         num_inference_steps=K).images  # fmt: skip
    torch.testing.assert_close(sigmas, reference.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    with torch.no_grad():
        out = rollout(backbone, CpsSampler(), cond, z0, sigmas, Window(0, K - 1), 0.0, 4.0, completions=None)
        swapped = sample_ode(backbone, backbone.encode(PROMPTS, sources=sources[::-1]), z0, sigmas, 4.0)
    torch.testing.assert_close(out.final, expected, rtol=0, atol=1e-4)
    assert (expected - z0).abs().max() > 0.1 and (swapped - out.final).abs().max() > 1e-3  # the sources reach it


def test_half_precision_parts_are_placed_as_the_pipeline_loads_them(tmp_path):
    """Under bf16 every part holds each tensor in the dtype ``from_pretrained(dtype=bf16)`` gives it (Qwen-Image's
    classes name no float32 module), the VAE in fp32 (it encodes the sources and decodes in fp32), the LoRA matrices
    in fp32; a velocity with two sources is finite."""
    pipe = tiny_qwen_image_edit_pipeline(0)
    pipe.save_pretrained(tmp_path)
    loaded = type(pipe).from_pretrained(tmp_path, dtype=torch.bfloat16)
    edit = registry.build("backbone", "tiny-qwen-image-edit", seed=0, dtype="bf16")
    for part in ("transformer", "text_encoder", "vae"):
        ours = {n.replace(".base_layer.", "."): p.dtype for n, p in getattr(edit.pipe, part).named_parameters()}
        lora = {n for n in ours if "lora_" in n}
        want = {n: p.dtype for n, p in getattr(loaded, part).named_parameters()}
        if part == "vae":
            want = dict.fromkeys(want, torch.float32)
        assert {n: d for n, d in ours.items() if n not in lora} == want, part
        assert all(ours[n] == torch.float32 for n in lora)
    z = edit.initial_noise(2, torch.Generator().manual_seed(0))
    v = edit.velocity(z, torch.full((2,), 0.7), edit.encode(PROMPTS, sources=_sources(2)), 4.0)
    assert v.dtype == torch.float32 and v.shape == z.shape and torch.isfinite(v).all()


def test_sources_key_the_cache_and_what_cannot_be_encoded_is_refused(backbone):
    factory = registry.get("backbone", "qwen-image-edit").factory
    assert takes_sources(backbone) and factory.source_images == backbone.source_images == (1, 3)  # built and not
    first = backbone.encode(["same words", "same words"], sources=_sources(1))  # one text, two sources: two rows
    assert (first.tensors["prompt_embeds"][0] - first.tensors["prompt_embeds"][1]).abs().max() > 1e-3
    again = backbone.encode(["same words"], sources=_sources(1)[1:])  # from the cache
    assert all(torch.equal(again.tensors[k][0], first.tensors[k][1]) for k in first.tensors)
    with pytest.raises(UserError, match="the same number"):
        backbone.encode(PROMPTS, sources=[_sources(1)[0], _sources(2)[1]])
    with pytest.raises(UserError, match="source images per instruction"):
        backbone.encode(PROMPTS)
    short = registry.build("backbone", "tiny-qwen-image-edit", seed=0, max_sequence_length=16)
    with pytest.raises(UserError, match="max_sequence_length = 16"):
        short.encode(PROMPTS[:1], sources=_sources(1)[:1])


@pytest.mark.parametrize("option", [{"resolution": 16}, {"source_area": 16 * 16}, {"condition_area": 24 * 24}])
def test_a_source_the_pipeline_would_size_to_0_px_is_refused_with_the_options(option):
    """calculate_dimensions rounds a side to a multiple of 32: below 32 × 32 pixels a source would be encoded at 0
    px (diffusers: "height and width must be > 0", after the weights load); the options refuse it first."""
    from pydantic import ValidationError

    from tpflow.backbones.qwen_image_edit import QwenImageEditOptions
    from tpflow.backbones.tiny_qwen_edit import TinyQwenImageEditOptions

    for options in (TinyQwenImageEditOptions, QwenImageEditOptions):
        with pytest.raises(ValidationError, match="greater than or equal to"):
            options(**option)
        options(**{k: 32 if k == "resolution" else 32 * 32 for k in option})  # the least that encodes


TRAIN = """
[backbone]
name = "tiny-qwen-image-edit"
[reward]
name = "edit-consistency"
features = "pixel"
[dataset]
name = "edit-jsonl"
path = "{path}"
min_side = 32
[sampler]
name = "flow-sde"
[credit]
name = "outcome"
[optimizer]
name = "grpo"
learning_rate = 1e-2
micro_batch_size = 4
[rollout]
num_steps = 3
window_size = 2
window_range = [0, 3]
guidance = 4.0
[train]
epochs = 1
prompts_per_epoch = 2
group_size = 2
rollout_batch = 4
ema = false
[eval]
every = 0
"""


def test_an_epoch_of_flow_grpo_trains_on_two_sources_per_instruction(tmp_path):
    """The trainer hands each (instruction, sources) pair's sources to the backbone (its ``source_images``) and a
    Flow-GRPO epoch moves the LoRA; the reward reads the same sources from the metadata."""
    import json

    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    lines = []
    for i, images in enumerate(_sources(2)):
        names = [f"{i}_{j}.png" for j in range(2)]
        for name, image in zip(names, _pil(images), strict=True):
            image.save(tmp_path / name)
        lines.append(json.dumps({"prompt": PROMPTS[i], "sources": names}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "recipe.toml").write_text(TRAIN.format(path=tmp_path / "edits.jsonl"))
    trainer = Trainer(load_recipe(tmp_path / "recipe.toml"), run_dir=tmp_path / "run")
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    names = [n for n, p in trainer.backbone.transformer.named_parameters() if p.requires_grad]
    moved = {n for n, a, b in zip(names, trainer.backbone.trainable_parameters(), before, strict=True)
             if not torch.equal(a, b)}  # fmt: skip
    assert trainer.optimizer.global_step == 1 and metrics
    # every B (0 at the start) took a gradient step but those of the text tokens' outputs, which the one (last)
    # block's output discards
    dead = ("attn.add_q_proj.", "attn.to_add_out.")
    assert {n for n in names if "lora_B" in n and not any(d in n for d in dead)} <= moved


def test_the_recipe_without_weights_exits_2_naming_them(monkeypatch, tmp_path, capsys):
    from tpflow.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "qwen_image" / "edit_plus_flowgrpo.toml"
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(recipe)])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert download_command("Qwen/Qwen-Image-Edit-2509") in err and "Traceback" not in err

"""FLUX.1 Kontext (tpflow/backbones/flux_kontext.py) beyond the backbone contract (tests/test_backbone_contract.py):
the source enters the sequence with its own ids and moves the velocity, each row's source stays with its row, a
source of another size is resized to the recipe's (what the pipeline computes from the source at that size), a prompt
without exactly one source is refused, and the Kontext recipes name their missing weights offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpflow import registry
from tpflow.backbones import tiny_kontext
from tpflow.backbones.flux_kontext import source_images
from tpflow.errors import UserError
from tpflow.rollout import sample_ode
from tpflow.weights import download_command

from .conftest import exact_fp32

PROMPTS = ["make the cat red", "add two dogs"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kontext():
    return registry.build("backbone", "tiny-flux-kontext", seed=0, resolution=16)


def _image(level: int, height: int = 16, width: int = 16, seed: int = 0) -> torch.Tensor:
    """[3, H, W] whole levels of 255 around ``level`` (a PIL round trip keeps them)."""
    noise = torch.randint(0, 64, (3, height, width), generator=torch.Generator().manual_seed(seed))
    return (noise + level).float() / 255


def test_the_source_is_appended_with_its_own_ids_and_moves_each_rows_velocity(kontext):
    dark, light = _image(0), _image(190, seed=1)
    cond = kontext.encode(PROMPTS, sources=[[dark], [light]])
    s = kontext.img_ids.shape[0]  # target tokens
    assert cond.tensors["source_latents"].shape == (2, s, 4 * kontext.channels)  # the source at the recipe's size
    ids = cond.extras["img_ids"]  # [S + S', 3]: the latents' ids, then the source's with first coordinate 1
    assert ids.shape == (2 * s, 3) and torch.equal(ids[:s], kontext.img_ids)
    assert (ids[s:, 0] == 1).all() and torch.equal(ids[s:, 1:], ids[:s, 1:])
    z = kontext.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.7)
    with torch.no_grad():
        v = kontext.velocity(z, sigma, cond, 2.5)
        swapped = kontext.velocity(z, sigma, kontext.encode(PROMPTS, sources=[[light], [dark]]), 2.5)
        alone = kontext.velocity(z[1:], sigma[1:], kontext.encode(PROMPTS[1:], sources=[[light]]), 2.5)
    assert v.shape == z.shape and v.dtype == torch.float32
    assert (v - swapped).abs().amax(dim=(1, 2)).min() > 1e-4  # each row's velocity reads its own source
    torch.testing.assert_close(v[1:], alone, rtol=0, atol=1e-6)  # a row's source stays with its row


def test_a_source_of_another_size_is_resized_to_the_recipes_as_the_pipeline_would_take_it(kontext):
    """tpflow resizes each source to the recipe's resolution (the pipeline's _auto_resize is the departure): the
    rollout equals FluxKontextPipeline given the source already resized to 16 x 16 by PIL's Lanczos."""
    from PIL import Image

    big = [_image(40, 24, 20, seed=2), _image(150, 12, 16, seed=3)]
    cond, sigmas = kontext.encode(PROMPTS, sources=[[b] for b in big]), kontext.sigmas(3)
    z0 = kontext.initial_noise(2, torch.Generator().manual_seed(3))
    resized = [image.resize((16, 16), Image.Resampling.LANCZOS) for image in source_images(big)]
    with exact_fp32(), torch.no_grad():
        ours = sample_ode(kontext, cond, z0, sigmas, 2.5)
        theirs = tiny_kontext.tiny_flux_kontext_pipeline(0)(
            image=resized, prompt=PROMPTS, latents=z0.clone(), output_type="latent", height=16, width=16,
            max_area=256, _auto_resize=False, guidance_scale=2.5, num_inference_steps=3, max_sequence_length=32,
        ).images  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_a_prompt_without_exactly_one_source_is_refused_in_one_paragraph(kontext):
    for sources in (None, [[_image(0)], []], [[_image(0), _image(9)], [_image(0)]]):
        with pytest.raises(UserError, match="one source image per instruction") as caught:
            kontext.encode(PROMPTS, sources=sources)
        assert "\n" not in str(caught.value)


def test_both_kontext_backbones_declare_one_source_and_no_cfg_branch(kontext):
    for name in ("flux.1-kontext-dev", "tiny-flux-kontext"):
        factory = registry.get("backbone", name).factory
        assert factory.source_images == (1, 1) and factory.cfg_branch is False, name
    assert kontext.source_images == (1, 1)  # the built backbone too: the trainer reads it there
    options = registry.get("backbone", "flux.1-kontext-dev").options()
    assert options.pretrained == "black-forest-labs/FLUX.1-Kontext-dev" and options.dtype == "bf16"


def test_the_real_factory_loads_a_diffusers_folder_keeping_the_vae_in_fp32(kontext, tmp_path):
    """``flux.1-kontext-dev`` from a folder in diffusers layout (the twin saved): in bf16 the VAE is loaded in fp32 and
    the LoRA matrices are fp32 over a bf16 transformer; in fp32 it computes the twin's velocity."""
    tiny_kontext.tiny_flux_kontext_pipeline(0).save_pretrained(tmp_path / "kontext")
    sizes = {"pretrained": str(tmp_path / "kontext"), "device": "cpu", "resolution": 16, "max_sequence_length": 32}
    half = registry.build("backbone", "flux.1-kontext-dev", dtype="bf16", lora_rank=4, lora_alpha=8, **sizes)
    assert {p.dtype for p in half.vae.parameters()} == {torch.float32}
    assert {p.dtype for p in half.trainable_parameters()} == {torch.float32}
    assert half.transformer.proj_out.weight.dtype == torch.bfloat16  # not a LoRA target: the base dtype
    full = registry.build("backbone", "flux.1-kontext-dev", dtype="fp32", lora_rank=4, lora_alpha=8, **sizes)
    z, sigma, sources = (
        kontext.initial_noise(2, torch.Generator().manual_seed(1)),
        torch.full((2,), 0.5),
        [[_image(9)]] * 2,
    )
    with torch.no_grad():
        twin = kontext.velocity(z, sigma, kontext.encode(PROMPTS, sources=sources), 2.5)
        loaded = full.velocity(z, sigma, full.encode(PROMPTS, sources=sources), 2.5)
        v = half.velocity(z, sigma, half.encode(PROMPTS, sources=sources), 2.5)
    torch.testing.assert_close(loaded, twin, rtol=0, atol=1e-6)  # the LoRA at init (B = 0) adds nothing
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


@pytest.mark.parametrize("name", ["kontext_flowgrpo", "kontext_tp"])
def test_the_kontext_recipes_without_weights_exit_2_naming_them(monkeypatch, tmp_path, capsys, name):
    from tpflow.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(ROOT / "recipes" / "flux" / f"{name}.toml")])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert download_command("black-forest-labs/FLUX.1-Kontext-dev") in err and "Traceback" not in err

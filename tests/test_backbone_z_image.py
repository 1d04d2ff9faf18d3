"""tiny-z-image and tiny-z-image-turbo behave exactly like diffusers' ZImagePipeline: the schedule, noise drawn as it
draws it, a noise-0 rollout with its CFG options (a negative prompt, normalisation, truncation), the decode, each
prompt's own caption length, bf16 placement; the turbo model refuses CFG; the recipes name their missing weights
(docs/backbones.md, "Z-Image"). The rollout and LoRA-export parity of both twins at the options' defaults is
tests/test_backbone_contract.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline

from tpflow.backbones.tiny_z_image import tiny_z_image_pipeline
from tpflow.errors import UserError
from tpflow.recipe import load_recipe
from tpflow.registry import build
from tpflow.rollout import Window, rollout, sample_ode
from tpflow.samplers.cps import CpsSampler

from .conftest import exact_fp32
from .test_placement import dtypes, loaded

PROMPTS = ["a photo of a red cat", "two dogs"]
K = 3
RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "z_image"


class TpflowScaleZImagePipeline(ZImagePipeline):
    """ZImagePipeline called with tpflow's guidance w (v_u + w·(v_c − v_u)) as ``guidance_scale``: it runs at its own
    scale w − 1 (w = 1: the conditional branch alone, its 0). The prompt lists are copied: ZImagePipeline writes
    the templated prompts into the list it is given."""

    def __call__(self, prompt=None, *args, guidance_scale: float = 5.0, negative_prompt=None, **kwargs):  # noqa: ANN001, ANN204
        return super().__call__(_copy(prompt), *args, guidance_scale=guidance_scale - 1,
                                negative_prompt=_copy(negative_prompt), **kwargs)  # fmt: skip


def _copy(prompts):  # noqa: ANN001, ANN202
    return list(prompts) if isinstance(prompts, list) else prompts


def tpflow_scale_pipeline(seed: int = 0, turbo: bool = False) -> TpflowScaleZImagePipeline:
    """``tiny_z_image_pipeline`` as a :class:`TpflowScaleZImagePipeline` (the backbone contract's twins)."""
    return TpflowScaleZImagePipeline(**tiny_z_image_pipeline(seed, turbo).components)


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


@pytest.fixture(scope="module")
def pipe():
    return tiny_z_image_pipeline(0)


@pytest.fixture(scope="module")
def backbone():
    return build("backbone", "tiny-z-image", seed=0, negative_prompt="blurry, low quality")


def _latents(pipe, z0: torch.Tensor, guidance: float, **options) -> torch.Tensor:
    out = pipe(prompt=list(PROMPTS), negative_prompt=["blurry, low quality"] * 2, num_inference_steps=K,
               latents=z0.clone(), output_type="latent", height=16, width=16, guidance_scale=guidance - 1,
               max_sequence_length=32, **options)  # fmt: skip
    return out.images


@pytest.mark.parametrize(
    "options", [{}, {"cfg_normalization": 1.0, "cfg_truncation": 0.5}], ids=["defaults", "normalised+truncated"]
)
def test_rollout_at_noise_0_equals_the_pipeline_with_its_cfg_options(pipe, backbone, options):
    """Noise as prepare_latents draws it, the schedule, a negative prompt, and the CFG options: normalisation
    caps a guided row's norm at the conditional one's, truncation drops CFG at the last step (1 − σ = 0.56 > 0.5)."""
    backbone.options = backbone.options.model_copy(update={"cfg_normalization": 0.0, "cfg_truncation": 1.0, **options})
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(3))
    drawn = pipe.prepare_latents(2, 4, 16, 16, torch.float32, "cpu", torch.Generator().manual_seed(3), None)
    torch.testing.assert_close(z0, drawn, rtol=0, atol=0)
    expected = _latents(pipe, z0, 5.0, **options)
    sigmas = backbone.sigmas(K)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)
    with torch.no_grad():
        out = rollout(backbone, CpsSampler(), backbone.encode(PROMPTS), z0, sigmas, Window(0, K - 1), 0.0, 5.0,
                      completions=None)  # fmt: skip
    torch.testing.assert_close(out.final, expected, rtol=0, atol=1e-4)
    if options:  # the options change the samples: the comparison has teeth
        assert (expected - _latents(pipe, z0, 5.0)).abs().max() > 1e-3


def test_each_prompt_keeps_its_own_caption_length_and_the_cache_its_prompts(backbone):
    """Rows zero-padded to max_sequence_length with their lengths; the transformer sees each caption at its own
    length (a longer padding changes the velocity: its pad token is learned). The cache gives the same rows."""
    prompts = list(PROMPTS)
    cond = backbone.encode(prompts)
    lengths = cond.tensors["lengths"].tolist()
    assert prompts == PROMPTS and lengths[0] > lengths[1] and cond.tensors["prompt_embeds"].shape[1] == 32
    assert cond.tensors["prompt_embeds"][1, lengths[1] :].abs().max() == 0
    z = backbone.initial_noise(2, torch.Generator().manual_seed(1))
    sigma = torch.full((2,), 0.5)
    with torch.no_grad():
        v = backbone.velocity(z, sigma, cond, 1.0)
        cond.tensors["lengths"] = torch.full_like(cond.tensors["lengths"], 32)  # zeros read as caption tokens
        assert (backbone.velocity(z, sigma, cond, 1.0) - v).abs().max() > 1e-3
    cached = build("backbone", "tiny-z-image", seed=0, prompt_cache=8)
    cached.encode(prompts[:1])
    again = cached.encode(prompts)
    assert prompts == PROMPTS
    torch.testing.assert_close(again.tensors["prompt_embeds"], backbone.encode(PROMPTS).tensors["prompt_embeds"])


def test_turbo_runs_without_cfg_and_refuses_it_before_anything_loads():
    turbo = build("backbone", "tiny-z-image-turbo", seed=0)
    pipe = tiny_z_image_pipeline(0, turbo=True)
    z0 = turbo.initial_noise(2, torch.Generator().manual_seed(4))
    sigmas = turbo.sigmas(K)
    t = torch.tensor([1, 2 / 3, 1 / 3])
    torch.testing.assert_close(sigmas[:-1], 3 * t / (1 + 2 * t), rtol=0, atol=1e-6)  # Turbo's static shift 3
    with torch.no_grad():
        ours = sample_ode(turbo, turbo.encode(PROMPTS), z0, sigmas, 1.0)
    theirs = pipe(prompt=list(PROMPTS), num_inference_steps=K, latents=z0.clone(), output_type="latent", height=16,
                  width=16, guidance_scale=0.0, max_sequence_length=32).images  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    with pytest.raises(UserError, match=r"\[rollout\] guidance = 4: Z-Image-Turbo is distilled"):
        load_recipe(RECIPES / "z_image_turbo_flowgrpo.toml", ["rollout.guidance=4"])
    with pytest.raises(UserError, match=r"Extra inputs|negative_prompt"):
        load_recipe(RECIPES / "z_image_turbo_flowgrpo.toml", ["backbone.negative_prompt=x"])


def test_decode_and_bf16_placement_are_the_pipelines(pipe, backbone, tmp_path):
    z0 = backbone.initial_noise(2, torch.Generator().manual_seed(5))
    latents = _latents(pipe, z0, 1.0)
    theirs = pipe(prompt=list(PROMPTS), num_inference_steps=K, latents=z0.clone(), output_type="pt", height=16,
                  width=16, guidance_scale=0.0, max_sequence_length=32).images  # fmt: skip
    ours = backbone.decode(latents)
    assert ours.shape == (2, 3, 16, 16) and 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)
    # each part in the dtypes from_pretrained(bf16) gives it (neither ZImageTransformer2DModel nor Qwen3 keeps a
    # module in fp32), the VAE in fp32, the LoRA matrices aside
    half = build("backbone", "tiny-z-image", seed=0, dtype="bf16")
    reference = loaded(tiny_z_image_pipeline(0), tmp_path, torch.bfloat16)
    for part in ("transformer", "text_encoder", "vae"):
        model = getattr(half.pipe, part)
        want = dtypes(getattr(reference, part)) if part != "vae" else dict.fromkeys(dtypes(model), torch.float32)
        got = {n.replace(".base_layer.", "."): d for n, d in dtypes(model).items() if "lora_" not in n}
        assert got == want, part
    assert dtypes(half.transformer)["cap_embedder.1.weight"] == torch.bfloat16  # the rest in the pipeline dtype
    v = half.velocity(z0, torch.full((2,), 0.5), half.encode(PROMPTS), 5.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_a_resolution_the_patches_cannot_take_is_one_paragraph():
    with pytest.raises(UserError, match="multiple of 2"):
        build("backbone", "tiny-z-image", resolution=15)


@pytest.mark.parametrize("name", ["z_image_flowgrpo", "z_image_turbo_flowgrpo"])
def test_a_z_image_recipe_without_weights_is_one_paragraph_naming_them(monkeypatch, tmp_path, name):
    from tests.cli_run import tpflow
    from tpflow.weights import download_command

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    out = tpflow("validate", str(RECIPES / f"{name}.toml"))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "Traceback" not in err
    model = "Tongyi-MAI/Z-Image-Turbo" if "turbo" in name else "Tongyi-MAI/Z-Image"
    assert download_command(model) in err


def test_compile_blocks_finds_z_images_layers_and_refiners():
    """Z-Image's transformer keeps its blocks in ``layers`` and its refiners, not in SD3's or FLUX's lists:
    ``backbone.compile_blocks`` compiles each of them (it once refused the model, after its weights loaded)."""
    from tpflow.backbones.diffusers_common import compile_blocks

    model = tiny_z_image_pipeline(0).transformer
    expected = sum(len(getattr(model, name, None) or ()) for name in ("layers", "noise_refiner", "context_refiner"))
    assert expected > 0 and compile_blocks(model) == expected
    assert all(block._compiled_call_impl is not None for block in model.layers)  # nn.Module.compile: lazily

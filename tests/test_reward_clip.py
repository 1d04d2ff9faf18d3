"""The CLIP-based rewards (pickscore, clipscore, aesthetic) on tiny random models built here, offline.

Tests that take ``device`` run on the CPU and, in the GPU suite, with the reward's model and the images on CUDA,
where their expected values (computed by the same tiny models on the CPU) make them CPU-vs-CUDA comparisons.
"""

from __future__ import annotations

import gzip
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tpflow import registry
from tpflow.errors import UserError
from tpflow.images import clip_preprocess, to_uint8
from tpflow.weights import download_command

from .test_device_rules import FactoryWatch

PROMPTS = ["a red cube", "two blue spheres on a table", "a cat " * 60, "a green frog"]  # [2] is > 77 tokens


def uint8_images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """[n, 3, h, w] float images exactly on the uint8 grid, so quantisation is lossless."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255


def assert_batch_independent(reward, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Scores of the batch equal the scores of each image alone; returns the batch scores."""
    out = reward(images, prompts, [{}] * len(prompts))
    assert out.scores.shape == (len(prompts),) and out.scores.dtype == torch.float32
    assert out.scores.device.type == "cpu" and all(v.device.type == "cpu" for v in out.details.values())
    assert torch.isfinite(out.scores).all()
    alone = torch.cat([reward(images[i : i + 1], prompts[i : i + 1], [{}]).scores for i in range(len(prompts))])
    torch.testing.assert_close(out.scores, alone, rtol=0, atol=1e-5)
    return out.scores


# Tolerance of a CPU-vs-CUDA comparison of scores: both sides run in float32 (TF32 off, ``no_tf32``) and differ only
# by the order of their sums, about 1e-7 relative per layer for these widths (at most 1024, the aesthetic head); the
# scores are at most a few units, so 1e-5 leaves a margin of ten or more. Same-device comparisons use it too.
ATOL = 1e-5


def model_device(reward) -> str:
    """The device type of the reward's model (loading it)."""
    loaded = reward.load()
    if loaded is None:  # pickscore
        return reward._model.logit_scale.device.type
    clip = loaded[0] if isinstance(loaded, tuple) else loaded  # aesthetic: (clip, head); clipscore: clip
    return next(clip.model.parameters()).device.type


# ------------------------------------------------------------------------------------------------ shared helpers


def test_to_uint8_rounds_and_clips():
    x = torch.tensor([-0.5, 0.0, 0.6 / 255, 0.4 / 255, 254.4 / 255, 1.0, 1.7])
    assert to_uint8(x).tolist() == [0, 0, 1, 0, 254, 255, 255]  # round(x·255) clipped, not truncated
    assert to_uint8(x).dtype == torch.uint8


def test_clip_preprocess_resizes_shortest_side_then_centre_crops():
    images = uint8_images(2, 20, 40)
    out = clip_preprocess(images, resize=10, crop=(10, 10), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    assert out.shape == (2, 3, 10, 10)
    # At the target size already, the preprocessing is a centre crop plus normalisation, exactly.
    images = uint8_images(1, 12, 16)
    out = clip_preprocess(images, resize=12, crop=(12, 12), mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    expected = (images[..., :, 2:14] - torch.tensor([0.5, 0.4, 0.3])[:, None, None]) / torch.tensor([0.2, 0.25, 0.5])[
        :, None, None
    ]
    torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------------------------------------ pickscore


def tiny_clip_tokenizer():
    """A real CLIP BPE with the first 486 merges of CLIP's merges file: 1,000 ids (docs/architecture.md, "Real
    models at test size, offline")."""
    import open_clip
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    merges = [tuple(line.split()) for line in gzip.open(path).read().decode().split("\n")[1:487]]
    byte = list(bytes_to_unicode().values())
    vocab = [*byte, *(b + "</w>" for b in byte), *("".join(m) for m in merges), "<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={v: i for i, v in enumerate(vocab)}, merges=merges)
    assert len(tokenizer) == 1000  # transformers 5 silently ignores vocab_file= / merges_file=
    return tokenizer


@pytest.fixture(scope="module")
def pick_dirs(tmp_path_factory: pytest.TempPathFactory):
    """(model folder, processor folder, the model itself) of a tiny random PickScore-like CLIPModel."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    root = tmp_path_factory.mktemp("pickscore")
    tokenizer = tiny_clip_tokenizer()
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(root / "processor")
    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=1000)
    text.update(max_position_embeddings=77, bos_token_id=998, eos_token_id=999, pad_token_id=999)
    vision = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, image_size=32)
    vision.update(patch_size=8)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(40.0))  # not the init value, so the formula test sees exp(logit_scale)
    model.save_pretrained(root / "model")
    return root / "model", root / "processor", model, processor


def build_pickscore(pick_dirs, device: str = "cpu"):
    model_dir, processor_dir, _, _ = pick_dirs
    return registry.build("reward", "pickscore", model=str(model_dir), processor=str(processor_dir), device=device)


def test_pickscore_shapes_and_batch_independence(pick_dirs, device, no_tf32):
    reward = build_pickscore(pick_dirs, device)
    assert_batch_independent(reward, uint8_images(4, 40, 48).to(device), PROMPTS)
    assert model_device(reward) == torch.device(device).type


def test_pickscore_equals_the_formula_on_the_model_embeddings(pick_dirs, device, no_tf32):
    """exp(logit_scale) · cos / 26, with each prompt tokenised alone and unpadded (so padding changes nothing).

    The expected scores come from the model on the CPU, so on CUDA this compares the two devices."""
    _, _, model, processor = pick_dirs
    reward = build_pickscore(pick_dirs, device)
    images = uint8_images(3, 32, 32, seed=1)  # at the model size: preprocessing is exactly (x - mean) / std
    images[2] = images[0]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0]]
    scores = reward(images.to(device), prompts, [{}] * 3).scores
    assert scores.device.type == "cpu" and scores.dtype == torch.float32

    ip = processor.image_processor
    pixels = (images - torch.tensor(ip.image_mean)[:, None, None]) / torch.tensor(ip.image_std)[:, None, None]
    with torch.no_grad():
        image_emb = model.get_image_features(pixel_values=pixels).pooler_output  # [3, 16]
        text_emb = torch.cat(
            [
                model.get_text_features(
                    **processor.tokenizer([p], truncation=True, max_length=77, return_tensors="pt")
                ).pooler_output
                for p in prompts
            ]
        )  # [3, 16]
    cos = torch.nn.functional.cosine_similarity(image_emb, text_emb, dim=-1)
    torch.testing.assert_close(scores, 40.0 * cos / 26, rtol=0, atol=ATOL)
    torch.testing.assert_close(scores[0], scores[2], rtol=0, atol=1e-6)  # identical image and prompt
    assert not torch.isclose(scores[0], scores[1])


SIZES = [(40, 48), (17, 23), (100, 64), (20, 30), (32, 32)]  # down, up (odd margin), down, up, same


def pil_arrays(images: torch.Tensor) -> list:
    import numpy as np

    return [(x.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for x in images]


@pytest.mark.parametrize(("h", "w"), SIZES)
def test_torch_preprocessing_matches_the_pil_clip_processor(pick_dirs, h: int, w: int):
    """Resize (shortest side, PIL bicubic) + centre crop + normalise, as transformers' PIL CLIP processor does."""
    from transformers.models.clip import image_processing_pil_clip

    ip = pick_dirs[3].image_processor
    pil_processor = image_processing_pil_clip.CLIPImageProcessorPil(**ip.to_dict())
    images = uint8_images(2, h, w, seed=h)  # noise: the worst case for the cubic's overshoot
    expected = pil_processor(images=pil_arrays(images), return_tensors="pt")["pixel_values"]  # [2, 3, 32, 32]
    got = clip_preprocess(images, resize=32, crop=(32, 32), mean=ip.image_mean, std=ip.image_std)
    assert got.shape == expected.shape
    # They differ only by PIL's rounding of each resampling pass to uint8: about one grey level.
    assert (got - expected).abs().max() < 1.5 / 255 / min(ip.image_std)


def test_pickscore_missing_weights_is_a_user_error(pick_dirs, tmp_path: Path):
    missing = tmp_path / "no-such-model"
    reward = registry.build("reward", "pickscore", model=str(missing), processor=str(pick_dirs[1]), device="cpu")
    with pytest.raises(UserError, match="no-such-model"):
        reward(uint8_images(1, 32, 32), ["x"], [{}])
    reward = registry.build("reward", "pickscore", model="tpflow-test/not-cached", processor=str(pick_dirs[1]))
    with pytest.raises(UserError, match=re.escape(download_command("tpflow-test/not-cached"))):
        reward.load()


# ------------------------------------------------------------------------------------------------ open_clip rewards

TINY_ARCH = "tpflow-test-tiny-clip"


@pytest.fixture(scope="module")
def open_clip_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """A tiny open_clip architecture registered for this module, its random model and checkpoint file."""
    import open_clip
    from safetensors.torch import save_file

    open_clip.factory._MODEL_CONFIGS[TINY_ARCH] = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_ARCH).eval()
    path = tmp_path_factory.mktemp("open_clip") / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    yield model, path
    open_clip.factory._MODEL_CONFIGS.pop(TINY_ARCH, None)


def hand_embeddings(model, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised image and text embeddings of 32x32 uint8-grid images, computed without the reward's code."""
    import open_clip

    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN)[:, None, None]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD)[:, None, None]
    with torch.no_grad():
        image = model.encode_image((images - mean) / std)
        text = model.encode_text(open_clip.get_tokenizer(TINY_ARCH)(prompts))
    return image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)


def test_clipscore_batch_independent_and_equals_clipscore_formula(open_clip_ckpt, device, no_tf32):
    """The expected cosines come from the model on the CPU, so on CUDA this compares the two devices."""
    model, path = open_clip_ckpt
    reward = registry.build("reward", "clipscore", model=TINY_ARCH, pretrained=str(path), device=device)
    assert_batch_independent(reward, uint8_images(4, 40, 48).to(device), PROMPTS)
    assert model_device(reward) == torch.device(device).type

    images = uint8_images(4, 32, 32, seed=2)
    images[3] = images[1]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    out = reward(images.to(device), prompts, [{}] * 4)
    image, text = hand_embeddings(model, images, prompts)
    cosine = (image * text).sum(-1)
    torch.testing.assert_close(out.details["cosine"], cosine, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.scores, 2.5 * cosine.clamp(min=0), rtol=0, atol=ATOL)
    assert out.scores[1] == out.scores[3]


@pytest.mark.parametrize(("h", "w"), SIZES)
def test_open_clip_preprocessing_matches_open_clips_transform(open_clip_ckpt, h: int, w: int):
    import open_clip
    from PIL import Image

    from tpflow.rewards.open_clip import load_open_clip

    clip = load_open_clip(TINY_ARCH, str(open_clip_ckpt[1]), torch.device("cpu"), "test")
    transform = open_clip.image_transform(32, is_train=False)  # Resize(bicubic) + CenterCrop + Normalize, on PIL
    images = uint8_images(2, h, w, seed=w)
    expected = torch.stack([transform(Image.fromarray(a)) for a in pil_arrays(images)])
    got = clip.preprocess(images)
    assert got.shape == expected.shape == (2, 3, 32, 32)
    assert (got - expected).abs().max() < 1.5 / 255 / min(open_clip.OPENAI_DATASET_STD)


def test_clipscore_first_calls_from_two_threads_share_one_model(open_clip_ckpt, device):
    """As the scoring worker calls it: the first call, which loads the model, comes from another thread."""
    reward = registry.build("reward", "clipscore", model=TINY_ARCH, pretrained=str(open_clip_ckpt[1]), device=device)
    images = uint8_images(2, 32, 32, seed=3).to(device)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: reward(images, PROMPTS[:2], [{}, {}]).scores, range(2)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert reward.load() is reward.load()
    assert model_device(reward) == torch.device(device).type and outs[0].device.type == "cpu"


def test_clipscore_missing_weights_are_user_errors(open_clip_ckpt, tmp_path: Path, monkeypatch):
    import huggingface_hub.constants

    missing = tmp_path / "weights" / "missing.safetensors"
    reward = registry.build("reward", "clipscore", model=TINY_ARCH, pretrained=str(missing))
    with pytest.raises(UserError, match=str(missing)):
        reward.load()
    with pytest.raises(UserError, match="not a pretrained tag|neither"):
        registry.build("reward", "clipscore", model="ViT-B-32", pretrained="no-such-tag").load()
    with pytest.raises(UserError, match="not an open_clip architecture"):
        registry.build("reward", "clipscore", model="ViT-Q-99", pretrained="openai").load()
    # A real tag whose weights are not cached: an empty cache and home, so nothing is found, nothing downloaded.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(UserError, match=re.escape(download_command("timm/vit_base_patch32_clip_224.openai"))):
        registry.build("reward", "clipscore", model="ViT-B-32", pretrained="openai").load()


def random_head(path: Path, width: int = 16) -> torch.nn.Module:
    """A random aesthetic head with the published layer names, saved at ``path``."""
    from safetensors.torch import save_file

    from tpflow.rewards.aesthetic import AestheticHead

    torch.manual_seed(4)
    head = AestheticHead([width, 1024, 128, 64, 16, 1]).eval()
    state = head.state_dict()
    assert sorted({k.rsplit(".", 1)[0] for k in state}) == [f"layers.{i}" for i in (0, 2, 4, 6, 7)]
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return head


def test_aesthetic_is_the_head_on_normalised_embeddings(open_clip_ckpt, tmp_path: Path, device, no_tf32):
    """The expected scores come from the models on the CPU, so on CUDA this compares the two devices."""
    model, path = open_clip_ckpt
    head = random_head(tmp_path / "head.safetensors")
    random_head(tmp_path / "head.pth")  # same seed: the same head as a torch pickle
    options = dict(clip_model=TINY_ARCH, clip_pretrained=str(path), device=device)
    reward = registry.build("reward", "aesthetic", head=str(tmp_path / "head.safetensors"), **options)
    assert_batch_independent(reward, uint8_images(4, 48, 40).to(device), PROMPTS)
    assert model_device(reward) == torch.device(device).type
    assert reward.load()[1].layers[0].weight.device.type == torch.device(device).type

    images = uint8_images(3, 32, 32, seed=5)
    scores = reward(images.to(device), PROMPTS[:3], [{}] * 3).scores
    image, _ = hand_embeddings(model, images, PROMPTS[:3])
    with torch.no_grad():
        expected = head(image)[:, 0]
    torch.testing.assert_close(scores, expected, rtol=0, atol=ATOL)
    from_pth = registry.build("reward", "aesthetic", head=str(tmp_path / "head.pth"), **options)
    torch.testing.assert_close(from_pth(images.to(device), PROMPTS[:3], [{}] * 3).scores, scores, rtol=0, atol=0)


def test_aesthetic_missing_or_wrong_head_is_a_user_error(open_clip_ckpt, tmp_path: Path):
    options = dict(clip_model=TINY_ARCH, clip_pretrained=str(open_clip_ckpt[1]), device="cpu")
    with pytest.raises(UserError, match="set option head"):
        registry.build("reward", "aesthetic", **options).load()
    missing = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    with pytest.raises(UserError, match="sac\\+logos\\+ava1-l14-linearMSE.pth does not exist"):
        registry.build("reward", "aesthetic", head=str(missing), **options).load()
    random_head(tmp_path / "wide.safetensors", width=768)  # the published ViT-L-14 width on a 16-d tiny CLIP
    with pytest.raises(UserError, match="768-d"):
        registry.build("reward", "aesthetic", head=str(tmp_path / "wide.safetensors"), **options).load()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_clip_rewards_take_half_precision_images(pick_dirs, open_clip_ckpt, tmp_path: Path, device, dtype):
    """Decoded images may come in float16 / bfloat16: each CLIP reward scores them as the float32 images of the same
    values (quantised to the same uint8 pixels, so the model's inputs are identical and so are the scores). PickScore
    with a half-precision model (its ``dtype`` option) takes them too."""
    random_head(tmp_path / "head.safetensors")
    path = str(open_clip_ckpt[1])
    aesthetic = dict(head=str(tmp_path / "head.safetensors"), clip_model=TINY_ARCH, clip_pretrained=path)
    rewards = {
        "pickscore": build_pickscore(pick_dirs, device),
        "clipscore": registry.build("reward", "clipscore", model=TINY_ARCH, pretrained=path, device=device),
        "aesthetic": registry.build("reward", "aesthetic", **aesthetic, device=device),
    }
    half = uint8_images(3, 40, 48, seed=6).to(device=device, dtype=dtype)
    for name, reward in rewards.items():
        out = reward(half, PROMPTS[:3], [{}] * 3)
        assert out.scores.dtype == torch.float32 and out.scores.shape == (3,) and out.scores.device.type == "cpu", name
        assert torch.isfinite(out.scores).all(), name
        expected = reward(half.float(), PROMPTS[:3], [{}] * 3).scores
        torch.testing.assert_close(out.scores, expected, rtol=0, atol=0, msg=name)
    options = dict(model=str(pick_dirs[0]), processor=str(pick_dirs[1]), device=device)
    half_model = registry.build("reward", "pickscore", **options, dtype=str(dtype).removeprefix("torch."))
    out = half_model(half, PROMPTS[:3], [{}] * 3)
    assert out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    # Rounding to 11 (float16) or 8 (bfloat16) significant bits through the tiny model moves scores of magnitude
    # <= 40/26 by 1e-3 (float16) and 6e-3 (bfloat16) on the CPU; 3e-2 leaves a margin of five.
    full = rewards["pickscore"](half, PROMPTS[:3], [{}] * 3).scores
    torch.testing.assert_close(out.scores, full, rtol=0, atol=3e-2)


def test_clip_rewards_state_every_device(pick_dirs, open_clip_ckpt, tmp_path: Path):
    """Loading and scoring make no tensor without a device (tpflow.devices): none falls back to the default one."""
    random_head(tmp_path / "head.safetensors")
    path = str(open_clip_ckpt[1])
    aesthetic = dict(head=str(tmp_path / "head.safetensors"), clip_model=TINY_ARCH, clip_pretrained=path)
    with FactoryWatch() as watch:
        for reward in (
            build_pickscore(pick_dirs),
            registry.build("reward", "clipscore", model=TINY_ARCH, pretrained=path, device="cpu"),
            registry.build("reward", "aesthetic", **aesthetic, device="cpu"),
        ):
            reward(uint8_images(2, 40, 48), PROMPTS[:2], [{}, {}])
    assert not watch.calls, "\n".join(sorted(set(watch.calls)))


def test_temporal_consistency_is_the_mean_cosine_of_consecutive_frames(open_clip_ckpt, no_tf32):
    """Clips of 3 frames: the score is the mean of the two consecutive cosines by hand; a still clip scores 1; an
    image is a clip of one frame (1); a clip reward (accepts_clips)."""
    model, path = open_clip_ckpt
    reward = registry.build("reward", "temporal-consistency", model=TINY_ARCH, pretrained=str(path), device="cpu")
    assert reward.accepts_clips
    frames = uint8_images(6, 32, 32, seed=5).view(2, 3, 3, 32, 32)
    still = frames[:1, :1].expand(1, 3, 3, 32, 32)
    out = reward(torch.cat([frames, still]), PROMPTS[:3], [{}] * 3)
    image, _ = hand_embeddings(model, frames.flatten(0, 1), ["x"] * 6)
    image = image.view(2, 3, -1)
    pairs = (image[:, 1:] * image[:, :-1]).sum(-1)  # [2, 2]
    torch.testing.assert_close(out.scores[:2], pairs.mean(1), rtol=0, atol=ATOL)
    torch.testing.assert_close(out.details["min_cosine"][:2], pairs.min(1).values, rtol=0, atol=ATOL)
    assert abs(float(out.scores[2]) - 1) < 1e-5
    assert reward(frames[:, 0], PROMPTS[:2], [{}] * 2).scores.tolist() == [1.0, 1.0]


def test_hpsv2_is_the_cosine_of_the_checkpoints_embeddings(open_clip_ckpt, no_tf32):
    """HPSv2.1's score: the cosine of the fine-tuned model's image and text embeddings (the hpsv2 package's
    diagonal of image_features @ text_featuresᵀ), on a tiny architecture with its checkpoint file."""
    model, path = open_clip_ckpt
    reward = registry.build("reward", "hpsv2", model=TINY_ARCH, checkpoint=str(path), device="cpu")
    images = uint8_images(3, 32, 32, seed=4)
    out = reward(images, PROMPTS[:3], [{}] * 3)
    image, text = hand_embeddings(model, images, PROMPTS[:3])
    torch.testing.assert_close(out.scores, (image * text).sum(-1), rtol=0, atol=ATOL)


def hpsv2_package_transform(image: torch.Tensor, size: int) -> torch.Tensor:
    """[3, H, W] on the uint8 grid -> [3, size, size] float64: the hpsv2 package's validation transform, rewritten
    here line by line in float64 from its open_clip fork (tgxs002/HPSv2, hpsv2/src/open_clip/transform.py:
    ``image_transform(resize_longest_max=True)``, what ``create_model_and_transforms(light_augmentation=True)`` in
    hpsv2/img_score.py builds): ToTensor, ``ResizeMaxSize(size, fill=0)`` (torchvision's bicubic resize of the
    tensor, unclamped), Normalize with open_clip's OpenAI mean and std."""
    import open_clip
    import torchvision.transforms.functional as F
    from torchvision.transforms import InterpolationMode

    img = image.double()
    height, width = img.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_size = tuple(round(dim * scale) for dim in (height, width))
        img = F.resize(img, new_size, InterpolationMode.BICUBIC)
        pad_h, pad_w = size - new_size[0], size - new_size[1]
        img = F.pad(img, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(open_clip.OPENAI_DATASET_STD, dtype=torch.float64)[:, None, None]
    return (img - mean) / std


@pytest.mark.parametrize(("h", "w"), [(576, 1024), (832, 480), (150, 200), (1024, 1024), (17, 301)])
def test_hpsv2_preprocessing_is_the_packages_resize_longest_and_pad(h: int, w: int):
    """Wan-sized frames both ways, a small image scaled up, a square one and a thin one, at HPS's 224 px: tpflow's
    float32 preprocessing equals the package's transform in float64 to float32 rounding; the non-square ones keep
    their whole content between black bars."""
    import open_clip

    from tpflow.images import pad_preprocess

    images = uint8_images(2, h, w, seed=h + w)
    expected = torch.stack([hpsv2_package_transform(x, 224) for x in images])  # [2, 3, 224, 224]
    got = pad_preprocess(images, 224, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
    assert got.shape == expected.shape == (2, 3, 224, 224) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() < 1e-5
    if h != w:  # the bars are black before normalisation: exactly -mean / std
        black = (0 - torch.tensor(open_clip.OPENAI_DATASET_MEAN)) / torch.tensor(open_clip.OPENAI_DATASET_STD)
        torch.testing.assert_close(got[:, :, 0, 0], black.expand(2, 3), rtol=0, atol=1e-6)


def test_hpsv2_preprocessing_keeps_the_cubics_overshoot():
    """The package resizes a float tensor and never clamps: on a noise image scaled up (150² -> 224², a square,
    so nothing is padded or cropped) the cubic overshoots [0, 1], and tpflow keeps the overshoot; open_clip's
    default preprocessing of the same image (``clip_preprocess``, each pass clamped as PIL does) does not."""
    import open_clip

    from tpflow.images import pad_preprocess

    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    images = uint8_images(1, 150, 150, seed=7)
    expected = hpsv2_package_transform(images[0], 224)[None]  # [1, 3, 224, 224]
    std64, mean64 = (torch.tensor(v, dtype=torch.float64)[:, None, None] for v in (std, mean))
    unnormalised = expected * std64 + mean64
    assert unnormalised.min() < -0.01 and unnormalised.max() > 1.01  # the overshoot this test is about
    got = pad_preprocess(images, 224, mean, std)
    assert (got.double() - expected).abs().max() < 1e-5
    clamped = clip_preprocess(images, 224, (224, 224), mean, std, offset="round")
    assert (clamped.double() - expected).abs().max() > 0.03


@pytest.mark.parametrize(("h", "w"), [(36, 64), (60, 34), (20, 30)])
def test_hpsv2_scores_the_packages_padded_image(open_clip_ckpt, no_tf32, h: int, w: int):
    """Non-square images through the reward (tiny architecture, 32 px): the score is the cosine of the model's
    embeddings of the package's transform of each image (computed in float64 here, fed in float32), and it differs
    from the score of the centre-cropped image, so the test tells padding from cropping."""
    import open_clip

    model, path = open_clip_ckpt
    reward = registry.build("reward", "hpsv2", model=TINY_ARCH, checkpoint=str(path), device="cpu")
    images = uint8_images(3, h, w, seed=h)
    out = reward(images, PROMPTS[:3], [{}] * 3)
    padded = torch.stack([hpsv2_package_transform(x, 32) for x in images]).float()  # [3, 3, 32, 32]
    cropped = clip_preprocess(images, 32, (32, 32), open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
    tokens = open_clip.get_tokenizer(TINY_ARCH)(PROMPTS[:3])
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.encode_text(tokens), dim=-1)
        expected, other = (
            (torch.nn.functional.normalize(model.encode_image(pixels), dim=-1) * text).sum(-1)
            for pixels in (padded, cropped)
        )
    torch.testing.assert_close(out.scores, expected, rtol=0, atol=ATOL)
    assert (other - expected).abs().max() > 100 * ATOL


def test_hpsv2_without_its_checkpoint_is_one_paragraph_before_any_weights_load(tmp_path, monkeypatch):
    from tests.cli_run import tpflow
    from tests.test_train import tiny_recipe
    from tpflow.errors import UserError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    reward = registry.build("reward", "hpsv2")
    with pytest.raises(UserError, match="xswu/HPSv2"):
        reward.load()
    (source,) = registry.get("reward", "hpsv2").factory.weight_sources(reward.options, {})
    assert source.problem and "never downloads" in source.problem
    recipe = tiny_recipe(tmp_path, None, reward="hpsv2", backbone='name = "tiny-sd3"\nseed = 0')
    out = tpflow("validate", str(recipe))
    err = " ".join(out.stderr.split())
    assert out.returncode == 2 and "HPS_v2.1_compressed.pt of xswu/HPSv2 is not in the Hugging Face cache" in err
    assert "Traceback" not in err
    described = tpflow("components", "reward", "hpsv2")
    assert described.returncode == 0 and "checkpoint" in described.stdout and "ViT-H-14" in described.stdout

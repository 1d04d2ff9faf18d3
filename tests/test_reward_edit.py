"""Rewards for edits, offline on tiny models built here: ``edit-consistency`` (pixel, flow_grpo's CLIP image
similarity, DINO CLS cosine) against float64 hand computations of their formulas; ``weighted`` handing the sources to
its parts (flow_grpo's Kontext counting reward: GenEval's count + CLIP similarity, 0.5 each); the VLM judge's
editing question, which shows the source before the edit."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tpflow import registry
from tpflow.errors import RecipeError, UserError
from tpflow.recipe import load_recipe
from tpflow.weights import download_command

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "recipes" / "shapes_flowgrpo.toml"  # dataset "shapes": GenEval metadata, no sources
TINY_ARCH = "tpflow-test-edit-clip"
INSTRUCTIONS = ["add a red circle", "make the square blue", "remove the triangle"]


def write_source(path: Path, h: int, w: int, seed: int) -> str:
    """A random RGB PNG of h × w at ``path``; its reference (the absolute path)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two source files of sizes unlike the edits' (one taller, one wider)."""
    root = tmp_path_factory.mktemp("sources")
    return [write_source(root / "a.png", 30, 20, 0), write_source(root / "b.png", 24, 36, 1)]


def by_hand_source(ref: str, h: int, w: int) -> torch.Tensor:
    """flow_grpo's reference image: PIL's default (bicubic) resize to the edit's size, uint8 / 255; [3, h, w] f64."""
    with Image.open(ref) as image:
        pixels = np.asarray(image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC))
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).double() / 255


# ------------------------------------------------------------------------------------------------------ pixel


def test_pixel_consistency_is_one_minus_the_mean_absolute_difference(sources):
    """1 - mean |edit - source| (both on the uint8 grid) by hand in float64; an edit equal to its source scores 1;
    with two sources, multiple_sources takes the first, the mean or the max."""
    h, w = 16, 12
    g = torch.Generator().manual_seed(2)
    edits = torch.randint(0, 256, (3, 3, h, w), generator=g).float() / 255
    edits[1] = by_hand_source(sources[0], h, w).float()
    metadata = [{"sources": [sources[0], sources[1]]}, {"sources": [sources[0]]}, {"sources": sources[1]}]
    hand = torch.tensor(
        [[1 - (edits[i].double() - by_hand_source(r, h, w)).abs().mean().item() for r in sources] for i in range(3)],
        dtype=torch.float64,
    )  # [3 images, 2 sources]
    first = registry.build("reward", "edit-consistency", features="pixel")(edits, INSTRUCTIONS, metadata).scores
    assert first.dtype == torch.float32 and first.shape == (3,)
    torch.testing.assert_close(first.double(), torch.stack([hand[0, 0], hand[1, 0], hand[2, 1]]), rtol=0, atol=1e-6)
    assert first[1] == 1.0
    mean = registry.build("reward", "edit-consistency", features="pixel", multiple_sources="mean")
    most = registry.build("reward", "edit-consistency", features="pixel", multiple_sources="max")
    assert abs(float(mean(edits, INSTRUCTIONS, metadata).scores[0]) - float(hand[0].mean())) < 1e-6
    assert abs(float(most(edits, INSTRUCTIONS, metadata).scores[0]) - float(hand[0].max())) < 1e-6
    assert hand[0, 0] != hand[0, 1]  # the three rules differ on this image


def test_an_edit_without_a_source_is_refused_in_one_paragraph(sources):
    reward = registry.build("reward", "edit-consistency", features="pixel")
    with pytest.raises(UserError, match="compares each edited image with its source image.*'edit-jsonl'"):
        reward(torch.rand(2, 3, 8, 8), INSTRUCTIONS[:2], [{"sources": [sources[0]]}, {"tag": "counting"}])
    with pytest.raises(RecipeError, match=r"\[reward\] \(edit-consistency\).*\"sources\"") as caught:
        load_recipe(SHAPES, ['reward={name = "edit-consistency", features = "pixel"}'])
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------------------------------- clip


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory):
    """A tiny open_clip architecture registered for this module, its random model and its checkpoint file."""
    import open_clip
    from safetensors.torch import save_file

    open_clip.factory._MODEL_CONFIGS[TINY_ARCH] = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = open_clip.create_model(TINY_ARCH).eval()
    path = tmp_path_factory.mktemp("edit_clip") / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    yield model, path
    open_clip.factory._MODEL_CONFIGS.pop(TINY_ARCH, None)


def test_clip_consistency_is_flow_grpos_image_similarity_in_float64(tiny_clip, sources):
    """flow_grpo's ClipScorer.image_similarity on the same inputs, by hand in float64 with torchvision's v1
    transforms as flow_grpo writes them: T.Resize(224 -> 32, bilinear, antialiased) on the float edit (not
    quantised) and on the PIL-resized source, T.CenterCrop, T.Normalize, get_image_features, L2 norm, the dot."""
    import open_clip
    import torchvision.transforms as T

    model, path = tiny_clip
    reward = registry.build("reward", "edit-consistency", features="clip", model=TINY_ARCH, pretrained=str(path),
                            device="cpu")  # fmt: skip
    h, w = 40, 48
    edits = torch.rand(3, 3, h, w, generator=torch.Generator().manual_seed(3))  # off the uint8 grid
    edits[2] = by_hand_source(sources[1], h, w).float()  # the source itself: similarity 1
    metadata = [{"sources": [sources[0]]}, {"sources": [sources[1], sources[0]]}, {"sources": [sources[1]]}]
    scores = reward(edits, INSTRUCTIONS, metadata).scores
    assert scores.dtype == torch.float32 and scores.shape == (3,) and scores.device.type == "cpu"

    tform = T.Compose([T.Resize(32), T.CenterCrop(32), T.Normalize(open_clip.OPENAI_DATASET_MEAN,
                                                                     open_clip.OPENAI_DATASET_STD)])  # fmt: skip
    double = model.double()
    try:
        with torch.no_grad():
            mine = double.encode_image(tform(edits.double()))
            theirs = double.encode_image(tform(torch.stack([by_hand_source(sources[i], h, w) for i in (0, 1, 1)])))
    finally:
        model.float()
    mine, theirs = mine / mine.norm(dim=-1, keepdim=True), theirs / theirs.norm(dim=-1, keepdim=True)
    expected = (mine * theirs).sum(-1)
    torch.testing.assert_close(scores.double(), expected, rtol=0, atol=2e-6)
    assert abs(float(scores[2]) - 1) < 1e-5 and float(scores[0]) < 0.999


def test_clip_first_calls_from_two_threads_share_one_model(tiny_clip, sources):
    """The scoring worker calls rewards from its own thread: two first calls at once load one model."""
    reward = registry.build("reward", "edit-consistency", features="clip", model=TINY_ARCH,
                            pretrained=str(tiny_clip[1]), device="cpu")  # fmt: skip
    edits = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    metadata = [{"sources": [sources[0]]}, {"sources": [sources[1]]}]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: reward(edits, INSTRUCTIONS[:2], metadata).scores, range(2)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert reward.features.clip.get() is reward.features.clip.get()


# ------------------------------------------------------------------------------------------------------- dino


@pytest.fixture(scope="module")
def tiny_dino(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random DINOv2 (transformers' Dinov2Model) and its image processor, saved to a folder."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    folder = tmp_path_factory.mktemp("tiny-dinov2")
    config = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                          image_size=32, patch_size=8)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Dinov2Model(config).eval()
    model.save_pretrained(folder)
    processor = BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                  image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])  # fmt: skip
    processor.save_pretrained(folder)
    return model, processor, folder


def test_dino_consistency_is_the_cosine_of_the_cls_features_in_float64(tiny_dino, sources):
    """cos(CLS(edit), CLS(source)) by hand in float64 on images at the model's size (preprocessing: (x - mean) /
    std), the source resized to the edit as flow_grpo resizes it; a missing model is one paragraph naming the
    download command."""
    model, processor, folder = tiny_dino
    reward = registry.build("reward", "edit-consistency", features="dino", model=str(folder), device="cpu")
    edits = torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(5)).float() / 255
    metadata = [{"sources": [sources[0]]}, {"sources": [sources[1]]}]
    scores = reward(edits, INSTRUCTIONS[:2], metadata).scores
    mean = torch.tensor(processor.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(processor.image_std, dtype=torch.float64)[:, None, None]
    originals = torch.stack([by_hand_source(r, 32, 32) for r in sources])
    double = model.double()
    try:
        with torch.no_grad():
            a = double(pixel_values=(edits.double() - mean) / std).last_hidden_state[:, 0]  # CLS after layernorm
            b = double(pixel_values=(originals - mean) / std).last_hidden_state[:, 0]
    finally:
        model.float()
    expected = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    torch.testing.assert_close(scores.double(), expected, rtol=0, atol=2e-6)

    missing = registry.build("reward", "edit-consistency", features="dino", model="tpflow-test/no-dino")
    with pytest.raises(UserError, match=re.escape(download_command("tpflow-test/no-dino"))):
        missing(edits, INSTRUCTIONS[:2], metadata)
    (source,) = registry.get("reward", "edit-consistency").factory.weight_sources(missing.options, {})
    assert source.problem and "tpflow-test/no-dino" in source.problem


# ---------------------------------------------------------------------------------------------------- weighted


def test_weighted_gives_each_part_the_sources(sources):
    """flow_grpo's counting_flux_kontext reward as a tpflow recipe writes it: 0.5 GenEval (the edited image's count,
    from the prompt's GenEval metadata) + 0.5 edit consistency (from its sources); the sum equals the parts."""
    counting = {"tag": "counting", "include": [{"class": "circle", "count": 2}]}
    metadata = [{**counting, "sources": [sources[0]]}, {**counting, "sources": [sources[1]]}]
    edits = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    parts = [{"name": "geneval", "weight": 0.5, "options": {"detector": "shapes"}},
             {"name": "edit-consistency", "weight": 0.5, "options": {"features": "pixel"}}]  # fmt: skip
    out = registry.build("reward", "weighted", rewards=parts)(edits, INSTRUCTIONS[:2], metadata)
    geneval = registry.build("reward", "geneval", detector="shapes")(edits, INSTRUCTIONS[:2], metadata).scores
    same = registry.build("reward", "edit-consistency", features="pixel")(edits, INSTRUCTIONS[:2], metadata).scores
    torch.testing.assert_close(out.details["edit-consistency"], same, rtol=0, atol=0)
    torch.testing.assert_close(out.scores, 0.5 * geneval + 0.5 * same, rtol=0, atol=1e-6)
    assert (same > 0).all()


# ------------------------------------------------------------------------------------------------- VLM judge


def test_the_judges_editing_question_shows_the_source_before_the_edit(sources, tmp_path_factory):
    """question = "edit": each row holds two images, the prompt's source (at the edit's size) then the edit, and the
    editing question with the instruction; its score is the judge's on exactly that input, row by row."""
    from tests.test_reward_vlm_judge import tiny_judge
    from tpflow.rewards._vlm import EDIT_TEMPLATE
    from tpflow.rewards.edit_features import source_at
    from tpflow.sources import load

    folder = tmp_path_factory.mktemp("tiny-edit-judge")
    tiny_judge(folder)
    judge = registry.build("reward", "vlm-judge", model=str(folder), device="cpu", dtype="float32", batch_size=2,
                           max_pixels=56 * 56, question="edit")  # fmt: skip
    edits = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(7))
    metadata = [{"sources": [sources[0]]}, {"sources": [sources[1]]}]
    out = judge(edits, INSTRUCTIONS[:2], metadata)
    assert out.scores.shape == (2,) and ((out.scores >= 0) & (out.scores <= 1)).all()
    text = judge.texts(INSTRUCTIONS[:1])[0]
    assert text.count("<|image_pad|>") == 2 and EDIT_TEMPLATE.replace("{prompt}", INSTRUCTIONS[0]) in text
    assert text.endswith("Final Score: ")
    tokenizer = judge._processor.tokenizer
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(1, 6)]
    for i in range(2):
        source = source_at(load(sources[i]), (56, 56))[None]
        shown = [judge._pixels(source)[0], judge._pixels(edits[i : i + 1])[0]]  # the source first
        with torch.no_grad():
            logits = judge._model(**judge._batch(judge.texts(INSTRUCTIONS[i : i + 1]), shown)).logits[0, -1].double()
        expected = float((logits[digits].softmax(-1) * torch.arange(1, 6, dtype=torch.float64)).sum())
        assert abs(float(out.details["vlm_judge_score"][i]) - expected) < 1e-5
    swapped = judge(edits, INSTRUCTIONS[:2], metadata[::-1]).details["vlm_judge_score"]
    assert not torch.allclose(swapped, out.details["vlm_judge_score"], rtol=0, atol=1e-7)  # the source is read
    with pytest.raises(UserError, match="vlm-judge"):
        judge(edits[:1], INSTRUCTIONS[:1], [{}])

"""The ``geneval`` reward: the scorer on every tag, the detector interface, and Mask2Former + CLIP colours end to end
on tiny random models built here (offline; on the CPU and, in the GPU suite, on CUDA)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from PIL import Image

import tpflow
from tpflow.data import geneval as templates
from tpflow.errors import UserError
from tpflow.images import to_uint8
from tpflow.interfaces import RewardModel
from tpflow.rewards.geneval import score
from tpflow.rewards.geneval.colors import COLORS, GREY, grey_crop
from tpflow.rewards.geneval.detectors import COCO_CLASSES, Detector, geneval_class_name
from tpflow.rewards.geneval.mask2former import masks_to_boxes

from .test_device_rules import FactoryWatch

SIZE = (64, 64)  # (H, W) of the hand-built scenes


class Det(NamedTuple):
    cls: str
    color: str | None
    box: tuple[float, float, float, float]
    score: float = 0.95


def _at(cls: str, x: float, y: float, color: str | None = None, size: float = 10, conf: float = 0.95) -> Det:
    return Det(cls, color, (x, y, x + size, y + size), conf)


# --------------------------------------------------------------------------------- the scorer, tag by tag
# (expected correct, strict_correct, partial score); the partial list is written out in each comment.
CASES = {
    "single_object ok": (templates.single_object("apple"), [_at("apple", 5, 5)], (True, True, 1.0)),
    # one apple asked, two found: correct (at least one), not strict; 1 − |1 − 2|/1 = 0.
    "single_object extra": (
        templates.single_object("apple"),
        [_at("apple", 5, 5), _at("apple", 40, 40)],
        (True, False, 0.0),
    ),
    # below GenEval's 0.3 confidence: nothing kept; 1 − 1/1 = 0.
    "single_object unsure": (templates.single_object("apple"), [_at("apple", 5, 5, conf=0.3)], (False, False, 0.0)),
    "two_object ok": (templates.two_object("cat", "dog"), [_at("cat", 5, 5), _at("dog", 40, 5)], (True, True, 1.0)),
    # the dog is missing: [1, 0] -> 0.5.
    "two_object missing": (templates.two_object("cat", "dog"), [_at("cat", 5, 5)], (False, False, 0.5)),
    "counting ok": (
        templates.counting("clock", 3),
        [_at("clock", x, 5) for x in (2, 22, 42)] + [_at("clock", 2, 40, conf=0.85)],  # 0.85 ≤ 0.9: not kept
        (True, True, 1.0),
    ),
    # four clocks for three: the exclude clause {clock, 4} fails correctness; [1 − 1/3] -> 2/3.
    "counting too many": (
        templates.counting("clock", 3),
        [_at("clock", x, y) for x, y in ((2, 5), (22, 5), (42, 5), (2, 40))],
        (False, False, 2 / 3),
    ),
    "colors ok": (templates.colors("car", "orange"), [_at("car", 5, 5, "orange")], (True, True, 1.0)),
    # right count, wrong colour: [1, 0] -> 0.5.
    "colors wrong": (templates.colors("car", "orange"), [_at("car", 5, 5, "red")], (False, False, 0.5)),
    # nothing found: [0, 0] (a 0 for the colour of a wrong count) -> 0.
    "colors absent": (templates.colors("car", "orange"), [], (False, False, 0.0)),
    "position ok": (
        templates.position("cat", "below", "dog"),
        [_at("dog", 25, 2), _at("cat", 25, 45)],
        (True, True, 1.0),
    ),
    # The cat is beside the dog, not below it. Include = [{dog, 1}, {cat, 1, position: [below, 0]}].
    # tpflow: dog [1]; cat [1 (count), 0 (position)] -> (1 + 1 + 0) / 3 = 2/3.
    # Upstream appends 1.0 after the loop even on a mismatch: [1, 1, 0, 1] -> 3/4. tpflow gives the lower 2/3.
    "position wrong": (
        templates.position("cat", "below", "dog"),
        [_at("dog", 5, 25), _at("cat", 45, 25)],
        (False, False, 2 / 3),
    ),
    # The reference dog is missing: dog [0]; cat [1, 0 (no matched target)] -> 1/3.
    "position no target": (templates.position("cat", "below", "dog"), [_at("cat", 25, 45)], (False, False, 1 / 3)),
    "color_attr ok": (
        templates.color_attr("bench", "red", "vase", "blue"),
        [_at("bench", 5, 5, "red"), _at("vase", 40, 5, "blue")],
        (True, True, 1.0),
    ),
    # colours swapped: bench [1, 0], vase [1, 0] -> 0.5.
    "color_attr swapped": (
        templates.color_attr("bench", "red", "vase", "blue"),
        [_at("bench", 5, 5, "blue"), _at("vase", 40, 5, "red")],
        (False, False, 0.5),
    ),
    # two red benches for one: GenEval checks the best one only (correct), strict wants exactly one.
    # bench [1 − 1/1 = 0, 0 (wrong count)], vase [1, 1] -> 0.5.
    "color_attr extra": (
        templates.color_attr("bench", "red", "vase", "blue"),
        [_at("bench", 5, 5, "red"), _at("bench", 5, 40, "red", conf=0.5), _at("vase", 40, 5, "blue")],
        (True, False, 0.5),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scorer_every_tag(case):
    item, detections, (correct, strict, partial) = CASES[case]
    result = score(detections, item.metadata, SIZE)
    assert (result.correct, result.strict_correct) == (correct, strict), result.reason
    assert result.score == pytest.approx(partial)
    assert (result.reason == "") == strict


def test_every_tag_has_cases():
    assert {CASES[c][0].metadata["tag"] for c in CASES} == set(templates.TAGS)


@pytest.mark.parametrize("mode", ["partial", "strict"])
def test_reward_shapes_detector_scores_hand_built_cases(mode, monkeypatch):
    """The reward's scores/details are the scorer's verdicts, whatever the detector returned."""
    reward = tpflow.build("reward", "geneval", detector="shapes", score=mode)
    items = [CASES[c][0] for c in CASES]
    monkeypatch.setattr(reward, "detector", lambda images, metadata: [CASES[c][1] for c in CASES])
    out = reward(torch.zeros(len(items), 3, *SIZE), [it.prompt for it in items], [it.metadata for it in items])
    expected = torch.tensor([CASES[c][2] for c in CASES], dtype=torch.float64)  # [N, (correct, strict, partial)]
    assert out.scores.dtype == torch.float32 and out.scores.shape == (len(items),)
    torch.testing.assert_close(out.details["correct"].double(), expected[:, 0])
    torch.testing.assert_close(out.details["strict"].double(), expected[:, 1])
    torch.testing.assert_close(out.details["partial"].double(), expected[:, 2])
    torch.testing.assert_close(out.scores, out.details[mode])


# ------------------------------------------------------------------------------ detector "shapes" = shapes-geneval


def test_shapes_detector_equals_shapes_geneval():
    from tpflow.shapes import prompts as shape_prompts
    from tpflow.shapes.render import render_batch

    items = shape_prompts.prompts("test", 36, seed=5)
    images = render_batch([it.metadata for it in items], np.random.default_rng(1))
    images[::3] = (images[::3] + 0.08 * torch.randn_like(images[::3])).clamp(0, 1)  # some noisy renderings
    metadata = [it.metadata for it in items[1:]] + [items[0].metadata]  # most images now miss their prompt
    metadata[:12] = [it.metadata for it in items[:12]]
    prompts = [m["prompt"] for m in metadata]
    reward = tpflow.build("reward", "geneval", detector="shapes")
    assert isinstance(reward, RewardModel) and isinstance(reward.detector, Detector)
    ours = reward(images, prompts, metadata)
    theirs = tpflow.build("reward", "shapes-geneval")(images, prompts, metadata)
    assert torch.equal(ours.scores, theirs.scores) and ours.details.keys() == theirs.details.keys()
    assert all(torch.equal(ours.details[k], theirs.details[k]) for k in ours.details)
    assert len(set(ours.scores.tolist())) >= 3  # right and wrong prompts: not a constant


# --------------------------------------------------------------------------------------- mask -> box, crops


def test_masks_to_boxes_matches_pixel_extent():
    rng = np.random.default_rng(0)
    masks = np.zeros((5, 13, 17), dtype=bool)
    masks[0, 2:6, 3:8] = True  # a rectangle
    masks[1, 7, 11] = True  # one pixel
    masks[2, 1:12, 2] = masks[2, 11, 2:16] = True  # an L
    masks[4] = rng.random((13, 17)) < 0.05  # scattered pixels; masks[3] stays empty
    boxes = masks_to_boxes(torch.from_numpy(masks))
    assert boxes.dtype == torch.float32 and boxes.shape == (5, 4)
    for mask, box in zip(masks, boxes.tolist(), strict=True):
        ys, xs = np.nonzero(mask)
        want = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] if len(xs) else [0, 0, 0, 0]  # mmdet's mask2bbox
        assert box == [float(v) for v in want]
    assert boxes[0].tolist() == [3.0, 2.0, 8.0, 6.0]


def test_grey_crop_matches_genevals_pil_composite():
    """GenEval: Image.composite(image, Image.new("RGB", size, "#999"), Image.fromarray(mask)).crop(box)."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (11, 14, 3), dtype=np.uint8)  # [H, W, 3]
    mask = np.zeros((11, 14), dtype=bool)
    mask[3:9, 4:12] = rng.random((6, 8)) < 0.7
    box = (3.6, 2.5, 12.4, 9.5)  # PIL rounds: (4, 2, 12, 10)
    pil = Image.composite(Image.fromarray(image), Image.new("RGB", (14, 11), "#999"), Image.fromarray(mask))
    want = np.asarray(pil.crop(box))  # [h, w, 3]
    got = grey_crop(torch.from_numpy(image).permute(2, 0, 1), torch.from_numpy(mask), box)
    assert got.dtype == torch.uint8 and got.shape == (3, 8, 8)
    assert np.array_equal(got.permute(1, 2, 0).numpy(), want)
    assert (got.permute(1, 2, 0).numpy()[~mask[2:10, 4:12]] == GREY).all()


def test_class_names_follow_geneval():
    assert len(COCO_CLASSES) == len(set(COCO_CLASSES)) == 80
    assert [geneval_class_name(n) for n in ("mouse", "remote", "keyboard", "TV", "hot_dog", "sofa")] == [
        "computer mouse",
        "tv remote",
        "computer keyboard",
        "tv",
        "hot dog",
        "couch",
    ]


# ---------------------------------------------------------------------- mask2former end to end (tiny models)

LABELS = ("person", "cat", "dog", "mouse", "cup")  # a few COCO labels, as the HF config spells them
TINY_CLIP = "tpflow-test-tiny-clip"


def _tiny_mask2former(folder: Path, processor_size: dict) -> Path:
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig
    from transformers.models.mask2former import Mask2FormerImageProcessor

    backbone = SwinConfig(
        image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=2,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = Mask2FormerConfig(
        backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32,
        encoder_layers=1, decoder_layers=2, num_attention_heads=2, dim_feedforward=32, num_queries=8,
        id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)},
    )  # fmt: skip
    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(config).eval()
    with torch.no_grad():
        model.class_predictor.weight.mul_(40.0)  # confident random classes, so that detections pass the thresholds
        projection = model.model.pixel_level_module.decoder.mask_projection  # a shared offset of the pixel
        projection.bias.copy_(-0.15 * torch.randn_like(projection.bias))  # embeddings: masks smaller than the image
    model.save_pretrained(folder)
    Mask2FormerImageProcessor(size=processor_size).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Reward options pointing at a tiny random Mask2Former and a tiny random open_clip checkpoint on disk."""
    import open_clip
    from open_clip import factory
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("tiny-geneval")
    factory._MODEL_CONFIGS[TINY_CLIP] = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    torch.manual_seed(0)
    save_file(open_clip.create_model(TINY_CLIP).state_dict(), root / "clip.safetensors")
    _tiny_mask2former(root / "m2f", {"shortest_edge": 64, "longest_edge": 96})
    yield {
        "detector_model": str(root / "m2f"),
        "clip_model": TINY_CLIP,
        "clip_pretrained": str(root / "clip.safetensors"),
        "device": "cpu",
    }
    factory._MODEL_CONFIGS.pop(TINY_CLIP, None)


def _scenes(n: int, seed: int = 0) -> torch.Tensor:
    """n images [n, 3, 40, 48]: coloured rectangles on grey, regions that random masks can follow."""
    g = torch.Generator().manual_seed(seed)
    images = torch.full((n, 3, 40, 48), 0.5)
    for i in range(n):
        for _ in range(2):
            y, x = torch.randint(0, 28, (2,), generator=g).tolist()
            images[i, :, y : y + 12, x : x + 16] = torch.rand(3, 1, 1, generator=g)
    return images


def _metadata() -> list[dict]:
    return [
        templates.color_attr("cat", "red", "dog", "blue").metadata,
        templates.counting("dog", 2).metadata,
        templates.position("cup", "left of", "cat").metadata,
        templates.colors("cup", "green").metadata,
    ]


@pytest.fixture(scope="module")
def m2f_rewards(tiny):
    """The reward on the tiny models on a given device, built and loaded once per device."""
    built: dict[str, RewardModel] = {}

    def on(device: str):
        if device not in built:
            built[device] = tpflow.build("reward", "geneval", **{**tiny, "device": device})
            built[device].load()
        return built[device]

    return on


@pytest.fixture(scope="module")
def m2f_reward(m2f_rewards):
    return m2f_rewards("cpu")


def test_mask2former_detections_are_well_formed(m2f_reward):
    images, metadata = _scenes(4), _metadata()
    found = m2f_reward.detector(images, metadata)
    assert len(found) == 4 and sum(map(len, found)) > 0
    from tpflow.rewards.geneval import kept_detections

    colored = 0
    for dets, meta in zip(found, metadata, strict=True):
        asked = {c["class"] for c in meta["include"] if c.get("color")}
        kept = {id(d) for ds in kept_detections(dets, meta["tag"]).values() for d in ds}
        for d in dets:
            assert d.cls in {geneval_class_name(n) for n in LABELS} and 0 <= d.score <= 1
            x0, y0, x1, y1 = d.box
            assert 0 <= x0 < x1 <= 48 and 0 <= y0 < y1 <= 40
            if d.cls in asked and id(d) in kept:
                assert d.color in COLORS
                colored += 1
            else:
                assert d.color is None
    assert colored > 0  # the colour path ran
    assert any(d.box != (0.0, 0.0, 48.0, 40.0) for dets in found for d in dets)  # masks are not the whole image


def test_mask2former_reward_batch_independent_and_valid(m2f_rewards, device, no_tf32):
    m2f_reward = m2f_rewards(device)
    images, metadata = _scenes(3, seed=1).to(device), _metadata()[:3]
    prompts = [m["prompt"] for m in metadata]
    out = m2f_reward(images, prompts, metadata)
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32 and torch.isfinite(out.scores).all()
    assert out.scores.device.type == "cpu" and all(v.device.type == "cpu" for v in out.details.values())
    strict, correct, partial = out.details["strict"], out.details["correct"], out.details["partial"]
    assert set(strict.tolist()) <= {0.0, 1.0} and set(correct.tolist()) <= {0.0, 1.0}
    assert (partial <= 1).all() and (strict <= correct).all() and (partial[strict == 1] == 1).all()
    # the least a clause can give is 1 − 16/count (16 kept per class): 1 − 16 = −15 for a single object
    assert (partial >= -15).all()
    torch.testing.assert_close(out.scores, partial)
    singles = [m2f_reward(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1]) for i in range(3)]
    torch.testing.assert_close(out.scores, torch.cat([s.scores for s in singles]))
    for key in out.details:
        torch.testing.assert_close(out.details[key], torch.cat([s.details[key] for s in singles]))
    with ThreadPoolExecutor(2) as pool:  # concurrent calls from worker threads agree with the serial one
        again = list(pool.map(lambda _: m2f_reward(images, prompts, metadata), range(2)))
    assert all(torch.equal(a.scores, out.scores) for a in again)


@pytest.mark.gpu
def test_mask2former_on_the_device_equals_the_cpu(m2f_rewards, cuda, no_tf32):
    """Both models of the detector on CUDA, images given there: the model's outputs equal the CPU's up to float32
    rounding, and the detections and the scores are the CPU's.

    Tolerances: the model is compared with rtol = atol = 1e-4 (float32 on both devices, TF32 off, differing only by
    the order of sums: about 1e-6 relative for these widths). Detections and scores are decisions (thresholds, a mask
    binarised at 0, the argmax of the colours, box relations): on these scenes they were checked not to move when
    every model output is perturbed by 1e-4 relative noise (boxes, colours) or 1e-3 (scores), far more than the
    devices differ; the detection confidences are compared with atol 1e-4."""
    cpu, gpu = m2f_rewards("cpu"), m2f_rewards(cuda)
    assert next(gpu.detector._model.parameters()).device.type == torch.device(cuda).type
    assert next(gpu.detector._colors.clip.model.parameters()).device.type == torch.device(cuda).type
    images, metadata = _scenes(4, seed=1), _metadata()
    prompts = [m["prompt"] for m in metadata]

    inputs = cpu.detector._processor(images=list(to_uint8(images)), return_tensors="pt")
    with torch.no_grad():
        want = cpu.detector._model(pixel_values=inputs["pixel_values"])
        got = gpu.detector._model(pixel_values=inputs["pixel_values"].to(cuda))
    for key in ("class_queries_logits", "masks_queries_logits"):
        torch.testing.assert_close(getattr(got, key).cpu(), getattr(want, key), rtol=1e-4, atol=1e-4, msg=key)

    found, expected = gpu.detector(images.to(cuda), metadata), cpu.detector(images, metadata)
    assert [[(d.cls, d.color, d.box) for d in dets] for dets in found] == [
        [(d.cls, d.color, d.box) for d in dets] for dets in expected
    ]
    scores = [d.score for dets in found for d in dets]
    assert scores == pytest.approx([d.score for dets in expected for d in dets], rel=0, abs=1e-4)

    out, want_out = gpu(images.to(cuda), prompts, metadata), cpu(images, prompts, metadata)
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert len(set(want_out.scores.tolist())) >= 3  # the scenes tell scores apart, or equality would prove little
    assert torch.equal(out.scores, want_out.scores) and out.details.keys() == want_out.details.keys()
    assert all(v.device.type == "cpu" and torch.equal(v, want_out.details[k]) for k, v in out.details.items())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_mask2former_takes_half_precision_images(m2f_rewards, device, dtype):
    """Decoded images may come in float16 / bfloat16: they are scored as the float32 images of the same values
    (quantised to the same uint8 pixels, the detector sees the same input)."""
    reward = m2f_rewards(device)
    images, metadata = _scenes(4, seed=1).to(device=device, dtype=dtype), _metadata()
    prompts = [m["prompt"] for m in metadata]
    out, full = reward(images, prompts, metadata), reward(images.float(), prompts, metadata)
    assert out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert torch.equal(out.scores, full.scores)
    assert all(torch.equal(v, full.details[k]) for k, v in out.details.items())


def test_mask2former_states_every_device(tiny):
    """Loading and scoring make no tensor without a device (tpflow.devices): none falls back to the default one."""
    metadata = _metadata()
    with FactoryWatch() as watch:
        tpflow.build("reward", "geneval", **tiny)(_scenes(4), [m["prompt"] for m in metadata], metadata)
    assert not watch.calls, "\n".join(sorted(set(watch.calls)))


def test_mask2former_matches_transformers_postprocessing(tiny, tmp_path):
    """At a 384×384 input the processor neither resizes nor pads, and transformers' own instance post-processing
    (which works at 384×384) must find exactly our detections: same classes, scores and mask boxes."""
    from transformers.models.mask2former import Mask2FormerImageProcessor

    folder = _tiny_mask2former(tmp_path / "m2f384", {"height": 384, "width": 384})
    detector = tpflow.build("reward", "geneval", **{**tiny, "detector_model": str(folder)}).detector
    images = torch.nn.functional.interpolate(_scenes(2, seed=2), size=(384, 384), mode="nearest")
    meta = [templates.two_object("cat", "dog").metadata] * 2
    ours = detector(images, meta)
    detector.load()
    processor = Mask2FormerImageProcessor.from_pretrained(folder)
    inputs = processor(images=list((images * 255).round().to(torch.uint8)), return_tensors="pt")
    with torch.no_grad():
        outputs = detector._model(**inputs)
    theirs = processor.post_process_instance_segmentation(
        outputs, threshold=0.3, target_sizes=[(384, 384)] * 2, return_binary_maps=True
    )
    total = 0
    for dets, ref in zip(ours, theirs, strict=True):
        kept = sorted((d.cls, round(d.score, 4), d.box) for d in dets if d.score > 0.3)
        if not ref["segments_info"]:
            assert kept == []
            continue
        boxes = masks_to_boxes(ref["segmentation"].bool()).tolist()
        want = sorted(
            (geneval_class_name(LABELS[s["label_id"]]), round(s["score"], 4), tuple(b))
            for s, b in zip(ref["segments_info"], boxes, strict=True)
        )
        assert kept == want
        total += len(kept)
    assert total > 0


def test_missing_weights_raise_user_error_naming_them(tiny, tmp_path):
    missing = tmp_path / "no-such-mask2former"
    reward = tpflow.build("reward", "geneval", **{**tiny, "detector_model": str(missing)})  # lazy: builds fine
    images, metadata = _scenes(1), _metadata()[:1]
    with pytest.raises(UserError, match=str(missing)):
        reward(images, [metadata[0]["prompt"]], metadata)
    no_clip = tmp_path / "no-such-clip.safetensors"
    reward = tpflow.build("reward", "geneval", **{**tiny, "clip_pretrained": str(no_clip)})
    with pytest.raises(UserError, match=str(no_clip)):
        reward(images, [metadata[0]["prompt"]], metadata)
    with pytest.raises(UserError, match="not in the Hugging Face cache.*nobody/no-such-model"):
        tpflow.build("reward", "geneval", **{**tiny, "detector_model": "nobody/no-such-model"}).load()


def test_options_are_validated():
    with pytest.raises(UserError):
        tpflow.build("reward", "geneval", detector="yolo")
    with pytest.raises(UserError):
        tpflow.build("reward", "geneval", scroe="strict")

"""The ``ocr`` reward (Flow-GRPO's edit-distance rule) on text rendered with PIL, read by the rapidocr models that
ship in its wheel (offline, CPU), and the ``ocr`` prompt dataset."""

from __future__ import annotations

import functools
import logging
import random
import re
import sys
import threading
import time
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import tpflow
from tpflow.data.ocr import OcrDataset, OcrDatasetOptions, is_test_text
from tpflow.errors import UserError
from tpflow.rewards.ocr import (
    OcrOptions,
    OcrReward,
    levenshtein,
    normalize,
    ocr_distance,
    ocr_reward,
    paddle_lines,
    target_text,
    to_bgr_uint8,
)

SIZE = 512  # square: rapidocr's detector scales the short side to 736 px, so wide strips are slower to read


@functools.cache
def _font() -> ImageFont.FreeTypeFont:
    """DejaVu Sans at 64 px: the font file matplotlib (a tpflow dependency) ships, so the same glyphs everywhere."""
    return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"), size=64)


def render(text: str) -> torch.Tensor:
    """Large black text centred on a white SIZE×SIZE image, as [3, H, W] in [0, 1]."""
    font = _font()
    image = Image.new("RGB", (SIZE, SIZE), "white")
    if text:
        ImageDraw.Draw(image).text((SIZE // 2, SIZE // 2), text, fill="black", font=font, anchor="mm")
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255  # [3, H, W]


@pytest.fixture(scope="module")
def reward() -> OcrReward:
    return tpflow.build("reward", "ocr", num_threads=1)


# --- the OCR reward end to end (one batch: the models load once and each image takes ~0.3 s) -------------------


def test_rendered_text_scores_follow_the_formula(reward):
    target = "Hello World"  # normalised: "helloworld", 10 characters
    prompt = f'A storefront sign that says "{target}"'
    rendered = ["HELLO WORLD", "", "HELLO WORLB", "HELLO", "", "HELLO"]
    prompts = [prompt] * 4 + ['A sign that says ""', "no quotes here"]
    metadata: list[dict] = [{}] * 5 + [{"target": "Hello"}]
    images = torch.stack([render(text) for text in rendered])  # [6, 3, 512, 512]

    recognized = reward.recognize(images)
    out = reward(images, prompts, metadata)

    # OCR read exactly what was drawn (up to spaces and case, which the reward ignores) and nothing on blanks.
    assert [normalize(r) for r in recognized] == [normalize(t) for t in rendered]
    # exact text: 1; blank: every letter missing, dist = len = 10 -> 0; one substituted letter (D -> B): 1 - 1/10;
    # the prefix "HELLO": five letters missing: 1 - 5/10; empty target: 1; metadata target "Hello" read as such: 1.
    expected = [1.0, 0.0, 1 - 1 / 10, 1 - 5 / 10, 1.0, 1.0]
    assert out.scores.dtype == torch.float32 and out.scores.shape == (6,)
    torch.testing.assert_close(out.scores, torch.tensor(expected))
    torch.testing.assert_close(out.details["ocr_distance"], torch.tensor([0.0, 10, 1, 5, 0, 0]))
    torch.testing.assert_close(out.details["ocr_recognized_len"], torch.tensor([10.0, 0, 10, 5, 0, 5]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_images_on_the_gpu_are_read_as_on_the_cpu(reward, cuda, dtype):
    """The OCR engine runs on the CPU (onnxruntime): images decoded on the GPU, in float32 or bfloat16, are copied
    to it and read exactly as the same values given on the CPU in float32."""
    images = torch.stack([render("HELLO WORLD"), render("")]).to(dtype)  # [2, 3, 512, 512]
    prompts, metadata = ['A storefront sign that says "Hello World"'] * 2, [{}, {}]
    out = reward(images.to(cuda), prompts, metadata)
    want = reward(images.float(), prompts, metadata)
    assert out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert out.scores.tolist() == want.scores.tolist() == [1.0, 0.0]
    assert all(v.device.type == "cpu" and torch.equal(v, want.details[k]) for k, v in out.details.items())


def test_length_mismatch_raises(reward):
    with pytest.raises(ValueError, match="2 images, 1 prompts"):
        reward(torch.zeros(2, 3, 8, 8), ["a"], [{}, {}])


# --- the formula --------------------------------------------------------------------------------------------------


@functools.cache
def _edit_distance_oracle(a: str, b: str) -> int:
    """The textbook recursive definition, independent of the DP under test."""
    if not a or not b:
        return len(a) + len(b)
    return min(
        _edit_distance_oracle(a[1:], b) + 1,
        _edit_distance_oracle(a, b[1:]) + 1,
        _edit_distance_oracle(a[1:], b[1:]) + (a[0] != b[0]),
    )


@pytest.mark.parametrize(
    ("a", "b", "dist"),
    [("", "", 0), ("abc", "", 3), ("", "ab", 2), ("abc", "abc", 0), ("kitten", "sitting", 3), ("flaw", "lawn", 2)],
)
def test_levenshtein_known_cases(a, b, dist):
    assert levenshtein(a, b) == dist
    assert levenshtein(b, a) == dist


def test_levenshtein_matches_the_recursive_definition():
    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choices("abc", k=rng.randint(0, 7)))
        b = "".join(rng.choices("abc", k=rng.randint(0, 7)))
        assert levenshtein(a, b) == _edit_distance_oracle(a, b), (a, b)


@pytest.mark.parametrize(
    ("prompt", "target"),
    [
        ('A storefront sign that says "OPEN LATE" in red', "OPEN LATE"),
        ('two quotes "first" and "second"', "first"),
        ("a prompt without quotes", "a prompt without quotes"),
        ('an empty quote "" here', ""),
        ('a lone quote "rest of it', "rest of it"),  # the reference takes split('"')[1]
    ],
)
def test_target_is_the_first_quoted_text(prompt, target):
    assert target_text(prompt) == target


def test_normalisation_removes_spaces_and_case():
    assert normalize(" Hello  World ") == "helloworld"
    assert normalize("ÉTÉ 2024") == "été2024"


def test_distance_rules():
    assert ocr_distance("Welcome! HELLO world, friends", "Hello World") == 0  # target found inside: distance 0
    assert ocr_distance("anything", "") == 0
    assert ocr_distance("x" * 50, "abc") == 3  # capped at the normalised target length
    assert ocr_distance("helo wrld", "Hello World") == 2


def test_denominators():
    # The docs/algorithm.md §7 example: "Hello World" read as nothing.
    assert ocr_reward("", "Hello World") == 0.0  # Flow-GRPO: 1 - 10/10
    assert ocr_reward("", "Hello World", "raw") == pytest.approx(1 - 10 / 11)  # TP-GRPO reference: raw length
    assert ocr_reward("whatever", "") == 1.0
    assert ocr_reward("helo world", "Hello World") == pytest.approx(1 - 1 / 10)


def test_images_become_bgr_uint8(device):
    images = torch.zeros(2, 3, 4, 5, device=device)
    images[0, 0] = 1.0  # pure red
    images[1, 1] = 0.2  # 51 in green
    images[1, 2] = 1.5  # out of range: clipped to 255 in blue
    images[1, 0] = -0.3  # clipped to 0
    out = to_bgr_uint8(images)
    assert out.shape == (2, 4, 5, 3) and out.dtype == np.uint8 and out.flags["C_CONTIGUOUS"]
    assert out[0, 0, 0].tolist() == [0, 0, 255]
    assert out[1, 0, 0].tolist() == [255, 51, 0]


# --- engine failures, thread safety and backends (fake engines: no model load) -----------------------------------


class _FailingEngine:
    """Fake rapidocr engine that raises on the images whose first pixel is dark, reads "hi" on the others."""

    def __call__(self, image):
        if image[0, 0, 0] < 128:
            raise RuntimeError("corrupt input")
        return [[[[0, 0]] * 4, "hi", 0.9]], [0.0]


def test_an_ocr_exception_scores_zero_is_counted_and_warned_with_the_count(caplog):
    reward = OcrReward()
    reward._engine = _FailingEngine()
    images = torch.ones(3, 3, 8, 8)
    images[:2] = 0  # the first two fail
    with caplog.at_level(logging.WARNING, logger="tpflow.rewards.ocr"):
        out = reward(images, ['say "hi"', 'say ""', 'say "hi"'], [{}] * 3)
        assert out.scores.tolist() == [0.0, 0.0, 1.0]  # even the empty target, as the reference
        assert out.details["ocr_failed"].tolist() == [1.0, 1.0, 0.0]  # reward_ocr_failed in the metrics
        assert [r.getMessage() for r in caplog.records][-1].startswith("OCR failed on 2 of 3 images")
        out = reward(images[:1], ['say "hi"'], [{}])  # every call with failures warns, with the running total
    warnings = [r.getMessage() for r in caplog.records if "OCR failed" in r.getMessage()]
    assert len(warnings) == 2 and "3 images so far" in warnings[1] and "RuntimeError('corrupt input')" in warnings[1]
    assert out.details["ocr_failed"].tolist() == [1.0]
    assert reward(images[2:], ['say "hi"'], [{}]).details["ocr_failed"].tolist() == [0.0]


class _SlowEngine:
    """Fake rapidocr engine that records whether two calls ever overlapped."""

    def __init__(self):
        self.active = 0
        self.overlapped = False

    def __call__(self, image):
        self.active += 1
        self.overlapped |= self.active > 1
        time.sleep(0.01)
        self.active -= 1
        return [[[[0, 0]] * 4, "hi", 0.9]], [0.0]


def test_engine_use_is_serialised_across_threads():
    reward = OcrReward()
    reward._engine = engine = _SlowEngine()
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(reward(torch.ones(3, 3, 8, 8), ['"hi"'] * 3, [{}] * 3)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not engine.overlapped
    assert len(results) == 4 and all(r.scores.tolist() == [1.0] * 3 for r in results)


def test_paddle_results_are_parsed_and_filtered():
    results = [{"rec_texts": ["HELLO", "WORLD", "noise"], "rec_scores": [0.95, 0.8, 0.0]}]
    assert paddle_lines(results) == [("HELLO", 0.95), ("WORLD", 0.8), ("noise", 0.0)]
    assert paddle_lines(None) == []

    class FakePaddle:
        def predict(self, image):
            assert image.shape == (8, 8, 3) and image.dtype == np.uint8
            return results

    for min_confidence, text in [(0.0, "HELLOWORLD"), (0.9, "HELLO")]:
        reward = OcrReward(OcrOptions(backend="paddleocr", min_confidence=min_confidence))
        reward._engine = FakePaddle()
        assert reward.recognize(torch.ones(1, 3, 8, 8)) == [text]


def test_unknown_backend_is_a_user_error():
    with pytest.raises(UserError, match="backend"):
        tpflow.build("reward", "ocr", backend="tesseract")


@pytest.mark.parametrize(
    ("backend", "module", "hint"),
    [("paddleocr", "paddleocr", "tpflow[paddleocr]"), ("rapidocr", "rapidocr_onnxruntime", "pip install")],
)
def test_missing_backend_package_is_a_user_error(monkeypatch, backend, module, hint):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    reward = tpflow.build("reward", "ocr", backend=backend)  # lazy: building never loads the engine
    with pytest.raises(UserError, match=re.escape(hint)):
        reward(torch.ones(1, 3, 8, 8), ['"hi"'], [{}])


# --- the dataset ---------------------------------------------------------------------------------------------------


def test_generated_dataset_is_seeded_with_disjoint_splits():
    data = OcrDataset(OcrDatasetOptions(train_size=500, test_size=200))
    again = tpflow.build("dataset", "ocr", train_size=500, test_size=200)
    other = OcrDataset(OcrDatasetOptions(seed=1, train_size=500, test_size=200))
    train, test = data.split("train"), data.split("test")
    assert (len(train), len(test)) == (500, 200)
    assert train == again.split("train") and test == again.split("test")
    assert train != other.split("train")
    for split in (train, test):
        assert len({item.prompt for item in split}) == len(split)
        for item in split:
            assert item.metadata == {"target": target_text(item.prompt)} and item.metadata["target"]
    train_texts = {normalize(item.metadata["target"]) for item in train}
    test_texts = {normalize(item.metadata["target"]) for item in test}
    assert not train_texts & test_texts
    assert all(is_test_text(t) for t in test_texts) and not any(is_test_text(t) for t in train_texts)
    # The test split does not move when the train size changes.
    assert OcrDataset(OcrDatasetOptions(train_size=50, test_size=200)).split("test") == test
    with pytest.raises(UserError, match="Unknown split"):
        data.split("validation")


def test_dataset_reads_prompt_files(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text('A sign that says "OPEN"\n\nplain prompt\n', encoding="utf-8")
    test = tmp_path / "test.txt"
    test.write_text('A mug with "Good Morning" on it\n', encoding="utf-8")
    data = tpflow.build("dataset", "ocr", path=str(train), test_path=str(test))
    assert [(i.prompt, i.metadata) for i in data.split("train")] == [
        ('A sign that says "OPEN"', {"target": "OPEN"}),
        ("plain prompt", {"target": "plain prompt"}),
    ]
    assert [i.metadata["target"] for i in data.split("test")] == ["Good Morning"]
    with pytest.raises(UserError, match="not found"):
        tpflow.build("dataset", "ocr", path=str(tmp_path / "missing.txt"))
    with pytest.raises(UserError, match="test_path"):
        tpflow.build("dataset", "ocr", test_path=str(test))


def test_loading_rapidocr_leaves_the_library_path_as_it_was():
    """cv2 (imported by rapidocr) prepends its bundled lib64 to LD_LIBRARY_PATH in os.environ; every process tpflow
    starts afterwards (accelerate workers, serve-reward) would inherit it. Checked in a fresh interpreter, where cv2
    is not imported yet, both with the variable unset and set (the two at once: each imports for about 4 s)."""
    import subprocess

    code = (
        "import os; before = os.environ.get('LD_LIBRARY_PATH'); "
        "from tpflow.rewards.ocr import OcrOptions, _load_rapidocr; _load_rapidocr(OcrOptions()); "
        "import cv2; print(repr(before), repr(os.environ.get('LD_LIBRARY_PATH')))"
    )
    import os

    started = {}
    for value in (None, "/opt/some/lib"):
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        if value is not None:
            env["LD_LIBRARY_PATH"] = value
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        started[value] = subprocess.Popen([sys.executable, "-c", code], env=env, text=True, **pipes)
    for value, process in started.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        before, after = stdout.split()
        assert before == after == repr(value)


def test_weight_sources_say_where_each_backends_models_come_from(tmp_path, monkeypatch):
    """The preflight hook, read from the registered class as ``tpflow.preflight`` reads it: rapidocr's models ship
    in its wheel; paddleocr's are the given folders, each checked, else its own cache."""
    import importlib.util
    from types import SimpleNamespace

    from tpflow import registry

    hook = registry.get("reward", "ocr").factory.weight_sources
    [rapid] = hook(OcrOptions(), {})
    assert rapid.problem is None and rapid.where.startswith("shipped in the rapidocr_onnxruntime wheel")
    find_spec = importlib.util.find_spec
    installed = SimpleNamespace(submodule_search_locations=[str(tmp_path / "paddleocr")])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: installed if name == "paddleocr" else find_spec(name)
    )
    options = OcrOptions(backend="paddleocr", det_model_dir=str(tmp_path), rec_model_dir=str(tmp_path / "missing"))
    det, rec = hook(options, {})
    assert det.problem is None and det.where == f"local folder {tmp_path}"
    assert rec.where is None and f"{tmp_path / 'missing'} is not a directory" in rec.problem
    [unset, _] = hook(OcrOptions(backend="paddleocr"), {})
    assert unset.name == "(unset)" and "PaddleOCR's own cache" in unset.where

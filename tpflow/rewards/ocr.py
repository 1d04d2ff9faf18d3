"""Reward ``ocr``: how well an image spells the text quoted in its prompt (Flow-GRPO's OCR reward).

    [reward]
    name = "ocr"
    backend = "rapidocr"      # PP-OCR models shipped in the rapidocr_onnxruntime wheel (offline); or "paddleocr"
    min_confidence = 0.0      # keep recognised lines whose confidence is above this
    denominator = "normalized"  # Flow-GRPO; "raw" reproduces the TP-GRPO reference's published numbers

Target: ``metadata["target"]`` when the dataset provides it (the ``ocr`` dataset does, equal to the quoted text),
otherwise the text between the first pair of double quotes of the prompt, or the whole prompt when it has none.
Recognised text: the concatenation of the recognised lines, top to bottom. Both are normalised by removing spaces
and lower-casing, then

    dist   = 0 if the target is empty or a substring of the recognised text, else min(Levenshtein(rec, tgt), len(tgt))
    reward = 1 - dist / len(tgt)      (1.0 for an empty target)

(docs/algorithm.md §7, §8 D8). An image whose OCR raises scores 0, as in the reference; the detail
``ocr_failed`` marks it (``reward_ocr_failed`` / ``eval_ocr_failed`` in the metrics: the fraction of images) and each
call with such images logs a warning with their count (the first one with the engine's traceback). A backend that
cannot be loaded at all raises UserError.

Backends. ``rapidocr`` runs PP-OCRv4 detection + recognition on onnxruntime, on the CPU, with models that ship
inside its wheel: nothing to download. ``paddleocr`` is what the reference uses (PaddleOCR 3.x, ``lang="en"``,
``use_textline_orientation=False``); install it with ``pip install "tpflow[paddleocr]"``. It downloads its models
on first use unless ``det_model_dir`` / ``rec_model_dir`` point to local copies. Both take BGR uint8 arrays (the
OpenCV convention), so images are converted from RGB; the reference hands PaddleOCR the RGB array unchanged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tpflow.errors import UserError
from tpflow.images import to_uint8_hwc
from tpflow.registry import register
from tpflow.rewards import option_help
from tpflow.types import RewardOutput
from tpflow.weights import WeightSource

logger = logging.getLogger(__name__)
PADDLE_INSTALL = '`pip install "tpflow[paddleocr]"` (plus paddlepaddle or paddlepaddle-gpu for your platform)'


class OcrOptions(BaseModel):
    """Options of the OCR reward."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["rapidocr", "paddleocr"] = Field(
        "rapidocr",
        description="OCR engine: 'rapidocr' (PP-OCRv4 on onnxruntime, models in the wheel, offline) or 'paddleocr' "
        '(PaddleOCR 3.x, the reference\'s engine; `pip install "tpflow[paddleocr]"`).',
    )
    min_confidence: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Recognised lines count only when their confidence is above this (the reference keeps every "
        "line with confidence > 0).",
    )
    denominator: Literal["normalized", "raw"] = Field(
        "normalized",
        description="Length the capped distance is divided by: the normalised target (Flow-GRPO, "
        "docs/algorithm.md §8 D8) or the raw target with spaces (the TP-GRPO reference code, docs/algorithm.md "
        "§7), which is slightly higher for targets with spaces.",
    )
    use_angle_cls: bool = Field(
        False,
        description="Run the text-line orientation classifier (the reference sets use_textline_orientation=False).",
    )
    num_threads: int = Field(
        0, ge=0, description="rapidocr: onnxruntime threads per model (0: onnxruntime's default, all cores)."
    )
    det_model_dir: str | None = Field(
        None, description="paddleocr: local text-detection model directory (default: PaddleOCR downloads it)."
    )
    rec_model_dir: str | None = Field(
        None, description="paddleocr: local text-recognition model directory (default: PaddleOCR downloads it)."
    )
    device: str | None = Field(
        None,
        description=option_help.DEVICE,
        json_schema_extra={"torch_device": False},  # paddle's names: not checked as a torch device
    )


def target_text(prompt: str) -> str:
    """The text between the first pair of double quotes; the whole prompt when it has no double quote.

    As in the reference, a lone double quote yields the rest of the prompt after it.
    """
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 2 else prompt


def _target(prompt: str, metadata: dict[str, Any]) -> str:
    target = metadata.get("target")
    return target if isinstance(target, str) else target_text(prompt)


def normalize(text: str) -> str:
    """What the reward compares: spaces removed (only U+0020, as the reference), lower-cased."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1); O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_distance(recognized: str, target: str) -> int:
    """The capped distance of the reward: 0 when the normalised target is empty or found in the recognised text."""
    rec, tgt = normalize(recognized), normalize(target)
    if not tgt or tgt in rec:
        return 0
    return min(levenshtein(rec, tgt), len(tgt))


def ocr_reward(recognized: str, target: str, denominator: str = "normalized") -> float:
    """1 - capped distance / target length (normalised, or raw with spaces); 1.0 for an empty target."""
    length = len(normalize(target)) if denominator == "normalized" else len(target)
    return 1.0 - ocr_distance(recognized, target) / max(length, 1)


def to_bgr_uint8(images: Tensor) -> np.ndarray:
    """[N, 3, H, W] float RGB in [0, 1] -> [N, H, W, 3] uint8 BGR (what OpenCV-based OCR engines expect)."""
    return np.ascontiguousarray(to_uint8_hwc(images)[..., ::-1])  # [N, H, W, 3], RGB -> BGR


def paddle_lines(results: Any) -> list[tuple[str, float]]:
    """(text, confidence) of every line in PaddleOCR 3.x ``predict`` results (dict-like, rec_texts/rec_scores)."""
    lines: list[tuple[str, float]] = []
    for page in results or []:
        texts, scores = page["rec_texts"], page["rec_scores"]
        lines += [(str(text), float(score)) for text, score in zip(texts, scores, strict=True)]
    return lines


@register("reward", "ocr", options=OcrOptions)
class OcrReward:
    """RewardModel: OCR edit-distance reward (module docstring).

    Options: ``backend``, ``min_confidence``, ``denominator``, ``use_angle_cls``, ``num_threads`` (rapidocr),
    ``det_model_dir`` / ``rec_model_dir`` / ``device`` (paddleocr). ``details``: ``ocr_distance`` (the capped
    distance), ``ocr_recognized_len`` (normalised length of the recognised text) and ``ocr_failed`` (1 where the
    engine raised and the image scored 0, else 0). One engine per instance, built
    on the first call; a lock serialises its use, so the reward is safe to call from several threads.
    """

    @staticmethod
    def weight_sources(options: OcrOptions, settings: dict) -> list[WeightSource]:
        """Where the OCR models come from (``tpflow.weights``): rapidocr's ship in its wheel; paddleocr's are the model
        directories when given, else PaddleOCR's own cache (which it fills from the network on first use)."""
        import importlib.util

        package = "rapidocr_onnxruntime" if options.backend == "rapidocr" else "paddleocr"
        what = f"reward 'ocr' {options.backend} models (option backend)"
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            install = '`pip install "rapidocr_onnxruntime>=1.3"`' if package != "paddleocr" else PADDLE_INSTALL
            return [
                WeightSource(what, package, None, f"{what}: {package} is not installed; install it with {install}.")
            ]
        folder = Path(spec.submodule_search_locations[0])
        if options.backend == "rapidocr":
            return [WeightSource(what, package, f"shipped in the {package} wheel {folder / 'models'}")]
        sources = []
        for option in ("det_model_dir", "rec_model_dir"):
            value = getattr(options, option)
            label = f"reward 'ocr' paddleocr {option[:3]} model (option {option})"
            if value is None:
                where = "PaddleOCR's own cache ~/.paddlex/official_models (it downloads a missing model on first use)"
                sources.append(WeightSource(label, "(unset)", where))
            elif not Path(value).expanduser().is_dir():
                problem = f"{label}: {Path(value).expanduser()} is not a directory; give a PP-OCR model directory."
                sources.append(WeightSource(label, value, None, problem))
            else:
                sources.append(WeightSource(label, value, f"local folder {Path(value).expanduser()}"))
        return sources

    def __init__(self, options: OcrOptions | None = None):
        self.options = options or OcrOptions()
        self._engine: Any = None
        self._lock = threading.Lock()
        self.failures = 0  # images whose OCR raised, over this instance's life

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> RewardOutput:
        """Score images [N, 3, H, W] in [0, 1] against their target texts; ``scores`` [N] float32."""
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(f"Got {len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata entries.")
        targets = [_target(p, m) for p, m in zip(prompts, metadata, strict=True)]
        recognized = self.recognize(images)
        scores, distances, lengths = [], [], []
        for rec, target in zip(recognized, targets, strict=True):
            if rec is None:  # the OCR raised on this image: score 0, as the reference
                scores.append(0.0)
                distances.append(len(normalize(target)))
                lengths.append(0)
                continue
            scores.append(ocr_reward(rec, target, self.options.denominator))
            distances.append(ocr_distance(rec, target))
            lengths.append(len(normalize(rec)))
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32, device="cpu"),  # [N]
            details={
                "ocr_distance": torch.tensor(distances, dtype=torch.float32, device="cpu"),  # [N]
                "ocr_recognized_len": torch.tensor(lengths, dtype=torch.float32, device="cpu"),  # [N]
                "ocr_failed": torch.tensor(
                    [rec is None for rec in recognized], dtype=torch.float32, device="cpu"
                ),  # [N]
            },
        )

    def recognize(self, images: Tensor) -> list[str | None]:
        """The recognised text of each image [N, 3, H, W] in [0, 1]; None where the OCR engine raised."""
        arrays = to_bgr_uint8(images)  # [N, H, W, 3]
        with self._lock:
            if self._engine is None:
                self._engine = self._load()
            out: list[str | None] = []
            errors: list[Exception] = []
            for array in arrays:
                try:
                    lines = self._read(array)
                except Exception as exc:  # one bad image must not stop training (reference behaviour)
                    errors.append(exc)
                    out.append(None)
                    continue
                out.append("".join(text for text, conf in lines if conf > self.options.min_confidence))
            if errors:
                first = not self.failures
                self.failures += len(errors)
                logger.warning(
                    "OCR failed on %d of %d images (scored 0, marked in the reward detail ocr_failed; %d images so "
                    "far): %r",
                    len(errors), len(arrays), self.failures, errors[0],
                    exc_info=errors[0] if first else None,
                )  # fmt: skip
        return out

    def _read(self, image: np.ndarray) -> list[tuple[str, float]]:
        """(text, confidence) lines of one [H, W, 3] uint8 BGR image, top to bottom."""
        if self.options.backend == "rapidocr":
            result, _ = self._engine(image)  # result: [[box, text, score], ...] or None when nothing is found
            return [(str(text), float(score)) for _, text, score in result or []]
        return paddle_lines(self._engine.predict(image))

    def _load(self) -> Any:
        return _load_rapidocr(self.options) if self.options.backend == "rapidocr" else _load_paddleocr(self.options)


def _restore(name: str, value: str | None) -> None:
    """Put an environment variable back as it was (unset if it was)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _load_rapidocr(options: OcrOptions) -> Any:
    library_path = os.environ.get("LD_LIBRARY_PATH")
    try:
        from rapidocr_onnxruntime import RapidOCR  # imports cv2, which prepends its lib64 to LD_LIBRARY_PATH
    except ImportError as exc:
        raise UserError(
            f"The ocr reward's rapidocr backend needs rapidocr_onnxruntime ({exc}). Install it with "
            '`pip install "rapidocr_onnxruntime>=1.3"` (a tpflow dependency), or set [reward] backend = "paddleocr".'
        ) from None
    finally:  # cv2 has loaded its libraries; processes tpflow starts later must not inherit its path
        _restore("LD_LIBRARY_PATH", library_path)
    kwargs: dict[str, Any] = {"text_score": 0.0, "use_cls": options.use_angle_cls}  # filter lines here, not there
    if options.num_threads:
        kwargs["intra_op_num_threads"] = options.num_threads
    try:
        return RapidOCR(**kwargs)
    except (OSError, ValueError) as exc:  # a model file missing from a broken install
        raise UserError(
            f"Could not load the rapidocr models ({exc}). Reinstall the package: "
            '`pip install --force-reinstall "rapidocr_onnxruntime>=1.3"`.'
        ) from None


def _load_paddleocr(options: OcrOptions) -> Any:
    try:
        from paddleocr import PaddleOCR
    except ImportError as exc:
        raise UserError(
            f"The ocr reward's paddleocr backend needs PaddleOCR 3.x ({exc}). Install it with {PADDLE_INSTALL}, or "
            'use backend = "rapidocr", which needs nothing else.'
        ) from None
    kwargs: dict[str, Any] = {"use_textline_orientation": options.use_angle_cls}
    if options.det_model_dir:
        kwargs["text_detection_model_dir"] = options.det_model_dir
    if options.rec_model_dir:
        kwargs["text_recognition_model_dir"] = options.rec_model_dir
    if not (options.det_model_dir or options.rec_model_dir):
        kwargs["lang"] = "en"  # PaddleOCR ignores lang when model directories are given
    if options.device:
        kwargs["device"] = options.device
    try:
        return PaddleOCR(**kwargs)
    except Exception as exc:  # PaddleOCR fetches its models on first use; offline this is where it fails
        raise UserError(
            f"Could not load PaddleOCR ({type(exc).__name__}: {exc}). Without network access, download the PP-OCR "
            "detection and recognition models elsewhere and set [reward] det_model_dir and rec_model_dir."
        ) from None

"""Detector ``mask2former``: GenEval's object detector, with transformers instead of mmdet.

GenEval (Ghosh et al., 2023) detects objects with mmdet's Mask2Former Swin-S COCO instance model
(``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``) and classifies colours with CLIP. tpflow runs the same
architecture from transformers (default ``facebook/mask2former-swin-small-coco-instance``), no mmdet, no mmcv:

1. Images are quantised (round(x·255)) and go through the checkpoint's image processor (resize, normalise, pad)
   on the CPU, so that the model's input does not depend on its device.
2. Instances are read as mmdet's Mask2Former head reads them: class probabilities (softmax, no-object column
   dropped) of every (query, class) pair, the top Q pairs (Q = number of queries, mmdet's ``max_per_image`` = 100);
   each pair's mask logits are upsampled (bilinear) to the padded input, cut to the image's region, resized to the
   original image and binarised at 0; its score is the class probability times the mean mask probability inside
   the binary mask (an empty mask, of score 0, is dropped). A pair whose class probability is not above the tag's
   threshold (0.3, 0.9 for counting) is dropped before its mask is upsampled: its score could only be lower, so the
   scorer would drop it anyway.
3. The box of a detection is its mask's extent, (x_min, y_min, x_max + 1, y_max + 1), mmdet's ``mask2bbox``.
4. Labels come from the model config's id2label, mapped to GenEval's class names (``detection.COCO_CLASSES``).
5. Detections that the scorer keeps (``scoring.kept_detections``) and whose class some include clause asks a colour
   for get one from ``colors.ColorClassifier`` (object on grey, cropped to its box); the others get None.

Weights are never downloaded: ``model`` is a local folder written by ``save_pretrained`` or a Hugging Face id
already in the local cache (``hf download facebook/mask2former-swin-small-coco-instance``).
transformers' Mask2Former needs scipy (its training loss is built with the model).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tpflow.devices import resolve_device
from tpflow.errors import UserError
from tpflow.images import to_uint8
from tpflow.rewards.geneval.colors import ColorClassifier, grey_crop
from tpflow.rewards.geneval.detection import Detection, geneval_class_name
from tpflow.rewards.geneval.scoring import COUNTING_THRESHOLD, THRESHOLD, kept_detections
from tpflow.weights import MODEL_FILES, WeightSource, download_command, model_folder

DEFAULT_MODEL = "facebook/mask2former-swin-small-coco-instance"
_MICRO_BATCH = 8  # images per Mask2Former forward


def masks_to_boxes(masks: Tensor) -> Tensor:
    """Boxes [K, 4] float32 (x0, y0, x1, y1) of binary masks [K, H, W]: x1, y1 one past the last pixel, as mmdet.

    An empty mask gets (0, 0, 0, 0).
    """
    k, h, w = masks.shape
    cols, rows = masks.any(1), masks.any(2)  # [K, W], [K, H]
    xs = torch.arange(w, device=masks.device)
    ys = torch.arange(h, device=masks.device)
    x0 = torch.where(cols, xs, w).amin(1)
    x1 = torch.where(cols, xs, -1).amax(1) + 1
    y0 = torch.where(rows, ys, h).amin(1)
    y1 = torch.where(rows, ys, -1).amax(1) + 1
    boxes = torch.stack([x0, y0, x1, y1], 1).float()  # [K, 4]
    return torch.where(cols.any(1, keepdim=True), boxes, torch.zeros_like(boxes))


class Mask2FormerDetector:
    """Detector: Mask2Former COCO instances plus CLIP colours, as GenEval (module docstring).

    Options: ``detector_model`` (folder or cached hub id), ``clip_model`` and ``clip_pretrained`` (open_clip
    architecture, and a checkpoint file or cached tag), ``device`` ("auto" = CUDA when available). Both models load
    on the first call (or ``load()``), under a lock; calls may come from any thread.
    """

    def __init__(
        self,
        detector_model: str = DEFAULT_MODEL,
        clip_model: str = "ViT-L-14",
        clip_pretrained: str = "openai",
        device: str = "auto",
    ):
        self.detector_model, self.clip_model, self.clip_pretrained = detector_model, clip_model, clip_pretrained
        self.device = resolve_device(device)  # in the building thread, on its current GPU
        self._lock = threading.Lock()
        self._model: Any = None
        self._processor: Any = None
        self._names: list[str] = []
        self._colors: ColorClassifier | None = None

    def load(self) -> None:
        """Load the detector and the colour classifier now (the first call does it otherwise)."""
        with self._lock:
            if self._model is not None:
                return
            device = self.device
            processor, model = _load_mask2former(self.detector_model)
            where = "reward 'geneval' (options clip_model, clip_pretrained)"
            self._colors = ColorClassifier.load(self.clip_model, self.clip_pretrained, device, where)
            self._names = [geneval_class_name(model.config.id2label[i]) for i in range(model.config.num_labels)]
            self._processor = processor
            self._model = model.eval().requires_grad_(False).to(device)

    @torch.no_grad()
    def __call__(self, images: Tensor, metadata: Sequence[dict[str, Any]]) -> list[list[Detection]]:
        """images [N, 3, H, W] in [0, 1] and their GenEval metadata -> the detections of each image."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"Expected images [N, 3, H, W], got shape {tuple(images.shape)}.")
        if len(images) != len(metadata):
            raise ValueError(f"Got {len(images)} images for {len(metadata)} metadata entries.")
        self.load()
        device = next(self._model.parameters()).device
        pixels = to_uint8(images.detach()).to(device)  # [N, 3, H, W]
        out: list[list[Detection]] = []
        for start in range(0, len(pixels), _MICRO_BATCH):
            chunk, meta = pixels[start : start + _MICRO_BATCH], metadata[start : start + _MICRO_BATCH]
            thresholds = [COUNTING_THRESHOLD if m.get("tag") == "counting" else THRESHOLD for m in meta]
            instances = self._instances(chunk, thresholds)
            out += [self._with_colors(img, inst, m) for img, inst, m in zip(chunk, instances, meta, strict=True)]
        return out

    def _instances(self, pixels: Tensor, thresholds: list[float]) -> list[list[tuple[Detection, Tensor]]]:
        """(detection without colour, its mask [H, W] bool) of each image [3, H, W] uint8, class prob > threshold."""
        h, w = pixels.shape[-2:]
        # The processor runs on the CPU, whatever the model's device: torchvision resizes uint8 images with a native
        # uint8 kernel on the CPU but through float32 and rounding on CUDA, which moves a fifth of the pixels by one
        # grey level, and the detections (hence the scores) would depend on the device.
        inputs = self._processor(images=list(pixels.cpu()), return_tensors="pt")
        outputs = self._model(pixel_values=inputs["pixel_values"].to(pixels.device))
        probs = outputs.class_queries_logits.float().softmax(-1)[..., :-1]  # [n, Q, C] without "no object"
        mask_logits = outputs.masks_queries_logits.float()  # [n, Q, h/4, w/4] of the padded input
        padded = inputs["pixel_values"].shape[-2:]
        pixel_mask = inputs["pixel_mask"].bool()  # [n, Hp, Wp]: the image region of the padded input
        result = []
        for i, threshold in enumerate(thresholds):
            q, c = probs[i].shape
            top, index = probs[i].flatten().topk(q)  # [Q] the best (query, class) pairs, mmdet's max_per_image
            keep = top > threshold
            if not keep.any():
                result.append([])
                continue
            top, query, label = top[keep], index[keep] // c, index[keep] % c
            logits = F.interpolate(mask_logits[i, query][None], size=padded, mode="bilinear", align_corners=False)
            vh, vw = int(pixel_mask[i].any(1).sum()), int(pixel_mask[i].any(0).sum())
            logits = F.interpolate(logits[:, :, :vh, :vw], size=(h, w), mode="bilinear", align_corners=False)[0]
            masks = logits > 0  # [K, H, W]
            mask_score = (logits.sigmoid() * masks).flatten(1).sum(1) / (masks.flatten(1).sum(1) + 1e-6)  # [K]
            some = masks.flatten(1).any(1)  # an empty mask scores 0: never kept, and it has no box
            top, label, masks, mask_score = top[some], label[some], masks[some], mask_score[some]
            scores, boxes = (top * mask_score).tolist(), masks_to_boxes(masks).tolist()
            result.append(
                [
                    (Detection(self._names[int(lab)], None, tuple(box), score), mask)
                    for lab, box, score, mask in zip(label.tolist(), boxes, scores, masks, strict=True)
                ]
            )
        return result

    def _with_colors(
        self, image: Tensor, found: list[tuple[Detection, Tensor]], meta: dict[str, Any]
    ) -> list[Detection]:
        """The detections, those the scorer keeps of a class asked a colour classified on their grey crop."""
        asked = {clause["class"] for clause in meta.get("include", []) if clause.get("color")}
        kept = {id(d) for dets in kept_detections([d for d, _ in found], meta.get("tag")).values() for d in dets}
        todo = [k for k, (d, _) in enumerate(found) if d.cls in asked and id(d) in kept]
        crops = [grey_crop(image, found[k][1], found[k][0].box) for k in todo]
        assert self._colors is not None
        colors = dict(zip(todo, self._colors.classify(crops, [found[k][0].cls for k in todo]), strict=True))
        return [d._replace(color=colors.get(k)) for k, (d, _) in enumerate(found)]


def _load_mask2former(name: str) -> tuple[Any, Any]:
    """(image processor, model) from a local folder or its snapshot in the Hugging Face cache, found first without
    the network (``tpflow.weights``); UserError when absent."""
    try:
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise UserError(f"reward 'geneval' with detector 'mask2former' needs transformers: {exc}") from None
    source = detector_source(name)
    if source.problem or source.path is None:
        raise UserError(source.problem or f"reward 'geneval': the Mask2Former weights {name} were not found.")
    try:
        processor = AutoImageProcessor.from_pretrained(source.path, local_files_only=True)
        model = Mask2FormerForUniversalSegmentation.from_pretrained(source.path, local_files_only=True)
    except ImportError as exc:
        raise UserError(
            f"reward 'geneval': transformers' Mask2Former could not be built ({exc}); install scipy "
            f"(`pip install scipy`), which it needs."
        ) from None
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"reward 'geneval': the Mask2Former weights {name} could not be loaded from {source.path} ({first}). "
            f"Fetch them again with {download_command(name)}, or set the reward option detector_model to a local "
            "folder written by save_pretrained."
        ) from None
    return processor, model


def detector_source(name: str) -> WeightSource:
    """Where the Mask2Former weights ``name`` (option detector_model) will be read from, or why they cannot be."""
    return model_folder(
        "reward 'geneval' Mask2Former (option detector_model)",
        name,
        [("config.json",), ("preprocessor_config.json",), MODEL_FILES],
        f"set detector_model to a local folder written by save_pretrained (default {DEFAULT_MODEL!r})",
    )

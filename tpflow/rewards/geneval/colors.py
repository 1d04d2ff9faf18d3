"""GenEval's colour classifier: CLIP zero-shot over ten colours, on the object cut out onto a grey background.

For each detection whose clause asks a colour, GenEval (``evaluation/evaluate_images.py``) pastes the object's mask
onto a #999999 grey image of the same size, crops the detection box and classifies the crop with CLIP ViT-L-14
(OpenAI weights) over ``COLORS``. The zero-shot classifier of an object name is clip_benchmark's: for each colour,
the three ``TEMPLATES`` are embedded, each embedding L2-normalised, averaged and normalised again; the predicted
colour is the argmax of the cosine similarity to the crop's normalised image embedding.

tpflow does the same, except that the CLIP preprocessing (resize the shortest side, bicubic, centre crop, normalise)
runs in torch (``tpflow.images.clip_preprocess``) instead of PIL, which differs only by PIL's rounding of the
resized crop to uint8.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from tpflow.images import l2_normalize
from tpflow.rewards.open_clip import OpenClip, load_open_clip

COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TEMPLATES: tuple[str, ...] = (  # GenEval's (note "a" even before a vowel)
    "a photo of a {color} {object}",
    "a photo of a {color}-colored {object}",
    "a photo of a {color} object",
)
GREY = 153  # GenEval's background "#999"
_CHUNK = 64  # crops per image-encoder call


def grey_crop(image: Tensor, mask: Tensor, box: Sequence[float]) -> Tensor:
    """The object of ``mask`` on a grey background, cropped to ``box``, as GenEval feeds CLIP.

    Args:
        image: [3, H, W] uint8.
        mask: [H, W] bool, the object's pixels.
        box: (x0, y0, x1, y1) in pixels; rounded to integers as PIL's ``Image.crop`` rounds them.
    Returns:
        [3, y1 - y0, x1 - x0] uint8.
    """
    composite = torch.where(mask.to(image.device)[None], image, torch.full_like(image, GREY))  # [3, H, W]
    x0, y0, x1, y1 = (int(round(float(v))) for v in box[:4])
    return composite[:, y0:y1, x0:x1]


class ColorClassifier:
    """CLIP zero-shot colour of object crops; one text classifier per object name, computed once and cached.

    Safe to call from several threads: the cache is filled under a lock.
    """

    def __init__(self, clip: OpenClip):
        self.clip = clip
        self._classifiers: dict[str, Tensor] = {}  # object name -> [len(COLORS), D] unit rows
        self._lock = threading.Lock()

    @classmethod
    def load(cls, arch: str, pretrained: str, device: torch.device, where: str) -> ColorClassifier:
        """Load open_clip ``arch`` with ``pretrained`` (a checkpoint file or a cached tag); UserError when absent."""
        return cls(load_open_clip(arch, pretrained, device, where))

    @torch.no_grad()
    def classify(self, crops: Sequence[Tensor], names: Sequence[str]) -> list[str]:
        """The colour of each crop ([3, h, w] uint8, h and w ≥ 1) of an object named ``names[k]``."""
        if len(crops) != len(names):
            raise ValueError(f"Got {len(crops)} crops for {len(names)} object names.")
        if not crops:
            return []
        pixels = torch.cat([self.clip.preprocess(crop[None].float() / 255) for crop in crops])  # [K, 3, s, s]
        model = self.clip.model
        image = torch.cat([l2_normalize(model.encode_image(c)) for c in pixels.split(_CHUNK)])  # [K, D]
        weights = torch.stack([self._classifier(name) for name in names])  # [K, C, D]
        logits = torch.einsum("kd,kcd->kc", image, weights.to(image.device))  # [K, C]
        return [COLORS[i] for i in logits.argmax(-1).tolist()]

    def _classifier(self, name: str) -> Tensor:
        """[len(COLORS), D] float32: the mean normalised text embedding of the templates for each colour."""
        with self._lock:
            if name not in self._classifiers:
                texts = [t.format(color=c, object=name) for c in COLORS for t in TEMPLATES]
                device = next(self.clip.model.parameters()).device
                emb = l2_normalize(self.clip.model.encode_text(self.clip.tokenizer(texts).to(device)))  # [C·T, D]
                self._classifiers[name] = l2_normalize(emb.view(len(COLORS), len(TEMPLATES), -1).mean(1))
            return self._classifiers[name]

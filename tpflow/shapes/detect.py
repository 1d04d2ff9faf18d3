"""The rule-based object detector of the shapes world: the ``shapes`` detector of the GenEval scorer.

Three stages, the first two batched over images:

1. **Colour.** Every pixel ``p`` is read as a blend ``white + α·(c − white)`` of the white background and a palette
   colour ``c`` (``vocab.COLORS``): its colour is the palette colour whose direction from white is closest in angle
   to ``p − white``, and ``α`` (the coverage) its projection on that direction. Anti-aliased edges and blurred
   pixels are exactly such blends, and colours a generative model gets slightly wrong still land on the nearest
   direction. Pixels too far from every white-to-colour line (greys, black) count as background.
2. **Blobs.** Pixels with coverage ≥ ``CORE`` are connected (4-neighbourhood, same colour) by label propagation;
   blobs with fewer than ``MIN_PIXELS`` core pixels (scaled with the image area) are noise and dropped. The high
   core threshold keeps two objects apart across a one-pixel gap even after a 3×3 blur.
3. **Shape.** For each blob and each shape, the box the shape would need is fitted from the coverage moments in a
   window around the blob (area, centroid and second moments of a uniform square, disc or upright triangle), the
   shape is re-drawn at that box with the renderer's own code (``render.shape_mask``, cached per quarter-pixel box),
   and compared to the coverage by soft IoU. The best shape wins; its box is the detection box and its IoU, mapped
   to [0, 1] by ``_confidence``, the detection score.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from torch import Tensor

from tpflow.shapes.render import SCALE, shape_mask
from tpflow.shapes.vocab import BACKGROUND, COLORS, SHAPES

CORE = 0.75  # coverage of a blob's core pixels
FLOOR = 0.1  # coverage below this is treated as background noise
MIN_PIXELS = 6  # core pixels of the smallest kept blob at 32×32 (an 8 px triangle has ~25)
MIN_CHROMA = 0.15  # |p − white| below which a pixel is background whatever its direction
MAX_OFF_LINE = 0.3  # distance from the white-to-colour line beyond which a pixel is no palette colour (grey, black)
_PAD = 3  # window margin around a blob, in pixels
_GROW = 2  # rounds of growing blobs into their partly covered surroundings
# Templates are compared sharp and after a 3×3 blur (binomial, box): (1-D kernel, variance it adds per axis).
_BLURS = (((0, 1, 0), 0.0), ((0.25, 0.5, 0.25), 0.5), ((1 / 3, 1 / 3, 1 / 3), 2 / 3))
_COLOR_NAMES = tuple(COLORS)
_DIRS = (np.array(list(COLORS.values()), dtype=np.float32) - np.array(BACKGROUND, dtype=np.float32)) / 255.0  # [C, 3]


class Detection(NamedTuple):
    """One detected object: ``box`` = (x0, y0, x1, y1) in pixels, ``score`` in [0, 1]."""

    cls: str
    color: str
    box: tuple[float, float, float, float]
    score: float


def detect(image: Tensor) -> list[Detection]:
    """Detect the objects of one image [3, H, W] in [0, 1], highest score first."""
    return detect_batch(image[None])[0]


def detect_batch(images: Tensor) -> list[list[Detection]]:
    """Detect the objects of images [N, 3, H, W] in [0, 1]; one list per image, highest score first."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"Expected images [N, 3, H, W], got shape {tuple(images.shape)}.")
    n, _, h, w = images.shape
    color, alpha = _classify(images.detach().float().cpu().clamp(0, 1).numpy())  # [N, H, W] each
    labels = _components(np.where(alpha >= CORE, color, -1))  # [N, H, W] blob ids, -1 = none
    ids, counts = np.unique(labels, return_counts=True)
    small = ids[(ids >= 0) & (counts < max(2, round(MIN_PIXELS * h * w / 32**2)))]
    labels[np.isin(labels, small)] = -1
    owner = _grow(labels, color, alpha)  # [N, H, W]
    out: list[list[Detection]] = [[] for _ in range(n)]
    for blob in ids[(ids >= 0) & ~np.isin(ids, small)]:
        i = int(blob) // (h * w)
        out[i].append(_shape(color[i], alpha[i], labels[i], owner[i], int(blob)))
    return [sorted(found, key=lambda d: -d.score) for found in out]


def _classify(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Palette colour index [N, H, W] (int8) and coverage α [N, H, W] (float32 in [0, 1]) of each pixel."""
    p = images.transpose(0, 2, 3, 1) - np.asarray(BACKGROUND, dtype=np.float32) / 255.0  # [N, H, W, 3]
    along = p @ (_DIRS / np.linalg.norm(_DIRS, axis=-1, keepdims=True)).T  # [N, H, W, C] length along each line
    color = along.argmax(-1)  # smallest angle to the direction from white
    length = np.take_along_axis(along, color[..., None], -1)[..., 0]  # [N, H, W]
    alpha = length / np.linalg.norm(_DIRS, axis=-1)[color]
    chroma2 = (p * p).sum(-1)
    alpha[(chroma2 < MIN_CHROMA**2) | (chroma2 - length**2 > MAX_OFF_LINE**2)] = 0
    return color.astype(np.int8), alpha.clip(0, 1)


def _grow(labels: np.ndarray, color: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Give the partly covered pixels around the blobs to their blob: [N, H, W] owner ids (-1 none, -2 contested).

    Two rounds; in each, an unowned pixel of some coverage joins the blob of its colour among its 8 neighbours, or
    is contested (and owned by none) when blobs of its colour on both sides reach it.
    """
    owner = labels.copy()
    n, h, w = labels.shape
    for _ in range(_GROW):
        pad = np.pad(owner, ((0, 0), (1, 1), (1, 1)), constant_values=-1)
        pad_color = np.pad(color, ((0, 0), (1, 1), (1, 1)), constant_values=-1)
        low = np.full(labels.shape, np.iinfo(np.int64).max)
        high = np.full(labels.shape, -1)
        for dy in range(3):
            for dx in range(3):
                nb = pad[:, dy : dy + h, dx : dx + w]
                ok = (nb >= 0) & (pad_color[:, dy : dy + h, dx : dx + w] == color)
                low = np.where(ok, np.minimum(low, nb), low)
                high = np.where(ok, np.maximum(high, nb), high)
        free = (owner == -1) & (alpha >= FLOOR) & (high >= 0)
        owner = np.where(free, np.where(low == high, high, -2), owner)
    return owner


def _components(labels: np.ndarray) -> np.ndarray:
    """Connected components (4-neighbourhood) of equal non-negative labels [N, H, W] -> component ids (-1 = none).

    Each pixel ends with the smallest flat index of its component: rounds of min-propagation between neighbours of
    the same label, each followed by pointer jumping (a pixel takes the id its id's pixel holds), until stable.
    """
    n, h, w = labels.shape
    none = n * h * w
    flat = np.arange(none, dtype=np.int32).reshape(n, h, w)
    ids = np.where(labels >= 0, flat, none).astype(np.int32)
    right = (labels[:, :, 1:] == labels[:, :, :-1]) & (labels[:, :, 1:] >= 0)  # [N, H, W-1]
    down = (labels[:, 1:, :] == labels[:, :-1, :]) & (labels[:, 1:, :] >= 0)  # [N, H-1, W]
    while True:
        new = ids.copy()
        np.minimum(new[:, :, 1:], np.where(right, ids[:, :, :-1], none), out=new[:, :, 1:])
        np.minimum(new[:, :, :-1], np.where(right, ids[:, :, 1:], none), out=new[:, :, :-1])
        np.minimum(new[:, 1:, :], np.where(down, ids[:, :-1, :], none), out=new[:, 1:, :])
        np.minimum(new[:, :-1, :], np.where(down, ids[:, 1:, :], none), out=new[:, :-1, :])
        table = np.append(new.ravel(), none)  # id -> the id its pixel holds now (none -> none)
        for _ in range(2):
            new = table[new]
        if np.array_equal(new, ids):
            return np.where(ids == none, -1, ids)
        ids = new


def _shape(color: np.ndarray, alpha: np.ndarray, labels: np.ndarray, owner: np.ndarray, blob: int) -> Detection:
    """Classify one blob of one image (maps [H, W]) by re-drawing each shape at its fitted box."""
    h, w = labels.shape
    ys, xs = np.nonzero(labels == blob)
    k = int(color[ys[0], xs[0]])
    y0, y1 = max(ys.min() - _PAD, 0), min(ys.max() + _PAD + 1, h)
    x0, x1 = max(xs.min() - _PAD, 0), min(xs.max() + _PAD + 1, w)
    cover = np.where(owner[y0:y1, x0:x1] == blob, alpha[y0:y1, x0:x1], 0)  # [h', w']
    mass = max(float(cover.sum()), 1e-6)
    yy, xx = _grid(*cover.shape)
    cx, cy = float((cover * xx).sum() / mass), float((cover * yy).sum() / mass)
    vx = float((cover * (xx - cx) ** 2).sum() / mass) - 1 / 12  # minus the variance the pixel grid adds
    vy = float((cover * (yy - cy) ** 2).sum() / mass) - 1 / 12
    union = np.empty_like(cover)
    best = (-1.0, SHAPES[0], (0.0, 0.0, 1.0, 1.0))
    for blur, (_, added) in enumerate(_BLURS):
        for cls in SHAPES:
            box = _fit(cls, cx, cy, max(vx - added, 0.1), max(vy - added, 0.1))
            template = _template(cls, *(round(v * SCALE) for v in box), *cover.shape, blur)
            np.maximum(cover, template, out=union)
            iou = float(np.minimum(cover, template).sum() / max(float(union.sum()), 1e-6))
            if iou > best[0]:
                best = (iou, cls, box)
    iou, cls, (bx, by, bw, bh) = best
    box = (float(x0 + bx), float(y0 + by), float(x0 + bx + bw), float(y0 + by + bh))
    return Detection(cls, _COLOR_NAMES[k], box, _confidence(iou, max(bw, bh) / max(min(bw, bh), 1e-6)))


@functools.lru_cache(maxsize=64)
def _grid(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates (y, x) [height, width] each."""
    yy, xx = np.mgrid[:height, :width] + 0.5
    yy.flags.writeable = xx.flags.writeable = False  # shared through the cache
    return yy, xx


def _fit(cls: str, cx: float, cy: float, vx: float, vy: float) -> tuple[float, float, float, float]:
    """Box (x0, y0, width, height) a uniform ``cls`` needs to have centroid (cx, cy) and variances (vx, vy)."""
    if cls == "square":  # uniform on [−w/2, w/2]: variance w²/12
        bw, bh = np.sqrt(12 * vx), np.sqrt(12 * vy)
        return cx - bw / 2, cy - bh / 2, bw, bh
    if cls == "circle":  # disc: variance r²/4 = w²/16
        bw, bh = np.sqrt(16 * vx), np.sqrt(16 * vy)
        return cx - bw / 2, cy - bh / 2, bw, bh
    bw, bh = np.sqrt(24 * vx), np.sqrt(18 * vy)  # upright triangle: w²/24 across, h²/18 along; centroid at 2h/3
    return cx - bw / 2, cy - 2 * bh / 3, bw, bh


@functools.lru_cache(maxsize=65536)
def _template(cls: str, qx: int, qy: int, qw: int, qh: int, height: int, width: int, blur: int) -> np.ndarray:
    """Coverage [height, width] of ``cls`` drawn at the box (qx, qy, qw, qh) in drawing pixels (1/SCALE), blurred."""
    mask = shape_mask(cls, max(qw, 1) / SCALE, max(qh, 1) / SCALE, (height, width), (qx / SCALE, qy / SCALE))
    a, b, c = _BLURS[blur][0]
    if b != 1:  # separable 3-tap blur, zero outside the window
        mask = np.pad(mask, 1)
        mask = a * mask[:-2] + b * mask[1:-1] + c * mask[2:]
        mask = a * mask[:, :-2] + b * mask[:, 1:-1] + c * mask[:, 2:]
    mask = mask.astype(np.float32)
    mask.flags.writeable = False  # shared through the cache
    return mask


def _confidence(iou: float, aspect: float) -> float:
    """Detection score from the best template IoU and the box's aspect ratio (long side / short side, ≥ 1).

    The IoU part is 0 at IoU ≤ 0.5 and 1 at IoU ≥ 0.8, linear between: rendered shapes reach IoU ≥ 0.89, and ≥ 0.82
    after noise (σ 0.03) and a 3×3 blur, so they pass even the 0.9 threshold of GenEval's counting task (IoU 0.77);
    blobs that fit no shape (smudges, two objects merged) do not. Every shape of the world is drawn in a square box,
    so the score also falls linearly from aspect 1.25 to 0 at aspect 2: an elongated blob is not one object.
    """
    fit = min(max((iou - 0.5) / 0.3, 0.0), 1.0)
    return float(fit * min(max((2.0 - aspect) / 0.75, 0.0), 1.0))

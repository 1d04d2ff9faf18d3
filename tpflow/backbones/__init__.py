"""Backbones. Importing this package registers them (real models load their weights only when built)."""

from tpflow.backbones import flux, flux_kontext, qwen_image, sd3, shapes_video, tiny, tiny_kontext, wan, wan22
from tpflow.backbones.shapes import ShapesBackbone

__all__ = [
    "ShapesBackbone",
    "flux",
    "flux_kontext",
    "qwen_image",
    "sd3",
    "shapes_video",
    "tiny",
    "tiny_kontext",
    "wan",
    "wan22",
]

"""Backbones. Importing this package registers them (real models load their weights only when built)."""

from tpflow.backbones import flux, qwen_image, sd3, shapes_video, tiny, wan, wan22
from tpflow.backbones.shapes import ShapesBackbone

__all__ = ["ShapesBackbone", "flux", "qwen_image", "sd3", "shapes_video", "tiny", "wan", "wan22"]

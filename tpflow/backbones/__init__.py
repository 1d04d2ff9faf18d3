"""Backbones. Importing this package registers them (real models load their weights only when built)."""

from tpflow.backbones import (
    flux,
    flux2,
    flux_kontext,
    qwen_image,
    qwen_image_edit,
    sd3,
    shapes_edit,
    shapes_video,
    tiny,
    tiny_flux2,
    tiny_kontext,
    tiny_qwen_edit,
    tiny_z_image,
    wan,
    wan22,
    z_image,
)
from tpflow.backbones.shapes import ShapesBackbone

__all__ = [
    "ShapesBackbone",
    "flux",
    "flux2",
    "flux_kontext",
    "qwen_image",
    "qwen_image_edit",
    "sd3",
    "shapes_edit",
    "shapes_video",
    "tiny",
    "tiny_flux2",
    "tiny_kontext",
    "tiny_qwen_edit",
    "tiny_z_image",
    "wan",
    "wan22",
    "z_image",
]

"""Backbones. Importing this package registers them."""

from tpflow.backbones.shapes import ShapesBackbone

__all__ = ["ShapesBackbone"]

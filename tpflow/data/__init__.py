"""Prompt datasets. Importing this package registers them."""

from tpflow.data.files import JsonlDataset, TextFileDataset

__all__ = ["JsonlDataset", "TextFileDataset"]

"""Prompt datasets. Importing this package registers them."""

from tpflow.data import geneval, ocr
from tpflow.data.files import JsonlDataset, TextFileDataset

__all__ = ["JsonlDataset", "TextFileDataset", "geneval", "ocr"]

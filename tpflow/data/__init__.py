"""Prompt datasets. Importing this package registers them."""

from tpflow.data import edit_jsonl, geneval, ocr
from tpflow.data.files import JsonlDataset, TextFileDataset

__all__ = ["JsonlDataset", "TextFileDataset", "edit_jsonl", "geneval", "ocr"]

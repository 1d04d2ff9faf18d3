"""Read back what an offline W&B run wrote: the history rows of its ``run-<id>.wandb`` file.

The file is a LevelDB-style log (32 KiB blocks of records, each ``crc32 u32, length u16, type u8`` + payload, a
record split over blocks as FIRST / MIDDLE / LAST) of W&B's protobuf ``Record`` messages, after a 7-byte ``:W&B``
header. wandb ships the protobuf classes; it has no public reader for offline runs, hence these few lines.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(path: Path) -> Iterator[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer: too short for a header
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def history(run_file: Path) -> list[dict]:
    """Every ``run.log`` row: {key: value}, nested keys joined with "." (images appear as their ``.path`` etc.)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in _payloads(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def config(run_file: Path) -> dict:
    """The run's config as stored in its ``run`` record (and later ``config`` updates), {key: value}."""
    from wandb.proto import wandb_internal_pb2

    out: dict = {}
    for payload in _payloads(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            out[item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
    return out

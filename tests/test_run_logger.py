"""Run logs: JSONL metrics and traces, valid JSON for non-finite values, resume truncation, the epoch line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tpflow.train.run_logger import RunLogger, epoch_line, read_jsonl, truncate_after


def _trace(prompt: str) -> dict:
    return {
        "prompt": prompt, "tag": "counting", "trace": [0.1, 0.4, 0.3], "step_rewards": [0.3, -0.1],
        "turning_points": [False, True], "delta": torch.tensor([0.3, -0.1]),
    }  # fmt: skip


def test_metrics_lines_are_valid_json(tmp_path: Path):
    with RunLogger(tmp_path / "run") as logger:
        logger.log({"reward_mean": 0.5, "kl": float("nan"), "loss": float("inf"), "skipped": 2}, step=4, epoch=0)
        logger.log({"reward_mean": torch.tensor(0.25)}, step=8, epoch=1)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # strict JSON: no NaN/Infinity tokens
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    assert (first["epoch"], first["step"], first["reward_mean"], first["kl"], first["loss"], first["skipped"]) == (
        0, 4, 0.5, None, None, 2
    )  # fmt: skip
    assert isinstance(first["time"], float)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]["reward_mean"] == 0.25
    with pytest.raises(ValueError, match="reserved"):
        RunLogger(tmp_path / "run").log({"step": 1.0}, step=1, epoch=0)


def test_trackers_get_the_scalars_and_images_unless_untracked(tmp_path: Path):
    calls = []

    class FakeTrackers:  # what RunLogger hands on; tpflow.train.trackers talks to accelerate
        def log(self, metrics: dict, step: int) -> None:
            calls.append(("log", metrics, step))

        def log_image(self, name: str, path: Path, step: int) -> None:
            calls.append(("image", name, step))

        def close(self) -> None:
            calls.append(("close",))

    with RunLogger(tmp_path, FakeTrackers()) as logger:
        logger.track({"eval_reward": 0.25}, step=0)
        logger.log_image("eval_samples", tmp_path / "grid.png", step=0)
        logger.log({"reward_mean": 0.5, "eval_reward": 0.25}, step=3, epoch=0, untracked={"eval_reward"})
    assert calls == [
        ("log", {"eval_reward": 0.25}, 0),
        ("image", "eval_samples", 0),
        ("log", {"epoch": 0, "reward_mean": 0.5}, 3),
        ("close",),
    ]
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["eval_reward"] == 0.25  # the JSONL line keeps everything


def test_tracker_settings_refuse_a_tracker_that_is_not_installed(monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    from pydantic import ValidationError

    from tpflow.settings import LogSettings

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValidationError, match=r"not installed .*tpflow\[wandb\]"):
        LogSettings(trackers=["tensorboard", "wandb"])
    assert LogSettings(trackers=["tensorboard"]).trackers == ["tensorboard"]
    with pytest.raises(ValidationError, match="twice"):
        LogSettings(trackers=["tensorboard", "tensorboard"])


def test_flat_config_is_scalars_only():
    from tpflow.train.trackers import flat_config

    flat = flat_config({"rollout": {"window_range": [0, 9], "noise_level": 0.7}, "credit": {"name": "tp"}})
    assert flat == {"rollout.window_range": "[0, 9]", "rollout.noise_level": 0.7, "credit.name": "tp"}


def test_traces_one_line_per_record(tmp_path: Path):
    logger = RunLogger(tmp_path)
    logger.log_traces(0, [_trace("a"), _trace("b")])
    logger.log_traces(1, [_trace("c")])
    records = read_jsonl(tmp_path / "traces.jsonl")
    assert [(r["epoch"], r["prompt"]) for r in records] == [(0, "a"), (0, "b"), (1, "c")]
    assert records[0]["delta"] == pytest.approx([0.3, -0.1]) and records[0]["turning_points"] == [False, True]


def test_truncate_after_drops_later_epochs_and_cut_lines(tmp_path: Path):
    logger = RunLogger(tmp_path)
    for epoch in range(6):
        logger.log({"reward_mean": epoch / 10}, step=2 * epoch, epoch=epoch)
        logger.log_traces(epoch, [_trace(f"p{epoch}")])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 6, "step": 1')  # killed mid-line
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 6  # the cut last line is dropped
    truncate_after(tmp_path, 4)  # checkpoint at epoch 4, run killed after logging epoch 5
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert [r["prompt"] for r in read_jsonl(tmp_path / "traces.jsonl")] == ["p0", "p1", "p2", "p3", "p4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "traces.jsonl"]  # no temp left
    logger.log({"reward_mean": 0.5}, step=10, epoch=5)  # the same logger keeps appending to the new file
    assert [r["epoch"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    truncate_after(tmp_path / "nothing-here", 0)  # missing files: nothing to do


def test_append_after_cut_line_starts_a_new_line(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0, "step": 0}\n{"epoch": 1, "st')
    RunLogger(tmp_path).log({"reward_mean": 1.0}, step=2, epoch=1)
    with pytest.warns(UserWarning, match="line 2: skipped"):
        records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 2]


def test_epoch_line():
    metrics = {
        "reward_mean": 0.41234, "eval_reward": 0.45, "turning_points_per_traj": 0.3125, "clip_fraction": 0.02,
        "kl": 1.2e-5, "epoch_s": 12.31, "other": 7.0,
    }  # fmt: skip
    assert (
        epoch_line(3, metrics)
        == "epoch   3 | reward 0.412 | eval 0.450 | tp/traj 0.31 | clip 0.02 | kl 1.2e-05 | 12.3 s"
    )
    assert (
        epoch_line(12, {"reward_mean": 0.5, "eval_reward": None, "epoch_s": 1.0}) == "epoch  12 | reward 0.500 | 1.0 s"
    )
    assert epoch_line(0, {"kl": math.nan}) == "epoch   0 | kl nan"


def test_epoch_line_says_which_epoch_the_repeated_eval_is_from():
    """The eval figures repeat on every epoch line until the next eval: the line says which eval they are."""
    line = epoch_line(6, {"reward_mean": 0.5, "eval_reward": 0.61, "last_eval_epoch": 4})
    assert line == "epoch   6 | reward 0.500 | eval@4 0.610"

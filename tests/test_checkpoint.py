"""Checkpoints: round trip, atomic temp + rename, corruption and truncation detected, full disk, pruning."""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from tpflow.errors import UserError
from tpflow.train.checkpoints.format import (
    CheckpointError,
    capture_rng_state,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)


class TinyAdapter(nn.Module):
    """Stands in for a backbone: a dict of LoRA tensors saved through the Backbone adapter protocol."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lora = nn.ParameterDict(
            {"a": nn.Parameter(torch.randn(4, 3, generator=g)), "b": nn.Parameter(torch.randn(3, 4, generator=g))}
        )

    def save_adapter(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(
            {k: v.detach() for k, v in self.lora.items()}, directory / "adapter_model.safetensors"
        )

    def load_adapter(self, directory: Path) -> None:
        state = safetensors.torch.load_file(directory / "adapter_model.safetensors")
        with torch.no_grad():
            for k, v in state.items():
                self.lora[k].copy_(v)


def _save(run_dir: Path, step: int, model: TinyAdapter | None = None, **overrides) -> Path:
    model = model or TinyAdapter(step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.lora["a"].sum().backward()
    opt.step()
    args = dict(
        backbone=model,
        optimizer_state=opt.state_dict(),
        ema_state={"0": torch.full((4, 3), float(step)), "1": torch.zeros(3, 4)},
        rng_state=capture_rng_state(),
        train_state={"epoch": step, "global_step": 2 * step},
        recipe={"name": "tiny", "train": {"lr": 1e-3}},
    )
    args.update(overrides)
    return save_checkpoint(run_dir, step, **args)


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_round_trip_restores_everything(tmp_path: Path):
    model = TinyAdapter(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99))
    (model.lora["a"] ** 2).sum().backward()
    opt.step()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    rng = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(2))
    ema = {"0": torch.randn(4, 3), "1": torch.randn(3, 4)}
    path = save_checkpoint(
        tmp_path, 7, backbone=model, optimizer_state=opt.state_dict(), ema_state=ema, rng_state=rng,
        train_state={"epoch": 3, "global_step": 7}, recipe={"seed": 42, "lora": {"rank": 4}},
    )  # fmt: skip
    assert path == tmp_path / "checkpoints" / "00000007"
    assert find_checkpoint(tmp_path) == (path, [])
    assert find_checkpoint(path) == (path, [])
    ckpt = load_checkpoint(path)
    assert (ckpt.step, ckpt.train_state, ckpt.recipe) == (
        7,
        {"epoch": 3, "global_step": 7},
        {"seed": 42, "lora": {"rank": 4}},
    )
    assert ckpt.ema_state.keys() == ema.keys() and all(torch.equal(ckpt.ema_state[k], ema[k]) for k in ema)
    fresh = TinyAdapter(99)
    fresh.load_adapter(ckpt.adapter_dir)
    assert all(torch.equal(fresh.lora[k], model.lora[k]) for k in model.lora)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt.optimizer_state)
    assert opt2.param_groups[0]["betas"] == (0.8, 0.99)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng_state(ckpt.rng_state)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(2), expected[2])


def test_no_ema_and_foreign_rng_values(tmp_path: Path):
    path = _save(
        tmp_path,
        1,
        ema_state=None,
        rng_state={"gen": torch.Generator().get_state(), "np": np.arange(3), "k": np.int64(5), "t": (1, [2, 3])},
    )
    ckpt = load_checkpoint(path)
    assert ckpt.ema_state is None
    assert (
        ckpt.rng_state["np"].tolist() == [0, 1, 2] and ckpt.rng_state["k"] == 5 and ckpt.rng_state["t"] == (1, [2, 3])
    )
    with pytest.raises(TypeError, match="cannot be stored"):
        _save(tmp_path, 2, rng_state={"x": object()})
    assert _names(tmp_path) == ["00000001"]


@pytest.mark.parametrize("fail", ["manifest", "rename"])
def test_crash_mid_write_leaves_no_step_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str):
    first = _save(tmp_path, 2)
    import tpflow.train.checkpoints.files as files  # where the manifest is written
    import tpflow.train.checkpoints.format as ck

    if fail == "manifest":
        real = files._write

        def write(path: Path, data: bytes) -> None:
            if path.name == ck.MANIFEST:
                raise KeyboardInterrupt  # killed while writing the manifest
            real(path, data)

        monkeypatch.setattr(files, "_write", write)
        with pytest.raises(KeyboardInterrupt):
            _save(tmp_path, 4)
    else:
        monkeypatch.setattr(ck.os, "rename", lambda *a: (_ for _ in ()).throw(RuntimeError("crash")))
        with pytest.raises(RuntimeError):
            _save(tmp_path, 4)
    monkeypatch.undo()
    assert _names(tmp_path) == ["00000002"]
    assert find_checkpoint(tmp_path) == (first, [])


def test_leftover_temp_of_dead_process_is_ignored_and_cleaned(tmp_path: Path):
    first = _save(tmp_path, 2)
    stale = tmp_path / "checkpoints" / ".tmp-4-999999999"
    (stale / "adapter").mkdir(parents=True)
    (stale / "optimizer.pt").write_bytes(b"half")
    assert find_checkpoint(tmp_path) == (first, [])
    assert not stale.exists()


def test_same_step_is_replaced(tmp_path: Path):
    _save(tmp_path, 3, train_state={"epoch": 1})
    path = _save(tmp_path, 3, train_state={"epoch": 2})
    assert _names(tmp_path) == ["00000003"]
    assert load_checkpoint(path).train_state == {"epoch": 2}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


ADAPTER_FILE = Path("adapter") / "adapter_model.safetensors"
DAMAGES = {
    "flipped": (lambda d: _flip_byte(d / "optimizer.pt"), "is corrupted (optimizer.pt: sha256 mismatch); using"),
    "truncated": (lambda d: os.truncate(d / "ema.safetensors", 10), "is truncated (ema.safetensors: size 10 != "),
    "missing": (lambda d: (d / ADAPTER_FILE).unlink(), "is incomplete (adapter/adapter_model.safetensors is missing)"),
    "no manifest": (lambda d: (d / "manifest.json").unlink(), "has no manifest"),
    "bad manifest": (lambda d: (d / "manifest.json").write_text("{"), "has an unreadable manifest"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_is_reported_and_previous_used(tmp_path: Path, damage: str):
    first = _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    apply, message = DAMAGES[damage]
    apply(newest)
    found, warnings = find_checkpoint(tmp_path)
    assert found == first
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint 00000004 " + message.split(" (")[0])
    assert message in warnings[0] and warnings[0].endswith("; using 00000002")
    with pytest.raises(CheckpointError, match="Cannot load checkpoint"):
        load_checkpoint(newest)
    assert find_checkpoint(newest)[0] is None
    assert load_checkpoint(found).step == 2


def test_nothing_valid(tmp_path: Path):
    assert find_checkpoint(tmp_path / "missing")[0] is None
    assert find_checkpoint(tmp_path) == (None, [])
    path = _save(tmp_path, 1)
    os.truncate(path / "rng.pt", 3)
    found, warnings = find_checkpoint(tmp_path)
    assert found is None and "no older valid checkpoint" in warnings[0]


def test_disk_full_raises_clear_error_and_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    first = _save(tmp_path, 2)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if hasattr(f, "write") and getattr(f, "name", "").endswith("optimizer.pt"):
            f.write(b"partial bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as info:
        _save(tmp_path, 4)
    monkeypatch.undo()
    message = str(info.value)
    assert isinstance(info.value, UserError)
    assert str(tmp_path) in message and "No space left on device" in message
    assert "previous checkpoint 00000002 is intact" in message and "\n" not in message
    assert _names(tmp_path) == ["00000002"]  # no temp dir, no 00000004
    assert find_checkpoint(tmp_path) == (first, [])


def test_keep_last_prunes_older_valid_and_invalid(tmp_path: Path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=3)
    assert _names(tmp_path) == ["00000002", "00000003", "00000004"]
    os.truncate(tmp_path / "checkpoints" / "00000004" / "rng.pt", 1)  # invalid: does not count, gets pruned
    _save(tmp_path, 5, keep_last=2)
    assert _names(tmp_path) == ["00000003", "00000005"]
    _save(tmp_path, 9, keep_last=1)
    _save(tmp_path, 6, keep_last=1)  # resumed from an older one: the later 9 is not touched, 6 is kept
    assert _names(tmp_path) == ["00000006", "00000009"]
    manifest = json.loads((tmp_path / "checkpoints" / "00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and {"optimizer.pt", "adapter/adapter_model.safetensors"} <= manifest["files"].keys()


def _steps(run_dir: Path) -> list[str]:
    """The step-numbered checkpoint folders (the ones --resume and tpflow eval pick from)."""
    return [name for name in _names(run_dir) if name.isdigit()]


def test_keep_last_zero_keeps_every_checkpoint_and_parking_moves_newer_ones(tmp_path: Path):
    from tpflow.train.checkpoints.format import park_newer

    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, keep_last=0)  # train.keep_checkpoints = 0
    assert _steps(tmp_path) == [f"{s:08d}" for s in (1, 2, 3, 4, 5)]
    parked = park_newer(tmp_path, 3)  # rewound to step 3
    assert [p.name for p in parked] == ["abandoned-00000004", "abandoned-00000005"]
    assert _steps(tmp_path) == ["00000001", "00000002", "00000003"]
    assert find_checkpoint(tmp_path)[0].name == "00000003"
    _save(tmp_path, 4, keep_last=0)
    assert [p.name for p in park_newer(tmp_path, 3)] == ["abandoned-00000004-2"]  # the same step parked twice
    _save(tmp_path, 6, keep_last=2)  # parked checkpoints are never pruned
    assert _steps(tmp_path) == ["00000003", "00000006"]
    assert (tmp_path / "checkpoints" / "abandoned-00000005" / "manifest.json").is_file()


def test_keep_checkpoints_is_a_train_option():
    """The trainer passes it on: tests/test_resume_logs.py keeps every checkpoint of its runs with 0 and compares
    them all."""
    from tpflow.settings import TrainSettings

    assert TrainSettings().keep_checkpoints == 3
    assert TrainSettings(keep_checkpoints=0).keep_checkpoints == 0
    with pytest.raises(ValueError, match="keep_checkpoints"):
        TrainSettings(keep_checkpoints=-1)


def test_the_folder_is_fsynced_after_the_rename_and_before_pruning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A power cut right after the save must not lose the new checkpoint and the pruned one both: the rename into
    ``checkpoints/`` reaches the disk (the folder fsynced) before anything older is deleted."""
    import tpflow.train.checkpoints.format as ck

    _save(tmp_path, 1, keep_last=1)
    root = tmp_path / "checkpoints"
    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_rmtree = os.fsync, os.rename, ck.shutil.rmtree

    def fsync(fd: int) -> None:
        if os.fstat(fd).st_ino == root.stat().st_ino:
            events.append(("fsync", root.name))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        real_rename(src, dst)

    def rmtree(path, *args, **kwargs) -> None:
        if Path(path).exists():
            events.append(("delete", Path(path).name))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(ck.shutil, "rmtree", rmtree)
    _save(tmp_path, 2, keep_last=1)
    monkeypatch.undo()
    installed = events.index(("rename", f".tmp-2-{os.getpid()} -> 00000002"))
    pruning = next(i for i, (kind, what) in enumerate(events) if "00000001" in what)
    assert installed < events.index(("fsync", "checkpoints"), installed) < pruning, events
    assert _names(tmp_path) == ["00000002"]


def _kill_while_deleting(path, *args, **kwargs) -> None:
    """shutil.rmtree killed part-way (kill -9): some files of the folder gone, the rest left behind."""
    path = Path(path)
    if path.exists():
        (path / "manifest.json").unlink(missing_ok=True)
        (path / "optimizer.pt").unlink(missing_ok=True)
        raise KeyboardInterrupt


def test_a_kill_mid_prune_leaves_no_half_deleted_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Pruning renames a checkpoint out of the step numbers before deleting it: a kill during the deletion leaves a
    ``.pruned-*`` folder, which the next start removes, never a half-deleted ``<step>`` that stays for good."""
    import tpflow.train.checkpoints.format as ck

    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=3)
    monkeypatch.setattr(ck.shutil, "rmtree", _kill_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4, keep_last=3)  # the final save, killed while it prunes 00000001
    monkeypatch.undo()
    assert _steps(tmp_path) == ["00000002", "00000003", "00000004"]
    assert [name.rsplit("-", 1)[0] for name in _names(tmp_path) if not name.isdigit()] == [".pruned-00000001"]
    assert find_checkpoint(tmp_path) == (tmp_path / "checkpoints" / "00000004", [])  # no warning: nothing skipped
    assert _names(tmp_path) == ["00000002", "00000003", "00000004"]  # the leftover removed at the next start


def test_a_resume_completes_a_prune_that_a_kill_interrupted(tmp_path: Path):
    """The state a kill mid-prune leaves (an older checkpoint half-deleted in place, as before pruning renamed
    first, and a ``.pruned-*`` folder of a dead process) is cleaned by any resume from the run's own checkpoints,
    pruned to ``train.keep_checkpoints``: a finished run resumes and saves nothing, so nothing else would prune it.
    A warm start from another run's checkpoint prunes nothing of that run."""
    from rich.console import Console

    from tpflow.recipe import load_recipe
    from tpflow.train.checkpoints.resume import checkpoint_to_resume

    root = Path(__file__).resolve().parent.parent
    recipe = load_recipe(root / "recipes" / "tiny_smoke.toml", ["train.keep_checkpoints=2"])
    run, other = tmp_path / "run", tmp_path / "other"
    for step in (1, 2, 3, 4):
        _save(run, step, keep_last=0, recipe=recipe.data)
        _save(other, step, keep_last=0, recipe=recipe.data)
    checkpoints = run / "checkpoints"
    (checkpoints / "00000001" / ADAPTER_FILE).unlink()  # half-deleted where it lies
    os.rename(checkpoints / "00000002", checkpoints / ".pruned-00000002-999999999")  # renamed, then killed
    (checkpoints / ".pruned-00000002-999999999" / "manifest.json").unlink()
    console = Console(quiet=True)
    assert checkpoint_to_resume(run, True, recipe, console, is_main=False).step == 4  # only the main process prunes
    assert _steps(run) == ["00000001", "00000003", "00000004"]
    ckpt = checkpoint_to_resume(run, True, recipe, console)
    assert ckpt is not None and ckpt.step == 4
    assert _names(run) == ["00000003", "00000004"]
    warm = checkpoint_to_resume(tmp_path / "new", other / "checkpoints" / "00000004", recipe, console)
    assert warm.step == 4 and _steps(other) == [f"{s:08d}" for s in (1, 2, 3, 4)]

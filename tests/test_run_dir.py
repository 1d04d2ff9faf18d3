"""The run directory is one run's: a lock keeps a second writer out, --resume reads only its own checkpoints, forged
checkpoints and damaged logs are clear errors or skipped lines, and a plugin that dies at import takes nothing down."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.test_preflight import SHAPES, assert_one_paragraph, no_weights, run_cli  # noqa: F401 (a fixture)
from tests.test_train import tiny_recipe
from tpflow import registry
from tpflow.backbones.shapes import ShapesBackbone
from tpflow.errors import UserError
from tpflow.recipe import load_recipe
from tpflow.train.checkpoints.files import MANIFEST, _digest
from tpflow.train.checkpoints.format import CheckpointError
from tpflow.train.run_lock import RunDirLock
from tpflow.train.run_logger import read_jsonl, truncate_after
from tpflow.train.trainer import Trainer

HOLD = (
    "import sys; from tpflow.train.run_lock import RunDirLock; lock = RunDirLock({run!r}).acquire(); "
    "print('held', flush=True); sys.stdin.read()"
)


def _holder(run: Path) -> subprocess.Popen[str]:
    """Another process holding the run dir's lock until its stdin closes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(run=str(run))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_second_train_on_a_held_run_dir_is_refused_before_weights_load(tmp_path, no_weights):  # noqa: F811
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        code, err = run_cli("train", str(SHAPES), "--run-dir", str(run), "--epochs", "1")
    finally:
        holder.communicate("", timeout=30)  # closes its stdin: it exits and the OS drops its lock
    assert_one_paragraph(code, err, str(run), "in use by another tpflow train", f"PID {holder.pid} on host")
    assert "backbone" not in no_weights
    with RunDirLock(run) as lock:  # free again once the holder exited
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_lock_of_a_killed_run_does_not_block(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    os.kill(holder.pid, signal.SIGKILL)  # no clean-up runs: the lock file keeps its PID
    holder.wait(timeout=30)
    assert json.loads((run / ".lock").read_text())["pid"] == holder.pid
    lock = RunDirLock(run).acquire()
    assert lock.held and json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()


def test_two_trainers_on_one_run_dir(tmp_path, tiny_weights, plugin):
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_weights), ["eval.every=0"])
    first = Trainer(recipe)
    with pytest.raises(UserError, match=f"in use by another tpflow train \\(PID {os.getpid()} on host"):
        Trainer(recipe)
    first.checkpoints.save(first.epoch, first.last_eval)
    first.run_lock.release()
    with pytest.raises(UserError, match="--resume"):  # refused after taking the lock: it must drop it again
        Trainer(recipe)
    assert RunDirLock(first.run_dir).acquire().held


def _trained_run(tmp_path: Path, tiny_weights: Path, name: str) -> tuple[Path, Path]:
    """A run dir holding one checkpoint (epoch 0) and its recipe file."""
    (tmp_path / name).mkdir()
    recipe_path = tiny_recipe(tmp_path / name, tiny_weights)
    trainer = Trainer(load_recipe(recipe_path, ["eval.every=0"]))
    checkpoint = trainer.checkpoints.save(trainer.epoch, trainer.last_eval)
    trainer.run_lock.release()
    assert checkpoint is not None
    return checkpoint, recipe_path


def test_resume_refuses_a_checkpoint_linked_from_another_run(tmp_path, tiny_weights, plugin):
    other, _ = _trained_run(tmp_path, tiny_weights, "other")
    mine = tmp_path / "mine"
    mine.mkdir()
    recipe = load_recipe(tiny_recipe(mine, tiny_weights), ["eval.every=0"])
    (mine / "run" / "checkpoints").mkdir(parents=True)
    (mine / "run" / "checkpoints" / "00000099").symlink_to(other)  # newer than anything of its own
    with pytest.raises(CheckpointError, match="outside the run's checkpoints") as err:
        Trainer(recipe, resume=True)
    assert str(other.resolve()) in str(err.value)
    named = Trainer(recipe, resume=other)  # naming another run's checkpoint is a deliberate warm start: allowed
    assert named.epoch == 0
    named.run_lock.release()


def test_resume_through_a_linked_checkpoints_folder(tmp_path, tiny_weights, plugin):
    """A checkpoints/ folder that is a link (to a scratch disk) holds the run's own checkpoints: save() writes it."""
    scratch, _ = _trained_run(tmp_path, tiny_weights, "scratch")
    mine = tmp_path / "mine"
    mine.mkdir()
    recipe = load_recipe(tiny_recipe(mine, tiny_weights), ["eval.every=0"])
    (mine / "run").mkdir()
    (mine / "run" / "checkpoints").symlink_to(scratch.parent, target_is_directory=True)
    assert Trainer(recipe, resume=True).epoch == 0


def _forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file of a checkpoint and re-sign the manifest, as a forger (or a careless edit) would."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][name] = _digest(checkpoint / name)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def test_forged_checkpoints_are_user_errors_naming_them(tmp_path, tiny_weights, plugin):
    checkpoint, recipe_path = _trained_run(tmp_path, tiny_weights, "forged")
    state = json.loads((checkpoint / "state.json").read_text())
    _forge(checkpoint, "state.json", json.dumps({**state, "epoch": "abc"}).encode())
    code, err = run_cli("train", str(recipe_path), "--resume", "--set", "eval.every=0")
    assert_one_paragraph(code, err, str(checkpoint), "epoch = 'abc'")

    _forge(checkpoint, "state.json", json.dumps(state).encode())
    adapter = "adapter/adapter_model.safetensors"
    tensors = safetensors.torch.load_file(checkpoint / adapter)
    wrong = {k: v.new_zeros((v.shape[0] + 1, *v.shape[1:])) for k, v in tensors.items()}
    _forge(checkpoint, adapter, safetensors.torch.save(wrong))
    code, err = run_cli("train", str(recipe_path), "--resume", "--set", "eval.every=0")
    assert_one_paragraph(code, err, str(checkpoint), "does not fit")


def _torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_checkpoint_missing_a_key_is_a_user_error_naming_it(tmp_path, tiny_weights, plugin):
    checkpoint, recipe_path = _trained_run(tmp_path, tiny_weights, "missing")
    files = {name: (checkpoint / name).read_bytes() for name in ("optimizer.pt", "rng.pt", "state.json")}
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    rng = torch.load(checkpoint / "rng.pt", weights_only=True)
    state = json.loads(files["state.json"])
    forged = {
        "optimizer.pt": (_torch_bytes({"optimizer": optimizer["optimizer"]}), "optimizer state lacks 'global_step'"),
        "rng.pt": (_torch_bytes({k: v for k, v in rng.items() if k != "numpy"}), "RNG state (rng.pt) lacks 'numpy'"),
        "state.json": (json.dumps({k: v for k, v in state.items() if k != "epoch"}).encode(), "holds no epoch"),
    }
    for name, (data, expected) in forged.items():
        _forge(checkpoint, name, data)
        code, err = run_cli("train", str(recipe_path), "--resume", "--set", "eval.every=0")
        assert_one_paragraph(code, err, str(checkpoint), expected)
        _forge(checkpoint, name, files[name])


def test_a_bug_while_restoring_keeps_its_traceback(tmp_path, tiny_weights, plugin, capsys, monkeypatch):
    """A checkpoint that fits, restored by a component with a bug: not 'does not fit this recipe' (exit 2, no
    traceback) but the bug's own exception, with its traceback and a note naming the checkpoint."""
    checkpoint, recipe_path = _trained_run(tmp_path, tiny_weights, "bug")

    def load_adapter(self, directory):  # a KeyError of the backbone's own code, not a key the checkpoint lacks
        return {}["lora_scale"]

    monkeypatch.setattr(ShapesBackbone, "load_adapter", load_adapter)
    from tpflow.cli import main

    with pytest.raises(KeyError) as err:  # called directly: the exception itself, not its printout
        main(["train", str(recipe_path), "--resume", "--set", "eval.every=0"])
    assert "load_adapter" in [frame.name for frame in traceback.extract_tb(err.value.__traceback__)]
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert str(checkpoint) in notes and "not a checkpoint that does not fit" in notes
    assert "does not fit this recipe" not in capsys.readouterr().err


def test_metrics_line_that_is_not_utf8_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"epoch": 0, "reward": 1.0}\n{"epoch": 1, "note": "\xff"}\n[1, 2]\n{"epoch": 2, "reward": 2.0}\n'
    )
    with pytest.warns(UserWarning) as caught:
        records = read_jsonl(path)
    assert [r["epoch"] for r in records] == [0, 2]
    messages = " ".join(str(w.message) for w in caught)
    assert "line 2: skipped, not UTF-8" in messages and "line 3: skipped, not a JSON object" in messages
    with pytest.warns(UserWarning):
        truncate_after(tmp_path, 0)  # resume rewrites the file from the lines it could read
    assert read_jsonl(path) == [{"epoch": 0, "reward": 1.0}]


BROKEN_PLUGINS = {
    "exits": "import sys\nsys.exit(3)\n",
    "raises": "raise RuntimeError('model hub unreachable')\n",
}


@pytest.fixture
def broken_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two installed reward plugins: one calls sys.exit at import, one raises."""
    root = tmp_path / "site"
    root.mkdir()
    lines = ["[tpflow.rewards]"]
    for name, body in BROKEN_PLUGINS.items():
        (root / f"tpflow_broken_{name}.py").write_text(textwrap.dedent(body))
        lines.append(f"{name}-reward = tpflow_broken_{name}:Reward")
    info = root / "tpflow_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tpflow_broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(root))
    registry.refresh_plugins()
    yield root
    for name in BROKEN_PLUGINS:
        sys.modules.pop(f"tpflow_broken_{name}", None)
    monkeypatch.undo()
    registry.refresh_plugins()


def test_a_plugin_that_exits_or_raises_at_import_is_reported_by_name(broken_plugins):
    code, out = run_cli("components", "reward")
    assert code == 0, out
    assert "exits-reward" in out and "sys.exit(3)" in out
    assert "raises-reward" in out and "RuntimeError: model hub unreachable" in out
    assert "shapes-geneval" in out  # the built-ins are all there
    code, out = run_cli("validate", str(SHAPES), "--no-machine")
    assert code == 0 and "valid" in out and "warning: plugin failed to load exits-reward" in out
    code, out = run_cli("validate", str(SHAPES), "--no-machine", "--set", "reward.name=exits-reward")
    assert code == 2 and "'exits-reward' is not a registered reward model" in out and "sys.exit(3)" in out

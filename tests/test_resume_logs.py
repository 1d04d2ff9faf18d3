"""A resumed run's logs equal the uninterrupted run's; a restart without a checkpoint starts clean logs; a resume with
a changed recipe says what changed, applies it (the learning rate reaches the optimizer) or refuses it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_train import TIMING, tiny_recipe
from tpflow.errors import UserError
from tpflow.recipe import load_recipe
from tpflow.train.checkpoints.format import find_checkpoint
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

# eval every 3 epochs, a checkpoint every epoch (all kept, to compare each): a resume at epoch 4 or 5
# must repeat epoch 3's eval figures on its lines, as the uninterrupted run does
EVERY_3 = ["train.epochs=6", "eval.every=3", "train.save_every=1", "train.keep_checkpoints=0", "log.trackers=[]"]


def _logs(run: Path) -> tuple[list[dict], list[dict]]:
    metrics = [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in read_jsonl(run / "metrics.jsonl")]
    return metrics, read_jsonl(run / "traces.jsonl")


def _checkpoints(run: Path) -> dict[str, dict[str, bytes]]:
    """Every checkpoint of a run, file by file. The manifest holds a creation time and is left out; recipe.json is
    compared without train.run_dir (the runs compared live in different directories)."""
    out = {}
    for path in sorted((run / "checkpoints").iterdir()):
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != "manifest.json")
        out[path.name] = {f.relative_to(path).as_posix(): f.read_bytes() for f in files}
        recipe = json.loads(out[path.name]["recipe.json"])
        del recipe["train"]["run_dir"]
        out[path.name]["recipe.json"] = json.dumps(recipe, sort_keys=True).encode()
    return out


def _differing(run: Path, expected: Path) -> list[str]:
    """The checkpoint files of ``run`` that differ from (or are missing in) ``expected``'s, and the reverse."""
    a, b = _checkpoints(run), _checkpoints(expected)
    names = sorted({(c, f) for c in a for f in a[c]} | {(c, f) for c in b for f in b[c]})
    return [f"{c}/{f}" for c, f in names if a.get(c, {}).get(f) != b.get(c, {}).get(f)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tiny_weights: Path) -> Path:
    """The uninterrupted run of 6 epochs."""
    root = tmp_path_factory.mktemp("straight")
    Trainer(load_recipe(tiny_recipe(root, tiny_weights, reward="image-stat"), EVERY_3)).fit()
    return root


def _resumed_from(straight: Path, tmp_path: Path, keep_epoch: int, tiny_weights: Path, kill: str) -> Path:
    """A copy of the run killed after ``keep_epoch``'s checkpoint, resumed to the end. Later log lines stay, as a kill
    leaves them; the later checkpoints are gone (``kill="deleted"``: killed in the rollout of the next epoch) or the
    next one is a complete ``.tmp-<step>-<pid>`` directory of a dead process (``"before-rename"``: killed between
    its manifest and the rename, or killed from outside while writing it)."""
    shutil.copytree(straight / "run", tmp_path / "run")
    later = []
    for path in sorted((tmp_path / "run" / "checkpoints").iterdir()):
        if json.loads((path / "state.json").read_text())["epoch"] > keep_epoch:
            later.append(path)
    if kill == "before-rename":
        pid = subprocess.Popen(["true"])
        pid.wait()
        later[0].rename(later[0].with_name(f".tmp-{int(later[0].name)}-{pid.pid}"))
        later = later[1:]
    for path in later:
        shutil.rmtree(path)
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    resumed = Trainer(load_recipe(recipe, EVERY_3), resume=True)
    assert resumed.epoch == keep_epoch
    resumed.fit()
    return tmp_path / "run"


@pytest.mark.parametrize("kill", ["deleted", "before-rename"])
@pytest.mark.parametrize("keep_epoch", [4, 5])  # epochs without an eval: their lines carry epoch 3's
def test_resume_at_an_epoch_without_eval_logs_what_the_straight_run_logged(
    straight, tmp_path, tiny_weights, keep_epoch, kill
):
    run = _resumed_from(straight, tmp_path, keep_epoch, tiny_weights, kill)
    metrics, traces = _logs(run)
    expected_metrics, expected_traces = _logs(straight / "run")
    assert [m["epoch"] for m in metrics] == [0, 1, 2, 3, 4, 5, 6]
    assert metrics[keep_epoch]["eval_reward"] == expected_metrics[3]["eval_reward"]  # restored from the checkpoint
    assert metrics == expected_metrics
    assert traces == expected_traces
    assert _differing(run, straight / "run") == []


def test_ctrl_c_after_an_eval_leaves_the_checkpoint_as_written(straight, tmp_path, tiny_weights):
    """Ctrl-C in the rollout of epoch 3, after that epoch's eval: no optimizer step happened since epoch 2's
    checkpoint, so that checkpoint must not be rewritten (it would hold the newer eval figures and RNG state and
    differ from the uninterrupted run's). Resumed to the end, checkpoints and logs equal the uninterrupted run's."""
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    trainer = Trainer(load_recipe(recipe, EVERY_3))
    real = trainer._sample_and_score

    def sample_and_score(plan):
        if plan.epoch == 3:
            raise KeyboardInterrupt
        return real(plan)

    trainer._sample_and_score = sample_and_score
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    straight_checkpoints = _checkpoints(straight / "run")
    written = _checkpoints(tmp_path / "run")
    newest = max(written)
    assert json.loads(written[newest]["state.json"])["epoch"] == 3
    assert written[newest] == straight_checkpoints[newest]  # the state after epoch 2, as first written
    resumed = Trainer(load_recipe(recipe, EVERY_3), resume=True)
    assert resumed.epoch == 3
    resumed.fit()
    assert _logs(tmp_path / "run") == _logs(straight / "run")
    assert _differing(tmp_path / "run", straight / "run") == []


def test_restart_without_a_checkpoint_starts_clean_logs(straight, tmp_path, tiny_weights):
    """An attempt killed before its first checkpoint left log lines; a fresh start must not keep them."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(straight / "run" / "metrics.jsonl", run)  # the dead attempt's lines
    shutil.copy(straight / "run" / "traces.jsonl", run)
    with open(run / "traces.jsonl", "a") as f:
        f.write('{"epoch": 0, "prompt": "cut sho')
    Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights, reward="image-stat"), EVERY_3)).fit()
    assert _logs(run) == _logs(straight / "run")


def test_resume_with_a_new_learning_rate_uses_and_records_it(straight, tmp_path, tiny_weights, capsys):
    shutil.copytree(straight / "run", tmp_path / "run")
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    overrides = [*EVERY_3, "train.epochs=7", "optimizer.learning_rate=1e-5", "train.group_size=4"]
    trainer = Trainer(load_recipe(recipe, overrides), resume=True)
    out = capsys.readouterr().out
    assert "optimizer.learning_rate 0.01 -> 1e-05" in " ".join(out.split())
    text = " ".join(out.split())
    assert "note: train.epochs 6 in the run, 7 now" in text  # expected: said in one line, not warned
    assert "train.epochs 6 ->" not in text and "group_size" not in out  # unchanged: not reported
    assert [g["lr"] for g in trainer.optimizer.loop.optimizer.param_groups] == [1e-5]  # not the checkpoint's 0.01
    trainer.fit()
    path, _ = find_checkpoint(tmp_path / "run")
    assert json.loads((path / "recipe.json").read_text())["optimizer"]["learning_rate"] == 1e-5


def test_resume_with_another_lora_shape_is_refused_before_the_model_loads(
    straight, tmp_path, tiny_weights, monkeypatch
):
    from tpflow.recipe import ComponentSpec

    shutil.copytree(straight / "run", tmp_path / "run")
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    real_build = ComponentSpec.build

    def build(spec: ComponentSpec):
        assert spec.kind not in ("backbone", "reward"), "refused after the weights loaded"
        return real_build(spec)

    monkeypatch.setattr(ComponentSpec, "build", build)
    with pytest.raises(UserError, match=r"backbone\.lora_rank: 8 in the checkpoint, 4 now"):
        Trainer(load_recipe(recipe, [*EVERY_3, "backbone.lora_rank=4"]), resume=True)


def test_rewinding_parks_the_newer_checkpoints(straight, tmp_path, tiny_weights, capsys):
    """--resume PATH to an older checkpoint of the run: the newer ones move to checkpoints/abandoned-*, so that a
    later bare --resume (or tpflow eval RUN) picks the rewound run's own; the rewound run ends as the straight one."""
    shutil.copytree(straight / "run", tmp_path / "run")
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    root = tmp_path / "run" / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    older = next(p for p in sorted(root.iterdir()) if json.loads((p / "state.json").read_text())["epoch"] == 4)
    newer = [name for name in names if name > older.name]
    assert newer, names
    trainer = Trainer(load_recipe(recipe, EVERY_3), resume=older)
    out = " ".join(capsys.readouterr().out.split())
    assert "abandons the newer ones" in out and all(name in out for name in newer)
    assert find_checkpoint(tmp_path / "run")[0] == older  # no longer the abandoned newest
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("abandoned-")) == [
        f"abandoned-{name}" for name in newer
    ]
    trainer.fit()
    assert _logs(tmp_path / "run") == _logs(straight / "run")
    assert find_checkpoint(tmp_path / "run")[0] == root / names[-1]  # rewritten by the rewound run

"""Ctrl-C (SIGINT) and SIGTERM at each phase of a run, on one process (tpflow.train.stop, Trainer.fit): the run stops
at the next safe point with every finished epoch saved, and ``--resume`` ends bitwise where the uninterrupted run
does. The signals are real, sent to this process from inside the phase (``os.kill``); the 2-process case is
tests/test_distributed_train.py's Ctrl-C test."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.test_train import TIMING, tiny_recipe
from tpflow import launch
from tpflow.recipe import load_recipe
from tpflow.train import trainer as trainer_module
from tpflow.train.checkpoints import run as run_checkpoints
from tpflow.train.checkpoints.format import find_checkpoint
from tpflow.train.run_logger import read_jsonl
from tpflow.train.stop import REPEAT_S, Stopped
from tpflow.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("sigint_not_ignored")  # a background suite ignores SIGINT

# 4 epochs, evaluations before epochs 0 and 2 and a final one, a checkpoint after epoch 1 and at the end
SETS = ["train.epochs=4", "train.save_every=2", "eval.every=2"]
INT, TERM = signal.SIGINT, signal.SIGTERM


def _send(signum: int) -> None:
    """``signum`` to this process, which must have the trainer's handler for it (else SIGTERM would end pytest)."""
    assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.default_int_handler), "no handler of the run's"
    os.kill(os.getpid(), signum)  # the handler runs in this (the main) thread before the next bytecode


def _with_signal(trainer: Trainer, monkeypatch, phase: str, epoch: int, signum: int) -> None:
    """Send ``signum`` once, inside ``phase`` of ``epoch``: "rollout" (as epoch's sampling starts), "update" (after
    the update's first optimizer step: the weights are part-way), "eval" (as the evaluation at ``epoch`` starts),
    "checkpoint" (as save_checkpoint starts writing)."""
    sent = []

    def once() -> None:
        if not sent:
            sent.append(signum)
            _send(signum)

    if phase == "rollout":
        real_phase = trainer._phase

        def phase_hook(description, total):
            real_phase(description, total)
            if description.startswith(f"epoch {epoch}: sampling"):
                once()

        trainer._phase = phase_hook
    elif phase == "update":
        real_update = trainer.optimizer.update

        def update(*args, on_step=None, **kwargs):
            def step(*a):
                result = on_step(*a) if on_step is not None else None
                if trainer.epoch == epoch:
                    once()
                return result

            return real_update(*args, on_step=step, **kwargs)

        trainer.optimizer.update = update
    elif phase == "eval":
        real_evaluate = trainer_module.evaluate

        def evaluate(*args, **kwargs):
            if trainer.epoch == epoch:
                once()
            return real_evaluate(*args, **kwargs)

        monkeypatch.setattr(trainer_module, "evaluate", evaluate)
    elif phase == "checkpoint":
        real_save = run_checkpoints.save_checkpoint

        def save_checkpoint(*args, **kwargs):
            once()
            return real_save(*args, **kwargs)

        monkeypatch.setattr(run_checkpoints, "save_checkpoint", save_checkpoint)


def _trainer(folder: Path, weights: Path, resume: bool = False, sets: list[str] = SETS) -> Trainer:
    return Trainer(load_recipe(tiny_recipe(folder, weights, reward="image-stat"), sets), resume=resume)


def _states(run: Path) -> list[dict]:
    folders = sorted(p for p in (run / "checkpoints").iterdir())
    assert all(p.name.isdigit() for p in folders), folders  # no .tmp-* left behind
    return [json.loads((p / "state.json").read_text()) for p in folders]


def _newest(run: Path) -> str | None:
    return max((p.name for p in (run / "checkpoints").glob("0*")), default=None)


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}


def _comparable(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in read_jsonl(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_weights) -> tuple[Path, dict[str, torch.Tensor]]:
    """The run uninterrupted: its directory and its final adapter."""
    folder = tmp_path_factory.mktemp("straight")
    trainer = _trainer(folder, tiny_weights)
    trainer.fit()
    return folder / "run", _adapter(trainer)


# (phase, epoch it lands in, the epoch the checkpoint then holds, whether that checkpoint is written by the stop)
CHAIN = [
    ("eval", 0, 0, True),  # the evaluation at epoch 0 ends, then the state before epoch 0 is saved with its figures
    ("update", 0, 1, True),  # epoch 0's update ends and is counted: the state after epoch 0 is saved
    ("rollout", 1, 1, False),  # after the first rollout batch of epoch 1: the checkpoint holds that state already
    ("checkpoint", 2, 2, False),  # the write after epoch 1 is finished, the run stops before epoch 2
    ("update", 3, 4, True),  # the last epoch's update ends: saved before the final evaluation
]


@pytest.mark.parametrize("first", [INT, TERM], ids=["SIGINT-first", "SIGTERM-first"])
def test_a_signal_at_each_phase_keeps_every_finished_epoch_and_resume_ends_bitwise(
    tmp_path, tiny_weights, straight, monkeypatch, capfd, first
):
    """One run, stopped five times (SIGINT and SIGTERM in turn; the other parametrization swaps them) and resumed
    each time: each stop exits with 128 + the signal, says what it keeps, and leaves a checkpoint of every finished
    epoch. A signal in the final evaluation lets the run end as it would have: with the uninterrupted run's adapter
    and metrics, bit for bit; resumed once more, it is finished. Before, SIGINT on one process raised at once
    (during an update: no checkpoint, the epoch lost) and SIGTERM killed the run."""
    other = TERM if first == INT else INT
    for i, (phase, epoch, kept, written) in enumerate(CHAIN):
        signum = first if i % 2 == 0 else other
        with monkeypatch.context() as patch:
            trainer = _trainer(tmp_path, tiny_weights, resume=i > 0)
            before = _newest(tmp_path / "run")
            _with_signal(trainer, patch, phase, epoch, signum)
            capfd.readouterr()
            with pytest.raises(Stopped) as stopped:
                trainer.fit()
        out = capfd.readouterr().out
        assert stopped.value.exit_status == 128 + signum and not stopped.value.at_once
        assert f"Interrupted ({'Ctrl-C' if signum == INT else 'SIGTERM'})" in out, out
        assert _states(tmp_path / "run")[-1]["epoch"] == kept, (phase, _states(tmp_path / "run"))
        assert (_newest(tmp_path / "run") != before) == (written or phase == "checkpoint"), phase  # a new step?
        if phase == "eval":  # the stop after eval@0 kept its figures: --resume does not evaluate again
            assert _states(tmp_path / "run")[-1]["last_eval"]["last_eval_epoch"] == 0
        if (phase, epoch) == ("update", 0):  # the notice, from the handler: what happens next, what a second keeps
            assert "finishing epoch 0's update, then saving; --resume starts at epoch 1" in out, out
            assert "stops at once and keeps only checkpoint" in out and "(epoch 0)." in out, out
    with monkeypatch.context() as patch:
        resumed = _trainer(tmp_path, tiny_weights, resume=True)
        _with_signal(resumed, patch, "eval", 4, other)
        capfd.readouterr()
        resumed.fit()  # not stopped: the final evaluation was the last thing left
    assert "finishing the final evaluation" in capfd.readouterr().out
    run, adapter = straight
    ours = _adapter(resumed)
    assert ours.keys() == adapter.keys() and all(torch.equal(ours[k], adapter[k]) for k in ours)
    assert _comparable(tmp_path / "run") == _comparable(run)
    again = _trainer(tmp_path, tiny_weights, resume=True)
    monkeypatch.setattr(trainer_module, "evaluate", lambda *a, **k: pytest.fail("a finished run evaluated"))
    again.fit()
    assert _comparable(tmp_path / "run") == _comparable(run)


def test_resume_of_a_finished_run_does_nothing(tmp_path, tiny_weights, straight, monkeypatch):
    """Its last checkpoint is after the last epoch and the final evaluation: --resume says so and evaluates
    nothing (it used to evaluate again, 56 s for 96 clips); the metrics keep the final evaluation's line."""
    run, _ = straight
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    expected = _comparable(copy)
    trainer = _trainer(tmp_path, tiny_weights, resume=True)
    monkeypatch.setattr(trainer_module, "evaluate", lambda *a, **k: pytest.fail("a finished run evaluated again"))
    monkeypatch.setattr(Trainer, "train_epoch", lambda *a: pytest.fail("a finished run trained again"))
    trainer.console.record = True
    metrics = trainer.fit()
    assert "eval_reward" in metrics
    assert "The run is finished: all 4 epochs trained, its final evaluation logged" in trainer.console.export_text()
    assert _comparable(copy) == expected
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == sorted(
        p.name for p in (run / "checkpoints").iterdir()
    )


def test_a_second_signal_stops_at_once_but_finishes_a_checkpoint_being_written(tmp_path, tiny_weights, monkeypatch):
    """A second SIGINT during the update (2 s or more after the first) stops at once: nothing more is written. A
    second SIGTERM during a checkpoint write waits for the write's end: the checkpoint is whole, then the run stops."""
    sets = ["train.epochs=2", "train.save_every=1", "eval.every=0"]
    trainer = _trainer(tmp_path, tiny_weights, sets=sets)
    real_update = trainer.optimizer.update

    def update(*args, **kwargs):  # epoch 0's update: a first signal, then a later one
        _send(INT)
        trainer._stop.requested_at -= REPEAT_S + 1
        _send(INT)
        raise AssertionError("the second SIGINT did not stop the run")

    trainer.optimizer.update, trainer.console.record = update, True
    with pytest.raises(Stopped) as stopped:
        trainer.fit()
    assert stopped.value.at_once and stopped.value.exit_status == 130
    assert not list((tmp_path / "run").glob("checkpoints/*"))
    text = " ".join(trainer.console.export_text().split())
    assert "Stopped at once (Ctrl-C again): nothing more is saved; none was saved before" in text, text

    (tmp_path / "again").mkdir()
    trainer = _trainer(tmp_path / "again", tiny_weights, sets=sets)
    trainer.optimizer.update, real_save = real_update, run_checkpoints.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        _send(TERM)
        trainer._stop.requested_at -= REPEAT_S + 1
        _send(TERM)  # held: nothing raised inside the write
        return real_save(*args, **kwargs)

    monkeypatch.setattr(run_checkpoints, "save_checkpoint", save_checkpoint)
    with pytest.raises(Stopped) as stopped:
        trainer.fit()
    assert stopped.value.at_once and stopped.value.exit_status == 143
    assert [s["epoch"] for s in _states(tmp_path / "again" / "run")] == [1]
    assert find_checkpoint(tmp_path / "again" / "run")[0] is not None  # whole: its manifest verifies


def test_the_launcher_exits_with_the_signal_it_passed_on(monkeypatch, capsys):
    """SIGTERM to the launcher (Slurm, Kubernetes): 143, as SIGINT gives 130; processes that stopped on a signal
    they got themselves give their status, not "one of the processes exited"."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def launching(error):
        def elastic_launch(config, command):
            def run(*args):
                raise error

            return run

        monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", elastic_launch)

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # torchrun's parser sets it
    args = launch.torchrun_args(["train", "x.toml"], 2)
    launching(SignalException("got signal", sigval=signal.SIGTERM))
    assert launch.launch(args) == 143
    assert "interrupted (SIGTERM)" in capsys.readouterr().err
    failures = {r: ProcessFailure(local_rank=r, pid=1, exitcode=130, error_file="") for r in (0, 1)}
    launching(ChildFailedError("tpflow.cli", failures))
    assert launch.launch(args) == 130
    assert "interrupted (SIGINT)" in capsys.readouterr().err


def test_the_eval_progress_line_counts_clips_for_a_video_backbone():
    """It said "sampling 96 images" of clips too; the backbone's latent shape tells (a frame axis: a video's)."""
    from types import SimpleNamespace

    class Said(Exception):
        pass

    def phase(description, total):
        raise Said(description)

    def line(latent_shape: tuple[int, ...]) -> str:
        fake = SimpleNamespace(
            test_items=[None] * 3,
            recipe=SimpleNamespace(eval=SimpleNamespace(images_per_prompt=2)),
            backbone=SimpleNamespace(latent_shape=lambda: latent_shape),
            _phase=phase,
        )
        fake._sample_noun = lambda: Trainer._sample_noun(fake)
        with pytest.raises(Said) as said:
            Trainer.evaluate(fake, 4)
        return str(said.value)

    assert line((5, 3, 32, 32)) == "eval at epoch 4: sampling 6 clips"  # shapes-video-dit: (F, C, H, W)
    assert line((16, 9, 30, 52)) == "eval at epoch 4: sampling 6 clips"  # Wan: (C, F', h, w)
    assert line((4, 16, 16)) == "eval at epoch 4: sampling 6 images"


@pytest.mark.parametrize(("signum", "status"), [(INT, 130), (TERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_tpflow_train_exits_with_the_signal_that_stopped_it(signum, status, tmp_path):
    """One process: ``tpflow train`` leaves with 128 + the signal, as the launcher does (Slurm and Kubernetes read
    143 as "stopped by SIGTERM"), and prints the command that resumes."""
    import io
    import types

    import typer
    from rich.console import Console

    from tpflow import cli

    def fit():
        raise Stopped(signum)

    trainer = types.SimpleNamespace(fit=fit, dist=types.SimpleNamespace(is_main=True), run_dir=tmp_path / "run")
    out = io.StringIO()
    with pytest.raises(typer.Exit) as exited:
        recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "shapes_tp.toml")
        cli._fit(trainer, recipe, Console(file=out, width=200), 1)
    assert exited.value.exit_code == status
    assert "Nothing was saved yet" in out.getvalue() and "--run-dir" in out.getvalue()  # how to start it again


def test_two_processes_stopped_at_each_phase_resume_bitwise(tmp_path, tiny_weights):
    """2 processes (gloo): process 0 gets SIGINT or SIGTERM during an update, at a checkpoint write, at an
    evaluation and at a rollout batch; each time both stop at the same safe point and save together, nothing
    finished is lost, and the run resumed each time ends with the uninterrupted 2-process run's adapter, bit for
    bit."""
    from tests.distributed_workers import interrupt_chain_worker, spawn

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    chain = [("update", 0, TERM), ("checkpoint", 2, INT), ("eval", 2, TERM), ("rollout", 3, INT)]
    ranks = spawn(interrupt_chain_worker, tmp_path, str(recipe), SETS, chain)
    for result in ranks:  # (exit status on process 0 (1: the signal it agreed to), epoch of the newest checkpoint)
        assert [epoch for _, epoch in result["stops"]] == [1, 2, 2, 3], result["stops"]
        assert all(status in (130, 143) for status, _ in result["stops"]), result["stops"]
        ours, theirs = result["resumed"], result["straight"]
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [s for s, _ in ranks[0]["stops"]] == [143, 130, 143, 130]  # process 0 exits with the signal it got

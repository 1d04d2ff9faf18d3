"""The trainer end to end on a tiny shapes world: learning happens, resume is exact, faults stop cleanly."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tpflow.errors import UserError
from tpflow.recipe import load_recipe
from tpflow.train import prompt_policy as prompt_policy_module
from tpflow.train import sampling as sampling_module
from tpflow.train import trainer as trainer_module
from tpflow.train.prompt_sampler import plan_epoch
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

TIMING = ("_s", "time")  # metric names that measure wall time: never compared


def tiny_recipe(
    tmp_path: Path,
    weights: Path | None,
    credit: str = "consistent",
    reward: str = "brightness",
    extra: str = "",
    backbone: str | None = None,
) -> Path:
    """A recipe small enough for the tests; the default reward is the test plugin's image brightness, which a
    random tiny model already spreads (the shapes reward would be 0 for all its samples: nothing to learn).
    ``backbone`` replaces the [backbone] section's body (default: shapes-dit from ``weights``)."""
    backbone = backbone or f'name = "shapes-dit"\nweights = "{weights}"\nlora_init = "gaussian"'
    text = f"""
[backbone]
{backbone}
[reward]
name = "{reward}"
[dataset]
name = "shapes"
test_size = 6
[credit]
name = "{credit}"
[optimizer]
name = "grpo"
learning_rate = 1e-2
beta = 1e-3
micro_batch_size = 4
gradient_accumulation_steps = 1
[rollout]
num_steps = 4
window_size = 3
window_range = [0, 4]
guidance = 2.0
[train]
epochs = 2
prompts_per_epoch = 2
group_size = 4
rollout_batch = 4
save_every = 1
ema = true
ema_every = 1
run_dir = "{tmp_path / "run"}"
[eval]
every = 1
num_steps = 3
guidance = 2.0
batch_size = 6
{extra}
"""
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}


def test_two_epochs_train_the_adapter_only(tmp_path, tiny_weights, plugin, monkeypatch):
    trainer = Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights)))
    lora = _adapter(trainer)
    frozen = {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" not in n}
    planned = []  # each epoch is planned once, and the plan handed on (the sampler planned it a second time)
    counted = lambda *args: planned.append(args[2]) or plan_epoch(*args)  # noqa: E731
    for module in (trainer_module, sampling_module, prompt_policy_module):  # the trainer plans through its policy
        monkeypatch.setattr(module, "plan_epoch", counted, raising=False)  # the sampler no longer imports it
    metrics = trainer.fit()
    assert planned == [0, 1]
    after = dict(trainer.backbone.model.named_parameters())
    assert all(not torch.equal(lora[n], after[n]) for n in lora), "every LoRA tensor must change"
    assert all(torch.equal(frozen[n], after[n]) for n in frozen), "frozen weights must not change"
    lines = read_jsonl(trainer.run_dir / "metrics.jsonl")
    epochs = [line for line in lines if "reward_mean" in line]
    assert [line["epoch"] for line in epochs] == [0, 1]
    assert epochs[0]["first_ratio_max_deviation"] == 0.0  # the first micro-batch is exactly on policy
    for line in epochs:
        for key, value in line.items():
            assert value is None or not isinstance(value, float) or math.isfinite(value), key
    assert metrics["optimizer_steps"] >= 1 and "eval_reward" in metrics
    assert len(read_jsonl(trainer.run_dir / "traces.jsonl")) == 2 * 8
    assert (trainer.run_dir / "samples" / "eval_0000.png").is_file()
    assert sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir() if not p.name.startswith("."))


def test_resume_continues_exactly(tmp_path, tiny_weights, plugin):
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight_dir.mkdir()
    split_dir.mkdir()
    straight = Trainer(load_recipe(tiny_recipe(straight_dir, tiny_weights), ["train.epochs=4"]))
    straight.fit()
    first = Trainer(load_recipe(tiny_recipe(split_dir, tiny_weights), ["train.epochs=2"]))
    first.fit()
    with pytest.raises(UserError, match="--resume"):
        Trainer(load_recipe(tiny_recipe(split_dir, tiny_weights), ["train.epochs=4"]))
    second = Trainer(load_recipe(tiny_recipe(split_dir, tiny_weights), ["train.epochs=4"]), resume=True)
    assert second.epoch == 2
    second.fit()
    a, b = _adapter(straight), _adapter(second)
    assert all(torch.equal(a[n], b[n]) for n in a), "resumed adapter must equal the uninterrupted one bitwise"

    def comparable(run: Path) -> list[dict]:
        rows = read_jsonl(run / "metrics.jsonl")
        return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in rows]

    assert comparable(straight.run_dir) == comparable(second.run_dir)


@pytest.mark.parametrize("during", ["sampling", "update"])
def test_ctrl_c_saves_only_a_state_that_resumes_exactly(tmp_path, tiny_weights, plugin, during):
    trainer = Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights), ["eval.every=0", "train.epochs=3"]))
    real_encode, real_update = trainer.backbone.encode, trainer.optimizer.update

    def encode(prompts):
        if trainer.epoch == 1 and during == "sampling":
            raise KeyboardInterrupt
        return real_encode(prompts)

    def update(*args, **kwargs):
        metrics = real_update(*args, **kwargs)  # the weights have moved, the epoch is not counted yet
        if trainer.epoch == 1 and during == "update":
            raise KeyboardInterrupt
        return metrics

    trainer.backbone.encode, trainer.optimizer.update = encode, update
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    steps_after_epoch_0 = read_state(next((trainer.run_dir / "checkpoints").iterdir()))["global_step"]
    # Sampling: the Ctrl-C checkpoint is the state after epoch 0 again (same step, rewritten). Update: the weights
    # have moved past it, and no checkpoint of that half-counted state is written.
    if during == "update":
        assert trainer.optimizer.global_step > steps_after_epoch_0
    else:  # nothing of epoch 1 was updated: the trainer stopped at the state it saved
        assert trainer.optimizer.global_step == steps_after_epoch_0
    states = [read_state(path) for path in (trainer.run_dir / "checkpoints").iterdir()]
    assert states == [{"epoch": 1, "global_step": steps_after_epoch_0, "last_eval": {}}]


def read_state(checkpoint: Path) -> dict:
    import json

    return json.loads((checkpoint / "state.json").read_text())


def test_failing_reward_stops_with_a_clear_message(tmp_path, tiny_weights, plugin):
    trainer = Trainer(load_recipe(tiny_recipe(tmp_path, tiny_weights), ["eval.every=0"]))
    calls = []

    def broken(images, prompts, metadata):
        calls.append(len(images))
        raise ConnectionError("reward server down")

    trainer.reward = broken
    with pytest.raises(UserError, match="failed twice.*reward server down.*--resume"):
        trainer.fit()
    assert len(calls) == 2  # retried once; the epoch's second rollout batch, queued meanwhile, is not scored


def test_cli_train_and_resume(tmp_path, tiny_weights):
    from tests.cli_run import tpflow  # in this process: the real entry point runs in test_distributed_train.py

    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="shapes-geneval")
    run = ["train", str(recipe), "--epochs", "1", "--set", "eval.every=1"]
    out = tpflow(*run)
    assert out.returncode == 0, out.stderr
    assert "done." in out.stdout and "samples:" in out.stdout
    again = tpflow(*run)
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    resumed = tpflow(*run[:3], "2", *run[4:], "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert "eval_acc_counting" in lines[0]  # per-tag accuracy of GenEval-style rewards
    assert "eval_strict" in lines[0] and "eval_strict_tags" in lines[0]  # over images; over tags (GenEval's)
    assert lines[0]["last_eval_epoch"] == 0 and "| eval@0 " in out.stdout  # the eval each epoch line repeats


@pytest.mark.parametrize("same_noise", [False, True])
def test_items_with_the_same_text_form_one_prompt_group(tmp_path, tiny_weights, plugin, same_noise):
    """docs/algorithm.md §5: advantages are normalised over every sample of the same prompt TEXT in the gathered batch.
    Two dataset items that share a text (the shapes train split repeats its texts) must be one group of 2G, not
    two groups of G: grouping on the dataset item gives different advantages. With ``same_noise`` each item's copies
    share their own z_0, and a group is one start: two groups of G (DanceGRPO's, MixGRPO's, TempFlow's siblings)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a circle\na photo of a  Circle\n")  # case and spacing folded, as the reference
    extra = f'[dataset]\nname = "text-file"\npath = "{prompts}"\n'
    text = tiny_recipe(tmp_path, tiny_weights).read_text().replace('[dataset]\nname = "shapes"\ntest_size = 6\n', "")
    path = tmp_path / "dup.toml"
    path.write_text(text + extra)
    sets = ["train.epochs=1", "train.rollout_batch=8", "eval.every=0", f"rollout.same_noise={str(same_noise).lower()}"]
    trainer = Trainer(load_recipe(path, sets))
    trainer.fit()
    traces = [r for r in read_jsonl(trainer.run_dir / "traces.jsonl") if r["epoch"] == 0]
    assert len(traces) == 8 and {r["item"] for r in traces} == {0, 1}  # both items drawn, G = 4 copies each
    if same_noise:
        assert all(r["group"] == [t["group"] for t in traces if t["item"] == r["item"]][0] for r in traces)
        assert len({r["group"] for r in traces}) == 2
    else:
        assert {r["group"] for r in traces} == {0}
    step_rewards = torch.tensor([r["step_rewards"] for r in traces], dtype=torch.float64)
    from tpflow.optim.advantages import group_advantages

    by_text = group_advantages(step_rewards, [0] * 8)
    by_item = group_advantages(step_rewards, [r["item"] for r in traces])
    logged = torch.tensor([r["advantages"] for r in traces], dtype=torch.float64)
    assert not torch.allclose(by_text, by_item)  # the test can tell the two groupings apart
    torch.testing.assert_close(logged, by_item if same_noise else by_text, rtol=0, atol=1e-12)


def _interrupt_at(monkeypatch, epoch: int) -> None:
    """Ctrl-C at the start of ``epoch``'s training (after the previous epochs and their checkpoints)."""
    original = Trainer.train_epoch

    def train_epoch(self, e):
        if e == epoch:
            raise KeyboardInterrupt
        return original(self, e)

    monkeypatch.setattr(Trainer, "train_epoch", train_epoch)


def test_the_ctrl_c_hint_reproduces_the_run_as_started(tmp_path, tiny_weights, plugin, monkeypatch):
    """The printed command keeps --epochs and every --set, so the resumed run ends where the started one
    would have, with logs equal to an uninterrupted run's (it used to drop them and train to the file's epochs)."""
    import shlex

    from tests.cli_run import tpflow

    recipe = tiny_recipe(tmp_path, tiny_weights)
    args = ["--epochs", "3", "--set", "optimizer.learning_rate=2e-2", "--set", "train.save_every=1"]
    straight = tpflow("train", str(recipe), *args, "--run-dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    with monkeypatch.context() as patch:
        _interrupt_at(patch, 2)
        stopped = tpflow("train", str(recipe), *args, "--run-dir", str(tmp_path / "split"))
    assert stopped.returncode == 130
    (hint,) = [line for line in stopped.stdout.splitlines() if line.startswith("Resume with: ")]
    command = shlex.split(hint.removeprefix("Resume with: "))
    assert command[:2] == ["tpflow", "train"] and "train.epochs=3" in command and "--resume" in command
    resumed = tpflow(*command[1:])
    assert resumed.returncode == 0, resumed.stderr

    def comparable(run):
        return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in read_jsonl(run / "metrics.jsonl")]

    assert comparable(tmp_path / "split") == comparable(tmp_path / "straight")
    assert max(row["epoch"] for row in read_jsonl(tmp_path / "split" / "metrics.jsonl")) == 3  # not the file's 2


def test_ctrl_c_before_any_checkpoint_prints_a_command_that_works(tmp_path, tiny_weights, plugin, monkeypatch):
    """Interrupted before the first checkpoint: nothing to resume from, so the hint starts the run again."""
    import shlex

    from tests.cli_run import tpflow
    from tpflow.optim.grpo import GRPO

    recipe = tiny_recipe(tmp_path, tiny_weights)
    args = ["--set", "train.save_every=10", "--set", "eval.every=10"]

    def update(*_args, **_kwargs):  # Ctrl-C in epoch 0's update: its weights are not a state to save
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(GRPO, "update", update)
        stopped = tpflow("train", str(recipe), *args, "--run-dir", str(tmp_path / "run"))
    assert stopped.returncode == 130
    text = " ".join(stopped.stdout.split())
    assert "none was saved before" in text and "Nothing was saved yet" in text, text
    command = shlex.split(text.split("start the run again with: ", 1)[1])
    assert "--resume" not in command and "train.save_every=10" in command
    again = tpflow(*command[1:])
    assert again.returncode == 0, again.stderr


def test_resuming_with_other_epochs_says_so(tmp_path, tiny_weights, plugin):
    """Also: without a terminal (a pipe here) the run prints its phase at [log] progress_lines_s."""
    from tests.cli_run import tpflow

    recipe = tiny_recipe(tmp_path, tiny_weights)
    lines = ("--set", "log.progress_lines_s=0.02")
    first = tpflow("train", str(recipe), "--epochs", "1", *lines, "--run-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stderr
    assert re.search(r"^\d\d:\d\d:\d\d epoch 0: (sampling|scoring|updating)", first.stdout, re.MULTILINE)
    more = tpflow("train", str(recipe), "--epochs", "2", *lines, "--resume", "--run-dir", str(tmp_path / "run"))
    assert more.returncode == 0 and "train.epochs 1 in the run, 2 now" in " ".join(more.stdout.split()), more.stdout

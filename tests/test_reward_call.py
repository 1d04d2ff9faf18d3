"""Rewards fail the same way on every path (tpflow/scoring/call.py): the output is checked, an exception or NaN is
retried then stops with one paragraph, sys.exit and a hang become a RewardError, evaluation retries like training."""

from __future__ import annotations

import logging
import math
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.test_train import tiny_recipe
from tpflow import registry
from tpflow.errors import RewardError, UserError
from tpflow.recipe import load_recipe
from tpflow.scoring.call import RewardPolicy, call_reward, recipe_policy
from tpflow.train.trainer import Trainer
from tpflow.types import RewardOutput

IMAGES = torch.rand(4, 3, 8, 8)
PROMPTS, META = ["a"] * 4, [{}] * 4
NO_LIMIT = RewardPolicy(timeout_s=0)
POLICIES = [RewardPolicy(), NO_LIMIT]  # in a time-limited thread, and in the caller's thread


def brightness(images, prompts, metadata):
    return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)), details={"grey": images.mean(dim=(1, 2, 3))})


class Flaky:
    """Raises (or returns NaN) on the first ``failures`` calls, then scores brightness."""

    def __init__(self, failures: int, nan: bool = False):
        self.failures, self.nan, self.calls = failures, nan, 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        if self.calls <= self.failures:
            if self.nan:
                return RewardOutput(scores=torch.full((len(images),), float("nan")))
            raise ConnectionError("reward server down\n(second line of the message)")
        return brightness(images, prompts, metadata)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_failure_is_retried_once_then_stops_with_one_paragraph(policy):
    once = Flaky(1)
    out = call_reward(once, IMAGES, PROMPTS, META, policy)
    assert once.calls == 2 and out.scores.shape == (4,) and out.details["grey"].dtype == torch.float32
    always = Flaky(99)
    with pytest.raises(RewardError) as err:
        call_reward(always, IMAGES, PROMPTS, META, policy)
    message = str(err.value).split("\n")[0]  # the paragraph; the reward's last frames follow it
    assert always.calls == 2
    assert "'Flaky' failed twice on the same 4 images" in message
    assert "ConnectionError: reward server down (second line of the message)" in message and "--resume" in message


def _lookup(table: dict) -> float:
    """A reward's helper with a bug: the frame its traceback must show."""
    return table["missing"]


def buggy(images, prompts, metadata):
    return _lookup({})


@pytest.mark.parametrize("policy", POLICIES)
def test_a_reward_bug_keeps_its_cause_and_shows_its_last_frames(policy):
    with pytest.raises(RewardError) as err:
        call_reward(buggy, IMAGES, PROMPTS, META, policy)
    assert isinstance(err.value.__cause__, KeyError)  # chained: a caller's traceback shows the reward's own
    paragraph, *frames = str(err.value).split("\n")
    assert "'buggy' failed twice on the same 4 images (it raised KeyError: 'missing')" in paragraph
    shown = "\n".join(frames)
    assert f'File "{__file__}"' in shown and "in _lookup" in shown and 'return table["missing"]' in shown
    assert shown.rstrip().endswith("KeyError: 'missing'")
    assert "scoring/call.py" not in shown  # tpflow's frames around the call are not the reward's traceback


def test_retries_follow_the_policy():
    flaky = Flaky(3)
    call_reward(flaky, IMAGES, PROMPTS, META, RewardPolicy(retries=3))
    assert flaky.calls == 4
    never = Flaky(1)
    with pytest.raises(RewardError, match="failed once"):
        call_reward(never, IMAGES, PROMPTS, META, RewardPolicy(retries=0))


def test_nonfinite_scores_are_retried_then_stop_or_are_kept():
    nan = Flaky(99, nan=True)
    with pytest.raises(RewardError, match="failed twice.*4 non-finite scores"):
        call_reward(nan, IMAGES, PROMPTS, META)
    assert nan.calls == 2
    kept = call_reward(Flaky(99, nan=True), IMAGES, PROMPTS, META, RewardPolicy(nonfinite="keep"))
    assert torch.isnan(kept.scores).all()
    assert torch.isfinite(call_reward(Flaky(1, nan=True), IMAGES, PROMPTS, META).scores).all()


@pytest.mark.parametrize(
    ("returned", "what"),
    [
        ([0.1, 0.2, 0.3, 0.4], "returned a list of 4 float, not a RewardOutput,"),
        (torch.rand(4), "returned a tensor of shape [4] (torch.float32), not a RewardOutput,"),
        (RewardOutput(scores=torch.rand(3)), "scores that are a tensor of shape [3] (torch.float32) for 4 images"),
        (RewardOutput(scores=torch.rand(4, 1)), "scores that are a tensor of shape [4, 1]"),
        (RewardOutput(scores=[0.1] * 4), "scores that are a list of 4 float"),  # type: ignore[arg-type]
        (RewardOutput(scores=torch.ones(4, dtype=torch.long)), "scores of dtype torch.int64"),
        (
            RewardOutput(scores=torch.rand(4), details={"x": torch.rand(2)}),
            "details['x'] that are a tensor of shape [2]",
        ),
        (RewardOutput(scores=torch.rand(4), details=[1]), "details that are a list of 1 int, not a dict,"),  # type: ignore[arg-type]
        (None, "returned None"),
    ],
)
def test_a_wrong_output_stops_at_once_and_says_what_came_back(returned, what):
    calls = []

    def wrong(images, prompts, metadata):
        calls.append(1)
        return returned

    with pytest.raises(RewardError) as err:
        call_reward(wrong, IMAGES, PROMPTS, META)
    assert what in str(err.value) and "Reward 'wrong'" in str(err.value) and "RewardOutput(scores=" in str(err.value)
    assert len(calls) == 1  # a bug in the reward, not a flaky server: no retry


def test_a_registered_reward_is_named_by_its_recipe_name():
    reward = registry.build("reward", "image-stat")
    reward.options = None  # breaks it: AttributeError on every call
    with pytest.raises(RewardError, match=r"Reward 'image-stat' \(ImageStatReward\) failed twice"):
        call_reward(reward, IMAGES, PROMPTS, META)


@pytest.mark.parametrize("policy", POLICIES)
def test_sys_exit_in_a_reward_is_an_error_and_ctrl_c_still_interrupts(policy):
    def exits(images, prompts, metadata):
        sys.exit(3)

    with pytest.raises(RewardError, match=r"'exits' called sys.exit\(3\) while scoring"):
        call_reward(exits, IMAGES, PROMPTS, META, policy)

    def interrupted(images, prompts, metadata):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_reward(interrupted, IMAGES, PROMPTS, META, policy)


def test_a_hanging_reward_is_an_error_within_the_time_limit():
    release = threading.Event()

    def hangs(images, prompts, metadata):
        release.wait(60)
        return brightness(images, prompts, metadata)

    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"'hangs' did not return within 0.3 s on 4 images.*reward_timeout_s"):
        call_reward(hangs, IMAGES, PROMPTS, META, RewardPolicy(timeout_s=0.3))
    assert time.perf_counter() - start < 5
    start = time.perf_counter()
    with pytest.raises(RewardError, match="still running a call that exceeded the time limit"):
        call_reward(hangs, IMAGES, PROMPTS, META, RewardPolicy(timeout_s=0.3))  # at once, no second wait
    assert time.perf_counter() - start < 0.3
    release.set()  # the abandoned call returns: the reward may be called again
    for thread in threading.enumerate():
        if thread.name == "tpflow-reward":
            thread.join(5)
    assert call_reward(hangs, IMAGES, PROMPTS, META).scores.shape == (4,)


def test_the_reward_thread_keeps_the_callers_grad_mode():
    seen = []

    def records(images, prompts, metadata):
        seen.append(torch.is_grad_enabled())
        return brightness(images, prompts, metadata)

    with torch.no_grad():
        call_reward(records, IMAGES, PROMPTS, META)
    call_reward(records, IMAGES, PROMPTS, META)
    assert seen == [False, True]


def test_the_recipe_sets_the_policy(tmp_path, tiny_weights, plugin):
    recipe = load_recipe(
        tiny_recipe(tmp_path, tiny_weights),
        ["train.reward_timeout_s=5", "train.reward_retries=2", "eval.nonfinite_rewards=warn"],
    )
    assert recipe_policy(recipe.train) == RewardPolicy(5.0, 2, "stop")  # training rollouts never keep a NaN
    assert recipe_policy(recipe.train, recipe.eval) == RewardPolicy(5.0, 2, "keep")
    default = load_recipe(tiny_recipe(tmp_path, tiny_weights))
    assert recipe_policy(default.train, default.eval) == RewardPolicy()


# ---- evaluation and training through the trainer ---------------------------------------------------------------


def _trainer(tmp_path: Path, weights: Path, *overrides: str) -> Trainer:
    tmp_path.mkdir(exist_ok=True)
    return Trainer(load_recipe(tiny_recipe(tmp_path, weights), ["train.epochs=1", *overrides]))


def test_evaluation_retries_like_training(tmp_path, tiny_weights, plugin):
    trainer = _trainer(tmp_path, tiny_weights)
    flaky = Flaky(1)
    trainer.reward = flaky
    metrics = trainer.evaluate(0)
    assert flaky.calls == 2 and math.isfinite(metrics["eval_reward"])
    trainer.reward = always = Flaky(99)
    with pytest.raises(RewardError, match="'Flaky' failed twice on the same 6 images.*ConnectionError") as err:
        trainer.evaluate(0)
    paragraph, *frames = str(err.value).split("\n")
    assert always.calls == 2 and "--resume" in paragraph
    shown = "\n".join(frames)  # the Flaky reward's own frame, then its exception
    assert "in __call__" in shown and "\nConnectionError: reward server down" in shown


def test_evaluation_with_nan_scores_stops_by_default_and_warns_when_asked(tmp_path, tiny_weights, plugin, caplog):
    trainer = _trainer(tmp_path, tiny_weights)
    trainer.reward = Flaky(99, nan=True)
    with pytest.raises(RewardError, match="failed twice on the same 6 images.*6 non-finite scores"):
        trainer.evaluate(0)
    warn = _trainer(tmp_path / "warn", tiny_weights, "eval.nonfinite_rewards=warn")
    warn.reward = Flaky(99, nan=True)
    for _ in range(2):  # every evaluation says it, not only the first
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tpflow.train.evaluation"):
            metrics = warn.evaluate(0)
        assert math.isnan(metrics["eval_reward"])
        [record] = caplog.records
        assert "reward 'Flaky' returned non-finite scores (NaN or inf) for 6 of 6 images" in record.getMessage()


def test_evaluation_checks_the_output(tmp_path, tiny_weights, plugin):
    trainer = _trainer(tmp_path, tiny_weights)
    trainer.reward = lambda images, prompts, metadata: images.mean(dim=(1, 2, 3)).tolist()
    with pytest.raises(RewardError, match="returned a list of 6 float, not a RewardOutput"):
        trainer.evaluate(0)


def test_a_hanging_reward_stops_training_without_hanging_it(tmp_path, tiny_weights, plugin):
    trainer = _trainer(tmp_path, tiny_weights, "eval.every=0", "train.reward_timeout_s=0.5")
    release = threading.Event()

    def hangs(images, prompts, metadata):
        release.wait(60)
        return brightness(images, prompts, metadata)

    trainer.reward = hangs
    start = time.perf_counter()
    try:
        with pytest.raises(RewardError, match="'hangs' did not return within 0.5 s"):
            trainer.fit()  # the scoring worker is shut down without waiting for a second 0.5 s
        assert time.perf_counter() - start < 30
    finally:
        release.set()


# ---- the CLI: exit status 2, never a silent exit or a hang ----------------------------------------------------

MISBEHAVING = textwrap.dedent(
    '''
    """A third-party reward that misbehaves as its option says."""
    import sys
    import time

    from pydantic import BaseModel, ConfigDict

    from tpflow.types import RewardOutput


    def lookup(table):
        return table["missing"]


    class MisbehavingReward:
        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")
            mode: str = "hang"

        def __init__(self, options):
            self.mode = options.mode

        def __call__(self, images, prompts, metadata):
            if self.mode == "hang":
                time.sleep(120)
            if self.mode == "exit":
                sys.exit(0)
            if self.mode == "keyerror":
                return lookup({})
            return RewardOutput(scores=images.mean(dim=(1, 2, 3)))
    '''
)


@pytest.fixture
def misbehaving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The ``misbehaving`` reward as an installed plugin, in this process and in subprocesses (PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "misbehaving_mod.py").write_text(MISBEHAVING)
    info = site / "tpflow_misbehaving-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tpflow_misbehaving\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tpflow.rewards]\nmisbehaving = misbehaving_mod:MisbehavingReward\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    registry.refresh_plugins()
    yield site
    sys.modules.pop("misbehaving_mod", None)
    monkeypatch.undo()
    registry.refresh_plugins()


def _misbehaving_recipe(tmp_path: Path, weights: Path, mode: str) -> Path:
    recipe = tiny_recipe(tmp_path, weights, reward="misbehaving")
    recipe.write_text(recipe.read_text().replace('name = "misbehaving"', f'name = "misbehaving"\nmode = "{mode}"'))
    return recipe


def test_cli_exits_2_on_a_hanging_reward_instead_of_hanging(tmp_path, tiny_weights, misbehaving):
    """A real process (forked: ``TpflowForked``) whose reward never returns: it exits 2 with one paragraph, without
    waiting for the reward's thread at exit."""
    from tests.cli_run import TpflowForked

    recipe = _misbehaving_recipe(tmp_path, tiny_weights, "hang")
    process = TpflowForked("train", str(recipe), "--set", "train.reward_timeout_s=0.5", folder=tmp_path / "out")
    code = process.wait(timeout=100)  # the reward sleeps 120 s: the process did not wait for it
    _, stderr = process.output()
    assert code == 2, stderr
    assert "'misbehaving' (MisbehavingReward) did not return within 0.5 s" in stderr
    assert "Traceback" not in stderr


def test_cli_exits_2_on_sys_exit_in_a_reward(tmp_path, tiny_weights, misbehaving, capsys):
    from tpflow.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", str(_misbehaving_recipe(tmp_path, tiny_weights, "exit"))])
    assert exc.value.code == 2
    assert "'misbehaving' (MisbehavingReward) called sys.exit(0)" in capsys.readouterr().err


def test_cli_exits_2_on_a_bug_in_a_reward_and_shows_its_traceback(tmp_path, tiny_weights, misbehaving, capsys):
    from tpflow.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", str(_misbehaving_recipe(tmp_path, tiny_weights, "keyerror")), "--set", "eval.every=0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "'misbehaving' (MisbehavingReward) failed twice" in err and "KeyError: 'missing'" in err
    assert "misbehaving_mod.py" in err and "in lookup" in err and 'return table["missing"]' in err


class OutOfMemory:
    """A reward whose model does not fit on the GPU: every call runs out of memory."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.10 GiB")


@pytest.mark.parametrize("policy", POLICIES)
def test_out_of_memory_is_not_retried_and_names_the_reward_and_its_batch(policy):
    """Retrying the same images runs out of memory again: the reward is called once, and what it raises is both a
    RewardError (one paragraph from any command) and torch's out-of-memory error (the trainer's paragraph, next
    test), naming the reward, its batch and the settings that size it."""
    reward = OutOfMemory()
    with pytest.raises(torch.cuda.OutOfMemoryError) as err:
        call_reward(reward, IMAGES, PROMPTS, META, RewardPolicy(policy.timeout_s, retries=3))
    message = str(err.value)
    assert reward.calls == 1 and isinstance(err.value, RewardError) and "\n" not in message
    assert isinstance(err.value.__cause__, torch.cuda.OutOfMemoryError)
    assert message.startswith("Reward 'OutOfMemory' ran out of GPU memory on a batch of 4 images, not retried")
    assert "train.score_batch" in message and "eval.batch_size" in message
    assert message.endswith("fewer at once: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.10 GiB")


def test_out_of_memory_in_a_reward_reaches_the_trainers_out_of_memory_paragraph(tmp_path, tiny_weights, plugin):
    trainer = _trainer(tmp_path, tiny_weights, "eval.every=0", "log.trackers=[]")
    trainer.reward = reward = OutOfMemory()
    with pytest.raises(UserError) as err:
        trainer.fit()
    message = str(err.value)
    assert reward.calls == 1 and "\n" not in message
    assert message.startswith("Out of GPU memory while epoch 0: scoring (Reward 'OutOfMemory' ran out of GPU memory")
    assert "lower train.score_batch (images decoded and scored at once" in message
    assert "starts the run again" in message and "--resume" not in message  # epoch 0: nothing saved yet


def test_after_a_batch_fails_the_scoring_worker_scores_no_later_batch():
    """The trainer stops the epoch at the first batch whose reward failed; batches queued meanwhile are not scored,
    whenever the worker reaches them (a reward server that is down is not called again for them)."""
    from tpflow.train.scoring import ScoringWorker

    calls, gate = [], threading.Event()

    def reward(images, prompts, metadata):
        calls.append(len(images))
        gate.wait(5)  # the second batch is queued before the first fails
        raise ConnectionError("down")

    worker = ScoringWorker(lambda latents: latents, reward, policy=RewardPolicy(retries=0))
    latents = torch.zeros(2, 3, 4, 4)
    first, second = (worker.submit(latents, None, ["a", "b"], [{}, {}], 1) for _ in range(2))
    gate.set()
    with pytest.raises(RewardError, match="down"):
        first.result()
    with pytest.raises(RuntimeError, match="earlier rollout batch's scoring failed"):
        second.result()
    worker.close()
    assert calls == [2]

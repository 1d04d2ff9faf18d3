"""The prompt sampler's policy (``[train] prompt_policy``, tpflow.train.prompt_policy): 'uniform' plans as
``plan_epoch`` always did; 'skip-solved' sets aside the texts whose groups had zero reward variance, for
``prompt_skip_epochs`` epochs or for good, fills a round from them only when the others are too few, and resumes
from a checkpoint drawing what the uninterrupted run drew."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError
from tpflow.recipe import load_recipe
from tpflow.settings import TrainSettings
from tpflow.train.prompt_policy import NEVER, PromptPolicy
from tpflow.train.prompt_sampler import plan_epoch
from tpflow.train.run_logger import epoch_line, read_jsonl
from tpflow.train.trainer import Trainer

PROMPTS = ["a red circle", "A red  circle", "a blue square", "a green star", "two cats", "one dog"]  # 0, 1: one text


def _settings(**kw) -> TrainSettings:
    base = {"prompts_per_epoch": 2, "group_size": 2, "rollout_batch": 2, "seed": 3}
    return TrainSettings(**{**base, **kw})


def _drawn(plan) -> set[int]:
    return {item for batch in plan.batches for item in batch.items}


def _observe(policy: PromptPolicy, epoch: int, rewards: dict[int, list[float]]):
    """Rows of ``rewards`` (item -> its copies' final rewards), one group per text (as ``prompt_groups``)."""
    items = [item for item, values in rewards.items() for _ in values]
    texts = {key: k for k, key in enumerate(dict.fromkeys(policy.keys[i] for i in items))}
    groups = [texts[policy.keys[i]] for i in items]
    final = torch.tensor([v for values in rewards.values() for v in values])
    return policy.observe(policy.plan(epoch), items, groups, final)


def test_uniform_plans_as_plan_epoch_and_keeps_no_state():
    """The default draws exactly what ``plan_epoch`` draws, sets nothing aside and adds no metric."""
    train = _settings()
    policy = PromptPolicy(train, PROMPTS)
    for epoch in range(3):
        assert policy.plan(epoch) == plan_epoch(len(PROMPTS), train, epoch)
        assert _observe(policy, epoch, {2: [1.0, 1.0], 3: [0.0, 0.0]}) == {}
    assert policy.aside == {} and policy.state_dict(5) == []
    policy.load_state_dict([[2, 0, NEVER]])  # a skip-solved run's checkpoint resumed with 'uniform'
    assert policy.plan(4) == plan_epoch(len(PROMPTS), train, 4)


def test_a_solved_text_is_not_drawn_for_its_epochs_then_returns():
    """A group of equal rewards sets aside every item of its text (0 and 1: one text) for prompt_skip_epochs
    epochs; a group that varies, or has a NaN, sets nothing aside."""
    policy = PromptPolicy(_settings(prompt_policy="skip-solved", prompt_skip_epochs=2), PROMPTS)
    metrics = _observe(policy, 0, {0: [1.0, 1.0], 2: [0.0, 1.0], 3: [float("nan"), float("nan")]})
    assert metrics == {"prompts_skipped": 0.0, "prompts_drawn_back": 0.0, "prompts_solved": 1.0}
    assert policy.aside == {0: (0, 3), 1: (0, 3)}
    for epoch in (1, 2):
        assert policy.set_aside(epoch) == {0, 1}
        assert not _drawn(policy.plan(epoch)) & {0, 1}, epoch
    assert policy.set_aside(3) == set()
    assert _observe(policy, 1, {4: [0.5, 0.5]})["prompts_skipped"] == 2.0


def test_never_again_and_the_floor_that_fills_a_round():
    """prompt_skip_epochs = 0 keeps a solved text aside for good; when fewer other items remain than a round draws,
    the round takes them all and draws set-aside ones back (counted), so the epoch keeps its batches."""
    policy = PromptPolicy(_settings(prompt_policy="skip-solved", prompts_per_epoch=4, rollout_batch=4), PROMPTS)
    _observe(policy, 0, {0: [1.0, 1.0], 2: [0.0, 0.0], 3: [0.2, 0.2]})  # items 0, 1, 2, 3 aside; 4, 5 remain
    assert all(until == NEVER for _, until in policy.aside.values())
    plan = policy.plan(40)
    drawn = [item for batch in plan.batches for item in batch.items]
    assert len(drawn) == 8 and {4, 5} <= set(drawn) and plan.refilled == 2
    assert len(set(drawn)) == 4, "the round's prompts stay distinct"
    unchanged = plan_epoch(len(PROMPTS), policy.train, 40)
    assert [len(b.items) for b in plan.batches] == [len(b.items) for b in unchanged.batches]


def test_a_text_with_a_varying_group_is_not_solved():
    """With same_noise a text's rows form one group per start: the text is set aside only if every group was
    solved."""
    policy = PromptPolicy(_settings(prompt_policy="skip-solved"), PROMPTS)
    final = torch.tensor([1.0, 1.0, 0.0, 1.0])
    metrics = policy.observe(policy.plan(0), [0, 0, 1, 1], [0, 0, 1, 1], final)
    assert metrics["prompts_solved"] == 0.0 and policy.aside == {}


def test_the_state_round_trips_and_leaves_out_an_epoch_cut_short():
    """``state_dict(e)`` holds what epochs before e set aside (JSON-ready ints); what epoch e itself observed (a
    stop after its update, before it counted) is not in a checkpoint whose next epoch is e."""
    policy = PromptPolicy(_settings(prompt_policy="skip-solved", prompt_skip_epochs=5), PROMPTS)
    _observe(policy, 0, {2: [1.0, 1.0]})
    _observe(policy, 1, {3: [1.0, 1.0]})
    assert policy.state_dict(1) == [[2, 0, 6]]
    assert policy.state_dict(2) == [[2, 0, 6], [3, 1, 7]]
    fresh = PromptPolicy(policy.train, PROMPTS)
    fresh.load_state_dict(policy.state_dict(2))
    assert all(fresh.plan(e) == policy.plan(e) for e in range(2, 9))


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["train.prompt_skip_epochs=3"], ["prompt_skip_epochs=3", "'uniform'", "skip-solved"]),
        (['train.prompt_policy="skip-solved"', "train.group_size=1", "train.rollout_batch=2"], ["group_size = 1"]),
    ],
    ids=["skip-epochs-with-uniform", "groups-of-one"],
)
def test_incoherent_policies_are_refused_in_one_paragraph(tmp_path, tiny_weights, sets, words):
    with pytest.raises(RecipeError) as error:
        load_recipe(tiny_recipe(tmp_path, tiny_weights, reward="image-stat"), sets)
    text = str(error.value).strip()
    assert "\n\n" not in text and "Traceback" not in text
    assert all(w in text for w in words), text


def test_the_epoch_line_shows_skipped_prompts_only_when_some_are():
    assert "skipped" not in epoch_line(3, {"reward_mean": 0.5, "prompts_skipped": 0.0, "epoch_s": 1.0})
    assert epoch_line(3, {"reward_mean": 0.5, "prompts_skipped": 7.0, "epoch_s": 1.0}).endswith("skipped 7 | 1.0 s")


def _items_by_epoch(run) -> list[list[str]]:
    rows = read_jsonl(run / "traces.jsonl")
    return [sorted(r["prompt"] for r in rows if r["epoch"] == e) for e in sorted({r["epoch"] for r in rows})]


class _OddTextsOnly:
    """image-stat's scores for the prompts of odd CRC-32, 0 for the others: their groups are solved."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, images, prompts, metadata):
        out = self.inner(images, prompts, metadata)
        odd = torch.tensor([_odd(p) for p in prompts])
        return dataclasses.replace(out, scores=torch.where(odd, out.scores, torch.zeros_like(out.scores)))


def _odd(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 2 == 1


def _trainer(recipe, sets, resume: bool = False) -> Trainer:
    trainer = Trainer(load_recipe(recipe, sets), resume=resume)
    trainer.reward = _OddTextsOnly(trainer.reward)
    return trainer


def _two_process_worker(rank: int, out, recipe: str, sets: list[str]) -> dict:
    """``_trainer``'s run on this process of two: the prompts it set aside, [item, epoch, until] each."""
    from pathlib import Path

    trainer = _trainer(Path(recipe), sets)
    trainer.fit()
    return {"aside": torch.tensor(trainer.prompts.state_dict(trainer.epoch), dtype=torch.long).reshape(-1, 3)}


def test_skip_solved_resumes_from_what_a_kill_leaves_drawing_the_same_prompts(tmp_path, tiny_weights):
    """The texts of even CRC-32 score 0 (solved: all failed) and are set aside for good; the others train. A kill
    after the first checkpoint, resumed, draws in every later epoch the texts the uninterrupted run drew, none set
    aside before, and logs the same metrics (prompts_skipped included)."""
    sets = ["train.epochs=3", "eval.every=0", "train.keep_checkpoints=0", 'train.prompt_policy="skip-solved"',
            "train.prompts_per_epoch=4"]  # fmt: skip
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    straight = _trainer(recipe, sets)
    straight.fit()
    drawn = _items_by_epoch(straight.run_dir)
    even = [{p for p in epoch if not _odd(p)} for epoch in drawn]
    assert len(drawn) == 3 and even[0] and not even[2] & (even[0] | even[1]), drawn
    skipped = [row["prompts_skipped"] for row in read_jsonl(straight.run_dir / "metrics.jsonl")]
    assert skipped[0] == 0 and 0 < skipped[1] <= skipped[2], skipped
    killed = tmp_path / "killed"
    written = what_a_kill_leaves(straight.run_dir, killed)
    assert len(written) == 3, [p.name for p in written]
    resumed = _trainer(recipe, [*sets, f"train.run_dir={killed}"], resume=True)
    before = {i: v for i, v in straight.prompts.aside.items() if v[0] < 1}
    assert resumed.epoch == 1 and resumed.prompts.aside == before
    resumed.fit()
    assert _items_by_epoch(resumed.run_dir) == drawn
    assert comparable_metrics(straight.run_dir) == comparable_metrics(resumed.run_dir)
    # two processes, each deciding from the gathered rows: the same prompts set aside on both, and as on one
    from tests.distributed_workers import spawn

    two = tmp_path / "two"
    two.mkdir()
    ranks = spawn(_two_process_worker, two, str(recipe), [*sets, f"train.run_dir={two / 'run'}"])
    alone = torch.tensor(straight.prompts.state_dict(3), dtype=torch.long).reshape(-1, 3)
    assert len(alone) and all(torch.equal(r["aside"], alone) for r in ranks)
    assert _items_by_epoch(two / "run") == drawn


class _TwoProcesses:
    """A Distributed whose other process holds ``theirs`` (gather_objects as two processes answer it)."""

    enabled, sharded = True, False

    def __init__(self, theirs) -> None:
        self.theirs = theirs

    def gather_objects(self, objects):
        return [*objects, self.theirs]


def test_a_save_refuses_processes_that_set_aside_different_prompts(tmp_path):
    """The invariant every process's policy keeps (the same gathered rows, the same decisions), checked before a
    collective checkpoint: equal states pass, different ones raise."""
    from types import SimpleNamespace

    from tpflow.train.checkpoints.run import RunCheckpoints

    policy = PromptPolicy(_settings(prompt_policy="skip-solved"), PROMPTS)
    _observe(policy, 0, {2: [1.0, 1.0]})
    recipe = SimpleNamespace(train=policy.train)
    same = RunCheckpoints(tmp_path, recipe, None, None, None, _TwoProcesses([[2, 0, NEVER]]), None, policy)
    same._check_prompts_agree(1)
    other = RunCheckpoints(tmp_path, recipe, None, None, None, _TwoProcesses([]), None, policy)
    with pytest.raises(RuntimeError, match="different prompts before epoch 1"):
        other._check_prompts_agree(1)


def test_the_shipped_recipe_is_shapes_tp_with_the_policy():
    """recipes/shapes_tp_skip_solved.toml differs from shapes_tp.toml in the prompt policy alone, so its first
    epoch draws what shapes_tp's does (its rollout fingerprint is shapes_tp's too)."""
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    skip, tp = load_recipe(recipes / "shapes_tp_skip_solved.toml"), load_recipe(recipes / "shapes_tp.toml")
    assert skip.train.prompt_policy == "skip-solved" and tp.train.prompt_policy == "uniform"
    policy = {"prompt_policy": "uniform", "prompt_skip_epochs": 0}
    assert skip.train.model_copy(update=policy) == tp.train
    assert {k: v for k, v in skip.data.items() if k != "train"} == {k: v for k, v in tp.data.items() if k != "train"}
    assert PromptPolicy(skip.train, PROMPTS).plan(0) == PromptPolicy(tp.train, PROMPTS).plan(0)

"""AdaGRPO's curriculum and advantage fusion as components (docs/algorithm.md §10.10): the ``ability-matched``
prompt policy (tpflow.train.curriculum) and ``[optimizer] advantage_fusion = "running-reward"``
(tpflow.optim.advantage_fusion), each against a float64 hand computation of the public code's formulas
(Bujiazi/GRPO-Series at d0ddaa4: ``sample_evaluate_and_select_ema``, ``compute_relative_adv``, ``compute_ema_adv``);
a tiny run that trains the prompts its anchors chose and resumes from what a kill leaves drawing them bitwise; the
refusals; the two shipped recipes."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError
from tpflow.optim.advantage_fusion import RunningReward
from tpflow.optim.grpo import GRPO
from tpflow.optim.grpo_options import GRPOOptions
from tpflow.recipe import load_recipe
from tpflow.settings import TrainSettings
from tpflow.train.curriculum import AbilityMatched, Anchors
from tpflow.train.trainer import Trainer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
K, ALPHA = 3, 0.8


def _reward(epoch: int, item: int) -> float:
    """A reward per (epoch, candidate) without ties: a fixed scramble of the item, shifted by the epoch."""
    return ((item * 37 + epoch * 11) % 23) / 23 + item * 1e-4


def _hand_running(before: tuple[float, float] | None, rewards: list[float]) -> tuple[float, float]:
    """The code's update: numpy's mean and var (ddof 0) of the batch; the first batch its own, then α-weighted."""
    mean = math.fsum(rewards) / len(rewards)
    var = math.fsum((r - mean) ** 2 for r in rewards) / len(rewards)
    if before is None:
        return mean, var
    return ALPHA * before[0] + (1 - ALPHA) * mean, ALPHA * before[1] + (1 - ALPHA) * var


def _hand_choice(items: list[int], rewards: list[float], mean: float) -> list[int]:
    """Per K candidates, the one closest to the running mean (np.argmin: the first on a tie)."""
    picks = []
    for j in range(0, len(items), K):
        distance = [abs(r - mean) for r in rewards[j : j + K]]
        picks.append(items[j + distance.index(min(distance))])
    return picks


def test_the_running_values_and_the_choice_match_a_float64_hand_computation():
    """Three epochs of two rounds of one prompt each: μ, v and the prompts trained as the code computes them; a plan
    asked twice runs its anchors once; the state before an epoch, loaded, plans that epoch again the same."""
    train = TrainSettings(prompts_per_epoch=2, prompts_per_round=1, group_size=2, rollout_batch=2, seed=3,
                          prompt_policy="ability-matched", prompt_candidates=K, prompt_ema_alpha=ALPHA)  # fmt: skip
    calls = []

    def score(epoch, items):
        calls.append((epoch, list(items)))
        return Anchors([_reward(epoch, i) for i in items], 4.0, 0.0)

    policy, running, states = AbilityMatched(train, 12, score), None, []
    for epoch in range(3):
        states.append(policy.state_dict(epoch))
        plan = policy.plan(epoch)
        assert policy.plan(epoch) is plan and len(calls) == epoch + 1
        items = calls[-1][1]
        assert len(items) == 2 * K and all(len(set(r)) == K for r in (items[:K], items[K:])), items
        rewards = [_reward(epoch, i) for i in items]
        running = _hand_running(running, rewards)
        assert policy.running.mean == pytest.approx(running[0], rel=1e-14, abs=0)
        assert policy.running.var == pytest.approx(running[1], rel=1e-14, abs=0)
        picks = _hand_choice(items, rewards, running[0])
        drawn = Counter(item for batch in plan.batches for item in batch.items)
        assert drawn == Counter({p: train.group_size * picks.count(p) for p in picks}), (drawn, picks)
        metrics = policy.observe(plan, [], [], torch.zeros(0))
        assert metrics["prompt_anchor_nfe"] == 4.0 * 2 * K
        assert policy.nfe_per_traj(plan) == 4.0 * 2 * K / plan.num_trajectories
    assert states[0] == [] and policy.state_dict(2) == states[2] != policy.state_dict(3)
    again = AbilityMatched(train, 12, score)
    again.load_state_dict(states[2])
    assert again.plan(2) == policy.plan(2) and again.running == policy.running


def _code_relative(r: list[float], clip: float) -> list[float]:
    """compute_relative_adv: (r − mean) / (torch.std (N − 1) + 1e-8), clamped."""
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    return [max(-clip, min(clip, (x - mean) / (std + 1e-8))) for x in r]


def _code_ema(r: list[float], mean: float, var: float, clip: float) -> list[float]:
    """compute_ema_adv with train.py's ema_std = max(ema_var, 1e-8) ** 0.5."""
    z = [(x - mean) / (max(var, 1e-8) ** 0.5 + 1e-8) for x in r]
    positive, negative = sum(v for v in z if v > 0), sum(-v for v in z if v < 0)
    if positive < 1e-6 or negative < 1e-6:
        z = [v - sum(z) / len(z) for v in z]
    else:
        z = [v / positive if v > 0 else v / negative if v < 0 else v for v in z]
    return [max(-clip, min(clip, v)) for v in z]


@pytest.mark.parametrize("var", [0.04, 1e-12], ids=["moderate", "floored-and-clamped"])
def test_fusion_adds_the_codes_global_advantage_to_its_relative_one(var):
    """grpo's advantages with advantage_std 'sample', eps 1e-8 and advantage_fusion = 'running-reward' equal
    compute_relative_adv + compute_ema_adv per group and step: a group on both sides of μ (parts normalised by their
    sums), one above it (z − mean(z)), a constant one (0); groups interleaved, two window steps."""
    table = {"mixed": [[0.2, 0.9], [0.7, 0.1], [0.5, 0.5], [0.9, 0.3]],
             "above": [[0.8, 0.6], [0.95, 0.61], [0.7, 0.9]], "constant": [[0.3, 0.4]] * 3}  # fmt: skip
    order = ["mixed", "above", "constant", "mixed", "above", "mixed", "constant", "above", "mixed", "constant"]
    seen, rows = Counter(), []
    for key in order:
        rows.append(table[key][seen[key]])
        seen[key] += 1
    step_rewards = torch.tensor(rows, dtype=torch.float64)  # [10, 2]
    grpo = GRPO(GRPOOptions(advantage_std="sample", advantage_eps=1e-8, adv_clip_max=5.0,
                            advantage_fusion="running-reward"))  # fmt: skip
    grpo.running_reward = RunningReward(0.55, var)
    got, largest = grpo.advantages(step_rewards, order), 0.0
    for key, values in table.items():
        index = [n for n, k in enumerate(order) if k == key]
        for i in range(2):
            r = [v[i] for v in values]
            fused = _code_ema(r, 0.55, var, 5.0)
            largest = max(largest, *map(abs, fused))
            want = [a + b for a, b in zip(_code_relative(r, 5.0), fused, strict=True)]
            if key == "constant":  # the code's is its mean's rounding over 1e-8; tpflow's exactly 0 (§5 item 6)
                assert max(map(abs, want)) < 1e-7 and len(set(r)) == 1
                want = [0.0] * len(r)
            assert got[index, i].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12), (key, i)
    assert (got[[2, 6, 9]] == 0).all()  # constant: exactly 0, for the zero-advantage filter
    assert largest == (1.0 if var > 1e-8 else 5.0)  # a part normalised by its sum; the floored std's at its clamp


def _items_by_epoch(run) -> list[list[str]]:
    from tpflow.train.run_logger import read_jsonl

    rows = read_jsonl(run / "traces.jsonl")
    return [sorted(r["prompt"] for r in rows if r["epoch"] == e) for e in sorted({r["epoch"] for r in rows})]


def _recorded(trainer: Trainer) -> list[tuple[int, list[int], list[float]]]:
    """Every anchor stage the trainer's policy runs: (epoch, candidates, their rewards)."""
    stages, score = [], trainer.prompts.score

    def recording(epoch, items):
        anchors = score(epoch, items)
        stages.append((epoch, list(items), list(anchors.rewards)))
        return anchors

    trainer.prompts.score = recording
    return stages


def test_a_run_trains_the_chosen_prompts_and_resumes_from_a_kill_drawing_the_same(tmp_path, tiny_weights):
    """Three epochs with the policy and fusion on tiny-shapes: each epoch trains exactly the prompts its anchors chose
    (recomputed by hand from the rewards scored), with fused advantages; a kill after the first checkpoint, resumed,
    restores μ and v, scores the same anchors and draws the same prompts, and logs the same metrics."""
    sets = ["train.epochs=3", "eval.every=0", "train.keep_checkpoints=0", 'train.prompt_policy="ability-matched"',
            f"train.prompt_candidates={K}", 'optimizer.advantage_fusion="running-reward"']  # fmt: skip
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    straight = Trainer(load_recipe(recipe, sets))
    stages = _recorded(straight)
    straight.fit()
    running, items = None, straight.train_items
    for epoch, (e, candidates, rewards) in enumerate(stages):
        running = _hand_running(running, rewards)
        picks = _hand_choice(candidates, rewards, running[0])
        assert e == epoch and _items_by_epoch(straight.run_dir)[epoch] == sorted(items[p].prompt for p in picks for _
                                                                                 in range(4))  # fmt: skip
    metrics = comparable_metrics(straight.run_dir)
    assert all(m["prompt_anchor_nfe"] == 2 * K * 4 and m["nfe_per_traj"] > 4 for m in metrics), metrics
    assert straight.optimizer.running_reward is straight.prompts.running
    written = what_a_kill_leaves(straight.run_dir, tmp_path / "killed")
    assert len(written) == 3, [p.name for p in written]
    resumed = Trainer(load_recipe(recipe, [*sets, f"train.run_dir={tmp_path / 'killed'}"]), resume=True)
    first = _hand_running(None, stages[0][2])
    assert resumed.epoch == 1 and (resumed.prompts.running.mean, resumed.prompts.running.var) == pytest.approx(first)
    again = _recorded(resumed)
    resumed.fit()
    assert again == stages[1:]
    assert _items_by_epoch(resumed.run_dir) == _items_by_epoch(straight.run_dir)
    assert comparable_metrics(resumed.run_dir) == metrics


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (['optimizer.advantage_fusion="running-reward"'], ["advantage_fusion", "'uniform'", "ability-matched"]),
        (['optimizer.advantage_fusion="running-reward"', 'train.prompt_policy="ability-matched"'],
         ["credit 'consistent'", "outcome", "branch"]),
        (["train.prompt_candidates=3"], ["prompt_candidates", "'uniform'", "ability-matched"]),
        (['train.prompt_policy="ability-matched"', "train.prompt_candidates=1"], ["prompt_candidates"]),
        (['train.prompt_policy="ability-matched"', "train.prompt_skip_epochs=2"], ["prompt_skip_epochs=2"]),
    ],
    ids=["fusion-alone", "fusion-with-step-differences", "candidates-alone", "one-candidate", "skip-epochs"],
)  # fmt: skip
def test_combinations_that_cannot_be_right_are_refused_in_one_paragraph(tmp_path, tiny_weights, sets, words):
    with pytest.raises(RecipeError) as error:
        load_recipe(tiny_recipe(tmp_path, tiny_weights, reward="image-stat"), sets)
    text = str(error.value).strip()
    assert "\n\n" not in text and "Traceback" not in text
    assert all(w in text for w in words), text


def test_the_shipped_recipes(monkeypatch, tmp_path, capsys):
    """shapes_curriculum.toml is shapes_flowgrpo.toml with the policy and fusion; flux_adagrpo.toml carries the
    script's values and, offline, exits 2 in one paragraph naming the FLUX and HPSv3 weights; fusion without the
    policy, from the command line, exits 2."""
    from tpflow.cli import main

    curriculum, flowgrpo = (
        load_recipe(RECIPES / "shapes_curriculum.toml"),
        load_recipe(RECIPES / "shapes_flowgrpo.toml"),
    )
    policy = {"prompt_policy": "uniform", "prompt_candidates": 10, "prompt_ema_alpha": 0.8}
    assert curriculum.train.model_copy(update=policy).model_dump() == flowgrpo.train.model_dump()
    assert curriculum.optimizer.options.model_copy(update={"advantage_fusion": "none"}) == flowgrpo.optimizer.options
    flux = load_recipe(RECIPES / "flux" / "flux_adagrpo.toml")
    t, o, r = flux.train, flux.optimizer.options, flux.rollout
    assert (t.prompt_candidates, t.prompt_ema_alpha, t.group_size, t.epochs, t.seed) == (10, 0.8, 12, 300, 42)
    assert (o.learning_rate, o.adv_clip_max, o.advantage_eps, o.advantage_fusion) == (
        2e-6,
        5.0,
        1e-8,
        "running-reward",
    )
    assert (r.num_steps, r.noise_level, r.guidance, r.window_size) == (16, 0.7, 3.5, 4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for args, words in [
        ([str(RECIPES / "flux" / "flux_adagrpo.toml")], ["black-forest-labs/FLUX.1-dev", "MizzenAI/HPSv3"]),
        ([str(RECIPES / "shapes_flowgrpo.toml"), "--set", "optimizer.advantage_fusion=running-reward"], ["fusion"]),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["validate", *args])
        err = " ".join(capsys.readouterr().err.split())
        assert exc.value.code == 2 and "Traceback" not in err and all(w in err for w in words), err


def test_with_same_noise_each_anchor_starts_where_its_prompts_group_does(tmp_path, tiny_weights, monkeypatch):
    """AdaGRPO branches the group off the chosen anchor's own ODE path: with ``same_noise`` each candidate's anchor
    starts from the z_0 its prompt's copies would share in that epoch (the rollout's group seed), so the group's ODE
    path is the anchor's; without it the anchors keep one seeded draw over all of them."""
    import tpflow.train.evaluation as evaluation
    from tpflow.devices import cpu_generator
    from tpflow.train.prompt_sampler import noise_seed

    starts, sample_ode = [], evaluation.sample_ode

    def recording(backbone, cond, z0, *args):
        starts.append(z0.clone())
        return sample_ode(backbone, cond, z0, *args)

    monkeypatch.setattr(evaluation, "sample_ode", recording)
    sets = ["train.epochs=1", "eval.every=0", 'train.prompt_policy="ability-matched"', f"train.prompt_candidates={K}",
            "rollout.same_noise=true"]  # fmt: skip
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    trainer = Trainer(load_recipe(recipe, sets))
    stages = _recorded(trainer)
    trainer.fit()
    (epoch, candidates, _), train = stages[0], trainer.recipe.train
    group_z0 = [trainer.backbone.initial_noise(1, cpu_generator(noise_seed(train, epoch, i))) for i in candidates]
    assert torch.equal(torch.cat(starts), torch.cat(group_z0))  # the anchors' one batch: the groups' z_0, in order

"""Replayed trajectories (OP-GRPO; ``[replay]``, tpflow.train.replay; grpo's replay_* options,
tpflow.optim.replay_weights; docs/algorithm.md §10.12): the importance weight and the loss as mapped, in float64; the
update without replayed rows as it always was; the buffer's admission, eviction and draw; a run that replays, resumed
from what a kill leaves, bitwise; the micro-batch layout and the processes' shares; the refusals."""

from __future__ import annotations

import dataclasses
import math
import sys
from types import SimpleNamespace

import pytest
import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tests.cli_run import tpflow
from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_train import tiny_recipe
from tpflow.distributed import Distributed
from tpflow.errors import RecipeError, UserError
from tpflow.optim.grpo import GRPO
from tpflow.optim.grpo_loss import clipped_surrogate
from tpflow.optim.replay_weights import corrected, kept_steps, sequence_weights
from tpflow.precision import FP32
from tpflow.recipe import load_recipe
from tpflow.replay_settings import ReplaySettings
from tpflow.train.replay import ReplayBuffer
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer
from tpflow.types import Conditioning, Rollout, RolloutCost, StepOutput

W = 3  # window steps of the synthetic rollouts


def _rollout(n: int, offset: float = 0.0, dtype=torch.float64) -> Rollout:
    """n synthetic trajectories of W steps on [2]-element latents; row j's tensors carry j + offset."""
    base = torch.arange(n, dtype=dtype)[:, None] + offset  # [n, 1]
    latents = (base[:, :, None] + torch.arange(W, dtype=dtype)[None, :, None] * 0.1).expand(n, W, 2).clone()
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.1], dtype=dtype).expand(n, W + 1).clone()
    cond = Conditioning({"text": base.expand(n, 4).clone()})
    return Rollout(latents=latents, next_latents=latents + 0.05, log_probs=-(base + torch.zeros(n, W, dtype=dtype)),
                   sigmas=sigmas, noise_level=0.7, guidance=1.0, cond=cond, final=latents[:, -1].clone(),
                   completions=None, cost=RolloutCost(nfe=4.0))  # fmt: skip


def test_the_weight_and_the_loss_are_the_mapped_formulas_in_float64():
    """w = min(exp(mean or sum over the kept steps of ℓ_θold − ℓ_μ), w_max), 0 for a row keeping no step; the kept
    steps are the stored trained ones at σ ≥ min_sigma with σ⁺ > 0; the loss w·max(−Âκ, −Â·clip(κ)) is
    clipped_surrogate of the weighted advantage against ℓ_θold."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.2, -1.5, -9.0], [-0.5, -0.6, -0.7], [0.0, 0.0, 0.0], [-9.0, -9.0, -9.0]],
                             dtype=torch.float64)  # fmt: skip
    sigmas = torch.tensor([[1.0, 0.7, 0.4, 0.1], [1.0, 0.7, 0.4, 0.0], [0.3, 0.2, 0.1, 0.05], [1.0, 0.7, 0.4, 0.1]],
                          dtype=torch.float64)  # fmt: skip
    stored = torch.tensor([[True, True, True], [True, True, True], [True, True, True], [False, True, True]])
    kept = kept_steps(sigmas, stored, 0.35)
    assert kept.tolist() == [[True, True, True], [True, True, False], [False, False, False], [False, True, True]]
    geometric = sequence_weights(old, behaviour, kept, "geometric", 100.0)
    hand = [math.exp((0.2 - 0.5 + 6.0) / 3), math.exp((0.0 + 0.1) / 2), 0.0, math.exp((11.0 + 12.0) / 2)]
    assert geometric.tolist() == pytest.approx([*hand[:3], 100.0], rel=1e-15, abs=0)  # the last clipped at w_max
    product = sequence_weights(old, behaviour, kept, "product", 1e300)
    assert product.tolist() == pytest.approx([math.exp(5.7), math.exp(0.1), 0.0, math.exp(23.0)], rel=1e-15)
    log_prob = torch.tensor([-0.9, -0.5, 0.1, 1.2], dtype=torch.float64)  # ℓ_θ at one step of the four rows
    adv = torch.tensor([1.5, -0.7, 2.0, 0.3], dtype=torch.float64)
    loss = clipped_surrogate(log_prob, old[:, 0], geometric * adv, 0.2).row_losses
    for j in range(4):
        kappa = math.exp(float(log_prob[j] - old[j, 0]))
        a = float(geometric[j] * adv[j])
        assert float(loss[j]) == pytest.approx(max(-a * kappa, -a * min(max(kappa, 0.8), 1.2)), rel=1e-14)


class _Velocity:
    """A backbone whose velocity is 2z + σ (float64), counting its rows."""

    rows = 0

    def velocity(self, z, sigma, cond, guidance):
        _Velocity.rows += z.shape[0]
        return 2 * z + sigma.reshape(-1, 1)


class _Sampler:
    """ℓ(z⁺ | z, v) = −mean((z⁺ − z − v·(σ − σ⁺))²)."""

    def log_prob(self, z_next, z, v, sigma, sigma_next, noise_level):
        step = (sigma - sigma_next).to(z.dtype).reshape(-1, 1)
        lp = -((z_next - z - v * step) ** 2).mean(1)
        return StepOutput(z_next, z, torch.ones_like(lp), lp, torch.ones_like(lp))


def test_the_correction_recomputes_replayed_rows_and_leaves_the_fresh_ones():
    """A batch without replayed rows comes back as the same objects (the update as before, bit for bit); with some,
    only they change: ℓ_old at their kept steps is the current weights' (2 rows x 2 kept steps, two calls), their
    advantages are times w, their steps below replay_min_sigma leave the trained mask."""
    batch, adv = _rollout(4), torch.randn(4, W, dtype=torch.float64)
    options = SimpleNamespace(
        replay_weight="geometric", replay_weight_max=5.0, replay_min_sigma=0.5, micro_batch_size=8
    )
    same = corrected(options, FP32, _Velocity(), _Sampler(), batch, adv)
    assert same[0] is batch and same[1] is adv and same[2] == {}
    none = dataclasses.replace(batch, replayed=torch.zeros(4, dtype=torch.bool))
    assert corrected(options, FP32, _Velocity(), _Sampler(), none, adv)[1] is adv
    replayed = torch.tensor([False, True, False, True])
    _Velocity.rows = 0
    mixed = dataclasses.replace(batch, replayed=replayed)
    out, out_adv, metrics = corrected(options, FP32, _Velocity(), _Sampler(), mixed, adv)
    assert _Velocity.rows == 4
    fresh = ~replayed
    assert torch.equal(out.log_probs[fresh], batch.log_probs[fresh]) and torch.equal(out_adv[fresh], adv[fresh])
    assert out.trained.tolist() == [[True] * 3, [True, True, False], [True] * 3, [True, True, False]]
    for j in (1, 3):
        z, z_next, sigma = batch.latents[j], batch.next_latents[j], batch.sigmas[j]
        start = [-float(((z_next[i] - z[i] - (2 * z[i] + sigma[i]) * (sigma[i] - sigma[i + 1])) ** 2).mean())
                 for i in range(2)]  # fmt: skip
        assert out.log_probs[j, :2].tolist() == pytest.approx(start, rel=1e-14)
        assert out.log_probs[j, 2] == batch.log_probs[j, 2]  # not kept: the behaviour's, never trained
        w = min(math.exp(sum(s - float(batch.log_probs[j, i]) for i, s in enumerate(start)) / 2), 5.0)
        assert out_adv[j].tolist() == pytest.approx((adv[j] * w).tolist(), rel=1e-13)
    assert metrics["replay_rows_trained"] == 2 and metrics["replay_steps_kept"] == 2


def _settings(**kw) -> ReplaySettings:
    return ReplaySettings(**{"capacity": 3, "min_advantage": 1.0, "max_age": 2, **kw})


def test_admission_eviction_and_the_draw():
    """Rows whose mean advantage reaches min_advantage are stored in the epoch and drawn from the next on, with the
    advantages they were admitted with; past max_age they go, past the capacity the oldest then the lowest; the
    state round-trips, leaving out what an epoch cut short admitted."""
    buffer, dist = ReplayBuffer(_settings(), seed=5), Distributed()
    adv0 = torch.tensor([[1.0, 1.0, 1.0], [0.5, 1.0, 1.4], [2.0, 2.0, 2.0], [-1.0, 1.0, 1.0]], dtype=torch.float64)
    batch, local, metrics = buffer.mix(0, _rollout(4), adv0, dist)
    assert batch.replayed is None and torch.equal(local, adv0)  # nothing to draw in the first epoch
    assert buffer.rows["row"].tolist() == [0, 2] and metrics == {
        "replay_drawn": 0,
        "replay_admitted": 2,
        "replay_held": 2,
    }
    adv1 = torch.tensor([[0.0] * 3, [1.2] * 3, [3.0] * 3, [0.0] * 3], dtype=torch.float64)
    mixed, local, metrics = buffer.mix(1, _rollout(4, offset=10), adv1, dist)
    assert len(mixed) == 6 and mixed.replayed.tolist() == [False] * 4 + [True] * 2
    assert torch.equal(local[4:], adv0[[0, 2]]) and torch.equal(mixed.latents[4:], _rollout(4).latents[[0, 2]])
    assert mixed.groups is None and mixed.cost == _rollout(4).cost
    assert buffer.state_dict(1)["row"].tolist() == [0, 2]  # a stop in epoch 1: its admissions left out
    # epoch 2 may draw epochs 0 and 1's four rows; the capacity keeps epoch 1's two and epoch 0's higher one (row 2)
    assert buffer.live(2).tolist() == [1, 2, 3] and buffer.rows["score"][buffer.live(2)].tolist() == [2.0, 1.2, 3.0]
    assert buffer.live(4).tolist() == []  # max_age 2: epoch 1's rows are replayed in epochs 2 and 3 only
    state = {k: v.clone() for k, v in buffer.state_dict(2).items()}
    mixed, local, _ = buffer.mix(2, _rollout(4, offset=20), torch.zeros(4, W, dtype=torch.float64), dist)
    again = ReplayBuffer(_settings(), seed=5)
    again.load_state_dict(state)
    redo, redo_local, _ = again.mix(2, _rollout(4, offset=20), torch.zeros(4, W, dtype=torch.float64), dist)
    assert torch.equal(redo.latents, mixed.latents) and torch.equal(redo_local, local) and len(redo) == 7
    narrower = ReplayBuffer(_settings(), seed=5)  # a checkpoint of a wider window, resumed
    narrower.load_state_dict({k: v[:, :2] if v.dim() > 1 and v.shape[1] == W else v for k, v in state.items()})
    with pytest.raises(UserError, match="window_size, resolution or backbone"):
        narrower.mix(2, _rollout(4), torch.zeros(4, W, dtype=torch.float64), dist)
    drawn = ReplayBuffer(_settings(rows=2), seed=5)
    drawn.load_state_dict(state)
    picked = drawn.mix(2, _rollout(4), torch.zeros(4, W, dtype=torch.float64), dist)[0]
    assert len(picked) == 6 and set(picked.latents[4:, 0, 0].tolist()) < {2.0, 11.0, 12.0}


class _Rank:
    """Process ``rank`` of two whose gathers return every process's rows (each rank's handed in beforehand)."""

    enabled, world_size, sharded = True, 2, False

    def __init__(self, rank: int, parts: list[dict]) -> None:
        self.rank, self.parts, self.calls = rank, parts, 0

    def gather(self, tensor):
        key, self.calls = self.calls, self.calls + 1
        self.parts[self.rank][key] = tensor
        return torch.cat([self.parts[r].get(key, tensor[:0]) for r in range(2)])  # an unset part: no rows


def test_two_processes_hold_one_buffer_and_replay_its_rows_once_between_them():
    """Each process admits its own rows of the gathered advantages; gathered, every process stores the rows one
    process would, in the same order, and the draw is dealt: the two shares are the one process's replayed rows."""
    adv = torch.tensor([[2.0] * 3, [0.0] * 3, [1.5] * 3, [0.9] * 3, [0.2] * 3, [4.0] * 3], dtype=torch.float64)
    whole, parts = _rollout(6), [{}, {}]
    alone = ReplayBuffer(_settings(capacity=8), seed=1)
    alone.mix(0, whole, adv, Distributed())
    one = alone.mix(1, _rollout(6, offset=50), torch.zeros(6, W, dtype=torch.float64), Distributed())[0]
    pair = [ReplayBuffer(_settings(capacity=8), seed=1) for _ in range(2)]
    halves = [whole.index(torch.arange(3 * r, 3 * r + 3)) for r in range(2)]
    ranks = [_Rank(0, parts), _Rank(1, parts)]
    parts[1] = {k: v for k, v in enumerate(_local_admissions(halves[1], adv, 1))}  # rank 1's rows, as it gives them
    pair[0].mix(0, halves[0], adv, ranks[0])
    parts[0] = {k: v for k, v in enumerate(_local_admissions(halves[0], adv, 0))}
    pair[1].mix(0, halves[1], adv, ranks[1])
    assert all(torch.equal(pair[r].rows[k], alone.rows[k]) for r in range(2) for k in alone.rows)
    assert pair[0].digest(1) == pair[1].digest(1) == alone.digest(1)
    later, none = _rollout(6, offset=50), torch.zeros(6, W, dtype=torch.float64)  # epoch 1 admits nothing
    shares = [pair[r].mix(1, later.index(torch.arange(3 * r, 3 * r + 3)), none, _Rank(r, [{}, {}]))[0] for r in (0, 1)]
    assert [len(s) - 3 for s in shares] == [1, 2]  # rows 0, 2 and 5 drawn: 3 // 2 to the first process
    assert torch.equal(torch.cat([s.latents[3:] for s in shares]), one.latents[6:])


def _local_admissions(half: Rollout, adv: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """What rank ``rank``'s buffer hands its gathers, in their order (ReplayBuffer._admit's)."""
    chosen = (adv.mean(1) >= 1.0).nonzero().squeeze(1)
    mine = chosen[(chosen >= 3 * rank) & (chosen < 3 * rank + 3)] - 3 * rank
    fields = [getattr(half, name)[mine] for name in ("latents", "next_latents", "log_probs", "sigmas", "final")]
    return [*fields, half.cond.tensors["text"][mine], torch.ones(len(mine), W).to(torch.uint8)]


REPLAY_SETS = ["replay.capacity=6", "replay.min_advantage=0.5", "replay.max_age=2", "optimizer.replay_min_sigma=0.3",
               "eval.every=0", "train.epochs=2", "train.keep_checkpoints=0", 'credit.name="outcome"',
               "train.ema=false"]  # fmt: skip


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}


def test_a_run_that_replays_resumes_bitwise_from_what_a_kill_leaves(tmp_path, tiny_weights):
    """Two epochs of the tiny recipe with a buffer: epoch 1 replays the rows epoch 0 admitted, and a kill after the
    first checkpoint, resumed, replays the same rows and ends with the same adapter and metrics, bitwise; the
    checkpoint holds the buffer (replay.safetensors). Epoch 1's update, replayed rows included, takes the same steps
    with micro-batches of 2 rows and 2 of them per step as with the recipe's one of 4."""
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    straight = Trainer(load_recipe(recipe, REPLAY_SETS))
    seen, update = [], straight.optimizer.update

    def recorded(backbone, sampler, batch, advantages, on_step=None):
        seen.append((batch, advantages, [p.detach().clone() for p in backbone.trainable_parameters()]))
        return update(backbone, sampler, batch, advantages, on_step)

    straight.optimizer.update = recorded
    straight.fit()
    lines = read_jsonl(straight.run_dir / "metrics.jsonl")
    assert lines[0]["replay_drawn"] == 0 and lines[1]["replay_drawn"] == min(6, lines[0]["replay_admitted"]) > 0
    assert lines[1]["replay_rows_trained"] > 0 and seen[1][0].replayed.sum() == lines[1]["replay_drawn"]
    written = what_a_kill_leaves(straight.run_dir, tmp_path / "killed")
    assert (written[0] / "replay.safetensors").is_file()
    resumed = Trainer(load_recipe(recipe, [*REPLAY_SETS, f"train.run_dir={tmp_path / 'killed'}"]), resume=True)
    assert resumed.epoch == 1 and len(resumed.replay) == lines[1]["replay_drawn"]
    resumed.fit()
    a, b = _adapter(straight), _adapter(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert comparable_metrics(straight.run_dir) == comparable_metrics(resumed.run_dir)
    batch, advantages, start = seen[1]
    ends = []
    for size, steps in ((4, 1), (2, 2)):
        for p, value in zip(straight.backbone.trainable_parameters(), start, strict=True):
            p.data.copy_(value)
        options = straight.optimizer.options.model_copy(update={"micro_batch_size": size,
                                                                "gradient_accumulation_steps": steps})  # fmt: skip
        GRPO(options).update(straight.backbone, straight.sampler, batch, advantages)
        ends.append([p.detach().clone() for p in straight.backbone.trainable_parameters()])
    for x, y in zip(*ends, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)  # the rounding of two summation orders


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (['optimizer.name="nft"'], ["[replay] capacity = 4", "'nft'", "no such correction"]),
        (["optimizer.ratio_norm=true", 'sampler.name="flow-sde"'], ["ratio_norm = True", "RatioNorm"]),
        (['optimizer.recompute="retain"'], ["recompute = 'retain'", 'recompute = "native"']),
        (['train.shard="fsdp"'], ['shard = "fsdp"', "share per process"]),
        (["replay.capacity=0", "replay.rows=2"], ["rows apply only to a replay buffer"]),
        (["replay.rows=5"], ["rows = 5 is more than the buffer holds"]),
    ],
    ids=["nft", "ratio-norm", "retain", "fsdp", "rows-without-buffer", "rows-past-capacity"],
)
def test_what_cannot_replay_is_refused_in_one_paragraph(tmp_path, tiny_weights, sets, words):
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    with pytest.raises(RecipeError) as error:
        load_recipe(recipe, ["replay.capacity=4", *sets])
    text = str(error.value).strip()
    assert "\n\n" not in text and "Traceback" not in text
    assert all(w in text for w in words), text


def test_a_refusal_exits_2(tmp_path, tiny_weights):
    result = tpflow("validate", str(tiny_recipe(tmp_path, tiny_weights, reward="image-stat")), "--set",
                    "replay.capacity=4", "--set", 'optimizer.name="nft"')  # fmt: skip
    assert result.returncode == 2 and "no such correction" in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("name", "base"),
    [("shapes_opgrpo.toml", "shapes_flowgrpo.toml"), ("sd35/sd35_opgrpo_ocr.toml", "sd35/sd35_flowgrpo_ocr.toml")],
)
def test_a_shipped_opgrpo_recipe_is_its_flowgrpo_recipe_with_replay(name, base):
    """recipes/shapes_opgrpo.toml and recipes/sd35/sd35_opgrpo_ocr.toml differ from their Flow-GRPO recipes (the
    latter: flow_grpo's general_ocr_sd3, checked in tests/test_rival_recipes.py) in their [replay] section and grpo's
    replay_* options alone; the shapes one's rollouts are shapes_flowgrpo's (one rollout fingerprint)."""
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    op, flow = tomllib.loads((recipes / name).read_text()), tomllib.loads((recipes / base).read_text())
    assert op["replay"]["capacity"] > 0 and "replay" not in flow
    replay = {k: v for k, v in op["optimizer"].items() if k.startswith("replay_")}
    assert replay and {**flow["optimizer"], **replay} == op["optimizer"]
    assert {k: v for k, v in op.items() if k not in ("replay", "optimizer")} == {
        k: v for k, v in flow.items() if k != "optimizer"
    }
    if name.startswith("shapes"):  # the shipped shapes recipes validate here; the sd35 ones in tests/test_recipe.py
        assert load_recipe(recipes / name).replay.enabled


def test_the_layout_line_counts_the_replayed_rows_each_process_updates_on():
    """``tpflow validate --num-processes N`` and a multi-process run's first line: each process's update holds its
    share of the drawn buffer rows beside its fresh ones, so its optimizer steps count them."""
    from types import SimpleNamespace as Layout

    from tpflow.settings import TrainSettings
    from tpflow.train.prompt_sampler import layout_line, plan_epoch

    train = TrainSettings(prompts_per_epoch=8, group_size=8, rollout_batch=16)
    plan = plan_epoch(100, train, 0)
    layout = Layout(micro_batch_size=8, accumulation=1)
    plain, replaying = layout_line(plan, layout, 2), layout_line(plan, layout, 2, replayed=17)
    assert "(32 of 64 trajectories)" in plain and "up to 4 optimizer steps" in plain and "replays" not in plain
    assert "its update replays up to 9 of the buffer's 17 drawn" in replaying  # 9 + 8 over 2 processes
    assert "up to 6 optimizer steps" in replaying  # ceil((32 + 9) / 8)
    assert ReplaySettings(capacity=12).drawn == 12 and ReplaySettings(capacity=12, rows=5).drawn == 5
    assert ReplaySettings().drawn == 0

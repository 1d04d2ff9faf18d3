"""GARDO's gated KL wired into grpo (``[optimizer] kl_gate``, docs/algorithm.md §10.9): the reward parts reach the
update (``Rollout.reward_details``), the gated rows' KL weighted by 1/(the epoch's gated fraction) against a float64
hand computation of the reference's loss structure (yifan123/flow_grpo at 94e23ee, ``scripts/train_sd3_gardo.py``),
the same weights whatever the micro-batches or the processes, and the controller across a resume."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_preflight import assert_one_paragraph, run_cli
from tests.test_train import tiny_recipe
from tpflow.optim.kl_gate import GateFraction, KLGate
from tpflow.recipe import load_recipe
from tpflow.train.prompt_sampler import plan_epoch
from tpflow.train.run_logger import read_jsonl
from tpflow.train.trainer import Trainer

GATE = {"kl_gate": True, "kl_gate_main": "main", "kl_gate_aux": ["aes", "ir"], "kl_gate_fraction": 0.5,
        "kl_gate_max": 0.5}  # fmt: skip
PARTS = ('name = "weighted"\nrewards = [{ name = "image-stat", label = "bright" }, { name = "image-stat", '
         'label = "saturated", weight = 0.0, options = { statistic = "saturation" } }]')  # fmt: skip


def _details(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {key: torch.rand(n, generator=g) for key in ("main", "aes", "ir")}


def reference_gate(details: dict[str, torch.Tensor], phi: float) -> np.ndarray:
    """The script's ranks (descending sort, rank 1 the highest), u and ``u > np.percentile(u[u >= 0], 100 − 100φ)``."""
    ranks = {}
    for key, scores in details.items():
        order = np.argsort(-scores.double().numpy(), kind="stable")
        ranks[key] = np.empty(len(order))
        ranks[key][order] = np.arange(1, len(order) + 1)
    u = ranks["main"] - (ranks["aes"] + ranks["ir"]) / 2
    return u > np.percentile(u[u >= 0], 100 - phi * 100)


def _optimizer(weights: str, micro: int = 8, accumulation: int = 1, **options):
    import tpflow
    from tests.distributed_workers import two_window_batch

    torch.manual_seed(0)  # the LoRA init
    backbone = tpflow.build("backbone", "shapes-dit", weights=weights, lora_init="gaussian")
    sampler = tpflow.build("sampler", "cps")
    optimizer = tpflow.build("optimizer", "grpo", learning_rate=1e-2, beta=1e-2, micro_batch_size=micro,
                             gradient_accumulation_steps=accumulation, **options)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the LoRA moved off its init (B = 0, where the policy is the base model: no KL)
        for p in backbone.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
    optimizer.bind(backbone)
    batch = dataclasses.replace(two_window_batch(backbone, sampler), reward_details=_details(8, 5))
    return backbone, sampler, optimizer, batch


def _hand_kl(backbone, sampler, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """KL_{b,i} = mean (μ_θ − μ_ref)² / (2·std_dev_t²) [8, W] in float64 and the live rows [8, W] (std ≠ 0)."""
    kls, live = [], []
    with torch.no_grad():
        for i in range(batch.log_probs.shape[1]):
            z, z_next, sigma, sigma_next = (batch.latents[:, i], batch.next_latents[:, i], batch.sigmas[:, i],
                                            batch.sigmas[:, i + 1])  # fmt: skip
            v = backbone.velocity(z, sigma, batch.cond, batch.guidance)
            with backbone.reference():
                v_ref = backbone.velocity(z, sigma, batch.cond, batch.guidance)
            out = sampler.log_prob(z_next, z, v, sigma, sigma_next, batch.noise_level)
            ref = sampler.log_prob(z_next, z, v_ref, sigma, sigma_next, batch.noise_level)
            std = out.std_dev_t.double()
            sq = (out.mean.double() - ref.mean.double()).square().flatten(1).mean(1)
            kls.append(torch.where(std != 0, sq / (2 * torch.where(std != 0, std, 1.0) ** 2), 0.0))
            live.append(out.std != 0)
    return torch.stack(kls, 1), torch.stack(live, 1)


def test_the_gated_kl_is_the_references_gated_mean_in_float64(tiny_weights):
    """One update of 8 rows: the gate is the script's (ranks, percentile at φ), the KL metric is Σ g·KL / (f·rows)
    over the live (row, step) pairs in float64 (rel 1e-5), and at a step where every row is live it is the reference's
    β-free term, the mean KL over the gated rows of the micro-batch (here the whole epoch: the two agree exactly)."""
    backbone, sampler, optimizer, batch = _optimizer(str(tiny_weights), **GATE)
    gate = torch.from_numpy(reference_gate(batch.reward_details, 0.5))
    fraction = float(gate.double().mean())
    assert 0 < int(gate.sum()) < 8
    kl, live = _hand_kl(backbone, sampler, batch)
    weighted = torch.where(live, gate.double()[:, None] / fraction * kl, 0.0)
    advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    metrics = optimizer.update(backbone, sampler, batch, advantages)
    assert metrics["kl"] > 0
    assert math.isclose(metrics["kl"], float(weighted.sum() / live.sum()), rel_tol=1e-5), metrics["kl"]
    assert metrics["kl_gated_fraction"] == fraction and metrics["kl_gate_phi"] == 0.5
    assert bool(live[:, 0].all()) and float(kl[gate, 0].mean()) > 0
    assert math.isclose(float(weighted[:, 0].mean()), float(kl[gate, 0].mean()), rel_tol=1e-12)


def test_the_gated_kl_does_not_depend_on_the_micro_batches(tiny_weights):
    """8 × 1, 4 × 2 and 2 × 4: the same KL and the same adapter after the step (rel 1e-5): each row's weight is the
    epoch's g / f, not a micro-batch's share of gated rows."""
    runs = []
    for micro, accumulation in ((8, 1), (4, 2), (2, 4)):
        backbone, sampler, optimizer, batch = _optimizer(str(tiny_weights), micro, accumulation, **GATE)
        advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        kl = optimizer.update(backbone, sampler, batch, advantages)["kl"]
        runs.append((kl, torch.cat([p.detach().flatten() for p in backbone.trainable_parameters()])))
    for kl, params in runs[1:]:
        assert math.isclose(kl, runs[0][0], rel_tol=1e-5) and kl > 0
        assert torch.allclose(params, runs[0][1], rtol=1e-5, atol=1e-7)


class _Processes:
    """A ``Distributed`` of process ``rank`` among several, in one: ``gather`` returns every process's tensors of
    that call, in process order (each process calls it with the same sequence)."""

    def __init__(self, rank: int, calls: list[list[torch.Tensor]]) -> None:
        self.rank, self.calls, self.count = rank, calls, 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        mine = [c[self.count] for c in self.calls]
        assert torch.equal(tensor, mine[self.rank])
        self.count += 1
        return torch.cat(mine)


class _One:
    rank = 0

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _gate() -> KLGate:
    return KLGate("main", ["aes", "ir"], GateFraction(0.5, 0.1, 0.02, 0.5))


def test_two_processes_gate_as_one_whatever_the_rows_order():
    """The weights of 2 processes (rows dealt unevenly, in another order) are the one process's of the same rows,
    with discrete scores full of ties (a geneval-like 0 / 0.5 / 1): tied scores share their mean rank."""
    g = torch.Generator().manual_seed(7)
    details = {key: torch.randint(0, 3, (12,), generator=g).float() / 2 for key in ("main", "aes", "ir")}
    single, metrics = _gate().row_weights(details, _One())
    assert 0 < int((single > 0).sum()) < 12 and metrics["kl_gated_fraction"] > 0
    order = torch.tensor([5, 0, 9, 3, 11, 7, 1, 2, 4, 6, 8, 10])
    parts = [order[:7], order[7:]]
    calls = [[torch.tensor([len(p)]), *(details[k][p] for k in ("main", "aes", "ir"))] for p in parts]
    for rank, rows in enumerate(parts):
        local = {key: value[rows] for key, value in details.items()}
        weights, _ = _gate().row_weights(local, _Processes(rank, calls))
        assert torch.equal(weights, single[rows]), rank


def test_the_sampling_stage_keeps_the_reward_parts_only_for_the_gate(tmp_path, tiny_weights):
    """With ``kl_gate`` each rollout batch carries its final samples' details ([n] float32, the weighted reward's
    parts); without, none (the other optimizers' rollouts are as before)."""
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    recipe.write_text(recipe.read_text().replace('name = "image-stat"', PARTS))
    gate = ["optimizer.kl_gate=true", 'optimizer.kl_gate_main="bright"', 'optimizer.kl_gate_aux=["saturated"]']
    for sets in ([], gate):
        trainer = Trainer(load_recipe(recipe, [*sets, "eval.every=0", f"train.run_dir={tmp_path / str(len(sets))}"]))
        sampled = trainer._sample_and_score(plan_epoch(len(trainer.train_items), trainer.settings, 0))
        details = [r.reward_details for r in sampled.rollouts]
        if not sets:
            assert details == [None] * len(details)
            continue
        for r, s in zip(sampled.rollouts, sampled.scored, strict=True):
            assert {"bright", "saturated"} <= set(r.reward_details) and r.reward_details[
                "bright"
            ].dtype == torch.float32
            assert torch.equal(r.reward_details["saturated"], s.details["saturated"])


def test_refused_in_one_paragraph_before_anything_loads(tmp_path, tiny_weights):
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    text = recipe.read_text().replace('name = "image-stat"', PARTS)
    gate = 'name = "grpo"\nkl_gate = true\nkl_gate_main = "bright"\nkl_gate_aux = ["%s"]\n'
    cases = [
        (text.replace('name = "grpo"\n', gate % "saturated").replace("beta = 1e-3", "beta = 0.0"),
         "kl_gate = true with beta = 0"),
        (text.replace('name = "grpo"\n', gate % "contrast"), "'contrast', which the recipe's reward does not return"),
        (text.replace('name = "grpo"\n', gate % "bright"), "needs the reward details it ranks"),
    ]  # fmt: skip
    for body, expected in cases:
        recipe.write_text(body)
        code, err = run_cli("validate", str(recipe), "--no-machine")
        assert_one_paragraph(code, err, expected)
    recipe.write_text(text.replace('name = "grpo"\n', gate % "saturated"))
    assert run_cli("validate", str(recipe), "--no-machine")[0] == 0


def test_a_resume_restores_the_gates_controller_bitwise(tmp_path, tiny_weights):
    """3 epochs straight against the run resumed from its first checkpoint (the later ones deleted, as a kill leaves
    them): φ, its history, the adapter and every logged metric bitwise."""
    recipe = tiny_recipe(tmp_path, tiny_weights, credit="outcome", reward="image-stat")
    gate = 'name = "grpo"\nkl_gate = true\nkl_gate_main = "bright"\nkl_gate_aux = ["saturated"]\n'
    recipe.write_text(recipe.read_text().replace('name = "image-stat"', PARTS).replace('name = "grpo"\n', gate))
    sets = ["train.epochs=3", "eval.every=0", "train.keep_checkpoints=0", "train.ema=false"]
    straight = Trainer(load_recipe(recipe, sets))
    straight.fit()
    rows = read_jsonl(straight.run_dir / "metrics.jsonl")
    assert len([r["kl_gate_phi"] for r in rows if "kl_gate_phi" in r]) == 3
    killed = tmp_path / "killed"
    what_a_kill_leaves(straight.run_dir, killed)
    resumed = Trainer(load_recipe(recipe, [*sets, f"train.run_dir={killed}"]), resume=True)
    assert resumed.epoch == 1 and len(resumed.optimizer.gate.controller.history) == 1
    resumed.fit()
    assert straight.optimizer.gate.controller.state_dict() == resumed.optimizer.gate.controller.state_dict()
    a, b = (torch.cat([p.detach().flatten() for p in t.backbone.trainable_parameters()]) for t in (straight, resumed))
    assert torch.equal(a, b)
    assert comparable_metrics(straight.run_dir) == comparable_metrics(killed)


@pytest.mark.parametrize("keys", [{"main", "aes"}, set()])
def test_a_reward_without_the_named_details_stops_in_one_paragraph(keys):
    from tpflow.errors import UserError

    with pytest.raises(UserError, match="did not return"):
        _gate().row_weights({k: torch.rand(4) for k in keys}, _One())

"""Collectives on a real 2-process gloo group: gathers, reductions, gradient all-reduce, and group statistics that do
not depend on where a prompt's copies sit (docs/algorithm.md §5 item 1, §6.3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed_workers import (
    GATE,
    GATE_PARTS,
    clipped_step,
    collectives_worker,
    group_stats_worker,
    layout_gradient,
    layout_worker,
    minimal_optimizer_worker,
    nft_layout_gradient,
    several_worker,
    sharded_layout_worker,
    spawn,
)
from tpflow.distributed import Distributed
from tpflow.optim.advantages import group_advantages
from tpflow.optim.grpo import GRPO
from tpflow.optim.grpo_options import GRPOOptions

G = 4  # 3 prompts x G = 4 copies; prompt of row t = t // 4
GROUP_REWARDS = torch.randn(3 * G, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
GROUP_LAYOUTS = {
    "whole": [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 10, 11]],  # prompts 0, 1 each on one rank (prompt 2 split)
    "split": [[0, 5, 10, 3, 6, 9], [4, 1, 2, 11, 8, 7]],  # every prompt's copies on both ranks
    "uneven": [[11], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]],  # ragged shares
}
EVERYTHING = list(range(8))
GRPO_LAYOUTS = {
    "4 + 4": [(EVERYTHING[:4], 4, 1), (EVERYTHING[4:], 4, 1)],
    "2 + 2 each": [(EVERYTHING[:4], 2, 2), (EVERYTHING[4:], 2, 2)],
    "3 + 3 | 2": [(EVERYTHING[:6], 3, 2), (EVERYTHING[6:], 3, 2)],
}
NFT_LAYOUTS = {
    "4 + 4": [(EVERYTHING[:4], 4, 1), (EVERYTHING[4:], 4, 1)],
    "3 + 3 | 2": [(EVERYTHING[:6], 3, 2), (EVERYTHING[6:], 3, 2)],
}
GRPO_MODES = ["grpo", "grpo-retain", "grpo-reweight", "grpo-reweight-outcome", "grpo-retain-branch",
              "grpo-reweight-branch", "grpo-gated"]  # fmt: skip


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tiny_weights) -> list[dict]:
    """One start of 2 processes for the module's tests (``several_worker``): each job's result per rank. The
    collectives come last: they make the processes disagree on purpose."""
    weights, root = str(tiny_weights), tmp_path_factory.mktemp("two-processes")
    jobs = [
        ("group-stats", group_stats_worker, (GROUP_LAYOUTS, GROUP_REWARDS)),
        ("grpo-layouts", layout_worker, (weights, GRPO_LAYOUTS, "+".join(GRPO_MODES))),
        ("nft-layouts", layout_worker, (weights, NFT_LAYOUTS, "nft+awm+dgpo")),
        ("sharded", sharded_layout_worker, (weights, GRPO_LAYOUTS)),
        ("minimal", minimal_optimizer_worker, (str(_minimal_recipe(root, tiny_weights)), MINIMAL_SETS)),
        ("collectives", collectives_worker, ()),
    ]
    return spawn(several_worker, root, jobs)


def test_a_prompts_copies_split_across_ranks_get_the_same_group_statistics(two_processes):
    g, rewards, layouts = G, GROUP_REWARDS, GROUP_LAYOUTS
    ranks = [r["group-stats"] for r in two_processes]
    reference = group_advantages(rewards, [t // g for t in range(3 * g)])  # everything on one process
    assert reference.abs().sum() > 0
    for name in layouts:
        seen = torch.zeros(3 * g, dtype=torch.bool)
        for result in ranks:
            ids, advantages = result[name]["ids"], result[name]["advantages"]
            torch.testing.assert_close(advantages, reference[ids], rtol=0, atol=1e-12, msg=name)
            seen[ids] = True
        assert seen.all(), f"{name}: every trajectory gets its advantage back on its own rank"


def test_collectives_on_two_processes(two_processes):
    zero, one = (r["collectives"] for r in two_processes)
    for result in (zero, one):
        assert torch.equal(result["rows"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))  # process order
        assert result["objects"] == ["r0", "r1", "r1"]
        assert (result["sum"], result["max"], result["losses"]) == (3.0, 10.0, 3)
        # mean over the 3 losses of both processes: (1·1 + 2·2) / 3 per element; b only had rank 1's 6 / 3
        torch.testing.assert_close(result["grad_a"], torch.full((3,), 5.0 / 3.0))
        torch.testing.assert_close(result["grad_b"], torch.full((2,), 2.0))
        assert result["grad_c_is_none"], "a parameter no process trained keeps grad None, as on one process"
        assert result["diverged"] is not None and "ranks [1] disagree" in result["diverged"]
    assert torch.equal(zero["grad_a"], one["grad_a"]), "every process holds the same gradient, bit for bit"
    # a sharded module's forwards in lockstep (tpflow.train.lockstep): rank 0 repeats one forward to join rank 1's
    # third, each computes what it computes unsharded, and processes in different batches stop with an error
    assert [r["lockstep"]["repeats"] for r in (zero, one)] == [1, 0]
    assert all(r["lockstep"]["equal"] for r in (zero, one))
    assert all("different rollout batches" in r["lockstep"]["error"] for r in (zero, one))


@pytest.fixture(scope="module")
def grpo_layout_gradients(two_processes) -> list[dict]:
    """Each rank's gradient of one GRPO step per layout, native ("grpo/<layout>"), from the rollout's retained
    graphs ("grpo-retain/<layout>") and from its per-row gradients ("grpo-reweight/<layout>", beta 0), on the window
    plan and on the branch ("…-branch")."""
    return [r["grpo-layouts"] for r in two_processes]


def _every_layout_steps_with(zero: dict, one: dict, mode: str, reference: torch.Tensor) -> None:
    """For each of ``GRPO_LAYOUTS``, both ranks' gradient of ``mode`` is one tensor, ``reference`` up to rounding."""
    for name in GRPO_LAYOUTS:
        key = f"{mode}/{name}"
        assert torch.equal(zero[key], one[key]), f"{key}: every process steps with the same gradient"
        torch.testing.assert_close(zero[key], reference, rtol=1e-5, atol=1e-7, msg=key)


def test_a_steps_gradient_is_the_same_on_two_processes_whatever_the_split(grpo_layout_gradients, tiny_weights):
    """One optimizer step over 8 rows split over 2 processes (4 + 4 as one micro-batch each, 2 + 2 on each, and
    3 + 3 on one with 2 on the other) gives the 1-process gradient: every row of every process weighs the same."""
    zero, one = grpo_layout_gradients
    reference = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1)
    _every_layout_steps_with(zero, one, "grpo", reference)


def test_a_gated_steps_gradient_is_the_same_on_two_processes_whatever_the_split(grpo_layout_gradients, tiny_weights):
    """GARDO's KL gate (``kl_gate``): the gate ranks the epoch's rows of both processes (their reward parts full of
    ties), so each split's step (4 + 4, 2 + 2 each, 3 + 3 | 2) is the 1-process step, up to rounding."""
    zero, one = grpo_layout_gradients
    gated = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, gated=True)
    weights, _ = GRPO(GRPOOptions(**GATE)).gate.row_weights(GATE_PARTS, Distributed())
    assert 0 < int((weights > 0).sum()) < 8  # some rows gated, not all
    _every_layout_steps_with(zero, one, "grpo-gated", gated)


def test_a_retained_steps_gradient_is_the_native_one_on_two_processes_whatever_the_split(
    grpo_layout_gradients, tiny_weights
):
    """``recompute = "retain"``: the step back-propagates the rollouts' own graphs (one backward per process over
    its share, micro-batches sharing them), is all-reduced as native's, and equals the 1-process native gradient up
    to float rounding (tests/test_recompute_retain.py says why not bitwise)."""
    zero, one = grpo_layout_gradients
    native = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1)
    retained = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, recompute="retain")
    assert native.norm() > 0
    torch.testing.assert_close(retained, native, rtol=1e-5, atol=1e-7)
    _every_layout_steps_with(zero, one, "grpo-retain", native)


def test_a_reweighted_steps_gradient_is_the_native_one_on_two_processes_whatever_the_split(
    grpo_layout_gradients, tiny_weights
):
    """``recompute = "reweight"``: each process weighs its rows' gradients (per step for step credits, per trajectory
    for outcome credit) by their advantages locally, the loop reduces the sum once, as a native step's; it equals the
    1-process native gradient (beta 0) up to float rounding."""
    zero, one = grpo_layout_gradients
    for mode, outcome in (("grpo-reweight", False), ("grpo-reweight-outcome", True)):  # per step; per trajectory
        native = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, beta=0.0, outcome=outcome)
        reweighted = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, recompute="reweight", beta=0.0,
                                     outcome=outcome)  # fmt: skip
        assert native.norm() > 0
        torch.testing.assert_close(reweighted, native, rtol=1e-5, atol=1e-7, msg=mode)
        _every_layout_steps_with(zero, one, mode, native)


def test_the_branchs_step_from_the_rollout_is_the_native_one_on_two_processes_whatever_the_split(
    grpo_layout_gradients, tiny_weights
):
    """TempFlow-GRPO's branch (per-step credit, copies of a noise row on either process): the step from the
    rollout's retained graphs and from its per-row gradients equals the 1-process native step up to float
    rounding, whichever process holds which copy."""
    zero, one = grpo_layout_gradients
    for mode, recompute, beta in (("grpo-retain-branch", "retain", 1e-2), ("grpo-reweight-branch", "reweight", 0.0)):
        native = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, beta=beta, plan="branch")
        kept = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, recompute=recompute, beta=beta, plan="branch")
        assert native.norm() > 0
        torch.testing.assert_close(kept, native, rtol=1e-5, atol=1e-7, msg=mode)
        _every_layout_steps_with(zero, one, mode, native)


def test_an_fsdp_sharded_step_is_the_unsharded_one_whatever_the_split(
    two_processes, tiny_weights, grpo_layout_gradients
):
    """``[train] shard = "fsdp"``: FSDP2 over 2 processes (each block's weights, gradients and moments halved), the
    gradient summed by its reduce-scatter and divided by the rows over both: one optimizer step of GRPO and of NFT,
    with a LoRA and with the whole model trained, on shapes-dit and (GRPO) tiny-sd3, equals the 1-process unsharded
    step within 1e-6 relative (tiny-sd3 with a LoRA: 2e-6), however the rows are split (3 + 3 | 2: the short
    process pads its step with a zero-weight micro-batch), also with activation checkpointing in each sharded block;
    under bf16 autocast and fp16 with the sharded gradient scaler, the step points where the unsharded one does.
    A LoRA's gradient, reduced once at the step's last backward (``deferred_sync``), is the replicated 2-process
    run's bit for bit (reduced after every loss it was 8.6e-8 relative apart)."""
    zero, one = (r["sharded"] for r in two_processes)
    for name in GRPO_LAYOUTS:
        assert torch.equal(zero[f"grpo-lora/{name}"], grpo_layout_gradients[0][f"grpo/{name}"]), name
    worst = 0.0
    for finetune in ("lora", "full"):
        references = {
            "grpo": layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, finetune=finetune),
            "nft": nft_layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, finetune=finetune),
        }
        for optimizer, reference in references.items():
            assert reference.norm() > 0
            for name in GRPO_LAYOUTS:
                key = f"{optimizer}-{finetune}/{name}"
                assert torch.equal(zero[key], one[key]), f"{key}: every process steps with the same gradient"
                relative = float((zero[key] - reference).norm() / reference.norm())
                worst = max(worst, relative)
                assert relative <= 1e-6, (key, relative)
    print(f"largest relative difference to the unsharded step: {worst:.1e}")
    for finetune in ("lora", "full"):  # tiny-sd3: a diffusers transformer's blocks, split 3 + 3 | 2
        reference = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, finetune=finetune, model="tiny-sd3")
        key = f"tiny-sd3-{finetune}"
        assert torch.equal(zero[key], one[key]) and reference.norm() > 0
        relative = float((zero[key] - reference).norm() / reference.norm())
        print(f"tiny-sd3, {finetune}: {relative:.1e}")
        # float32 sums in another order: 9.2e-7 with 2 threads, 1.09e-6 with 1 (the LoRA gradient is a product of
        # small factors); a real layout bug is of the order of the gradient itself
        assert relative <= 2e-6, (key, relative)
        if finetune == "full":  # recomputing each sharded block's activations in the backward changes nothing
            checkpointed = zero["tiny-sd3-full-checkpointed"]
            assert torch.equal(checkpointed, one["tiny-sd3-full-checkpointed"])
            relative = float((checkpointed - reference).norm() / reference.norm())
            print(f"tiny-sd3, full, gradient checkpointing: {relative:.1e}")
            assert relative <= 1e-6, ("checkpointed", relative)
    # a clipped step: the norm is the whole gradient's (over both shards), the step the unsharded clipped one
    unsharded = clipped_step(str(tiny_weights), EVERYTHING, accumulation=2)  # the 8 rows in one step, as sharded
    assert zero["clipped"]["grad_norm"] > 1e-3 * 10
    assert abs(zero["clipped"]["grad_norm"] / unsharded["grad_norm"] - 1) < 1e-6
    torch.testing.assert_close(zero["clipped"]["weights"], unsharded["weights"], rtol=0, atol=1e-7)
    assert torch.equal(zero["clipped"]["weights"], one["clipped"]["weights"])
    _check_sharded_checkpoint(zero["checkpoint"], one["checkpoint"])
    for mode in ("bf16", "fp16"):  # under mixed precision, against the unsharded step in the same precision
        reference = layout_gradient(str(tiny_weights), EVERYTHING, 8, 1, finetune="full", mode=mode)
        key = f"grpo-full-{mode}"
        assert torch.equal(zero[key], one[key]) and reference.norm() > 0
        cosine = float(torch.nn.functional.cosine_similarity(zero[key].double(), reference.double(), dim=0))
        print(f"{mode}: cosine to the unsharded step {cosine:.7f}")
        assert cosine >= 0.9999, (mode, cosine)


def _check_sharded_checkpoint(zero: dict, one: dict) -> None:
    """A sharded LoRA (tiny-sd3, a diffusers transformer with peft's layers) written by 2 processes as their own
    shards reads back whole on one process: weights into a fresh unsharded backbone, moments and EMA; a backbone of
    another LoRA rank is refused in one paragraph."""
    import tpflow
    from tpflow.train.checkpoints.format import CheckpointError, load_checkpoint
    from tpflow.train.checkpoints.sharded import restore_sharded

    assert one["path"] is None and zero["path"] is not None  # the main process installs it
    ckpt = load_checkpoint(Path(zero["path"]))
    assert len(list((ckpt.path / "shards").glob("*.safetensors"))) == 2
    backbone = tpflow.build("backbone", "tiny-sd3", lora_init="gaussian", resolution=8, device="cpu")
    ckpt.load_weights(backbone)
    loaded = [p.detach() for p in backbone.trainable_parameters()]
    assert len(loaded) == len(zero["weights"]) and all(map(torch.equal, loaded, zero["weights"]))
    ema = ckpt.full_ema()
    assert all(torch.equal(ema[str(i)], 3 * w) for i, w in enumerate(zero["weights"]))
    optimizer, ema_state = restore_sharded(ckpt, backbone)
    state = optimizer["optimizer"]["state"]
    assert all(torch.equal(state[str(i)]["exp_avg"], 2 * w) for i, w in enumerate(zero["weights"]))
    assert float(state["0"]["step"]) == 3.0 and torch.equal(ema_state["0"], ema["0"])
    other = tpflow.build("backbone", "tiny-sd3", lora_init="gaussian", resolution=8, lora_rank=2, device="cpu")
    with pytest.raises(CheckpointError, match="do not match"):
        ckpt.load_weights(other)


def test_an_nft_steps_gradient_is_the_same_on_two_processes_whatever_the_split(two_processes, tiny_weights):
    """DiffusionNFT and AWM draw each sample's times and noise from its own index among the update's samples, so
    one step over 8 samples split over 2 processes gives the 1-process gradient (an earlier release drew ε per
    micro-batch and per process); DGPO draws them per group, and its group weights add every process's rows."""
    everything, layouts = EVERYTHING, NFT_LAYOUTS
    zero, one = (r["nft-layouts"] for r in two_processes)
    for optimizer in ("nft", "awm", "dgpo"):
        reference = nft_layout_gradient(str(tiny_weights), everything, 8, 1, name=optimizer)
        assert reference.abs().max() > 0
        for name in layouts:
            key = f"{optimizer}/{name}"
            assert torch.equal(zero[key], one[key]), f"{key}: every process steps with the same gradient"
            torch.testing.assert_close(zero[key], reference, rtol=1e-5, atol=1e-7, msg=key)


MINIMAL_SETS = ["train.epochs=1", "eval.every=0", "log.trackers=[]", "train.ema=false"]


def _minimal_recipe(tmp_path: Path, weights: Path) -> Path:
    """The tiny recipe with the protocol-only test optimizer ``test-minimal`` and none of GRPO's options."""
    from tests.test_train import tiny_recipe

    recipe = tiny_recipe(tmp_path, weights, reward="image-stat")
    text = recipe.read_text().replace('[optimizer]\nname = "grpo"', '[optimizer]\nname = "test-minimal"')
    recipe.write_text("\n".join(line for line in text.splitlines() if not _grpo_only(line)))
    return recipe


@pytest.mark.parametrize("processes", [1, 2])
def test_an_optimizer_of_the_protocol_alone_trains_on_one_and_two_processes(tmp_path, tiny_weights, processes,
                                                                              request):  # fmt: skip
    """train/ needs nothing of an optimizer beyond ``tpflow.interfaces.Optimizer``: a plugin that implements the
    protocol and nothing else (no ``options`` the trainer reads, no tpflow optimizer base) trains an epoch. On 2
    processes it is a job of the module's one start (``two_processes``)."""
    if processes == 1:  # in this process: no process group, nothing to spawn
        ranks = [minimal_optimizer_worker(0, tmp_path, str(_minimal_recipe(tmp_path, tiny_weights)), MINIMAL_SETS)]
    else:
        ranks = [r["minimal"] for r in request.getfixturevalue("two_processes")]
    assert all(r["world_size"] == processes for r in ranks)
    for rank in ranks:
        assert any(not torch.equal(a, b) for a, b in zip(rank["start"], rank["end"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(rank["end"], ranks[0]["end"], strict=True))


def _grpo_only(line: str) -> bool:
    return line.split("=")[0].strip() in ("learning_rate", "beta", "micro_batch_size", "gradient_accumulation_steps")

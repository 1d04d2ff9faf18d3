"""The distributed prompt sampler: rounds of G copies, shuffled, dealt to processes; the same plan on every process
and for every process count (docs/algorithm.md §6.3)."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from tpflow.errors import UserError
from tpflow.settings import TrainSettings
from tpflow.train.prompt_sampler import check_layout, noise_seed, plan_epoch


def settings(**changes) -> TrainSettings:
    return TrainSettings(**{"prompts_per_epoch": 4, "group_size": 6, "rollout_batch": 3, **changes})


def test_every_process_count_deals_out_the_same_global_batches():
    train = settings()
    plan = plan_epoch(50, train, epoch=3)
    assert plan == plan_epoch(50, train, epoch=3), "every process computes the same plan from (seed, epoch)"
    assert plan != plan_epoch(50, train, epoch=4) and plan != plan_epoch(50, settings(seed=7), epoch=3)
    assert len(plan.batches) == 8 and plan.num_trajectories == 24
    for world in (1, 2, 4, 8):
        shares = [plan.local(rank, world) for rank in range(world)]
        assert sorted(b.index for share in shares for b in share) == list(range(8))
        assert {len(share) for share in shares} == {8 // world}
        assert all(b.index % world == rank for rank, share in enumerate(shares) for b in share)
    counts = Counter(i for b in plan.batches for i in b.items)
    assert len(counts) == 4 and set(counts.values()) == {6}, "4 distinct prompts, G = 6 copies each"
    assert len({b.seed for b in plan.batches}) == 8


def test_copies_of_a_prompt_land_on_different_processes():
    plan = plan_epoch(50, settings(), epoch=0)
    on_rank = [{i for b in plan.local(rank, 2) for i in b.items} for rank in range(2)]
    assert on_rank[0] & on_rank[1], "the copies are shuffled over the batches, not kept on one process"


def test_rounds_draw_their_prompts_separately():
    train = settings(prompts_per_epoch=4, prompts_per_round=2, group_size=3, rollout_batch=2)
    plan = plan_epoch(1000, train, epoch=0)
    assert len(plan.batches) == 6
    first = Counter(i for b in plan.batches[:3] for i in b.items)
    second = Counter(i for b in plan.batches[3:] for i in b.items)
    assert len(first) == len(second) == 2 and set(first.values()) == set(second.values()) == {3}
    assert first.keys() != second.keys()
    # the reference's split: a round of P·B trajectories gives each of P processes exactly one batch of it
    for rank in range(3):
        share = plan.local(rank, 3)
        assert [b.index for b in share] == [rank, rank + 3]


def test_small_splits_repeat_prompts():
    plan = plan_epoch(2, settings(prompts_per_epoch=4), epoch=0)
    assert set(Counter(i for b in plan.batches for i in b.items)) <= {0, 1}
    with pytest.raises(UserError, match="empty"):
        plan_epoch(0, settings(), epoch=0)


def test_layouts_that_cannot_be_shared_are_refused():
    check_layout(settings(), 1)
    check_layout(settings(), 8)
    with pytest.raises(UserError, match=r"3 processes cannot share.*\[1, 2, 4, 8\]"):
        check_layout(settings(), 3)
    partial = settings(prompts_per_epoch=1, group_size=5, rollout_batch=2)  # 5 trajectories: a half batch
    check_layout(partial, 1)
    with pytest.raises(UserError, match="whole batches"):
        check_layout(partial, 2)
    with pytest.raises(ValidationError, match="must divide prompts_per_epoch"):
        settings(prompts_per_round=3)
    with pytest.raises(ValidationError, match="whole rollout batches"):
        settings(prompts_per_round=1, group_size=5, rollout_batch=2)


def test_same_noise_seeds_are_per_prompt_and_epoch():
    train = settings()
    assert noise_seed(train, 0, 5) == noise_seed(train, 0, 5)
    assert len({noise_seed(train, e, i) for e in range(3) for i in range(3)}) == 9


def test_each_batch_knows_its_rows_in_the_epoch_whichever_process_samples_it():
    """``EpochPlan.epoch_rows``: process r of P samples batches r, r + P, ...; its rows keep their places in the
    epoch's order (what keys a final-sample update's draws), so two processes' rows are one process's."""
    train = TrainSettings(prompts_per_epoch=4, group_size=2, rollout_batch=2, seed=3)
    plan = plan_epoch(10, train, 0)
    mine = [plan.epoch_rows(b).tolist() for b in plan.local(1, 2)]
    assert mine == [[2, 3], [6, 7]]
    both = sorted(r for rank in range(2) for b in plan.local(rank, 2) for r in plan.epoch_rows(b).tolist())
    assert both == [r for b in plan.local(0, 1) for r in plan.epoch_rows(b).tolist()] == list(range(8))

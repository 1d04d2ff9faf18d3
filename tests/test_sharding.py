"""``[train] shard = "fsdp"``: what a recipe cannot run in lockstep is refused before anything loads, and the helpers
that move states between sharded and full tensors. The 2-process runs are in tests/test_distributed.py (one
optimizer step against the unsharded one) and tests/test_distributed_train.py (training, resume on 2 and 1
processes)."""

from __future__ import annotations

import pytest
import torch

from tests.test_train import tiny_recipe
from tpflow.errors import RecipeError, UserError
from tpflow.recipe import load_recipe
from tpflow.shards import full, like
from tpflow.train.sharding import equal_eval_shares


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (['optimizer.recompute="retain"'], 'recompute = "retain" runs the update'),
        (["backbone.compile_blocks=true"], "compiling FSDP-sharded blocks"),
    ],
)
def test_what_cannot_run_in_lockstep_is_refused(tmp_path, tiny_weights, sets, says):
    path = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    assert load_recipe(path, ['train.shard="fsdp"']).train.shard == "fsdp"
    with pytest.raises(RecipeError, match=says):
        load_recipe(path, ['train.shard="fsdp"', *sets])


def test_an_eval_that_processes_cannot_share_equally_is_refused():
    equal_eval_shares(6, 2)
    with pytest.raises(UserError, match="cannot share equally"):
        equal_eval_shares(7, 2)


def test_unsharded_values_pass_through():
    """On one process (nothing sharded) the gathering and sharding helpers are the identity."""
    value = {"a": [torch.ones(2), 3], "b": torch.zeros(1)}
    assert full(value)["a"][0] is value["a"][0] and full(value)["a"][1] == 3
    param = torch.nn.Parameter(torch.zeros(2))
    moment = torch.ones(2)
    assert like(moment, param) is moment


def test_validate_says_how_a_sharded_recipe_splits_and_refuses_an_unequal_eval(tmp_path, tiny_weights):
    """``tpflow validate --num-processes N`` of a sharded recipe: what each process holds, and an evaluation the
    processes cannot share equally refused there, before any launch."""
    from tpflow.cli_validate import layout_report

    path = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    sets = ['train.shard="fsdp"', "train.rollout_batch=2", "optimizer.micro_batch_size=2"]
    report = layout_report(load_recipe(path, [*sets, "eval.num_prompts=4"]), 2)
    assert "sharding: FSDP2 over 2 processes" in report
    with pytest.raises(UserError, match="cannot share equally"):
        layout_report(load_recipe(path, [*sets, "eval.num_prompts=3"]), 2)


def test_validate_refuses_sharded_anchors_the_processes_cannot_share(tmp_path, tiny_weights):
    """The ability-matched policy's anchors (prompts_per_epoch × prompt_candidates ODE samples an epoch) run in
    lockstep on a sharded model: a count the processes cannot split equally is refused by ``tpflow validate
    --num-processes N`` (and at the start of ``tpflow train``), not at the first epoch."""
    from tpflow.cli_validate import layout_report

    path = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    sets = ['train.shard="fsdp"', "train.rollout_batch=2", "optimizer.micro_batch_size=2", "eval.num_prompts=4",
            'train.prompt_policy="ability-matched"', "train.prompts_per_epoch=1", "train.group_size=4"]  # fmt: skip
    assert "sharding: FSDP2" in layout_report(load_recipe(path, [*sets, "train.prompt_candidates=4"]), 2)
    with pytest.raises(UserError, match="anchors"):
        layout_report(load_recipe(path, [*sets, "train.prompt_candidates=3"]), 2)
    assert "layout" in layout_report(load_recipe(path, [*sets[1:], "train.prompt_candidates=3"]), 2)  # unsharded

"""DiffusionNFT in the trainer: the recipe check, the CLI listing, no branch on the optimizer's name, and a run
killed with SIGKILL that resumes bitwise (docs/nft.md)."""

from __future__ import annotations

import ast
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.cli_run import TpflowForked
from tests.kill_leaves import comparable_metrics, what_a_kill_leaves
from tests.test_preflight import assert_one_paragraph, run_cli
from tests.test_train import tiny_recipe
from tpflow.recipe import load_recipe
from tpflow.train.trainer import Trainer

GRPO_SECTION = """[optimizer]
name = "grpo"
learning_rate = 1e-2
beta = 1e-3
micro_batch_size = 4
gradient_accumulation_steps = 1
"""
NFT_SECTION = """[optimizer]
name = "nft"
learning_rate = 1e-2
kl_weight = 1e-3
micro_batch_size = 4
gradient_accumulation_steps = 1
num_timesteps = 4
timesteps_per_sample = 2
old_decay_rate = 0.25
"""


AWM_SECTION = """[optimizer]
name = "awm"
learning_rate = 1e-2
kl_weight = 1e-3
micro_batch_size = 4
gradient_accumulation_steps = 1
num_timesteps = 4
train_timesteps = 2
timestep_fraction = 1.0
old_decay_rate = 0.25
"""

DGPO_SECTION = """[optimizer]
name = "dgpo"
learning_rate = 1e-2
kl_weight = 1e-3
micro_batch_size = 4
gradient_accumulation_steps = 1
num_timesteps = 4
train_timesteps = 2
trunc_steps = 3
old_decay_rate = 0.25
switch_ema_ref = 1
"""


def nft_recipe(
    tmp_path: Path,
    weights: Path | None,
    reward: str = "image-stat",
    credit: str = "outcome",
    backbone: str | None = None,
    section: str = NFT_SECTION,
) -> Path:
    """The trainer tests' tiny recipe (2 prompts x 4 copies, cps at 0.7 in a 3-step window, CFG 2) with the nft
    optimizer (KL on, the old policy lagging from the second step) and a built-in reward; ``backbone`` as in
    ``tiny_recipe``."""
    path = tiny_recipe(tmp_path, weights, credit=credit, reward=reward, backbone=backbone)
    text = path.read_text()
    assert GRPO_SECTION in text
    path.write_text(text.replace(GRPO_SECTION, section))
    return path


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.backbone.model.named_parameters() if "lora_" in n}


def _assert_ended_alike(straight: Trainer, resumed: Trainer) -> None:
    """The resumed run ends where the uninterrupted one did: its adapter and lagged copy bitwise, its metrics."""
    a, b = _adapter(straight), _adapter(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a), "the resumed adapter must equal the uninterrupted one bitwise"
    assert all(
        torch.equal(x, y) for x, y in zip(straight.optimizer.lagged.old, resumed.optimizer.lagged.old, strict=True)
    )
    assert comparable_metrics(straight.run_dir) == comparable_metrics(resumed.run_dir)


def test_validate_refuses_per_step_credit(tmp_path, tiny_weights):
    recipe = nft_recipe(tmp_path, tiny_weights, credit="consistent")
    code, err = run_cli("validate", str(recipe), "--no-machine")
    assert_one_paragraph(code, err, '[credit] name = "consistent"', "final samples only", 'name = "outcome"')
    code, err = run_cli("validate", str(nft_recipe(tmp_path, tiny_weights)), "--no-machine")
    assert code == 0, err


def test_components_lists_every_optimizer():
    code, out = run_cli("components", "optimizer")
    assert code == 0, out
    assert "grpo" in out and "nft" in out and "timesteps_per_sample" in out and "clip_range" in out
    assert "awm" in out and "train_timesteps" in out and "ghuber_power" in out
    assert "dgpo" in out and "beta_dpo" in out and "switch_ema_ref" in out


def _optimizer_specific_uses(source: str, filename: str) -> list[str]:
    """Code (not comments or docstrings) of ``source`` that names an optimizer or reads what is not in the
    ``Optimizer`` protocol: the names grpo / nft in identifiers or strings, ``optimizer.name``, ``<...>optimizer
    .options``, and GRPO's or NFT's option names."""
    tree = ast.parse(source, filename)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    words = re.compile(r"\b(grpo|nft|awm|dgpo)\b", re.IGNORECASE)
    options = {"clip_range", "gradient_accumulation_steps", "adv_clip_max", "kl_weight", "timesteps_per_sample"}
    hits = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Name) and words.search(node.id):
            text = node.id
        elif isinstance(node, ast.Attribute):
            chain = ast.unparse(node)
            if words.search(node.attr) or node.attr in options or re.search(r"optimizer\.(name|options)$", chain):
                text = chain
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if words.search(node.value) or any(option in node.value for option in options):
                text = repr(node.value)
        if text is not None:
            hits.append(f"{Path(filename).name}:{node.lineno}: {text}")
    return hits


def test_the_trainer_never_branches_on_the_optimizers_name():
    """What the trainer does for an optimizer follows from what the optimizer declares (the ``Optimizer``
    protocol: ``consumes``, ``sampling_policy``, ``batch_layout``...), never from its registered name or options."""
    train = Path(__file__).resolve().parent.parent / "tpflow" / "train"
    paths = sorted(train.glob("*.py"))
    hits = [hit for path in paths for hit in _optimizer_specific_uses(path.read_text(), str(path))]
    assert not hits, hits
    # the check can fail: quoted and unquoted names, option reads, user-facing strings
    bad = (
        'if self.recipe.optimizer.name == "nft":\n    pass\n'
        "steps = self.optimizer.options.micro_batch_size\n"
        "eps = GRPOOptions().clip_range\n"
        'message = "lower optimizer.gradient_accumulation_steps"\n'
    )
    assert len(_optimizer_specific_uses(bad, "example.py")) == 5, _optimizer_specific_uses(bad, "example.py")


def test_the_base_seed_follows_train_seed_not_what_was_built_before(tmp_path, tiny_weights, monkeypatch):
    """The nft base seed (its update's t and ε) is derived from ``train.seed``: a reward whose construction draws
    from the global RNG (shapes-clip's did) leaves it alone; another train.seed changes it."""
    from tpflow.recipe import Recipe

    recipe = load_recipe(nft_recipe(tmp_path, tiny_weights), ["train.epochs=1"])
    plain = Trainer(recipe, run_dir=tmp_path / "plain").optimizer.lagged.seed
    build = Recipe.build

    def drawing(self, kind):
        if kind == "reward":
            torch.rand(1000)  # what building a model with random initial weights does to the global RNG
        return build(self, kind)

    monkeypatch.setattr(Recipe, "build", drawing)
    assert Trainer(recipe, run_dir=tmp_path / "drawing").optimizer.lagged.seed == plain
    other = load_recipe(nft_recipe(tmp_path, tiny_weights), ["train.epochs=1", "train.seed=7"])
    assert Trainer(other, run_dir=tmp_path / "other").optimizer.lagged.seed != plain


def test_kill_9_then_resume_continues_exactly(tmp_path, tiny_weights, section=NFT_SECTION):
    """A real process (forked: ``TpflowForked``) killed with SIGKILL once its first checkpoint is in place,
    resumed: it ends bitwise where the uninterrupted run did, lagged copy included. AWM and DGPO resume from the
    same state, made in this process (``test_awm_and_dgpo_resume_from_what_a_kill_leaves_exactly``)."""
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight_dir.mkdir()
    killed_dir.mkdir()
    sets = ["train.epochs=4", "eval.every=0"]
    straight = Trainer(load_recipe(nft_recipe(straight_dir, tiny_weights, section=section), sets))
    straight.fit()
    assert straight.optimizer.global_step >= 4 and straight.optimizer.lagged.updates == 4

    recipe = nft_recipe(killed_dir, tiny_weights, section=section)
    proc = TpflowForked("train", str(recipe), *[a for s in sets for a in ("--set", s)], folder=tmp_path / "out")
    checkpoints = killed_dir / "run" / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoints.is_dir() and any(not p.name.startswith(".") for p in checkpoints.iterdir()):
            break  # installed by an atomic rename: complete once visible
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.output()[1]}"
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up of any kind
    assert proc.wait(timeout=60) == -signal.SIGKILL

    resumed = Trainer(load_recipe(recipe, sets), resume=True)
    assert 1 <= resumed.epoch < 4
    resumed.fit()
    _assert_ended_alike(straight, resumed)


@pytest.mark.parametrize("section", [AWM_SECTION, DGPO_SECTION], ids=["awm", "dgpo"])
def test_awm_and_dgpo_resume_from_what_a_kill_leaves_exactly(tmp_path, tiny_weights, section):
    """What a kill after the first checkpoint leaves (that checkpoint, and logs that run past it), made in this
    process from a finished run's copy: resumed, AWM and DGPO end bitwise where the uninterrupted run did, their
    lagged copy and their logged metrics included."""
    sets = ["train.epochs=4", "eval.every=0", "train.keep_checkpoints=0"]
    recipe = nft_recipe(tmp_path, tiny_weights, section=section)
    straight = Trainer(load_recipe(recipe, sets))
    straight.fit()
    killed = tmp_path / "killed"
    written = what_a_kill_leaves(straight.run_dir, killed)
    assert len(written) == 4, [p.name for p in written]
    resumed = Trainer(load_recipe(recipe, [*sets, f"train.run_dir={killed}"]), resume=True)
    assert resumed.epoch == 1
    resumed.fit()
    _assert_ended_alike(straight, resumed)

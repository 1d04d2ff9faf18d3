"""The optimizers compose instead of inheriting: no registered optimizer class subclasses another, each implements
the ``Optimizer`` protocol, each keeps its public config's defaults, and every shipped recipe's ``[optimizer]`` table
still validates with the keys it has. That every option name is described once is tests/test_option_descriptions.py's
(over every kind); that tpflow/optim/ keeps its functions short and its files small, tests/test_layers.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from tpflow import registry
from tpflow.interfaces import Optimizer

ROOT = Path(__file__).resolve().parents[1]


def _optimizers() -> dict[str, registry.Entry]:
    """The built-in optimizers (a test's or a plugin's registered beside them are their authors' own)."""
    entries = {name: registry.get("optimizer", name) for name in registry.names("optimizer")}
    return {name: entry for name, entry in entries.items() if entry.qualname.startswith("tpflow.optim.")}


def test_no_registered_optimizer_subclasses_another():
    classes = {name: entry.factory for name, entry in _optimizers().items()}
    assert {"grpo", "nft", "awm", "dgpo"} <= set(classes)
    for name, cls in classes.items():
        for other, base in classes.items():
            if other != name:
                assert not issubclass(cls, base), f"{name} subclasses {other}"
        assert isinstance(cls(), Optimizer), f"{name} does not implement the Optimizer protocol"


@pytest.mark.parametrize("name", ["grpo", "nft", "awm", "dgpo"])
def test_the_defaults_are_each_methods_public_config(name):
    """What each optimizer's defaults were before the options moved into shared bases."""
    defaults = {
        "grpo": {"micro_batch_size": 9, "gradient_accumulation_steps": 2, "global_std": False, "beta": 1e-4},
        "nft": {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "global_std": True, "kl_weight": 1e-4,
                "num_timesteps": 10, "old_decay_max": 0.5, "beta": 1.0},
        "awm": {"micro_batch_size": 3, "global_std": True, "kl_weight": 1e-3, "num_timesteps": 14,
                "old_decay_max": 0.3, "old_decay_unit": "epoch", "clip_range": 1.0, "train_guidance": None},
        "dgpo": {"micro_batch_size": 16, "global_std": False, "kl_weight": 0.02, "num_timesteps": 10,
                 "old_decay_max": 0.3, "clip_range": 1e-2, "train_guidance": 1.0},
    }[name]  # fmt: skip
    options = registry.get("optimizer", name).options()
    common = {"learning_rate": 3e-4, "adam_betas": (0.9, 0.999), "weight_decay": 1e-4, "adam_eps": 1e-8,
              "max_grad_norm": 1.0, "num_inner_epochs": 1, "adv_clip_max": 5.0}  # fmt: skip
    assert {k: getattr(options, k) for k in {**common, **defaults}} == {**common, **defaults}


def test_every_shipped_recipe_optimizer_table_validates():
    """The keys users write did not change: every recipe's [optimizer] table is its optimizer's valid options."""
    checked = 0
    for path in sorted((ROOT / "recipes").rglob("*.toml")):
        table = dict(tomllib.loads(path.read_text()).get("optimizer", {}))
        name = table.pop("name", None)
        if name in ("grpo", "nft", "awm", "dgpo"):
            registry.validate_options("optimizer", name, table)
            checked += 1
    assert checked > 40


def test_final_sample_options_refuse_what_they_refused():
    with pytest.raises(Exception, match="adam_betas"):
        registry.validate_options("optimizer", "nft", {"adam_betas": [1.0, 0.999]})
    with pytest.raises(Exception, match="recompute"):
        registry.validate_options("optimizer", "awm", {"recompute": "retain"})
    with pytest.raises(Exception, match="num_timesteps"):
        registry.validate_options("optimizer", "dgpo", {"num_timesteps": 1, "trunc_steps": 0, "train_timesteps": 1})

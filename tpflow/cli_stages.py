"""The run's stages that a recipe selects in a settings section rather than as a registered component: the prompt
policy (``[train] prompt_policy``) and the replay buffer (``[replay]``). ``tpflow components`` lists them beside the
registered kinds, as kind ``stage``, so that every method's part can be found in one listing (GARDO's and OP-GRPO's
optimizer options are the optimizer's, listed with it).

Each is a :class:`tpflow.registry.Entry` built here, not registered: nothing builds a stage by name.
"""

from __future__ import annotations

import inspect
from types import ModuleType

from pydantic import BaseModel, create_model

from tpflow import registry
from tpflow.replay_settings import ReplaySettings
from tpflow.settings import TrainSettings

KIND = "stage"
PROMPT_POLICY_FIELDS = ("prompt_policy", "prompt_skip_epochs", "prompt_candidates", "prompt_ema_alpha")


def _fields(model: type[BaseModel], names: tuple[str, ...], title: str) -> type[BaseModel]:
    """A model of ``names`` of ``model``'s fields alone (their types, defaults and descriptions)."""
    return create_model(title, **{n: (model.model_fields[n].annotation, model.model_fields[n]) for n in names})


def _entry(name: str, module: ModuleType, options: type[BaseModel]) -> registry.Entry:
    file = inspect.getsourcefile(module) or module.__name__
    return registry.Entry(KIND, name, module, options, f"{file}:1", "tpflow", module.__name__)  # type: ignore[arg-type]


def stage_entries() -> list[registry.Entry]:
    """The stages, in the order a run meets them: the prompts an epoch draws, then the rows it replays."""
    from tpflow.train import prompt_policy, replay

    return [
        _entry("prompt-policy", prompt_policy, _fields(TrainSettings, PROMPT_POLICY_FIELDS, "PromptPolicyOptions")),
        _entry("replay", replay, ReplaySettings),
    ]


def stage_entry(name: str) -> registry.Entry:
    """The stage ``name``; a UserError naming the stages for another name."""
    from tpflow.errors import UserError

    entries = {e.name: e for e in stage_entries()}
    if name not in entries:
        raise UserError(f"No stage {name!r}: the stages are {', '.join(entries)} (tpflow components stage).")
    return entries[name]

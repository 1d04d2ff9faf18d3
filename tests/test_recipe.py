"""Recipes: TOML to validated components, overrides, and the errors a user sees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpflow.errors import RecipeError
from tpflow.recipe import apply_overrides, load_recipe, parse_value
from tpflow.settings import RolloutSettings

ROOT = Path(__file__).resolve().parent.parent

BASE = """
[backbone]
name = "plugin-backbone"
resolution = 64

[reward]
name = "brightness"

[dataset]
name = "text-file"
path = "prompts.txt"

[credit]
name = "turning_point"
balanced = false

[optimizer]
name = "grpo"
learning_rate = 1e-4

[rollout]
num_steps = 10
window_size = 9
window_range = [0, 9]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_valid_recipe_with_defaults(plugin, tmp_path):
    recipe = load_recipe(write(tmp_path, BASE))
    assert recipe.backbone.name == "plugin-backbone" and recipe.backbone.options.resolution == 64
    assert recipe.credit.options.balanced is False and recipe.credit.options.first_step is True
    assert recipe.sampler.name == "cps"  # omitted section: the published default
    assert recipe.optimizer.options.learning_rate == 1e-4
    assert recipe.rollout.window_range == (0, 9) and recipe.train.group_size == 24
    assigner = recipe.build("credit")
    assert assigner.needs_completions


def test_misspelt_option_names_section_field_and_allowed(plugin, tmp_path):
    path = write(tmp_path, BASE.replace("balanced = false", "balancd = false"))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "[credit] (turning_point)" in message
    assert "unknown option 'balancd'" in message and "did you mean 'balanced'" in message
    assert "Allowed options: balanced, first_step." in message
    assert "\n" not in message


def test_wrong_type_names_the_field(plugin, tmp_path):
    path = write(tmp_path, BASE.replace("learning_rate = 1e-4", 'learning_rate = "fast"'))
    with pytest.raises(RecipeError, match=r"\[optimizer\] \(grpo\): option 'learning_rate'.*'fast'"):
        load_recipe(path)


def test_a_bad_value_does_not_append_every_option_name(plugin, tmp_path):
    """A type error named the field rightly; the whole list of allowed options after it was noise."""
    path = write(tmp_path, BASE.replace("learning_rate = 1e-4", 'learning_rate = "fast"'))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "Allowed options" not in str(info.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("log.trackers=wandb", 'trackers = ["wandb"] in the recipe, on the command line '
         """--set 'log.trackers=["wandb"]'"""),
        ("rollout.window_range=0,9", "window_range = [0, 9] in the recipe, on the command line "
         "--set 'rollout.window_range=[0, 9]'"),
    ],
)  # fmt: skip
def test_a_list_given_without_brackets_gets_the_syntax_that_works(plugin, tmp_path, override, expected):
    path = write(tmp_path, BASE)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, [override])
    message = str(info.value)
    assert "valid" in message and expected in message and "\n" not in message
    fixed = expected.split("--set '")[1].rstrip("'")
    load_recipe(path, [fixed])  # the suggested override is accepted


def test_unknown_component_lists_names(plugin, tmp_path):
    path = write(tmp_path, BASE.replace('name = "turning_point"', 'name = "turningpoint"'))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "[credit]" in message and "Did you mean 'turning_point'?" in message
    assert "Available: branch, consistent, incremental, outcome, turning_point." in message


def test_missing_required_section_and_unknown_section(plugin, tmp_path):
    with pytest.raises(RecipeError, match=r"missing section \[reward\].*brightness"):
        load_recipe(write(tmp_path, BASE.replace('[reward]\nname = "brightness"', "")))
    with pytest.raises(RecipeError, match=r"unknown section \[rolout\]. Did you mean \[rollout\]"):
        load_recipe(write(tmp_path, BASE.replace("[rollout]", "[rolout]")))


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(RecipeError, match="Recipe file not found.* a folder per model family .recipes/sd35/"):
        load_recipe(tmp_path / "nope.toml")
    with pytest.raises(
        RecipeError, match=r"not found: .*recipes/ocr_tp.toml. Did you mean .*recipes/sd35/ocr_tp.toml\?"
    ):
        load_recipe(ROOT / "recipes" / "ocr_tp.toml")  # its path before recipes/ filed the paper scale by family
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(write(tmp_path, "[credit\nname = 1"))


def test_a_directory_is_named_as_one_with_the_recipes_in_it(tmp_path):
    """``tpflow validate recipes/`` said "Recipe file not found" of a folder that is there; the recipes it lists
    include those in its family folders (recipes/flux/, ...)."""
    with pytest.raises(
        RecipeError, match=r"is a directory; .*Name one of the recipes in it: .*recipes/flux/\w+\.toml"
    ):
        load_recipe(ROOT / "recipes")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(RecipeError, match="is a directory.*looks like a run directory"):
        load_recipe(run)


def test_overrides(plugin, tmp_path):
    path = write(tmp_path, BASE)
    recipe = load_recipe(
        path,
        [
            "optimizer.learning_rate=3e-4",
            "credit.name=consistent",
            "credit.balanced=true",
            "rollout.window_range=[1, 6]",
            "rollout.window_size=5",
            "train.run_dir=runs/x y",
        ],
    )
    assert recipe.optimizer.options.learning_rate == 3e-4
    assert recipe.credit.name == "consistent" and recipe.credit.options.balanced is True
    assert recipe.rollout.window_range == (1, 6)
    assert recipe.train.run_dir == "runs/x y"
    with pytest.raises(RecipeError, match="expected section.key=value"):
        load_recipe(path, ["learning_rate=1"])
    with pytest.raises(RecipeError, match="unknown section 'optimiser'. Did you mean \\[optimizer\\]"):
        load_recipe(path, ["optimiser.learning_rate=1"])
    with pytest.raises(RecipeError, match="unknown option 'lr'"):
        load_recipe(path, ["optimizer.lr=1"])


def test_parse_value():
    assert parse_value("3e-4") == 3e-4 and parse_value("true") is True and parse_value("[0, 9]") == [0, 9]
    assert parse_value('"a b"') == "a b" and parse_value("shapes-dit") == "shapes-dit"


def test_apply_overrides_nested():
    data: dict = {"reward": {"name": "weighted"}}
    apply_overrides(data, ["reward.weights.ocr=0.5"])
    assert data["reward"]["weights"] == {"ocr": 0.5}


def test_window_check_says_how_to_fix():
    with pytest.raises(ValueError, match=r"window_range = \[0, 9\]"):
        RolloutSettings(num_steps=10, window_size=9, window_range=(2, 9))
    with pytest.raises(ValueError, match="exceeds num_steps"):
        RolloutSettings(num_steps=6, window_size=7, window_range=(0, 7))
    assert RolloutSettings(num_steps=10, window_size=2, window_range=(0, 10)).window_size == 2


SHIPPED = sorted((ROOT / "recipes").rglob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_recipe_validates(path):
    load_recipe(path)


def test_every_section_is_a_typed_attribute_of_the_recipe():
    """Recipe sections are properties with their types (no __getattr__ returning Any): a new component kind or
    settings section must be added there too, or this fails."""
    import inspect as _inspect

    from tpflow.recipe import SECTIONS, Recipe

    for section in SECTIONS:
        prop = getattr(Recipe, section, None)
        assert isinstance(prop, property), section
        assert _inspect.signature(prop.fget).return_annotation not in (_inspect.Signature.empty, "Any"), section


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ("train.epochs=true", "epochs = true"),  # int
        ("rollout.noise_level=true", "noise_level = true"),  # float
        ("rollout.window_range=[0, true]", "window_range[1] = true"),  # tuple[int, int]
        ("rollout.completion_steps=false", "completion_steps = false"),  # int | "all"
        ("optimizer.clip_range=false", "clip_range = false"),  # a component's options
    ],
)
def test_a_boolean_where_a_number_is_meant_is_refused(plugin, tmp_path, override, where):
    """pydantic's lax mode read ``true`` as 1 and ``false`` as 0 in int and float fields: refused, naming the field."""
    with pytest.raises(RecipeError, match=re.escape(where) + ".*is a boolean"):
        load_recipe(write(tmp_path, BASE), [override])


def test_boolean_options_still_take_booleans(plugin, tmp_path):
    loaded = load_recipe(write(tmp_path, BASE), ["rollout.same_noise=true", "credit.balanced=true"])
    assert loaded.rollout.same_noise is True and loaded.credit.options.balanced is True

"""Bad inputs are refused by `tpflow validate` and at the start of `tpflow train`, before any weights load: one
paragraph, exit status 2, no traceback, and the backbone and the reward are never built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.cli_run import tpflow
from tpflow import recipe as recipe_module
from tpflow.errors import RecipeError
from tpflow.preflight import run_dir_problems

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "recipes" / "shapes_tp.toml"
# prompt lines carry no metadata, so with them a reward that reads none (shapes-geneval would be refused for that)
TEXT_FILE = ("reward.name=shapes-clip", "dataset.name=text-file")


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail the test if a component that holds weights (backbone, reward) is built; returns the kinds built."""
    built: list[str] = []
    original = recipe_module.ComponentSpec.build

    def build(self):  # type: ignore[no-untyped-def]
        built.append(self.kind)
        if self.kind in ("backbone", "reward"):
            raise AssertionError(f"the {self.kind} was built (weights loaded) before the input was checked")
        return original(self)

    monkeypatch.setattr(recipe_module.ComponentSpec, "build", build)
    return built


def run_cli(*args: str) -> tuple[int, str]:
    """``tpflow ARGS`` in this process: (exit status, its stderr and stdout)."""
    done = tpflow(*args, columns=None)
    return done.returncode, done.stderr + done.stdout


def assert_one_paragraph(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    # warnings, and what a command says when its checks pass (the device, where each weight comes from), may come
    # before an error raised later, e.g. by a checkpoint that does not fit the loaded model
    lines = [
        line for line in err.splitlines() if line.strip() and not line.startswith(("warning", "device: ", "weights: "))
    ]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], (text, lines[0])


def _files(tmp_path: Path) -> dict[str, Path]:
    """Bad files of every kind, made once per test."""
    files = {
        "not_utf8": tmp_path / "latin1.txt",
        "empty": tmp_path / "empty.jsonl",
        "broken": tmp_path / "broken.jsonl",
        "not_string": tmp_path / "not_string.jsonl",
        "deep": tmp_path / "deep.jsonl",
        "reserved_tag": tmp_path / "reserved_tag.jsonl",
        "random_weights": tmp_path / "random.safetensors",
        "regular_file": tmp_path / "a_file",
    }
    files["not_utf8"].write_bytes("a red circle\nun carré bleu\n".encode("latin-1"))
    files["empty"].write_text("\n\n")
    files["broken"].write_text('{"prompt": "a red circle"}\n{"prompt": "a blue\n')
    files["not_string"].write_text('{"prompt": "a red circle"}\n{"prompt": 3}\n')
    files["deep"].write_text("[" * 100_000 + "]" * 100_000 + "\n")
    files["reserved_tag"].write_text('{"prompt": "a red box", "tag": "colors"}\n{"prompt": "cats", "tag": "tags"}\n')
    files["random_weights"].write_bytes(os.urandom(4096))
    files["regular_file"].write_text("not a directory")
    return files


# (overrides, words the message must hold); "{name}" is replaced by the path of the bad file of that name.
CASES = {
    "cps noise level": (["rollout.noise_level=1.5"], ["noise_level = 1.5", "cps", "[0, 1]"]),
    "seed beyond 64 bits": ([f"train.seed={2**64 + 1}"], ["seed", "less than or equal to"]),
    "negative seed": (["train.seed=-1"], ["seed"]),
    "huge prompts_per_epoch": ([f"train.prompts_per_epoch={10**12}"], ["prompts_per_epoch"]),
    "huge epoch": (["train.prompts_per_epoch=100000", "train.group_size=1000"], ["trajectories per epoch"]),
    "group of one": (["train.group_size=1"], ["group_size = 1", "advantage"]),
    "noise level 0": (["rollout.noise_level=0"], ["noise_level = 0", "std", "nothing trains"]),
    "flow-sde noise level 0": (["sampler.name=flow-sde", "rollout.noise_level=0"], ["noise_level = 0", "ODE"]),
    "nan guidance": (["rollout.guidance=nan"], ["guidance", "finite"]),
    "run_dir template": (["train.run_dir={{run}}"], ["run_dir", "{{recipe}}"]),
    "device gpu0": (["backbone.device=gpu0"], ["Unknown device 'gpu0'"]),
    "device cuda:3": (["backbone.device=cuda:3"], ["'cuda:3'"]),
    "random weights": (["backbone.weights={random_weights}"], ["{random_weights}", "not a safetensors file"]),
    "missing weights": (["backbone.weights={regular_file}.nope"], ["{regular_file}.nope", "missing"]),
    "prompts not utf-8": (
        [*TEXT_FILE, "dataset.path={not_utf8}"],
        ["{not_utf8}", "not UTF-8", "line 2"],
    ),
    "prompts missing": (
        ["dataset.name=jsonl", "dataset.path={regular_file}.nope"],
        ["{regular_file}.nope", "not found"],
    ),
    "prompts empty": (["dataset.name=jsonl", "dataset.path={empty}"], ["{empty}", "no prompts"]),
    "prompts broken json": (["dataset.name=jsonl", "dataset.path={broken}"], ["{broken}:2", "not valid JSON"]),
    "prompt not a string": (
        ["dataset.name=jsonl", "dataset.path={not_string}"],
        ["{not_string}:2", '"prompt" string'],
    ),
    "deeply nested json": (["dataset.name=jsonl", "dataset.path={deep}"], ["{deep}:1", "too deeply"]),
    "tag named like a figure": (
        ["dataset.name=jsonl", "dataset.path={reserved_tag}"],
        ["tagged 'tags'", "eval_reward_tags is the mean over tags", "Rename the tag"],
    ),
    "prompts from /dev/zero": ([*TEXT_FILE, "dataset.path=/dev/zero"], ["/dev/zero", "regular file"]),
    "prompts a directory": ([*TEXT_FILE, "dataset.path=/"], ["is a directory"]),
    "run_dir is a file": (["train.run_dir={regular_file}"], ["{regular_file}", "not a directory"]),
    "run_dir under a file": (["train.run_dir={regular_file}/run"], ["{regular_file}", "not a directory"]),
}


def _case(tmp_path: Path, name: str) -> tuple[list[str], list[str]]:
    files = {k: str(v) for k, v in _files(tmp_path).items()}
    overrides, expected = CASES[name]
    return [o.format(**files) for o in overrides], [e.format(**files) for e in expected]


@pytest.mark.parametrize("name", list(CASES))
def test_validate_refuses_without_loading_weights(name, tmp_path, no_weights):
    overrides, expected = _case(tmp_path, name)
    sets = [arg for o in overrides for arg in ("--set", o)]
    code, err = run_cli("validate", str(SHAPES), *sets)
    assert_one_paragraph(code, err, *expected)


TRAIN_CASES = ["cps noise level", "seed beyond 64 bits", "group of one", "noise level 0", "device gpu0",
               "device cuda:3", "random weights", "prompts not utf-8", "prompt not a string", "deeply nested json",
               "prompts from /dev/zero", "run_dir is a file"]  # fmt: skip


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_train_refuses_before_loading_weights(name, tmp_path, no_weights):
    overrides, expected = _case(tmp_path, name)
    run_dir = [] if any(o.startswith("train.run_dir") for o in overrides) else ["--run-dir", str(tmp_path / "run")]
    sets = [arg for o in overrides for arg in ("--set", o)]
    code, err = run_cli("train", str(SHAPES), *run_dir, *sets)
    assert_one_paragraph(code, err, *expected)
    assert "backbone" not in no_weights and "reward" not in no_weights


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it(tmp_path, no_weights):
    for command in ("validate", "train"):
        code, err = run_cli(command, str(SHAPES), "--set", "backbone.device=cuda")
        assert_one_paragraph(code, err, "[backbone] device", "'cuda'", "no CUDA GPU")


def test_fifo_is_not_a_prompt_file(tmp_path, no_weights):
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)  # reading it would block for ever
    sets = [arg for o in (*TEXT_FILE, f"dataset.path={fifo}") for arg in ("--set", o)]
    code, err = run_cli("validate", str(SHAPES), *sets)
    assert_one_paragraph(code, err, str(fifo), "not a regular file")


def test_no_machine_checks_the_values_only(tmp_path, no_weights):
    """A recipe for another machine (its prompt files, its GPUs) validates its values with --no-machine."""
    sets = [arg for o in (*TEXT_FILE, "dataset.path=/elsewhere/prompts.txt") for arg in ("--set", o)]
    code, err = run_cli("validate", str(SHAPES), *sets, "--no-machine")
    assert code == 0, err
    code, err = run_cli("validate", str(SHAPES), *sets)
    assert_one_paragraph(code, err, "/elsewhere/prompts.txt", "was not found")


def test_shipped_shapes_recipe_passes_the_machine_checks(no_weights):
    code, err = run_cli("validate", str(SHAPES))
    assert code == 0, err
    assert no_weights == ["dataset"]  # the prompts were read; nothing with weights was built


def test_unwritable_run_dir(tmp_path, monkeypatch):
    """A run dir whose nearest existing parent denies writing (os.access: root may write anywhere, so simulated)."""
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    problems = run_dir_problems(tmp_path / "a" / "run")
    assert len(problems) == 1 and "not writable" in problems[0] and str(tmp_path) in problems[0]
    assert run_dir_problems(tmp_path / "a" / "run") == problems


def test_check_machine_joins_every_problem_into_one_error(tmp_path):
    from tpflow.preflight import check_machine
    from tpflow.recipe import load_recipe

    files = _files(tmp_path)
    loaded = load_recipe(
        SHAPES, [f"backbone.weights={files['random_weights']}", "dataset.name=jsonl", f"dataset.path={files['deep']}"]
    )
    with pytest.raises(RecipeError) as err:
        check_machine(loaded, files["regular_file"])
    message = str(err.value)
    assert "not a safetensors file" in message and "too deeply" in message and "not a directory" in message
    assert "\n" not in message


def test_diffusers_weights_folder_is_checked_without_loading(tmp_path, no_weights):
    recipe = ROOT / "recipes" / "geneval_tp.toml"
    sets = ["--set", f"backbone.pretrained={tmp_path}", "--set", f"train.run_dir={tmp_path / 'run'}"]
    code, err = run_cli("validate", str(recipe), *sets)
    assert_one_paragraph(code, err, "[backbone]", f"SD3.5-Medium weights folder {tmp_path}", "model_index.json")
    code, err = run_cli("train", str(recipe), *sets)
    assert_one_paragraph(code, err, "model_index.json")


def test_random_bytes_as_weights_fail_at_load_too(tmp_path):
    """Built directly (no preflight), the backbone still names the file and says what it expected."""
    from tpflow import build
    from tpflow.errors import UserError

    weights = _files(tmp_path)["random_weights"]
    with pytest.raises(UserError, match="could not be loaded") as err:
        build("backbone", "shapes-dit", weights=str(weights))
    assert str(weights) in str(err.value) and "safetensors file" in str(err.value)


def test_shapes_weights_without_their_config_are_refused_before_loading(tmp_path, no_weights):
    import safetensors.torch

    weights = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(1)}, weights)  # a safetensors file, but no shapes-dit config
    code, err = run_cli("validate", str(SHAPES), "--set", f"backbone.weights={weights}")
    assert_one_paragraph(code, err, str(weights), "no readable model config", "other.json")


TINY = ROOT / "recipes" / "tiny_smoke.toml"


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a backbone's weights are read or built (shapes-dit's file, tiny-sd3's random weights)."""

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("weights were loaded before the LoRA targets were checked")

    monkeypatch.setattr("tpflow.backbones.shapes.load_checkpoint", refuse)
    monkeypatch.setattr("tpflow.backbones.tiny.tiny_sd3_pipeline", refuse)


@pytest.mark.parametrize("recipe", [SHAPES, TINY], ids=["shapes-dit", "tiny-sd3"])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_lora_target_that_names_no_layer_is_refused_before_loading(
    recipe, command, tmp_path, no_weights, no_loading
):
    """peft ignores a target that matches nothing when another matches, and fails only after the weights
    have loaded when none does; the target is checked against the model built on the meta device instead."""
    sets = ["--set", 'backbone.lora_targets=["attn.to_q", "attn.to_qq"]']
    run_dir = ["--run-dir", str(tmp_path / "run")] if command == "train" else []
    code, err = run_cli(command, str(recipe), *sets, *run_dir)
    assert_one_paragraph(code, err, "[backbone]", "'attn.to_qq' names no layer", "did you mean 'attn.to_q'")
    assert "attn.to_k" in err and "more" in err  # the model's adaptable layers, abbreviated
    assert "'attn.to_q' names" not in err  # the valid target is not blamed
    assert not (tmp_path / "run").exists()


def test_a_lora_target_that_names_a_block_is_refused(no_weights, no_loading):
    code, err = run_cli("validate", str(SHAPES), "--set", 'backbone.lora_targets=["attn"]')
    assert_one_paragraph(code, err, "'attn' names Attention modules", "cannot adapt", "Linear layers inside")


@pytest.mark.parametrize(
    ("recipe", "targets"),
    [(SHAPES, None), (SHAPES, '["to_q", "mlp.net.0", "ff.net.2"]'), (TINY, None), (TINY, '["to_q", "ff.net.2"]')],
)
def test_lora_targets_that_name_layers_pass_without_loading(recipe, targets, no_weights, no_loading):
    sets = ["--set", f"backbone.lora_targets={targets}"] if targets else []
    code, err = run_cli("validate", str(recipe), *sets)
    assert code == 0, err
    assert no_weights == ["dataset"]


@pytest.mark.parametrize("name", ["sd3.5-medium", "flux.1-dev"])
def test_diffusers_lora_targets_are_checked_against_the_transformer_config(name, tmp_path, monkeypatch, no_weights):
    """A local diffusers folder, or a hub id in the cache: the transformer is built from its transformer/config.json on
    the meta device (here a config of the tiny model's size, without weights, so loading it would fail)."""
    from tpflow import registry
    from tpflow.backbones.lora_targets import structure
    from tpflow.backbones.tiny import tiny_flux_transformer, tiny_sd3_transformer

    tiny = structure(tiny_sd3_transformer if name == "sd3.5-medium" else tiny_flux_transformer, meta=False)
    # Two blocks: an SD3 model's last block has no attn.to_add_out, so the defaults need a second one.
    transformer = structure(lambda: type(tiny).from_config({**tiny.config, "num_layers": 2}))
    transformer.save_config(tmp_path / "transformer")
    index = {"transformer": ["diffusers", type(transformer).__name__]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    hook = registry.get("backbone", name).factory.check_machine
    options = registry.validate_options("backbone", name, {"pretrained": str(tmp_path), "device": "cpu"})
    assert hook(options, {}) == []
    options = options.model_copy(update={"lora_targets": ["attn.to_q", "attn.to_vv"]})
    (problem,) = hook(options, {})
    assert "'attn.to_vv' names no layer of the" in problem and "did you mean 'attn.to_v'" in problem
    assert not (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors").exists()
    # A hub id: the config is read from the Hugging Face cache (nothing downloaded); not cached: nothing to check.
    import huggingface_hub

    def lookup(repo: str, filename: str, **kwargs) -> str | None:  # a cache holding org/cached
        return str(tmp_path / filename) if repo == "org/cached" else None

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lookup)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "'attn.to_vv' names no layer" in hook(options.model_copy(update={"pretrained": "org/cached"}), {})[0]
    elsewhere = options.model_copy(update={"pretrained": "org/elsewhere"})
    assert hook(elsewhere, {}) == []  # no config here: nothing to check the targets against
    (source,) = registry.get("backbone", name).factory.weight_sources(elsewhere, {})
    assert "not in the Hugging Face cache" in source.problem  # the weights' own check says why (tpflow.weights)


def test_lora_targets_match_module_names_as_peft_does():
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from tpflow.backbones.lora_targets import matches, structure
    from tpflow.backbones.tiny import tiny_sd3_transformer
    from tpflow.shapes.model import ShapesDiT

    names = [
        name
        for model in (structure(ShapesDiT, meta=False), structure(tiny_sd3_transformer, meta=False))
        for name, _ in model.named_modules()
    ]
    targets = ["to_q", "attn.to_q", "attn.to_out.0", "0", "net.2", "blocks.0.attn.to_k", "o_q", "attn.", "proj_out"]
    for target in targets:
        config = LoraConfig(target_modules=[target])
        assert [matches(n, target) for n in names] == [bool(check_target_module_exists(config, n)) for n in names]
    assert sum(matches(n, "to_q") for n in names) > 2  # the comparison covered matches, not only misses


def test_the_tiny_backbones_default_lora_targets_fit_them():
    """Their preflight skips the defaults (sparing validate the diffusers import), so they are checked here."""
    from tpflow.backbones.lora_targets import structure, target_problems
    from tpflow.backbones.tiny import TinyFluxOptions, TinySD3Options, tiny_flux_transformer, tiny_sd3_transformer

    for build, options in ((tiny_sd3_transformer, TinySD3Options()), (tiny_flux_transformer, TinyFluxOptions())):
        model = structure(build, meta=False)
        assert options.lora_targets and target_problems(model, options.lora_targets, "tiny") == []
    assert target_problems(structure(tiny_sd3_transformer, meta=False), ["attn.to_add_out"], "tiny") != []

"""Hostile editing data through the command line: `tpflow validate` and `tpflow train` refuse a missing, corrupt,
non-image or too small source, an instruction without a source for an editing backbone and sources for a text-only
one, in one paragraph with exit status 2, before the backbone is built; `tpflow sample` and `inspect-trajectory`
take the prompt's sources with --image, refused for a text-only backbone and required by an editing one.

The editing backbone is a fake registered here, declaring ``source_images = (1, 1)``: ``test-edit-unbuilt`` fails
the test if it is ever built (the proof that every check ran before any weights would load), ``test-edit-pixels``
samples (its velocity pulls the image towards the source's mean colour) and records the sources it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict

from tests.cli_run import tpflow
from tpflow import recipe as recipe_module
from tpflow import registry
from tpflow.types import Conditioning

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "recipes" / "shapes_tp.toml"  # shapes-dit: a text-only backbone
UNBUILT, PIXELS = "test-edit-unbuilt", "test-edit-pixels"


class _NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _unbuilt(options: _NoOptions) -> None:
    raise AssertionError("the editing backbone was built (weights would load) before its input was checked")


_unbuilt.source_images = (1, 1)  # type: ignore[attr-defined]


class _Pixels:
    """An editing backbone of 8x8 RGB images: v = z - the source's mean colour, so the ODE ends on that colour."""

    source_images = (1, 1)
    seen: list = []  # the sources of every encode call, per prompt: [[3, H, W] per source]

    def __init__(self, options: _NoOptions) -> None:
        pass

    def encode(self, prompts, sources=None) -> Conditioning:
        _Pixels.seen.append(sources)
        colour = torch.stack([s[0].mean(dim=(1, 2)) for s in sources])  # [N, 3]
        return Conditioning({"colour": colour})

    def initial_noise(self, n, generator=None):
        return torch.randn(n, 3, 8, 8, generator=generator)

    def sigmas(self, num_steps):
        return torch.linspace(1, 0, num_steps + 1)

    def velocity(self, z, sigma, cond, guidance):
        # z_σ = (1 - σ) x + σ ε and v = ε - x = (z_σ - x) / σ, with x the source's colour: the ODE ends on x
        return (z - cond.tensors["colour"][:, :, None, None]) / sigma.clamp_min(1e-3)[:, None, None, None]

    def decode(self, z):
        return z.clamp(0, 1)

    def trainable_parameters(self):
        return []


@pytest.fixture(scope="module", autouse=True)
def editing_backbones():
    registry.register("backbone", UNBUILT, options=_NoOptions)(_unbuilt)
    registry.register("backbone", PIXELS, options=_NoOptions)(_Pixels)
    yield
    for name in (UNBUILT, PIXELS):
        registry._entries["backbone"].pop(name, None)


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a component that holds weights (backbone, reward) is built."""
    original = recipe_module.ComponentSpec.build

    def build(self):  # type: ignore[no-untyped-def]
        assert self.kind not in ("backbone", "reward"), f"the {self.kind} was built before the input was checked"
        return original(self)

    monkeypatch.setattr(recipe_module.ComponentSpec, "build", build)


def png(path: Path, size: tuple[int, int] = (16, 16), colour: tuple[int, int, int] = (255, 0, 0)) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


def editing_recipe(tmp_path: Path, backbone: str, dataset: str) -> Path:
    """A small recipe whose backbone is ``backbone`` and whose [dataset] section is ``dataset`` (TOML lines)."""
    text = (ROOT / "recipes" / "tiny_smoke.toml").read_text()
    text = text.replace(
        'name = "tiny-sd3"\nseed = 0\nresolution = 16\nlora_rank = 4\nlora_alpha = 8', f'name = "{backbone}"'
    )
    text = text.replace('[dataset]\nname = "shapes"\ntest_size = 4', f"[dataset]\n{dataset}")
    assert f'name = "{backbone}"' in text and dataset in text, "tiny_smoke.toml changed: update this test"
    path = tmp_path / "edit.toml"
    path.write_text(text)
    return path


def edit_file(tmp_path: Path, case: str) -> Path:
    """An edit-jsonl file whose second line's source is as ``case`` says."""
    png(tmp_path / "good.png")
    bad = tmp_path / "bad.png"
    if case == "corrupt":
        data = png(bad).read_bytes()
        bad.write_bytes(data[: len(data) - 10])  # cut short: the header reads, the checksum does not
    elif case == "not an image":
        bad.write_text("not an image\n")
    elif case == "too small":
        png(bad, size=(4, 4))
    lines = [{"prompt": "make it blue", "source": "good.png"}, {"prompt": "make it green", "source": "bad.png"}]
    if case == "fine":
        lines[1]["source"] = "good.png"
    path = tmp_path / "edits.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def assert_one_paragraph(done, *expected: str) -> str:
    """Exit status 2, no traceback, one paragraph (beside the lines a passing check prints) holding ``expected``."""
    text = done.stderr + done.stdout
    assert done.returncode == 2, text
    assert "Traceback" not in text, text
    skip = ("warning", "device: ", "weights: ")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(skip)]
    assert len(lines) == 1, text
    for part in expected:
        assert part in lines[0], (part, lines[0])
    return lines[0]


IMAGE_CASES = {
    "missing": "does not exist",
    "corrupt": "is corrupt or truncated",
    "not an image": "is not an image",
    "too small": "is 4x4 px, smaller than [dataset] min_side = 8",
}


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_validate_refuses_a_bad_source_before_the_backbone_is_built(tmp_path, case) -> None:
    file = edit_file(tmp_path, case)
    recipe = editing_recipe(tmp_path, UNBUILT, f'name = "edit-jsonl"\npath = "{file}"\nmin_side = 8')
    line = assert_one_paragraph(tpflow("validate", str(recipe)), f"{file}:2", str(tmp_path / "bad.png"))
    assert IMAGE_CASES[case] in line and "line 2 of the file's 2 prompt lines" in line


def test_a_good_edit_dataset_validates_and_says_what_it_checked(tmp_path) -> None:
    file = edit_file(tmp_path, "fine")
    recipe = editing_recipe(tmp_path, UNBUILT, f'name = "edit-jsonl"\npath = "{file}"\nmin_side = 8')
    done = tpflow("validate", str(recipe))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "dataset: [dataset] (edit-jsonl) 2 lines read, 1 source image(s) checked (headers only)" in done.stdout


def test_an_editing_backbone_refuses_instructions_without_sources(tmp_path) -> None:
    """From the recipe alone when the dataset declares its keys (shapes: no sources), item by item otherwise."""
    recipe = editing_recipe(tmp_path, UNBUILT, 'name = "shapes"\ntest_size = 4')
    for machine in ("--machine", "--no-machine"):
        assert_one_paragraph(
            tpflow("validate", str(recipe), machine),
            "[dataset] (shapes)",
            f"backbone '{UNBUILT}' takes 1 to 1",
            "carry 0",
        )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "make it red"}\n')
    recipe = editing_recipe(tmp_path, UNBUILT, f'name = "jsonl"\npath = "{prompts}"')
    assert_one_paragraph(
        tpflow("train", str(recipe), "--run-dir", str(tmp_path / "run")),
        "[dataset] (jsonl)",
        "carry 0",
        "item 1 of the train split ('make it red': 0 source(s))",
    )


def test_a_text_only_backbone_refuses_a_dataset_with_sources(tmp_path, nothing_built) -> None:
    file = edit_file(tmp_path, "fine")
    sets = ["--set", "reward.name=shapes-clip", "--set", "dataset.name=edit-jsonl", "--set", f"dataset.path={file}"]
    for command in (["validate"], ["train", "--run-dir", str(tmp_path / "run")]):
        done = tpflow(*command, str(SHAPES), *sets, "--set", "dataset.min_side=8")
        assert_one_paragraph(done, "[dataset] (edit-jsonl)", "'shapes-dit' generates from text alone", "item 1")


def test_train_refuses_a_bad_source_before_the_backbone_is_built(tmp_path) -> None:
    file = edit_file(tmp_path, "corrupt")
    recipe = editing_recipe(tmp_path, UNBUILT, f'name = "edit-jsonl"\npath = "{file}"\nmin_side = 8')
    done = tpflow("train", str(recipe), "--run-dir", str(tmp_path / "run"))
    assert_one_paragraph(done, f"{file}:2", "is corrupt or truncated")
    assert not (tmp_path / "run").exists()


def test_image_is_refused_for_a_text_only_backbone_and_required_by_an_editing_one(tmp_path, nothing_built) -> None:
    good = png(tmp_path / "good.png")
    text_only = "'shapes-dit' generates from text alone"
    editing = editing_recipe(tmp_path, UNBUILT, 'name = "jsonl"\npath = "/elsewhere/prompts.jsonl"')
    for command in (["sample"], ["inspect-trajectory"]):
        prompt = ["--prompt", "make it red"]
        assert_one_paragraph(tpflow(*command, str(SHAPES), *prompt, "--image", str(good)), "--image", text_only)
        assert_one_paragraph(tpflow(*command, str(editing), *prompt), f"'{UNBUILT}' edits images", "none (no --image)")
        missing = tmp_path / "missing.png"
        assert_one_paragraph(tpflow(*command, str(editing), *prompt, "--image", str(missing)), "does not exist")
        two = ["--image", str(good), "--image", str(good)]
        assert_one_paragraph(tpflow(*command, str(editing), *prompt, *two), "takes 1 to 1", "gives 2")


def test_sample_hands_the_image_to_the_editing_backbone(tmp_path) -> None:
    source = png(tmp_path / "red.png", colour=(255, 0, 0))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "keep it", "source": "red.png"}) + "\n")
    recipe = editing_recipe(tmp_path, PIXELS, f'name = "edit-jsonl"\npath = "{prompts}"\nmin_side = 8')
    _Pixels.seen.clear()
    out = tmp_path / "grid.png"
    done = tpflow("sample", str(recipe), "--prompt", "keep it", "--image", str(source), "--n", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    assert [len(s) for s in _Pixels.seen] == [1] and len(_Pixels.seen[0][0]) == 1  # one pair, one source
    assert torch.allclose(_Pixels.seen[0][0][0][:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))  # [3, H, W] from the file
    red = sum(1 for r, g, b in Image.open(out).convert("RGB").get_flattened_data() if r > 250 and g < 5 and b < 5)
    assert red >= 2 * 8 * 8  # both samples ended on the source's red (noise would give a few such pixels at most)

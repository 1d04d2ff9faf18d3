"""recipes/tiny_smoke.toml: tiny-sd3 through the whole TP-GRPO trainer, and its adapter read back by diffusers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tpflow.backbones.tiny import tiny_sd3_pipeline
from tpflow.cli import main
from tpflow.recipe import load_recipe
from tpflow.train.trainer import Trainer


def cli(*args: str) -> int:
    """Run the tpflow CLI in-process; its exit status."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code


RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_smoke.toml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train tiny_smoke.toml for its 2 epochs; keep the trainer and the LoRA values from before training."""
    run = tmp_path_factory.mktemp("smoke") / "run"
    trainer = Trainer(load_recipe(RECIPE), run_dir=run)
    before = [p.detach().clone() for p in trainer.backbone.trainable_parameters()]
    metrics = trainer.fit()
    return trainer, before, metrics, run


def _frozen_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if "lora_" not in k}


def test_two_epochs_change_the_lora_and_nothing_else(trained):
    trainer, before, metrics, _ = trained
    backbone = trainer.backbone
    assert trainer.optimizer.global_step >= 2
    after = backbone.trainable_parameters()
    names = [n for n, p in backbone.transformer.named_parameters() if "lora_" in n]
    assert len(after) == len(before) == len(names) > 0
    # The last joint block is context_pre_only: it discards the text tokens' outputs, so its add_q_proj adapter
    # has no effect on the velocity and gets no gradient (its B stays 0). Every other LoRA tensor must move.
    dead = f"transformer_blocks.{backbone.transformer.config.num_layers - 1}.attn.add_q_proj.lora_B"
    for name, a, b in zip(names, after, before, strict=True):
        if name.startswith(dead):
            assert torch.equal(a, torch.zeros_like(a)), name
        elif "add_q_proj" not in name or not name.startswith(dead.removesuffix("lora_B")):
            assert not torch.equal(a, b), f"{name} did not move"
    fresh = tiny_sd3_pipeline(seed=0)  # the same seed builds the same base weights
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        mine = _frozen_state(getattr(backbone.pipe, name))
        base = _frozen_state(getattr(fresh, name))
        mine = {k.replace(".base_layer.", "."): v for k, v in mine.items()}
        assert mine.keys() == base.keys(), name
        for key, value in base.items():
            assert torch.equal(mine[key], value), f"{name}.{key} changed"
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))


def test_adapter_loads_into_a_diffusers_pipeline(trained):
    trainer, _, _, run = trained
    backbone = trainer.backbone
    adapter = sorted((run / "checkpoints").iterdir())[-1] / "adapter"  # what the trainer saved
    assert (adapter / "pytorch_lora_weights.safetensors").is_file()
    pipe = tiny_sd3_pipeline(seed=0)
    pipe.load_lora_weights(adapter)
    z = backbone.initial_noise(2, torch.Generator().manual_seed(0))
    cond = backbone.encode(["a photo of a red cat", "two blue squares"])
    sigma = torch.full((2,), 0.7)
    with torch.no_grad():
        ours = backbone.velocity(z, sigma, cond, 1.0)
        theirs = pipe.transformer(
            hidden_states=z,
            timestep=sigma * 1000,
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            pooled_projections=cond.tensors["pooled"],
            return_dict=False,
        )[0]
        with backbone.reference():
            base = backbone.velocity(z, sigma, cond, 1.0)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - base).abs().max() > 1e-5  # the adapter does something, so the comparison has teeth


def test_export_cli_writes_adapter_and_merged_model(trained, tmp_path):
    from diffusers import SD3Transformer2DModel

    trainer, _, _, run = trained
    assert cli("export", str(run), "--out", str(tmp_path / "lora")) == 0
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    written = (tmp_path / "lora" / "pytorch_lora_weights.safetensors").stat().st_mtime_ns
    assert cli("export", str(run), "--out", str(tmp_path / "lora")) == 2  # it holds an export: kept
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").stat().st_mtime_ns == written
    assert cli("export", str(run), "--out", str(tmp_path / "lora"), "--overwrite") == 0
    assert cli("export", str(run), "--out", str(tmp_path / "merged"), "--merge") == 0
    mask = os.umask(0o022)  # the usual umask: every file the export wrote is 0644, safetensors' 0600 included
    try:
        assert cli("export", str(run), "--out", str(tmp_path / "shared"), "--merge") == 0
    finally:
        os.umask(mask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "shared").rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {"0o644"}, modes
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "merged" / "transformer").eval()
    backbone = trainer.backbone
    z = backbone.initial_noise(1, torch.Generator().manual_seed(1))
    cond = backbone.encode(["a photo of a red cat"])
    t = torch.full((1,), 500.0)
    with torch.no_grad():
        expected = backbone.transformer(z, cond.tensors["prompt_embeds"], cond.tensors["pooled"], t)[0]
        got = merged(z, cond.tensors["prompt_embeds"], cond.tensors["pooled"], t)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_export_without_a_checkpoint_exits_2(tmp_path):
    assert cli("export", str(tmp_path), "--out", str(tmp_path / "out")) == 2


def test_eval_of_the_exported_lora_equals_eval_of_its_run(trained, tmp_path):
    """tiny-sd3: `tpflow eval` of the run, of the folder `tpflow export` wrote, and the run's own last eval agree."""
    import json

    from tpflow.train.run_logger import read_jsonl

    _, _, _, run = trained
    assert cli("export", str(run), "--out", str(tmp_path / "lora")) == 0
    steps = str(load_recipe(RECIPE).eval.num_steps)
    assert cli("eval", str(run), "--steps", steps, "--out", str(tmp_path / "run_eval")) == 0
    assert cli("eval", str(tmp_path / "lora"), "--steps", steps, "--out", str(tmp_path / "lora_eval")) == 0
    of_run = json.loads((tmp_path / "run_eval" / "eval.json").read_text())["target"]
    of_lora = json.loads((tmp_path / "lora_eval" / "eval.json").read_text())["target"]
    assert of_lora["kind"] == "export" and of_run["kind"] == "run"
    assert [i["score"] for i in of_lora["images"]] == [i["score"] for i in of_run["images"]]
    assert of_lora["metrics"] == of_run["metrics"]
    logged = read_jsonl(run / "metrics.jsonl")[-1]
    assert of_run["metrics"]["eval_reward"] == logged["eval_reward"]
    base = tmp_path / "base_eval"  # the base model differs: the comparison has teeth
    assert cli("eval", str(RECIPE), "--steps", steps, "--out", str(base)) == 0
    assert json.loads((base / "eval.json").read_text())["target"]["metrics"] != of_run["metrics"]


def test_eval_of_a_run_at_another_resolution(trained, tmp_path):
    """--resolution reaches the backbone rebuilt from the checkpoint's recipe (tiny-sd3 trains at 16 px)."""
    import json

    from PIL import Image

    _, _, _, run = trained
    assert cli("eval", str(run), "--resolution", "32", "--steps", "2", "--out", str(tmp_path / "e")) == 0
    data = json.loads((tmp_path / "e" / "eval.json").read_text())["target"]
    assert data["settings"]["resolution"] == 32
    layout = json.loads((tmp_path / "e" / "grid.png.json").read_text())
    assert list(Image.open(tmp_path / "e" / "grid.png").size) == layout["size"]
    assert len(layout["tiles"]) == len(data["images"])  # a small eval: every image
    assert all(t["box"][2] - t["box"][0] == 160 for t in layout["tiles"])  # 32 px images enlarged 5x (grids.py)

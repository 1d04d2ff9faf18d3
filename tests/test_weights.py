"""Weights are found before anything loads: where each comes from is said by `tpflow validate` and when a command
starts; a missing one is one exit-2 paragraph with its download command; the Hugging Face cache is read without the
network, with or without HF_HUB_OFFLINE; a paper-scale backbone does not fall back to the CPU silently.

Caches are built in tmp dirs with tiny placeholder files: the checks read paths and JSON, never weights."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from tpflow.errors import UserError
from tpflow.weights import download_command

from .test_preflight import assert_one_paragraph, no_weights, run_cli  # noqa: F401 (no_weights: a fixture)

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "recipes" / "shapes_tp.toml"
GENEVAL = ROOT / "recipes" / "geneval_tp.toml"
SD3 = "stabilityai/stable-diffusion-3.5-medium"
PICKSCORE, PROCESSOR = "yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_L = "timm/vit_large_patch14_clip_224.openai"  # open_clip's ViT-L-14 'openai' weights on the hub
MASK2FORMER = "facebook/mask2former-swin-small-coco-instance"
HUB_NOISE = ("Couldn't connect", "Will try to load", "FutureWarning", "Traceback", "stack trace")


@pytest.fixture
def empty_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No HF_HUB_OFFLINE, HF_HOME an empty folder: the hub cache (returned) holds nothing."""
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("COLUMNS", "500")  # tables wide enough for a tmp path on one line
    return tmp_path / "hf" / "hub"


@pytest.fixture
def built(no_weights: list[str]) -> list[str]:  # noqa: F811
    """The kinds of component built; building a backbone or a reward fails the test (test_preflight.no_weights)."""
    return no_weights


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every attempt to resolve a host or open a connection is refused and recorded (returned)."""
    attempts: list[str] = []

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        attempts.append(repr(args[:2]))
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def cache_repo(hub: Path, repo: str, files: dict[str, str]) -> Path:
    """Write ``files`` as the main snapshot of ``repo`` in the hub cache layout; returns the snapshot folder."""
    root = hub / f"models--{repo.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = root / "snapshots" / revision
    for name, text in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_text(text)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snapshot


def cache_sd3(hub: Path) -> Path:
    index = {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "X"], "vae": ["diffusers", "Y"]}
    return cache_repo(
        hub,
        SD3,
        {"model_index.json": json.dumps(index), "transformer/config.json": "{}", "vae/config.json": "{}"},
    )


def cache_pickscore(hub: Path) -> tuple[Path, Path]:
    model = cache_repo(hub, PICKSCORE, {"config.json": "{}", "model.safetensors": "not read"})
    processor = cache_repo(hub, PROCESSOR, {"preprocessor_config.json": "{}", "tokenizer.json": "{}"})
    return model, processor


def flat(text: str) -> str:
    """Output with its spacing and rich's table borders removed."""
    return "".join(ch for ch in text if ch not in "│┃\n ")


# ---------------------------------------------------------------------------------------------- item 2: weights


def test_validate_and_train_refuse_a_reward_whose_weights_are_absent(empty_hub, no_network, tmp_path, built):
    run = ["--run-dir", str(tmp_path / "run")]
    for command in (["validate"], ["train", *run]):
        code, err = run_cli(*command, str(SHAPES), "--set", "reward.name=pickscore")
        assert_one_paragraph(
            code, err, "[reward]", "option model", download_command(PICKSCORE), "option processor",
            download_command(PROCESSOR), str(empty_hub),
        )  # fmt: skip
    assert "reward" not in built and "backbone" not in built
    assert no_network == []


def test_validate_and_train_refuse_a_backbone_whose_weights_are_absent(empty_hub, no_network, tmp_path, built):
    sets = ["--set", "backbone.device=cpu", "--set", "reward.detector=shapes", "--set", f"train.run_dir={tmp_path}/r"]
    for command in ("validate", "train"):
        code, err = run_cli(command, str(GENEVAL), *sets)
        assert_one_paragraph(
            code, err, "[backbone]", f"'{SD3}' are not in the Hugging Face cache", download_command(SD3)
        )
    assert "reward" not in built and "backbone" not in built
    assert no_network == []


def test_validate_says_where_each_weight_comes_from(empty_hub, no_network, tmp_path, built):
    model, processor = cache_pickscore(empty_hub)
    clip_file = tmp_path / "clip.safetensors"
    clip_file.write_text("not read")
    recipe = tmp_path / "weighted.toml"
    recipe.write_text(
        SHAPES.read_text().replace(
            '[reward]\nname = "shapes-geneval"',
            '[reward]\nname = "weighted"\nrewards = [{ name = "pickscore" }, { name = "clipscore", options = '
            f'{{ model = "ViT-B-32", pretrained = "{clip_file}" }} }}, {{ name = "shapes-geneval" }}]',
        )
    )
    code, out = run_cli("validate", str(recipe))
    assert code == 0, out
    text = flat(out)
    assert flat(f"Hugging Face cache {model}") in text and flat(f"Hugging Face cache {processor}") in text, out
    assert flat(f"local file {clip_file}") in text, out
    assert "rewards[0]" in text and "rewards[1]" in text, out
    assert flat("shipped file") in text, out  # the shapes-dit backbone's weights
    assert built == ["dataset"] and no_network == []


def test_a_partial_download_names_the_missing_file(empty_hub, built):
    cache_repo(empty_hub, PICKSCORE, {"config.json": "{}"})  # the weights never arrived
    cache_repo(empty_hub, PROCESSOR, {"preprocessor_config.json": "{}", "tokenizer.json": "{}"})
    code, err = run_cli("validate", str(SHAPES), "--set", "reward.name=pickscore")
    assert_one_paragraph(code, err, f"'{PICKSCORE}' lacks model.safetensors or", download_command(PICKSCORE))
    assert PROCESSOR not in err  # found: not a problem


def test_a_cached_backbone_is_found_and_a_partial_one_refused(empty_hub, no_network, tmp_path, built):
    snapshot = cache_sd3(empty_hub)
    sets = ["--set", "backbone.device=cpu", "--set", "reward.detector=shapes", "--set", f"train.run_dir={tmp_path}/r"]
    code, out = run_cli("validate", str(GENEVAL), *sets)
    assert code == 0, out
    assert flat(f"Hugging Face cache {snapshot}") in flat(out), out
    (snapshot / "vae" / "config.json").unlink()  # an interrupted download: the vae folder is empty
    (snapshot / "vae").rmdir()
    code, err = run_cli("validate", str(GENEVAL), *sets)
    assert_one_paragraph(code, err, "lacks vae", "partial", download_command(SD3))
    assert set(built) == {"dataset"} and no_network == []


def test_other_rewards_name_their_weights(empty_hub, tmp_path, built):
    """aesthetic without its head, clipscore and geneval's colour classifier with an uncached tag, ocr's shipped
    models, remote's server: each says so before anything loads."""
    cases = {
        "aesthetic": (["reward.name=aesthetic"], ["option head", "is not set", "improved-aesthetic-predictor"]),
        "clipscore": (["reward.name=clipscore"], ["'ViT-L-14'", download_command(CLIP_L)]),
        "clipscore file": (
            ["reward.name=clipscore", f"reward.pretrained={tmp_path}/none.safetensors"],
            [f"{tmp_path}/none.safetensors", "does not exist"],
        ),
        "geneval": (
            ["reward.name=geneval"],
            [download_command(MASK2FORMER), "clip_pretrained", download_command(CLIP_L)],
        ),
    }  # fmt: skip
    for overrides, expected in cases.values():
        sets = [arg for o in overrides for arg in ("--set", o)]
        code, err = run_cli("validate", str(SHAPES), *sets)
        assert_one_paragraph(code, err, "[reward]", *expected)
    code, out = run_cli("validate", str(SHAPES), "--set", "reward.name=ocr")
    assert code == 0 and flat("shipped in the rapidocr_onnxruntime wheel") in flat(out), out
    url = "http://127.0.0.1:9"
    code, out = run_cli("validate", str(SHAPES), "--offline", "--set", "reward.name=remote",
                        "--set", f"reward.url={url}")  # fmt: skip
    assert code == 0 and flat(f"the reward server {url}") in flat(out), out
    assert "reward" not in built


def test_sample_says_where_the_weights_come_from_before_it_loads(tmp_path):
    out = tmp_path / "s.png"
    code, text = run_cli("sample", str(SHAPES), "--prompt", "a red circle", "--n", "1", "--steps", "2",
                         "--out", str(out))  # fmt: skip
    assert code == 0 and out.is_file(), text
    lines = text.splitlines()
    weights = next(i for i, line in enumerate(lines) if line.startswith("weights: [backbone] shapes-dit weights"))
    assert "shipped file" in lines[weights] and "shapes_dit.safetensors" in lines[weights], text
    assert (
        lines.index("device: cpu (backbone device = 'cpu')")
        < weights
        < next(i for i, line in enumerate(lines) if line.startswith("wrote "))
    ), text


def test_download_command_follows_the_installed_huggingface_hub(monkeypatch):
    import importlib.metadata

    from tpflow import weights

    version = tuple(int(x) for x in importlib.metadata.version("huggingface_hub").split(".")[:2])
    assert download_command("a/b") == ("`hf download a/b`" if version >= (0, 34) else "`huggingface-cli download a/b`")
    monkeypatch.setattr(weights, "hub_console_scripts", lambda: {"huggingface-cli"})
    assert download_command("a/b") == "`huggingface-cli download a/b`"


# --------------------------------------------------------------------------- item 3: the cache first, no network


def test_train_without_hf_hub_offline_is_one_quiet_paragraph(empty_hub, no_network, tmp_path, built):
    """geneval_tp.toml on a machine with no weights and no network, HF_HUB_OFFLINE unset: one paragraph naming every
    missing weight, nothing from the hub libraries, no connection tried, no stall."""
    start = time.monotonic()
    code, err = run_cli("train", str(GENEVAL), "--set", "backbone.device=cpu",
                        "--run-dir", str(tmp_path / "run"))  # fmt: skip
    took = time.monotonic() - start
    assert_one_paragraph(
        code, err, download_command(SD3), download_command(MASK2FORMER),
        download_command(CLIP_L),
    )  # fmt: skip
    assert not any(noise in err for noise in HUB_NOISE), err
    assert no_network == [] and "backbone" not in built
    assert took < 60, took  # the hub's retries would take minutes


def test_loaders_read_the_cache_only_without_hf_hub_offline(empty_hub, no_network, tmp_path):
    """Built directly (no preflight), the backbone and the rewards still never try the network."""
    from tpflow import registry
    from tpflow.rewards.geneval.mask2former import _load_mask2former

    with pytest.raises(UserError, match="not in the Hugging Face cache") as err:
        registry.build("backbone", "sd3.5-medium", device="cpu")
    assert download_command(SD3) in str(err.value)
    with pytest.raises(UserError, match="not in the Hugging Face cache") as err:
        registry.build("reward", "pickscore", device="cpu").load()
    assert download_command(PROCESSOR) in str(err.value)
    with pytest.raises(UserError, match="not in the Hugging Face cache") as err:
        _load_mask2former(MASK2FORMER)
    assert download_command(MASK2FORMER) in str(err.value)
    assert no_network == []


def test_a_cached_pipeline_loads_from_its_snapshot_quietly(empty_hub, no_network):
    """A pipeline in the cache (tiny-sd3 saved as SD3.5-M's snapshot) loads from that folder: no connection tried,
    no warning from diffusers (its torch_dtype FutureWarning included), the dtype asked for."""
    import warnings

    from tpflow import registry
    from tpflow.backbones.tiny import tiny_sd3_pipeline

    snapshot = cache_repo(empty_hub, SD3, {})
    tiny_sd3_pipeline(seed=0).save_pretrained(snapshot)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backbone = registry.build("backbone", "sd3.5-medium", device="cpu", dtype="bf16", resolution=16)
    assert next(backbone.transformer.parameters()).dtype == torch.bfloat16
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
    assert no_network == []


# ------------------------------------------------------------------------------------------- item 4: no GPU here


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_paper_backbone_needs_a_gpu_or_device_cpu(empty_hub, tmp_path, built):
    cache_sd3(empty_hub)
    sets = ["--set", "reward.detector=shapes", "--set", f"train.run_dir={tmp_path}/r"]
    code, err = run_cli("validate", str(GENEVAL), *sets)
    assert_one_paragraph(code, err, "[backbone] device", "no CUDA GPU", "SD3.5-Medium", "device = 'cpu'")
    code, err = run_cli("train", str(GENEVAL), *sets)
    assert_one_paragraph(code, err, "no CUDA GPU")
    code, out = run_cli("validate", str(GENEVAL), *sets, "--set", "backbone.device=cpu")
    assert code == 0, out
    assert "device: cpu (backbone device = 'cpu')" in out, out
    assert "ignored on the CPU" not in " ".join(out.split()), out  # fp16 is honoured on the CPU too (tpflow.precision)
    assert "backbone" not in built


def test_run_header_says_what_device_resolved_to(tmp_path):
    from rich.console import Console

    from tpflow.recipe import load_recipe
    from tpflow.train.trainer import Trainer

    recipe = load_recipe(ROOT / "recipes" / "tiny_smoke.toml", ["eval.every=0", "backbone.device=auto"])
    console = Console(record=True, width=300)
    trainer = Trainer(recipe, run_dir=tmp_path / "run", console=console)
    trainer.epoch = recipe.train.epochs  # nothing left to run: fit prints its header and saves
    trainer.fit()
    text = console.export_text()
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    why = "a CUDA GPU is here" if torch.cuda.is_available() else "no CUDA GPU here"
    assert f"device: {device} (backbone device 'auto': {why})" in text, text
    header = next(line for line in text.splitlines() if line.startswith("tpflow train"))
    assert f"| device {device} (backbone device 'auto'" in header, header

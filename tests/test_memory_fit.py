"""`tpflow validate RECIPE --num-processes N --gpu-memory GIB` (tpflow.memory.fit): the verdict's arithmetic, the
suggestions as real re-estimates, the offload accounting, and the command's exit status and output order. Tiny
models only (tiny-sd3 built for real, or the test sizes on fake tensors): seconds each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.cli_run import tpflow
from tpflow.memory import GIB, Fit, PerProcess, estimate_fit, tiny_setup
from tpflow.memory.accounting import component_rows, host_bytes, per_process, static_bytes
from tpflow.memory.fit import CUDA_CONTEXT, MARGIN_MIN, fit_word, reliable
from tpflow.recipe import load_recipe

TINY_SD3 = """
[backbone]
name = "tiny-sd3"
seed = 0
resolution = 16
device = "cpu"
{backbone}
[reward]
name = "image-stat"
[dataset]
name = "shapes"
test_size = 6
[credit]
name = "consistent"
[optimizer]
name = "grpo"
beta = 1e-3
micro_batch_size = 8
gradient_accumulation_steps = 1
[rollout]
num_steps = 4
window_size = 3
window_range = [0, 4]
guidance = 2.0
max_batch = 2
[train]
prompts_per_epoch = 2
group_size = 4
rollout_batch = 4
"""


def tiny_recipe(tmp_path: Path, backbone: str = "") -> Path:
    """tiny-sd3 trained without gradient checkpointing on micro-batches of 8, rollout calls of 2 rows: the update
    is the peak, so both of its suggestions (checkpointing, a smaller micro-batch) apply."""
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SD3.format(backbone=backbone))
    return path


def figures(sampling: float, update: float) -> PerProcess:
    """Per-process figures in GiB (only the two peaks matter to the verdict)."""
    return PerProcess(1, 8, 0, 0, 0, 0, 0, 0, int(sampling * GIB), int(update * GIB))


def test_the_verdict_is_the_larger_peak_with_the_context_and_the_margin_against_the_stated_memory():
    """The peak on the GPU is the live bytes plus the CUDA context (0.5 GiB); a fit keeps a margin of 5 % of it
    (at least 1 GiB) free."""
    fits = Fit("r.toml", None, 10, figures(5, 7))  # 7.5 GiB on the GPU, 1 GiB margin: 1.5 GiB to spare
    assert fits.fits and fits.headroom == 2.5 * GIB
    assert (
        fits.verdict() == "fits in 10 GiB per GPU: 2.5 GiB left at the update peak of 7.5 GiB, the 1.0 GiB margin kept"
    )
    tight = Fit("r.toml", None, 8.75, figures(5, 7))  # 1.25 GiB left: under the allocator's 20 % of 7.5
    assert tight.fits and tight.verdict().endswith(
        "the 1.0 GiB margin kept (tight: under the allocator's usual 5-20 %)"
    )
    roomy = Fit("r.toml", None, 80, figures(40, 7))  # 40.5 GiB on the GPU: margin 5 % of it, 2.0 GiB
    assert roomy.fits and roomy.verdict() == (
        "fits in 80 GiB per GPU: 39.5 GiB left at the sampling peak of 40.5 GiB, the 2.0 GiB margin kept"
    )
    over = Fit("r.toml", None, 7, figures(5, 7))
    assert not over.fits and over.headroom == -GIB // 2
    assert over.verdict() == "does not fit in 7 GiB per GPU: the update peak is 7.5 GiB, 0.5 GiB over"
    paragraph = over.paragraph()
    assert "\n" not in paragraph and paragraph.startswith("r.toml does not fit in 7 GiB per GPU on 1 process")
    assert "Nothing tried fits" in paragraph and "estimated, not measured" in paragraph
    assert "CUDA context (0.5 GiB) counted, a safety margin of 5% (at least 1 GiB)" in paragraph
    assert Fit("r.toml", None, 8.5, figures(5, 7)).fits  # exactly the peak, the context and the margin: fits


def test_a_peak_inside_the_safety_margin_does_not_fit_reliably():
    """geneval_flowgrpo_full on 80 GiB: a live peak of 79.6 GiB said "fits" with 0.4 GiB to spare. With
    the CUDA context it is 80.1 GiB: over. A peak that leaves less than the margin is "does not fit reliably"."""
    full = Fit("full.toml", None, 80, figures(78.4, 79.6))
    assert not full.fits and full.verdict().startswith("does not fit in 80 GiB per GPU: the update peak is 80.1 GiB")
    inside = Fit("r.toml", None, 80, figures(70, 77))  # 77.5 GiB on the GPU, 2.5 left, margin 3.9 GiB
    assert not inside.fits and inside.headroom == 2.5 * GIB
    assert inside.verdict() == (
        "does not fit reliably in 80 GiB per GPU: the update peak of 77.5 GiB leaves 2.5 GiB, inside the 3.9 GiB "
        "safety margin"
    )
    assert inside.paragraph().startswith(
        "r.toml does not fit reliably in 80 GiB per GPU on 1 process: its estimated update peak is 77.5 GiB, "
        "leaving 2.5 GiB, inside the 3.9 GiB safety margin."
    )
    assert fit_word(int(77 * GIB), 80 * GIB) == "does not fit reliably" and fit_word(int(70 * GIB), 80 * GIB) == "fits"


def test_the_figures_add_up_and_the_epoch_is_split_over_the_processes(tmp_path):
    fit = estimate_fit(load_recipe(tiny_recipe(tmp_path)), 2, 80)
    f = fit.figures
    assert fit.fits and f.world == 2 and f.trajectories == 4  # 2 prompts x 4 copies over 2 processes
    assert f.sampling == f.static + f.epoch + f.rollout_act + f.decode_act
    assert f.update == f.static + f.epoch + max(f.epoch, f.train_act)
    assert f.peak == max(f.sampling, f.update) and fit.headroom == 80 * GIB - f.peak - GIB // 2
    text = "\n".join(fit.lines())
    assert "memory per GPU on 2 processes (tiny-sd3; estimated, not measured on a GPU" in text
    assert "verdict (estimate): fits in 80 GiB per GPU" in text and "what would help" not in text
    assert "  reward models: none on the GPU" in text and "  CUDA context: 0.5 GiB (stated" in text


def test_each_suggestion_is_the_estimate_of_the_recipe_changed_so(tmp_path):
    """Below the peak, the suggestions are the changes that lower it, each with the figures a fresh estimate of the
    recipe with that ``--set`` gives (the training step re-measured at the smaller micro-batch)."""
    path = tiny_recipe(tmp_path)
    first = estimate_fit(load_recipe(path), 1, 80)
    assert first.figures.update > first.figures.sampling
    fit = estimate_fit(load_recipe(path), 1, (first.figures.peak * 0.97 + CUDA_CONTEXT + MARGIN_MIN) / GIB)
    assert not fit.fits
    labels = [s.label() for s in fit.suggestions]
    assert "--set backbone.gradient_checkpointing=true" in labels
    assert any(label.startswith("--set optimizer.micro_batch_size=") for label in labels), labels
    for suggestion in fit.suggestions:
        again = estimate_fit(load_recipe(path, list(suggestion.overrides)), 1, 80).figures
        assert again == suggestion.figures, suggestion.label()
        assert suggestion.figures.peak < fit.figures.peak
    smaller = next(s for s in fit.suggestions if "micro_batch_size" in s.label())
    assert reliable(smaller.figures.peak, fit.gpu_bytes)  # the largest micro-batch that fits: 4 of 8
    assert smaller.overrides == ("optimizer.micro_batch_size=4",)
    assert "Estimated to fit:" in fit.paragraph() and "micro_batch_size=4" in fit.paragraph()


@pytest.fixture(scope="module")
def sharded_full():
    """The tiny SD3 test size fully fine-tuned with shard = "fsdp", measured on fake tensors."""
    from tpflow.memory import measure

    setup = tiny_setup("sd3")
    setup.backbone = setup.backbone.model_copy(update={"finetune": "full"})
    setup.train = setup.train.model_copy(update={"shard": "fsdp"})
    return setup, measure(setup)


def test_offload_moves_the_sharded_rows_to_the_host(sharded_full):
    """offload = true: the GPU keeps the unsharded rows and two gathered blocks, each process's 1/P of the sharded
    rows is in host memory; on one process nothing is sharded, so nothing moves; without sharding it is inert."""
    setup, m = sharded_full
    offload = dataclasses.replace(setup, train=setup.train.model_copy(update={"offload": True}))
    rows = component_rows(setup, m)
    whole = sum(v for _, v, _, _ in rows)
    sharded = sum(v for _, v, _, s in rows if s)
    block = m["largest_block_bytes"]
    assert sharded > 0 and block > 0
    assert static_bytes(offload, m, rows, 8) == whole - sharded + 2 * block
    assert static_bytes(setup, m, rows, 8) == whole - sharded + -(-sharded // 8) + 2 * block
    assert host_bytes(offload, rows, 8) == -(-sharded // 8) and host_bytes(setup, rows, 8) == 0
    assert static_bytes(offload, m, rows, 1) == whole and host_bytes(offload, rows, 1) == 0
    unsharded = dataclasses.replace(offload, train=offload.train.model_copy(update={"shard": "none"}))
    assert static_bytes(unsharded, m, rows, 8) == whole and host_bytes(unsharded, rows, 8) == 0
    on, off = per_process(offload, m, 8), per_process(setup, m, 8)
    assert off.peak - on.peak == -(-sharded // 8) and on.host == -(-sharded // 8)


def test_the_report_has_the_checkpointing_and_offload_columns(sharded_full):
    from tpflow.memory import report

    setup, m = sharded_full
    text = report(setup, m, world_sizes=(1, 2), unit=2**10)
    head = next(line for line in text.splitlines() if line.startswith("| processes"))
    assert "update peak, no checkpointing (recipe) (KiB) | update peak, checkpointing (KiB)" in head
    assert head.endswith("| peak with offload (KiB) | host memory with offload (KiB) |")
    two = next(line for line in text.splitlines() if line.startswith("| 2 | "))
    cells = [float(c) for c in two.strip("|").split("|")[2:]]
    assert cells[4] < cells[3] and cells[5] > 0  # offload lowers the peak by the host's share
    assert abs((cells[3] - cells[4]) - cells[5]) < 0.15  # rounding of three .1f figures


def test_validate_says_it_does_not_fit_in_one_paragraph_and_exit_2(tmp_path):
    path = tiny_recipe(tmp_path)
    out = tpflow("validate", str(path), "--no-machine", "--gpu-memory", "0.001")
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    errors = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("estimating")]
    assert len(errors) == 1 and errors[0].startswith("error: "), out.stderr
    assert "does not fit in 0.001 GiB per GPU on 1 process" in errors[0]
    assert "verdict (estimate): does not fit in 0.001 GiB per GPU" in out.stdout
    assert "what would help (each re-estimated):" in out.stdout and "valid" in out.stdout
    ok = tpflow("validate", str(path), "--no-machine", "--num-processes", "2", "--gpu-memory", "80")
    assert ok.returncode == 0, ok.stderr
    assert "memory per GPU on 2 processes" in ok.stdout and "verdict (estimate): fits in 80 GiB" in ok.stdout
    bad = tpflow("validate", str(path), "--no-machine", "--gpu-memory", "0")
    assert bad.returncode == 2 and "--gpu-memory is the memory of one GPU in GiB" in bad.stderr


def test_validate_exits_2_when_the_peak_is_inside_the_safety_margin(tmp_path):
    """A GPU that holds the estimated bytes and the CUDA context but not the margin on top: "does not fit
    reliably", exit 2 with the suggestions (it said "fits" and exited 0 with any headroom at all)."""
    path = tiny_recipe(tmp_path)
    peak = estimate_fit(load_recipe(path), 1, 80).figures.peak
    gib = round((peak + CUDA_CONTEXT + MARGIN_MIN // 2) / GIB, 3)  # about half the margin left
    out = tpflow("validate", str(path), "--no-machine", "--gpu-memory", f"{gib:g}")
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert f"verdict (estimate): does not fit reliably in {gib:g} GiB per GPU" in out.stdout
    assert "inside the 1.0 GiB safety margin" in out.stdout and "what would help (each re-estimated):" in out.stdout
    assert f"does not fit reliably in {gib:g} GiB per GPU on 1 process" in " ".join(out.stderr.split())


def test_validate_without_weights_prints_the_estimate_before_the_missing_weights_paragraph(tmp_path, monkeypatch):
    """A paper backbone whose weights are not here: the estimate needs none, so it comes first, then the machine
    check's paragraph (exit 2). The published SD3.5-M configuration is swapped for the test size to stay fast."""
    from typer.testing import CliRunner

    from tpflow import cli
    from tpflow.memory import TINY_SD3, TINY_VAE, configs

    monkeypatch.setitem(configs.PUBLISHED, "sd3.5-medium", configs.Model("SD3.5-M test size", "sd3", TINY_SD3,
                                                                          TINY_VAE))  # fmt: skip
    text = TINY_SD3_PAPER.format(weights=tmp_path / "no-such-folder")
    (tmp_path / "paper.toml").write_text(text)
    result = CliRunner().invoke(cli.app, ["validate", str(tmp_path / "paper.toml"), "--gpu-memory", "80"])
    assert result.exit_code == 2, result.output
    output = result.output
    assert "Traceback" not in output
    verdict, error = output.find("verdict (estimate): fits in 80 GiB"), output.find("error:")
    assert 0 <= verdict < error, output
    assert "no-such-folder" in output[error:] and output.count("error:") == 1


TINY_SD3_PAPER = """
[backbone]
name = "sd3.5-medium"
pretrained = "{weights}"
device = "cpu"
resolution = 16
max_sequence_length = 8
[reward]
name = "image-stat"
[dataset]
name = "shapes"
test_size = 6
[optimizer]
name = "grpo"
micro_batch_size = 2
[rollout]
num_steps = 4
window_size = 3
window_range = [0, 4]
[train]
prompts_per_epoch = 2
group_size = 2
rollout_batch = 2
"""


def test_a_backbone_the_estimate_cannot_build_is_a_warning_not_a_failure(tmp_path, tiny_weights):
    from tests.test_train import tiny_recipe as shapes_recipe

    out = tpflow("validate", str(shapes_recipe(tmp_path, tiny_weights, reward="image-stat")), "--no-machine",
                 "--gpu-memory", "80")  # fmt: skip
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stderr.split())
    assert "warning: --gpu-memory: no memory estimate: shapes-dit is the embedded CPU-sized model" in flat
    assert "Nothing was checked against 80 GiB" in flat and "verdict" not in out.stdout


def test_validate_prints_the_estimate_of_a_wan_recipe(monkeypatch):
    """recipes/wan/wan_tp.toml (Wan2.1-T2V-1.3B, LoRA, 33 frames of 240×416): ``validate --gpu-memory`` runs the wan
    kind's estimate and prints it. The published transformer and VAE are swapped for tiny-wan's sizes to stay
    fast (the clip size, the UMT5-XXL count and everything else are the recipe's)."""
    from tpflow.memory import TINY_WAN, TINY_WAN_VAE, configs

    monkeypatch.setitem(configs.PUBLISHED, "wan2.1-t2v-1.3b", configs.Model("Wan2.1-T2V-1.3B test size", "wan",
                                                                             TINY_WAN, TINY_WAN_VAE))  # fmt: skip
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "wan" / "wan_tp.toml"
    out = tpflow("validate", str(recipe), "--no-machine", "--gpu-memory", "80")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "memory per GPU on 1 process (Wan2.1-T2V-1.3B test size; estimated, not measured on a GPU" in out.stdout
    assert "activations: rollout velocity call" in out.stdout and "(gradient checkpointing)" in out.stdout
    assert "epoch buffers:" in out.stdout and "(128 trajectories)" in out.stdout
    assert "verdict (estimate): fits in 80 GiB per GPU" in out.stdout


def test_wan22_suggestions_are_validated_outside_the_fake_tensors(tmp_path, monkeypatch):
    """wan_tp on Wan2.2-T2V-A14B (test size): its recipe check computes the schedule against the expert boundary,
    which read 0 from the probe's fake tensors and refused every variant; validated outside them, a smaller
    score_batch is offered with its re-estimate."""
    from tpflow.memory import TINY_WAN, TINY_WAN_VAE, configs

    monkeypatch.setitem(configs.PUBLISHED, "wan2.2-t2v-a14b", configs.Model("Wan2.2-T2V-A14B test size", "wan",
                                                                             TINY_WAN, TINY_WAN_VAE))  # fmt: skip
    text = (Path(__file__).resolve().parent.parent / "recipes" / "wan" / "wan_tp.toml").read_text()
    text = text.replace('name = "wan2.1-t2v-1.3b"', 'name = "wan2.2-t2v-a14b"').replace("flow_shift = 3.0", "")
    path = tmp_path / "wan22.toml"
    path.write_text(text.replace("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"))
    # decode chunks and velocity calls of 2: one halving each to re-measure (the fake VAE decode of a 33-frame clip
    # costs a second a variant), every variant still validated
    fit = estimate_fit(load_recipe(path, ["train.score_batch=2", "rollout.max_batch=2"]), 1, 0.01)
    assert not fit.fits and any(r[0] == "frozen expert's weights and buffers" for r in fit.rows)
    labels = [s.label() for s in fit.suggestions]
    assert any(label.startswith("--set train.score_batch=") for label in labels), labels


def test_replayed_rows_raise_the_update_peak_not_the_sampling_peak(sharded_full):
    """[replay]: the update appends the drawn buffer rows (dealt over the processes) to the epoch's, so its peak counts
    fresh + replayed trajectories; sampling holds the fresh ones only."""
    from tpflow.memory.accounting import epoch_buffers

    setup, m = sharded_full
    replaying = dataclasses.replace(setup, replayed=16)
    plain, more = per_process(setup, m, 8), per_process(replaying, m, 8)
    assert more.replayed == 2 and more.sampling == plain.sampling
    per_traj = epoch_buffers(setup, m, 1)["rollout"]
    assert more.update - plain.update >= 2 * per_traj  # at least the two rows' rollout tensors


def test_the_estimate_counts_a_recipes_replay_draw():
    from tpflow.memory.measure import setup_of

    path = Path("recipes/sd35/sd35_opgrpo_ocr.toml")
    assert setup_of(load_recipe(path), "ocr").replayed == 96  # rows unset: the whole buffer (capacity 96) is drawn
    assert setup_of(load_recipe(path, ["replay.rows=10"]), "ocr").replayed == 10
    assert load_recipe(Path("recipes/shapes_flowgrpo.toml")).replay.drawn == 0

"""``tpflow probe`` end to end at toy size, its resumable draws, and the estimator properties it relies on.

A probe that re-drew finished repeats differently after a kill, mixed two probes in one folder, or whose outcome
estimate did not converge to the reference as the group grows would rank credit methods on noise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import tpflow
from tpflow.probe.gradient import first_step_gradient
from tpflow.probe.reference import leave_one_out_advantages
from tpflow.probe.stats import cosine
from tpflow.types import PromptItem

from .cli_run import tpflow as run_tpflow
from .test_probe import LinearPolicy
from .test_train import tiny_recipe

TINY_SD3 = 'name = "tiny-sd3"\nlora_init = "gaussian"\nresolution = 8\ndevice = "cpu"\nseed = 0'


def _probe(recipe, out, repeats=2, *extra):
    return run_tpflow(
        "probe", str(recipe), "--arm", "outcome:credit.name=outcome,group_sizes=2/4", "--arm",
        "tp:credit.name=consistent", "--prompts", "2", "--group-sizes", "2", "--repeats", str(repeats),
        "--reference-draws", "2", "--reference-group-size", "4", "--out", str(out), *extra,
    )  # fmt: skip


def test_a_probe_of_tiny_sd3_reports_its_arms(tmp_path):
    """The diffusers backbone path (a real SD3 transformer, LoRA by peft) at 8 px, once: no resume here."""
    recipe = tiny_recipe(tmp_path, None, reward="image-stat", backbone=TINY_SD3)
    result = run_tpflow(
        "probe", str(recipe), "--arm", "outcome:credit.name=outcome", "--arm", "tp:credit.name=consistent",
        "--prompts", "2", "--group-sizes", "2", "--repeats", "2", "--reference-draws", "2",
        "--reference-group-size", "2", "--out", str(tmp_path / "probe"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "probe" / "report.json").read_text())
    assert {a["key"] for a in report["arms"]} == {"outcome@2", "tp@2"}
    assert all(-1 <= a["cosine"][0] <= 1 and a["seconds"] > 0 for a in report["arms"])
    # 2 repeats and 2 reference draws: the report says what that size cannot show (tpflow.probe.caveats)
    assert report["caveats"] and report["caveats"][0].startswith("At 2 repeats")
    assert "What this probe's size cannot show" in (tmp_path / "probe" / "report.md").read_text()


def test_a_probe_reports_every_arm_and_resumes_without_redrawing(tmp_path, tiny_weights):
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    out = tmp_path / "probe"
    first = _probe(recipe, out)
    assert first.returncode == 0, first.stderr
    report = json.loads((out / "report.json").read_text())
    assert {a["key"] for a in report["arms"]} == {"outcome@2", "outcome@4", "tp@2"}
    nfe = {a["key"]: a["nfe_per_prompt"] for a in report["arms"]}
    assert nfe["outcome@4"] == 2 * nfe["outcome@2"] and nfe["tp@2"] > nfe["outcome@2"]  # completions are charged
    assert [c["name"] for c in report["comparisons"]][0] == "tp@2 − outcome@2"
    assert report["paired_bitwise"] is True
    assert (out / "cosine_nfe.png").stat().st_size > 0 and "cos to g★" in (out / "report.md").read_text()
    kept = load_file(str(out / "draws" / "arms_r001.safetensors"))
    (out / "draws" / "arms_r001.json").unlink()  # as a kill before repeat 1 was recorded leaves it
    again = _probe(recipe, out, 3)  # ... and one repeat more
    assert again.returncode == 0, again.stderr
    assert sorted(p.stem for p in (out / "draws").glob("arms_*.json")) == ["arms_r000", "arms_r001", "arms_r002"]
    redrawn = load_file(str(out / "draws" / "arms_r001.safetensors"))
    assert all(torch.equal(kept[k], redrawn[k]) for k in kept)  # a repeat is a function of (seed, r)
    assert json.loads((out / "report.json").read_text())["arms"][0]["repeats"] == 3


def test_a_different_probe_in_the_same_folder_is_refused(tmp_path, tiny_weights):
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    out = tmp_path / "probe"
    (out).mkdir()
    (out / "probe.json").write_text(json.dumps({"key": {"recipe": "another"}}))
    result = _probe(recipe, out)
    assert result.returncode == 2 and "different probe" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "arm, message",
    [("bad:reward.name=brightness", "shared by every arm"), ("g:credit.name=outcome,group_sizes=1", "at least 2")],
)
def test_bad_arms_exit_2_with_one_paragraph(tmp_path, tiny_weights, arm, message):
    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    result = run_tpflow("probe", str(recipe), "--arm", arm, "--out", str(tmp_path / "p"))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_the_prompt_set_is_balanced_over_tags():
    from tpflow.probe.run import balanced_prompts

    items = [PromptItem(f"{tag} {k}", {"tag": tag}) for tag in "abc" for k in range(5)]
    picked = balanced_prompts(items + items[:3], 6, seed=0)  # duplicates count once
    assert sorted(p.metadata["tag"] for p in picked) == ["a", "a", "b", "b", "c", "c"]
    assert len({p.prompt for p in picked}) == 6 and picked == balanced_prompts(items, 6, seed=0)


def _linear_rollout(policy, n, seed):
    """n trajectories of the linear toy (2 SDE steps of 3), their z_0 and SDE noise from ``seed``."""
    from tpflow.rollout import Window, rollout
    from tpflow.types import Conditioning

    sampler = tpflow.build("sampler", "flow-sde")
    z0 = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.0])
    batch = rollout(policy, sampler, Conditioning({"rows": torch.arange(n)}), z0, sigmas, Window(0, 2), 0.7, 1.0,
                    None, generator=torch.Generator().manual_seed(seed + 1))  # fmt: skip
    return sampler, batch


def test_the_outcome_estimate_tends_to_the_reference_as_the_group_grows():
    """On the linear toy, with a reward of the final latent, the first-step gradient of outcome credit (group
    normalised, one prompt) turns towards the reference gradient as G grows: the property the probe's G axis shows."""
    policy = LinearPolicy()
    grpo = tpflow.build("optimizer", "grpo", beta=0.0, micro_batch_size=4096, adv_clip_max=100.0)
    grpo.bind(policy)

    def gradient(n, seed, reference):
        sampler, batch = _linear_rollout(policy, n, seed)
        final = (batch.final[:, 0] - 0.5 * batch.final[:, 1].square()).double()  # [n] reward of x_0
        groups = ["p"] * n
        width = batch.latents.shape[1]
        advantages = (
            leave_one_out_advantages(final, groups, width)
            if reference
            else grpo.advantages(final[:, None].expand(-1, width).clone() / width, groups)
        )
        return first_step_gradient(grpo, policy, sampler, batch, advantages)

    star = gradient(20000, 0, reference=True)
    cosines = {g: sum(cosine(gradient(g, 100 + r, False), star) for r in range(24)) / 24 for g in (4, 32, 512)}
    assert cosines[4] < cosines[32] < cosines[512] and cosines[512] > 0.9, cosines


def test_comparisons_pair_repeats_and_interpolate_the_baseline_only_inside_its_range():
    """Hand-made per-repeat cosines: the equal-G difference is the repeat-wise one; at equal NFE the baseline's
    cosine is interpolated in log NFE between its sizes (40 and 160 NFE: at 80, halfway in log), and an arm beyond
    the baseline's range gets no equal-NFE row."""
    from tpflow.probe.report import comparisons

    def arm(name, g, nfe_per_traj):
        return {"key": f"{name}@{g}", "arm": name, "group_size": g, "nfe_per_prompt": nfe_per_traj * g}

    result = {
        "arms": [arm("outcome", 4, 10), arm("outcome", 16, 10), arm("tp", 4, 20), arm("tp", 16, 20)],
        "per_repeat_cosine": {
            "outcome@4": [0.1, 0.2, 0.3],
            "outcome@16": [0.3, 0.4, 0.5],
            "tp@4": [0.25, 0.3, 0.5],
            "tp@16": [0.0, 0.0, 0.0],
        },
    }
    rows = {c.name: c for c in comparisons(result, "outcome")}
    assert set(rows) == {"tp@4 − outcome@4", "tp@4 − outcome at equal NFE (80/prompt)", "tp@16 − outcome@16"}
    assert rows["tp@4 − outcome@4"].mean == pytest.approx((0.15 + 0.1 + 0.2) / 3)
    assert rows["tp@4 − outcome at equal NFE (80/prompt)"].mean == pytest.approx((0.05 + 0.0 + 0.1) / 3)
    assert all(0 <= c.p <= c.p_holm <= 1 for c in rows.values())


def test_repeats_for_a_half_width():
    from scipy import stats

    from tpflow.intervals import repeats_for_half_width

    n = repeats_for_half_width(0.2, 0.02)
    half = lambda k: stats.t.ppf(0.975, k - 1) * 0.2 / k**0.5  # noqa: E731
    assert half(n) <= 0.02 < half(n - 1)

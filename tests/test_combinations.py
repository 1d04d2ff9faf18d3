"""The combination matrix in the suite (tests/combinations.py): a pairwise covering design over the single-process
factors on the embedded backbone, each combination refused by the recipe check in one paragraph, or training with
the reference's first-step gradient and finite weights after one non-finite trajectory. The benchmark
(benchmarks/combinations.py) runs the larger matrix (the tiny SD3 and FLUX twins, compiled blocks) and writes its
table to docs/testing.md."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.combinations import REFERENCE, SUITE_FACTORS, SUITE_ROWS, judge, overrides, recipe_text, run_combination


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("matrix")
    path = folder / "tiny.toml"
    path.write_text(recipe_text(folder / "run"))
    return path


def test_the_suites_rows_cover_every_pair_of_levels():
    """A level added to a factor (a new option or mode) fails here until ``benchmarks/combinations.py --suite-rows``
    writes rows that cover it: a new option enters the matrix to land."""
    names = list(SUITE_FACTORS)
    rows = [dict(zip(names, row, strict=True)) for row in SUITE_ROWS]
    assert all(row[n] in SUITE_FACTORS[n] for row in rows for n in names)
    missing = [((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in SUITE_FACTORS[a]
               for y in SUITE_FACTORS[b] if not any(row[a] == x and row[b] == y for row in rows)]  # fmt: skip
    assert not missing, f"{len(missing)} pairs uncovered, e.g. {missing[:3]}"


def test_every_pair_of_options_is_right_or_refused(recipe, tiny_weights):
    """No combination of the design fails; a reference configuration (native, fp32) is accepted (a harness that
    refused everything would pass nothing), and so are most rows."""
    cache: dict = {}
    outcomes = [judge({**dict(zip(SUITE_FACTORS, row, strict=True)), "compile": "off"}, recipe, tiny_weights, cache)
                for row in SUITE_ROWS]  # fmt: skip
    failed = [f"{o.combo}: {o.detail}" for o in outcomes if o.status == "FAILED"]
    assert not failed, "\n".join(failed)
    assert any(o.status == "accepted" and all(o.combo[k] == v for k, v in REFERENCE.items()) for o in outcomes)
    assert sum(o.status == "accepted" for o in outcomes) >= 6, [(o.combo, o.detail) for o in outcomes]


BASE = {  # the matrix's reference combination
    "backbone": "shapes-dit", "plan": "window", "sampler": "cps", "credit": "outcome", "optimizer": "grpo",
    "recompute": "native", "precision": "no", "compile": "off", "cfg_gradient": "full", "finetune": "lora",
}  # fmt: skip
SHAPED = 'reward={name = "diversity-shaped", reward = {name = "image-stat"}, features = "pixels"}'
PARTS = ('reward={name = "weighted", rewards = [{name = "image-stat", label = "bright"}, {name = "image-stat", '
         'label = "saturated", weight = 0.0, options = {statistic = "saturation"}}]}')  # fmt: skip
GATED = ["optimizer.kl_gate=true", 'optimizer.kl_gate_main="bright"', 'optimizer.kl_gate_aux=["saturated"]']
GARDO = {  # GARDO's options (docs/algorithm.md §10.9) on the matrix's tiny recipe: their sets and the outcome due
    "adaptive_reference, beta 0": (["optimizer.adaptive_reference=true"], "refused"),
    "adaptive_reference, retain": (
        ["optimizer.adaptive_reference=true", "optimizer.beta=1e-3", 'optimizer.recompute="retain"'],
        "refused",
    ),
    "adaptive_reference": (["optimizer.adaptive_reference=true", "optimizer.beta=1e-3"], "accepted"),
    "diversity-shaped, no std": ([SHAPED, 'optimizer.advantage_std="none"'], "accepted"),
    "diversity-shaped, adaptive, retain": (
        [SHAPED, "optimizer.adaptive_reference=true", "optimizer.beta=1e-3", 'optimizer.recompute="retain"'],
        "refused",
    ),  # fmt: skip
    "kl_gate, beta 0": ([PARTS, *GATED], "refused"),
    "kl_gate, a detail the reward lacks": (
        [PARTS, *GATED[:2], 'optimizer.kl_gate_aux=["contrast"]', "optimizer.beta=1e-3"],
        "refused",
    ),  # fmt: skip
    "kl_gate": ([PARTS, *GATED, "optimizer.beta=1e-3"], "accepted"),
    "kl_gate, retain": ([PARTS, *GATED, "optimizer.beta=1e-3", 'optimizer.recompute="retain"'], "accepted"),
}


def judged(recipe, base: list[str], table: dict[str, tuple[list[str], str]]) -> dict[str, torch.Tensor]:
    """Each combination of ``table`` (name -> (sets, the outcome due)) loaded and, once accepted, run: its first
    step's gradient by name. Fails on a refusal of more than one paragraph or with a traceback, a gradient that is
    not finite or is 0, weights not finite after one non-finite trajectory, or an outcome other than the one due."""
    from tpflow.errors import RecipeError
    from tpflow.recipe import load_recipe

    outcomes, grads = {}, {}
    for name, (sets, _) in table.items():
        try:
            load_recipe(recipe, [*base, *sets])
        except RecipeError as error:
            text = str(error).strip()
            assert "\n\n" not in text and "Traceback" not in text, (name, text)
            outcomes[name] = "refused"
            continue
        grad, finite = run_combination(recipe, [*base, *sets])
        assert finite and bool(torch.isfinite(grad).all()) and float(grad.norm()) > 0, name
        outcomes[name], grads[name] = "accepted", grad
    assert outcomes == {name: due for name, (_, due) in table.items()}
    return grads


def test_gardos_options_are_right_or_refused(recipe, tiny_weights):
    """Each GARDO combination refused in one paragraph or trained: a finite first-step gradient, finite weights
    after one non-finite trajectory; the adaptive reference's first step is the base-model KL's bitwise (its copy is
    the LoRA at init, B = 0, which computes what the adapter-disabled model does)."""
    base = overrides(BASE, tiny_weights)
    grads = judged(recipe, base, GARDO)
    plain, _ = run_combination(recipe, [*base, "optimizer.beta=1e-3"], nonfinite=False)
    assert torch.equal(grads["adaptive_reference"], plain), "the first update's reference is the base model, bitwise"


SKIP = 'train.prompt_policy="skip-solved"'
PROMPT_POLICY = {  # [train] prompt_policy (docs/training.md, "Which prompts an epoch draws"): sets, outcome due
    "skip-solved": ([SKIP], "accepted"),
    "prompt_skip_epochs, uniform": (["train.prompt_skip_epochs=2"], "refused"),
    "skip-solved, groups of one": ([SKIP, "train.group_size=1", "train.rollout_batch=2"], "refused"),
}


def test_the_prompt_policys_options_are_right_or_refused(recipe, tiny_weights):
    """Each prompt-policy combination refused in one paragraph or trained with a finite gradient and finite weights
    after one non-finite trajectory; the policy sets nothing aside before the first epoch, so the first step's
    gradient is the uniform policy's bitwise."""
    base = overrides(BASE, tiny_weights)
    for name, grad in judged(recipe, base, PROMPT_POLICY).items():
        sets = PROMPT_POLICY[name][0]
        plain, _ = run_combination(recipe, [*base, *(s for s in sets if s != SKIP)], nonfinite=False)
        assert torch.equal(grad, plain), f"{name}: the first step draws the uniform policy's prompts"

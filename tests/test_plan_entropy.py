"""The ``entropy-steps`` plan (E-GRPO, docs/algorithm.md §10.11) against the formulas of E-GRPO's public code.

github.com/shengjun-zhang/VisualGRPO at ae619bf, ``fastvideo/workers/sampler/flux_sampler.py``: the σ grid
``sd3_time_shift(3, linspace(1, 0, K + 1))``, the SDE step's std ``std_dev_t·sqrt(−dt)`` with ``std_dev_t =
sqrt(σ/(1 − where(σ = 1, σ_1, σ)))·η``, and ``dt = σ_{k+m} − σ_k`` for a step merged over m schedule steps; its log-
density is averaged over the latent's elements, so a step's entropy is per element. Written out here in float64.
"""

from __future__ import annotations

import math

import torch

import tpflow
from tests.test_plans import LinearFlow, flow_sde_formula
from tpflow.devices import cpu_generator, randn
from tpflow.plans.entropy_steps import EntropyStepsOptions, grid_sigmas, window_nodes
from tpflow.rollout import BranchEngine, RolloutInputs, Window, baseline_generator
from tpflow.settings import RolloutSettings
from tpflow.types import Conditioning


def reference_entropy(sigmas: torch.Tensor, index: int, merge_step: int, eta: float) -> float:
    """−E[log_prob] of ``_flow_grpo_step``'s Gaussian per element: log(std_dev_t·sqrt(−dt)) + ½·log(2π) + ½."""
    sigma, sigma_prev, sigma_max = sigmas[index], sigmas[index + merge_step], sigmas[1]
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    dt = sigma_prev - sigma
    return float(torch.log(std_dev_t * torch.sqrt(-dt)) + 0.5 * math.log(2 * math.pi) + 0.5)


def test_the_chosen_segments_follow_the_reference_entropies_in_float64():
    """On E-GRPO's FLUX grid (K = 16, shift 3, η = 0.7): the largest single-step entropy is step 1, so the unmerged
    window is its scripts' eta_step_list [1, 2, 3] (merge 1 each); with τ each segment ends at the first σ whose
    merged step's entropy reaches τ, hand-computed from the reference's formula; the plan's σ grid is its grid."""
    k, eta = 16, 0.7
    sigmas = torch.linspace(1, 0, k + 1, dtype=torch.float64)
    sigmas = 3.0 * sigmas / (1 + 2.0 * sigmas)  # sd3_time_shift(3, t)
    assert torch.allclose(torch.tensor(grid_sigmas("linspace", k, 3.0), dtype=torch.float64), sigmas, atol=1e-15)
    single = [reference_entropy(sigmas, i, 1, eta) for i in range(k)]
    assert max(range(k), key=single.__getitem__) == 1
    assert window_nodes(EntropyStepsOptions(), k, 3, eta) == (1, 2, 3, 4)
    for tau in (0.5, 1.0, 1.2):
        nodes = [1]
        for _ in range(3):
            m = next(m for m in range(1, k - nodes[-1] + 1) if reference_entropy(sigmas, nodes[-1], m, eta) >= tau)
            nodes.append(nodes[-1] + m)
        assert window_nodes(EntropyStepsOptions(entropy_threshold=tau), k, 3, eta) == tuple(nodes), tau
    assert window_nodes(EntropyStepsOptions(entropy_threshold=1.0), k, 4, eta) == (1, 2, 4, 7, 12)  # merges happen
    # a segment that cannot reach τ ends at σ_K = 0; nothing follows it
    assert window_nodes(EntropyStepsOptions(entropy_threshold=1.0), k, 5, eta) == (1, 2, 4, 7, 12, 16)
    assert window_nodes(EntropyStepsOptions(entropy_threshold=1.0), k, 6, eta) is None
    # the entropy ranked is the flow-sde sampler's own: ½·log(2πe) + log(std) of its step on the same grid
    sampler, z = tpflow.build("sampler", "flow-sde"), torch.zeros(1, 4, dtype=torch.float64)
    for i in range(1, k):
        std = sampler.step(z, z, sigmas[i], sigmas[i + 1], eta, noise=z).std
        assert math.isclose(0.5 * math.log(2 * math.pi * math.e) + math.log(float(std.flatten()[0])), single[i],
                            rel_tol=1e-9)  # fmt: skip


def test_the_plan_is_a_function_of_the_schedule_not_of_the_seeds():
    """Every batch, epoch and run seed gets the same segments (siblings of a group may span rollout batches); the
    merged window travels as grid nodes, an unmerged one as the branch plan's window."""
    settings = RolloutSettings(num_steps=16, window_size=3, window_range=(0, 16), same_noise=True)
    merged = tpflow.build("plan", "entropy-steps", entropy_threshold=1.0)
    plans = {(p.starts, p.size, p.nodes, p.branch) for s in range(20) for p in [merged.plan(settings, 4, s, 7 * s, s)]}
    assert plans == {((1,) * 4, 3, (1, 2, 4, 7), True)}
    plain = tpflow.build("plan", "entropy-steps").plan(settings, 4, 0, 0, 0)
    assert (plain.starts, plain.size, plain.nodes, plain.branch) == ((1,) * 4, 3, None, True)


def test_a_merged_branch_steps_from_sigma_a_to_sigma_b_and_completes_from_b():
    """The engine's merged window step (nodes 1 -> 3): one flow-sde step from the ODE state at σ_1 to σ_3, stored
    with the σ pair (σ_1, σ_3), the child ODE-completed from σ_3; float64 against the sequential formula."""
    backbone, sampler = LinearFlow(), tpflow.build("sampler", "flow-sde")
    n, num_steps, alpha, nodes = 3, 5, 0.7, (1, 3, 4)
    sigmas = backbone.sigmas(num_steps)
    z0 = backbone.initial_noise(1, cpu_generator(0))
    source = torch.zeros(n, dtype=torch.long)
    cond = Conditioning({"row": torch.arange(n)})
    inputs = RolloutInputs(backbone, cond, z0, sigmas, 1.0, source=source, generator=cpu_generator(5))
    out = BranchEngine(sampler, Window(1, 2), alpha, nodes=nodes).run(inputs)
    gen = cpu_generator(5)
    baseline_generator(gen)
    xis = [randn((n, backbone.dim), gen, "cpu").double() for _ in range(num_steps)]

    def ode(z, start):
        for k in range(start, num_steps):
            z = z - (float(sigmas[k]) - float(sigmas[k + 1])) * backbone.velocity(z, sigmas[k : k + 1], cond, 1.0)
        return z

    assert torch.equal(out.sigmas[0], sigmas[list(nodes)].float())
    for row in range(n):
        x = z0
        for k in range(num_steps):
            v = backbone.velocity(x, sigmas[k : k + 1], cond, 1.0)
            if k in nodes[:-1]:
                i = nodes.index(k)
                b = nodes[i + 1]
                child = flow_sde_formula(x, v, float(sigmas[k]), float(sigmas[b]), alpha, xis[k][row : row + 1])
                torch.testing.assert_close(out.latents[row, i], x[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out.next_latents[row, i], child[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out.completions[row, i], ode(child, b)[0], atol=1e-5, rtol=1e-5)
            x = x - (float(sigmas[k]) - float(sigmas[k + 1])) * v
        torch.testing.assert_close(out.final[row], x[0], atol=1e-5, rtol=1e-5)
    # NFE per trajectory: the path's K over its n copies, plus each child's steps from σ_b on (5 − 3, 5 − 4)
    assert out.cost.nfe == round((num_steps + n * ((num_steps - 3) + (num_steps - 4))) / n, 2)


def test_a_recipe_it_cannot_serve_is_refused_in_one_paragraph():
    """Refused before anything loads: a sampler whose entropy is not flow-sde's, per-copy noise, non-branch credit
    and more segments than the K steps hold (recipes/shapes_egrpo.toml itself validates: test_recipe_index.py)."""
    from pathlib import Path

    import pytest

    from tpflow.errors import UserError
    from tpflow.recipe import load_recipe

    path = Path(__file__).resolve().parents[1] / "recipes" / "shapes_egrpo.toml"
    bad = ["sampler.name=cps", "rollout.same_noise=false", "credit.name=outcome", "rollout.window_size=8"]
    with pytest.raises(UserError) as refused:
        load_recipe(path, bad)
    text = str(refused.value)
    assert "flow-sde" in text and "same_noise" in text and "'outcome'" in text and "do not fit" in text, text


def test_merged_entropy_steps_train_resume_bitwise_and_ignore_the_micro_batches(tmp_path, tiny_weights, plugin):
    """recipes/shapes_egrpo.toml (merged segments 1->2, 2->4, 4->7) runs the trainer at the smallest sizes: the trace
    holds the 3 segments, the adapter moves; 2 epochs straight equal 1 + a resumed 1 bitwise (what a kill after the
    first epoch's checkpoint leaves), and the first epoch cut into micro-batches of 2 (3 per step) ends where micro-
    batches of 6 do, up to float rounding."""
    from tests.test_plans import _method_run
    from tpflow.train.run_logger import read_jsonl

    extra = ["train.group_size=3", "train.rollout_batch=6", "optimizer.micro_batch_size=6", "rollout.same_noise=true"]
    runs = {name: tmp_path / name for name in ("straight", "resumed", "micro")}
    for folder in runs.values():
        folder.mkdir()
    straight = _method_run("shapes_egrpo.toml", runs["straight"], tiny_weights, 2, extra)
    start = {n: p.detach().clone() for n, p in straight.backbone.model.named_parameters() if "lora_" in n}
    straight.fit()
    first = _method_run("shapes_egrpo.toml", runs["resumed"], tiny_weights, 1, extra)
    metrics = first.fit()
    widths = {len(r["step_rewards"]) for r in read_jsonl(first.run_dir / "traces.jsonl")}
    assert widths == {3}, widths
    assert metrics["optimizer_steps"] >= 1 and metrics["first_ratio_max_deviation"] == 0.0, metrics
    one = {n: p.detach().clone() for n, p in first.backbone.model.named_parameters() if "lora_" in n}
    assert any(not torch.equal(start[n], one[n]) for n in start)
    second = _method_run("shapes_egrpo.toml", runs["resumed"], tiny_weights, 2, extra, resume=True)
    assert second.epoch == 1
    second.fit()
    a, b = dict(straight.backbone.model.named_parameters()), dict(second.backbone.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in start)
    micro = [*extra[:2], "optimizer.micro_batch_size=2", "optimizer.gradient_accumulation_steps=3", extra[3]]
    cut = _method_run("shapes_egrpo.toml", runs["micro"], tiny_weights, 1, micro)
    cut.fit()
    c = dict(cut.backbone.model.named_parameters())
    for n in start:
        torch.testing.assert_close(c[n], one[n], rtol=1e-5, atol=1e-6, msg=n)


def test_the_flux_recipe_without_weights_exits_2_naming_them(monkeypatch, tmp_path, capsys):
    """recipes/flux/flux_egrpo.toml offline, with an empty Hugging Face cache: one paragraph, exit 2, naming the FLUX
    weights and the HPS checkpoint to fetch."""
    from pathlib import Path

    import pytest

    from tpflow.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(Path(__file__).resolve().parents[1] / "recipes" / "flux" / "flux_egrpo.toml")])
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert "black-forest-labs/FLUX.1-dev" in err and "xswu/HPSv2" in err and "never downloads" in err, err


def test_a_grid_that_is_not_the_backbones_schedule_is_refused_before_sampling(tmp_path, tiny_weights, plugin):
    """The plan ranks entropies on its entropy_grid: the backbone's own σ must be it (shapes-dit: 'sd3', shift 3),
    or the steps it chooses are not the ones sampled; the trainer says so once the backbone is built."""
    import pytest

    from tests.test_plans import _method_run
    from tpflow.errors import UserError
    from tpflow.samplers.schedules import sd3_sigmas

    sigmas = [float(s) for s in sd3_sigmas(10, 3.0)]
    assert tpflow.build("plan", "entropy-steps", entropy_grid="sd3").schedule_problem(sigmas) is None
    problem = tpflow.build("plan", "entropy-steps", entropy_grid="linspace").schedule_problem(sigmas)
    assert problem and "entropy_grid = 'linspace'" in problem and "\n" not in problem, problem
    extra = ("plan.entropy_grid=linspace", "rollout.same_noise=true")
    with pytest.raises(UserError, match="not the steps the run takes"):
        _method_run("shapes_egrpo.toml", tmp_path, tiny_weights, 1, extra)
    # shapes-dit's schedule follows from its options (capability static_sigmas): refused by the recipe check, before
    # anything loads (tpflow validate); a backbone whose schedule is in its weights' config is checked when built
    from pathlib import Path

    from tpflow.errors import RecipeError
    from tpflow.recipe import load_recipe

    shipped = Path(__file__).resolve().parents[1] / "recipes" / "shapes_egrpo.toml"
    assert load_recipe(shipped).plan.name == "entropy-steps"
    with pytest.raises(RecipeError, match="not the steps the run takes"):
        load_recipe(shipped, ["plan.grid_shift=1.0"])
    with pytest.raises(RecipeError, match="not the steps the run takes"):
        load_recipe(shipped, ["backbone.shift=1.0"])

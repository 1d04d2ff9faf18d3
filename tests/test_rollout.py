"""The batched rollout engine against a plain sequential re-implementation of docs/algorithm.md Appendix A.

Every test that uses the ``backbone`` fixture runs on the CPU and, in the GPU suite, with shapes-dit on CUDA (the
cuda variant is skipped without CUDA, so it costs the CPU suite nothing). On the CPU a row's result does not depend on
how many rows share a velocity call, so the tolerances are tight and a few checks bitwise. On CUDA cuBLAS picks its
kernels by problem shape, and the engine batches the main trajectory, the baseline and the branches in one call
where the reference evaluates them apart: the same float32 function rounded differently. There ``close`` allows
``CUDA_TOL`` (1e-4 absolute and relative; the float32 drift of these rollouts is ~1e-6, a real bug 0.1 or more) and
TF32 is off (``exact_fp32``, tests/conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

import tpflow
from tpflow.rollout import Window, draw_window, rollout
from tpflow.samplers import euler_step

from .conftest import cuda_or_skip, exact_fp32

PROMPTS = ["a photo of a red circle", "a photo of two squares"]
CUDA_TOL = 1e-4  # the least atol and rtol on CUDA (module docstring)


@pytest.fixture(autouse=True)
def _no_tf32():
    with exact_fp32():
        yield


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backbone(request, tiny_weights):
    """shapes-dit on the CPU and, in the GPU suite, on CUDA (one model per device for the module)."""
    device = cuda_or_skip() if request.param == "cuda" else "cpu"
    return tpflow.build("backbone", "shapes-dit", weights=str(tiny_weights), device=device)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-8, rtol: float = 1e-5) -> bool:
    """``torch.allclose`` with at least ``CUDA_TOL`` on CUDA (kernel choice follows the batch shape there)."""
    if a.device.type == "cuda":
        atol, rtol = max(atol, CUDA_TOL), max(rtol, CUDA_TOL)
    return torch.allclose(a, b, atol=atol, rtol=rtol)


def _setup(backbone, n_copies=2, seed=0):
    prompts = [p for p in PROMPTS for _ in range(n_copies)]
    cond = backbone.encode(prompts)
    z0 = backbone.initial_noise(len(prompts), torch.Generator().manual_seed(seed))
    return cond, z0


def _ode(backbone, z, cond, sigmas, start, guidance):
    for k in range(start, sigmas.shape[0] - 1):
        n = z.shape[0]
        v = backbone.velocity(z, sigmas[k].expand(n), cond, guidance)
        z = euler_step(z, v, sigmas[k], sigmas[k + 1])
    return z


@pytest.mark.parametrize("start,reuse", [(0, True), (2, True), (0, False)])
def test_matches_sequential_reference(backbone, start, reuse):
    """Main trajectory, baseline and every completion equal the reference's one-branch-at-a-time computation."""
    sampler = tpflow.build("sampler", "cps")
    sigmas = backbone.sigmas(8)
    cond, z0 = _setup(backbone)
    window = Window(start, 5)
    gen = torch.Generator().manual_seed(3)
    out = rollout(backbone, sampler, cond, z0, sigmas, window, 0.7, 2.0, generator=gen, reuse_main_velocity=reuse)
    n, width = z0.shape[0], window.size
    assert out.latents.shape == (n, width, 3, 32, 32) and out.log_probs.shape == (n, width)
    assert out.completions.shape == (n, width, 3, 32, 32)
    assert out.latents.device == z0.device and out.completions.device == z0.device
    assert torch.equal(out.sigmas, sigmas[start : start + width + 1].expand(n, -1).to(z0.device))
    # The stored transitions chain into each other and into the final latent.
    assert torch.equal(out.latents[:, 1:], out.next_latents[:, :-1])
    # Before the window the main trajectory is the ODE.
    z_s = _ode(backbone, z0, cond, sigmas[: start + 1], 0, 2.0) if start else z0
    assert close(out.latents[:, 0], z_s, atol=1e-5)
    # Completion j = ODE from the latent after j SDE steps; j = 0 is the baseline from the same noise.
    for j in range(width):
        expected = _ode(backbone, out.latents[:, j], cond, sigmas, start + j, 2.0)
        assert close(out.completions[:, j], expected, atol=1e-4), j
    assert close(out.final, _ode(backbone, out.next_latents[:, -1], cond, sigmas, start + width, 2.0))
    # NFE per trajectory: main K, baseline K - s, branches K - s - j (docs/algorithm.md §3.5), or W fewer when every
    # branch's first step reuses the main trajectory's velocity.
    k = 8
    reference_nfe = 2 * k + (width - 1) * (k - start) - width * (width - 1) // 2 - (k - (k - start))
    if start == 0:
        assert reference_nfe == (width + 1) * k - width * (width - 1) // 2
    assert out.cost.nfe == (reference_nfe - width if reuse else reference_nfe) and out.cost.model_s > 0


def test_old_log_probs_are_on_policy(backbone):
    """Re-scoring the stored transitions with the same weights gives the stored log-probs: ratio 1."""
    sampler = tpflow.build("sampler", "cps")
    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone)
    out = rollout(backbone, sampler, cond, z0, sigmas, Window(0, 5), 0.7, 2.0, completions=None)
    assert out.completions is None and out.cost.nfe == 6
    for i in range(5):
        n = z0.shape[0]
        v = backbone.velocity(out.latents[:, i], out.sigmas[:, i], cond, 2.0)
        assert out.sigmas[:, i].shape == (n,)
        again = sampler.log_prob(
            out.next_latents[:, i], out.latents[:, i], v, out.sigmas[:, i], out.sigmas[:, i + 1], 0.7
        )
        assert close(again.log_prob, out.log_probs[:, i], rtol=1e-5, atol=1e-7)


def test_noise_level_zero_makes_every_completion_the_ode_image(backbone):
    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone)
    out = rollout(backbone, tpflow.build("sampler", "flow-sde"), cond, z0, sigmas, Window(0, 4), 0.0, 1.0)
    for j in range(4):
        assert close(out.completions[:, j], out.final, atol=1e-5)


def test_same_noise_dedupes_prefix_and_baseline(backbone):
    """Copies that share z_0 give the same result as repeating z_0, with fewer evaluations."""
    sampler = tpflow.build("sampler", "cps")
    sigmas = backbone.sigmas(6)
    cond, _ = _setup(backbone, n_copies=3)
    z_unique = backbone.initial_noise(2, torch.Generator().manual_seed(5))
    source = torch.tensor([0, 0, 0, 1, 1, 1])
    window = Window(2, 3)
    deduped = rollout(
        backbone,
        sampler,
        cond,
        z_unique,
        sigmas,
        window,
        0.7,
        2.0,
        source=source,
        generator=torch.Generator().manual_seed(9),
    )
    repeated = rollout(
        backbone,
        sampler,
        cond,
        z_unique[source],
        sigmas,
        window,
        0.7,
        2.0,
        generator=torch.Generator().manual_seed(9),
    )
    assert close(deduped.final, repeated.final, atol=1e-5)
    assert close(deduped.completions, repeated.completions, atol=1e-5)
    assert close(deduped.log_probs, repeated.log_probs, atol=1e-6)
    assert deduped.cost.nfe < repeated.cost.nfe


def test_x0_completions_and_max_batch(backbone):
    sampler = tpflow.build("sampler", "cps")
    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone)
    out = rollout(backbone, sampler, cond, z0, sigmas, Window(0, 4), 0.7, 2.0, completions="x0", max_batch=3)
    assert out.cost.nfe == 6  # the estimates reuse the main trajectory's velocities
    n = z0.shape[0]
    for j in range(4):
        v = backbone.velocity(out.latents[:, j], sigmas[j].expand(n), cond, 2.0)
        assert close(out.completions[:, j], out.latents[:, j] - sigmas[j] * v, atol=1e-5)


def _euler_along(backbone, z, cond, sigmas, nodes, guidance):
    """Euler from grid index nodes[0] to nodes[-1], one step per pair of consecutive nodes."""
    for a, b in zip(nodes, nodes[1:], strict=False):
        v = backbone.velocity(z, sigmas[a].expand(z.shape[0]), cond, guidance)
        z = euler_step(z, v, sigmas[a], sigmas[b])
    return z


def test_completion_nodes():
    from tpflow.rollout import completion_nodes

    assert completion_nodes(0, 10, 1) == [0, 10]
    assert completion_nodes(0, 10, 2) == [0, 5, 10]
    assert completion_nodes(3, 10, 3) == [3, 5, 8, 10]
    assert completion_nodes(8, 10, 3) is None and completion_nodes(0, 10, None) is None  # every step: exact


@pytest.mark.parametrize("start", [0, 1])
def test_k_step_completions(backbone, start):
    """completion_steps = k: each completion takes k Euler steps on nodes of the main schedule (by hand below); k = 1
    is the x0 estimate exactly, k ≥ the steps left is the exact completion, the main trajectory never changes, and
    the NFE falls as the branches skip steps."""
    from tpflow.rollout import completion_nodes

    sampler = tpflow.build("sampler", "cps")
    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone)

    def run(**kwargs):
        gen = torch.Generator().manual_seed(3)
        return rollout(backbone, sampler, cond, z0, sigmas, Window(start, 4), 0.7, 2.0, generator=gen, **kwargs)

    exact, x0 = run(completions="ode"), run(completions="x0")
    one, two, many = (run(completions="ode", completion_steps=k) for k in (1, 2, 6))
    # bit for bit on the CPU; on CUDA the batched call's kernels follow its row count, which the branches change
    same = torch.equal if z0.device.type == "cpu" else close
    assert same(one.completions, x0.completions) and one.cost.nfe == x0.cost.nfe == 6
    assert same(many.completions, exact.completions) and many.cost.nfe == exact.cost.nfe
    for out in (one, two, many):
        assert same(out.final, exact.final) and same(out.next_latents, exact.next_latents)
        assert same(out.log_probs, exact.log_probs)
    assert one.cost.nfe < two.cost.nfe < exact.cost.nfe
    for j in range(4):  # completion j starts at z_{start+j}, on its nodes
        nodes = completion_nodes(start + j, 6, 2) or list(range(start + j, 7))
        expected = _euler_along(backbone, two.latents[:, j], cond, sigmas, nodes, 2.0)
        assert close(two.completions[:, j], expected, atol=1e-5), j
    assert not torch.allclose(two.completions, exact.completions, atol=1e-3)  # approximate: it does differ


def test_completion_steps_settings():
    from tpflow.settings import RolloutSettings

    assert RolloutSettings().completion_steps == "all" and RolloutSettings(completion_steps=3).completion_steps == 3
    for bad in (0, "some"):
        with pytest.raises(ValueError, match="completion_steps"):
            RolloutSettings(completion_steps=bad)
    with pytest.raises(ValueError, match="'x0' is the one-step"):
        RolloutSettings(completions="x0", completion_steps=2)


def test_independent_baseline_uses_fresh_noise(backbone):
    """The independent baseline is the ODE image of noise from its own stream (``baseline_generator``, seeded by the
    generator's first draw): neither z_0 nor the generator's next draws, so it is no copy of the main trajectory."""
    from tpflow.rollout import baseline_generator

    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone, seed=4)  # z_0 from a generator seeded like the SDE one: still not the fresh noise
    gen = torch.Generator().manual_seed(4)
    out = rollout(
        backbone,
        tpflow.build("sampler", "cps"),
        cond,
        z0,
        sigmas,
        Window(0, 3),
        0.0,
        1.0,
        baseline_noise="independent",
        generator=gen,
    )
    fresh = backbone.initial_noise(z0.shape[0], baseline_generator(torch.Generator().manual_seed(4)))
    assert close(out.completions[:, 0], _ode(backbone, fresh, cond, sigmas, 0, 1.0), atol=1e-5)
    assert not torch.allclose(fresh, z0, atol=0.5)
    assert not torch.allclose(fresh, backbone.initial_noise(z0.shape[0], torch.Generator().manual_seed(4)), atol=0.5)
    assert not torch.allclose(out.completions[:, 0], out.final, atol=1e-3)


@pytest.mark.parametrize("sampler_name", ["cps", "flow-sde"])
def test_main_trajectory_does_not_depend_on_baseline_or_completions(backbone, sampler_name):
    """Same seed and z_0: the main trajectory (window transitions, log-probs, final latents) is the same whatever
    ``baseline_noise``, ``completions``, ``completion_steps`` or ``transitions`` (docs/algorithm.md §1.6), so arms
    that differ in them are paired on ξ. The window leaves ODE steps before and after it, which draw ξ too."""
    sampler = tpflow.build("sampler", sampler_name)
    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone)
    window = Window(1, 3)

    def run(**kwargs):
        return rollout(
            backbone, sampler, cond, z0, sigmas, window, 0.7, 2.0, generator=torch.Generator().manual_seed(8), **kwargs
        )

    reference = run(completions="ode", baseline_noise="shared")
    arms = {
        "ode, independent": run(completions="ode", baseline_noise="independent"),
        "x0, shared": run(completions="x0", baseline_noise="shared"),
        "x0, independent": run(completions="x0", baseline_noise="independent"),
        "none, shared": run(completions=None, baseline_noise="shared"),
        "none, independent": run(completions=None, baseline_noise="independent"),
        "ode, 2 steps, independent": run(completions="ode", baseline_noise="independent", completion_steps=2),
    }
    for name, out in arms.items():
        assert close(out.final, reference.final, atol=0, rtol=0), name
        assert close(out.latents, reference.latents, atol=0, rtol=0), name
        assert close(out.next_latents, reference.next_latents, atol=0, rtol=0), name
        assert close(out.log_probs, reference.log_probs, atol=0, rtol=0), name
    final_only = run(completions=None, transitions=False)
    assert close(final_only.final, reference.final, atol=0, rtol=0)
    # the baselines do differ: R_0 from z_0 against R_0 from fresh noise
    assert not torch.allclose(arms["ode, independent"].completions[:, 0], reference.completions[:, 0], atol=1e-3)


@torch.no_grad()
def _window_xi(backbone, sampler, out, start: int, cond, sigmas, k: int) -> torch.Tensor:
    """The ξ of generation step k recovered from a rollout (window start ``start``, α 0.7, guidance 2) from its stored
    transition at window position k − start: (z_{k+1} − μ) / std."""
    z, z_next = out.latents[:, k - start], out.next_latents[:, k - start]
    v = backbone.velocity(z, sigmas[k].expand(z.shape[0]), cond, 2.0)
    step = sampler.log_prob(z_next, z, v, sigmas[k], sigmas[k + 1], 0.7)
    return (z_next.float() - step.mean) / step.std.view(-1, *([1] * (z.ndim - 1)))


@pytest.mark.parametrize("sampler_name", ["cps", "flow-sde"])
def test_a_step_common_to_two_windows_gets_the_same_xi(backbone, sampler_name):
    """ξ_k is a function of (generator seed, k) only: windows [0, 4) and [2, 5) (different baselines too) give
    steps 2 and 3 the same ξ, recovered from each stored transition as (z_{k+1} − μ) / std: the generator's draw
    k + 2 (after the baseline generator's seed and one [N, ...] draw per earlier step, window or not)."""
    from tpflow.rollout import baseline_generator

    sampler = tpflow.build("sampler", sampler_name)
    sigmas = backbone.sigmas(6)
    cond, z0 = _setup(backbone)

    def run(window, baseline_noise):
        gen = torch.Generator().manual_seed(12)
        return rollout(
            backbone, sampler, cond, z0, sigmas, window, 0.7, 2.0, baseline_noise=baseline_noise, generator=gen
        )

    early, late = run(Window(0, 4), "shared"), run(Window(2, 3), "independent")
    stream = torch.Generator().manual_seed(12)
    baseline_generator(stream)
    draws = [torch.randn(z0.shape, generator=stream) for _ in range(6)]  # ξ_0 .. ξ_5
    for k in (2, 3):
        xi_early = _window_xi(backbone, sampler, early, 0, cond, sigmas, k)
        xi_late = _window_xi(backbone, sampler, late, 2, cond, sigmas, k)
        assert close(xi_early, xi_late, atol=1e-5, rtol=1e-5), k  # float32 recovery: ~5e-7
        assert close(xi_late, draws[k].to(xi_late.device), atol=1e-5, rtol=1e-5), k
        assert 0.8 < float(xi_early.std()) < 1.2  # a standard normal draw, not a degenerate quotient
    xi = [_window_xi(backbone, sampler, early, 0, cond, sigmas, k) for k in (2, 3)]
    assert not torch.allclose(xi[0], xi[1], atol=0.5)  # each step its own draw


def test_draw_window():
    rng = random.Random(0)
    starts = {draw_window(10, 2, (0, 10), rng).start for _ in range(200)}
    assert starts == set(range(9))
    assert draw_window(10, 9, (0, 9), rng) == Window(0, 9)
    with pytest.raises(ValueError):
        draw_window(10, 9, (0, 8), rng)


def test_rollout_from_settings_shares_noise_within_a_group(backbone):
    from tpflow.rollout import rollout_from_settings
    from tpflow.settings import RolloutSettings

    settings = RolloutSettings(num_steps=5, window_size=3, window_range=(0, 3), same_noise=True, guidance=2.0)
    cond, _ = _setup(backbone, n_copies=3)
    groups = [0, 0, 0, 1, 1, 1]
    sampler = tpflow.build("sampler", "cps")
    out = rollout_from_settings(backbone, sampler, cond, groups, Window(0, 3), settings, "ode", torch.Generator())
    baseline = out.completions[:, 0]  # ODE from z_0: equal within a group, different across groups
    assert torch.equal(baseline[0], baseline[2]) and torch.equal(baseline[3], baseline[5])
    assert not torch.allclose(baseline[0], baseline[3])
    assert not torch.allclose(out.final[0], out.final[1])  # the SDE noise still separates the copies


def test_group_seeds_give_a_group_the_same_noise_in_every_batch(backbone):
    from tpflow.rollout import rollout_from_settings
    from tpflow.settings import RolloutSettings

    settings = RolloutSettings(num_steps=5, window_size=3, window_range=(0, 3), same_noise=True, guidance=2.0)
    sampler = tpflow.build("sampler", "cps")
    seeds = {0: 11, 1: 12}  # group g is the prompt PROMPTS[g]

    def baseline(groups: list[int], generator_seed: int) -> torch.Tensor:
        cond = backbone.encode([PROMPTS[g] for g in groups])
        gen = torch.Generator().manual_seed(generator_seed)
        out = rollout_from_settings(backbone, sampler, cond, groups, Window(0, 3), settings, "ode", gen, seeds)
        return out.completions[:, 0]  # the ODE image from z_0

    # group 1 in a batch of its own copies, and beside group 0 in another batch sampled with another generator
    alone, mixed = baseline([1, 1, 1], 0), baseline([0, 0, 1, 1], 1)
    assert close(alone[0], mixed[3], atol=0, rtol=0), "a group's z_0 depends on its seed only, not on its batch"
    assert not torch.allclose(mixed[0], mixed[3])

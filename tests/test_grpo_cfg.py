"""``[optimizer] cfg_gradient``: which classifier-free-guidance branch the GRPO gradient flows through
(tpflow.guidance, docs/algorithm.md §6.2), against a float64 hand computation on tiny-sd3 with CFG.

The guided velocity is v = v_u + w·(v_c − v_u), both branches from one transformer call on [z; z]. On policy the
GRPO row loss max(−A·κ, −A·clip(κ)) has the gradient −A·∂ℓ/∂v; "both" maps it to the network output as
[(1 − w)·g ; w·g], "conditional" (v_u a constant) as [0 ; w·g]. Their difference is the unconditional half alone."""

from __future__ import annotations

import warnings

import pytest
import torch

import tpflow
from tpflow.errors import UserError
from tpflow.rollout import Window, rollout

PROMPTS = ["a photo of a red circle", "a photo of two squares", "a photo of a red circle", "a blue square"]
GUIDANCE = 4.5


@pytest.fixture(scope="module")
def setting():
    """tiny-sd3 with its transformer in float64, so the comparison measures the optimizer's formula, not float32's
    backward: what is left is the sampler's float32 ∂ℓ/∂v (about 1e-7; a float32 transformer adds up to 1e-6)."""
    torch.manual_seed(0)
    backbone = tpflow.build("backbone", "tiny-sd3", seed=0, resolution=16)
    with warnings.catch_warnings():  # diffusers' note on .to(dtype) for modules it keeps in float32: it has none
        warnings.simplefilter("ignore")
        backbone.transformer.to(torch.float64)
    backbone.dtype = torch.float64  # what the backbone casts latents and text embeddings to
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0: move every adapter tensor so both branches carry a gradient
        for p in backbone.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    sampler = tpflow.build("sampler", "flow-sde")
    z0 = backbone.initial_noise(len(PROMPTS), torch.Generator().manual_seed(2))
    batch = rollout(backbone, sampler, backbone.encode(PROMPTS), z0, backbone.sigmas(4), Window(1, 2), 1.0,
                    GUIDANCE, None, generator=torch.Generator().manual_seed(3))  # fmt: skip
    advantages = torch.tensor([[1.0, -0.5], [-1.2, 0.3], [0.4, 1.1], [-0.2, -0.9]])
    return backbone, sampler, batch, advantages


def optimizer_gradient(backbone, sampler, batch, advantages, mode: str, i: int) -> list[torch.Tensor]:
    """The gradient of window step i's summed row loss as the grpo optimizer computes it."""
    optimizer = tpflow.build("optimizer", "grpo", beta=0.0, cfg_gradient=mode, micro_batch_size=len(batch))
    optimizer.bind(backbone)
    params = backbone.trainable_parameters()
    for p in params:
        p.grad = None
    out = optimizer._step_loss(backbone, sampler, batch, advantages[:, i], i)
    assert out.rows.item() == len(batch) and out.sums["ratio_mean"].item() == len(batch)  # on policy: κ = 1
    out.total.backward()
    return [p.grad.detach().clone() for p in params]


def hand_gradients(backbone, batch, advantages, i: int) -> tuple[list[torch.Tensor], ...]:
    """(both, conditional, unconditional part) by hand: g = −A·∂ℓ/∂v in float64 from Flow-GRPO's SDE step
    (docs/algorithm.md §1.4), mapped to the transformer's [2N] output, then to the LoRA by its backward."""
    outputs = []
    handle = backbone.transformer.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    try:
        v = backbone.velocity(batch.latents[:, i], batch.sigmas[:, i], batch.cond, GUIDANCE)
    finally:
        handle.remove()
    (raw,) = outputs  # [2N, ...]: [unconditional; conditional] in the transformer's dtype
    z, z_next = batch.latents[:, i].double(), batch.next_latents[:, i].double()
    sigma, sigma_next = batch.sigmas[0, i].double(), batch.sigmas[0, i + 1].double()
    h, alpha, v64 = sigma - sigma_next, batch.noise_level, v.detach().double()
    eps = alpha * torch.sqrt(sigma / (1 - sigma))  # σ < 1 inside this window
    mean = z * (1 - eps**2 * h / (2 * sigma)) - v64 * (1 + eps**2 * (1 - sigma) / (2 * sigma)) * h
    std2 = eps**2 * h
    dmean_dv = -(1 + eps**2 * (1 - sigma) / (2 * sigma)) * h
    size = z[0].numel()
    dlogp_dv = (z_next - mean) / std2 * dmean_dv / size  # ℓ = mean_elems(−(z' − μ)²/(2s²)) + const
    a = advantages[:, i].double().reshape(-1, *([1] * (z.dim() - 1)))
    g = -a * dlogp_dv  # ∂(Σ_b row loss_b)/∂v on policy
    params = backbone.trainable_parameters()

    def mapped(uncond_weight: float, cond_weight: float) -> list[torch.Tensor]:
        grad_out = torch.cat([uncond_weight * g, cond_weight * g]).to(raw.dtype)
        return [x.detach() for x in torch.autograd.grad(raw, params, grad_outputs=grad_out, retain_graph=True)]

    return mapped(1 - GUIDANCE, GUIDANCE), mapped(0.0, GUIDANCE), mapped(1 - GUIDANCE, 0.0)


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads]).double()


@pytest.mark.parametrize("i", [0, 1])
def test_each_mode_equals_the_hand_computation_and_they_differ_by_the_unconditional_branch(setting, i):
    backbone, sampler, batch, advantages = setting
    both = flat(optimizer_gradient(backbone, sampler, batch, advantages, "both", i))
    conditional = flat(optimizer_gradient(backbone, sampler, batch, advantages, "conditional", i))
    hand_both, hand_conditional, hand_unconditional = (flat(g) for g in hand_gradients(backbone, batch, advantages, i))
    for got, want in ((both, hand_both), (conditional, hand_conditional)):
        assert want.norm() > 0
        # the sampler's float32 ∂ℓ/∂v is the floor: measured 2.0e-7 to 2.4e-7
        assert float((got - want).norm() / want.norm()) <= 1e-6
    difference = both - conditional
    assert float(hand_unconditional.norm()) > 0.1 * float(hand_both.norm())  # the branch carries a real share
    assert float((difference - hand_unconditional).norm() / hand_unconditional.norm()) <= 1e-6  # measured 1.7e-7


def test_the_forward_values_do_not_change(setting):
    """Holding v_u constant changes the gradient only: the velocity, hence the on-policy ratio, is bit for bit."""
    from tpflow.guidance import conditional_only

    backbone, _, batch, _ = setting
    args = (batch.latents[:, 0], batch.sigmas[:, 0], batch.cond, GUIDANCE)
    with torch.no_grad():
        plain = backbone.velocity(*args)
        with conditional_only() as combined:
            held = backbone.velocity(*args)
    assert combined[0] == 1 and torch.equal(plain, held)


def test_conditional_without_a_cfg_branch_is_refused(tmp_path, tiny_weights):
    """At guidance 1 there is no unconditional branch, nor in a guidance-distilled backbone (FLUX's embedding): both
    recipes are refused before anything loads (the combination matrix found the second accepted, then stopped at the
    first update), and a backbone no recipe check knows is still refused at the first update, each in one paragraph."""
    from tests.cli_run import tpflow as run
    from tests.test_train import tiny_recipe

    recipe = tiny_recipe(tmp_path, tiny_weights, reward="image-stat")
    result = run("validate", str(recipe), "--set", "optimizer.cfg_gradient=conditional", "--set", "rollout.guidance=1")
    assert result.returncode == 2 and "no unconditional branch" in result.stderr + result.stdout
    from tpflow.errors import RecipeError
    from tpflow.recipe import load_recipe

    with pytest.raises(RecipeError, match="guidance-distilled"):
        load_recipe(
            recipe,
            ['backbone={name = "tiny-flux", seed = 0, resolution = 16}', 'optimizer.cfg_gradient="conditional"'],
        )
    flux = tpflow.build("backbone", "tiny-flux", seed=0, resolution=16)
    sampler = tpflow.build("sampler", "flow-sde")
    z0 = flux.initial_noise(2, torch.Generator().manual_seed(0))
    batch = rollout(flux, sampler, flux.encode(PROMPTS[:2]), z0, flux.sigmas(3), Window(0, 1), 0.7, 3.5, None,
                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    optimizer = tpflow.build("optimizer", "grpo", cfg_gradient="conditional")
    optimizer.bind(flux)
    with pytest.raises(UserError, match="distilled"):
        optimizer._step_loss(flux, sampler, batch, torch.ones(2), 0)

"""The ``grpo`` optimizer's options (:class:`GRPOOptions`): the SD3.5-M paper settings of docs/algorithm.md §6.3 as
defaults, every field documented where a recipe's ``[optimizer]`` table is validated (``tpflow.optim.grpo``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GRPOOptions(BaseModel):
    """Options of the ``grpo`` optimizer; defaults are the SD3.5-M paper settings (docs/algorithm.md §6.3)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(
        3e-4, gt=0, description="AdamW learning rate, constant, no warm-up (docs/algorithm.md §6.3, SD3.5-M and FLUX)."
    )
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW (β1, β2), each in [0, 1) (docs/algorithm.md §6.3)."
    )
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay (docs/algorithm.md §6.3).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon (docs/algorithm.md §6.3).")
    clip_range: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="PPO ratio clip ε: the ratio is clipped to [1 − ε, 1 + ε]. 1e-5 in every published TP-GRPO "
        "config; upstream Flow-GRPO uses 1e-4 (docs/algorithm.md §6.2, §8 item 12).",
    )
    adv_clip_max: float = Field(
        5.0,
        gt=0,
        description="Advantages are clamped to ±adv_clip_max; never binds with G = 24 and per-prompt std "
        "(|A| ≤ √(G−1) ≈ 4.8) (docs/algorithm.md §5 item 7).",
    )
    beta: float = Field(
        1e-4,
        ge=0,
        description="KL weight β toward the adapter-disabled model. The reference config files say 0, its launch "
        "scripts set 1e-4 (used here); the paper's Fig. 4 uses 0 (docs/algorithm.md §6.3, §8 item 7).",
    )
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient-norm clip applied at each optimizer step (docs/algorithm.md §6.2)."
    )
    global_std: bool = Field(
        False,
        description="Normalise advantages by the std of the whole column instead of the prompt's std; the mean "
        "stays per prompt. False in TP-GRPO, True in upstream Flow-GRPO (docs/algorithm.md §5 item 2).",
    )
    advantage_std: Literal["population", "sample"] = Field(
        "population",
        description="The std that divides the advantages: 'population' (ddof 0: Flow-GRPO, TP-GRPO) or 'sample' "
        "(ddof 1, torch.std's default: DanceGRPO, docs/algorithm.md §10.1).",
    )
    advantage_eps: float = Field(
        1e-4,
        ge=0,
        description="Added to the std before dividing: 1e-4 in Flow-GRPO and TP-GRPO, 1e-8 in DanceGRPO.",
    )
    filter_zero_advantage: bool = Field(
        True,
        description="Skip trajectories whose advantages are 0 at every window step, as the reference does "
        "(docs/algorithm.md §5 item 6, §8 D6).",
    )
    gradient_accumulation_steps: int = Field(
        2,
        ge=1,
        description="Micro-batches per optimizer step; each micro-batch contributes one backward per window step, "
        "and a step's gradient is the mean over every trained (trajectory, window step) row of its micro-batches "
        "(the reference's Accelerate accumulation is this × W). SD3.5-M: 2, giving 2 optimizer steps per epoch "
        "(docs/algorithm.md §6.1, §6.3, §8 D10).",
    )
    micro_batch_size: int = Field(
        9,
        ge=1,
        description="Trajectories per micro-batch: the reference trains on its per-device sampling batch "
        "(B = 9 for SD3.5-M, 3 for FLUX.1-dev) (docs/algorithm.md §6.3).",
    )
    num_inner_epochs: int = Field(
        1, ge=1, description="Passes over each epoch's rollouts (docs/algorithm.md §6.1; 1 in every published config)."
    )
    ratio_norm: bool = Field(
        False,
        description="GRPO-Guard's RatioNorm: log r = s·(Δlog p + mean (μ_θ − μ_old)²/(2s²)), s the step's std "
        "(tpflow.optim.ratio_norm; needs a Gaussian sampler: flow-sde or dance-sde).",
    )
    ratio_norm_reweight: bool = Field(
        False,
        description="GRPO-Guard's gradient reweight: each step's policy loss divided by its Δσ = σ − σ⁺ "
        "(tpflow.optim.ratio_norm; GRPO-Guard uses it with RatioNorm, Flow-Factory does not).",
    )
    kl_std: Literal["sde", "transition"] = Field(
        "sde",
        description="The std the KL's squared mean difference is divided by (2·std²): 'sde', the sampler's noise "
        "scale σ^sde without √Δσ (Flow-GRPO, GRPO-Guard), or 'transition', the step's own std s = σ^sde·√Δσ "
        "(TempFlow-GRPO's per-step code: a KL 1/Δσ times larger at the same β; docs/algorithm.md §10.3).",
    )
    cfg_gradient: Literal["both", "conditional"] = Field(
        "both",
        description="Which CFG branch the policy gradient flows through: 'both', the guided velocity's exact "
        "gradient (every method's public code today), or 'conditional', the unconditional velocity a constant "
        "(flow_grpo's SD3 code of July-August 2025); the same forward values either way (tpflow.guidance, "
        "docs/algorithm.md §6.2).",
    )
    recompute: Literal["native", "retain", "reweight"] = Field(
        "native",
        description="How the update gets the policy's log-probabilities with gradients: 'native' recomputes each "
        "trained step's forward pass; 'retain' keeps the graphs of the rollout's own forward passes and "
        "back-propagates them at the first (on-policy) optimizer step of each update, later steps native "
        "(LeanGRPO's Retain; memory grows with the retained steps); 'reweight' back-propagates each step during "
        "the rollout into a gradient per trajectory (per trajectory and step for step credits) that the first step "
        "weighs by the advantages (LeanGRPO's Reweight; beta = 0 and no ratio_norm). Retain: the window, "
        "window-schedule and branch plans; reweight: every plan (docs/training.md).",
    )
    max_retained_steps: int | None = Field(
        None,
        ge=1,
        description="With recompute = 'retain' or 'reweight': take the first M window steps only from the rollout "
        "(the rest are recomputed natively), bounding the rollout's memory. None: every window step.",
    )
    retain_min_trained: float = Field(
        0.5,
        ge=0,
        le=1,
        description="With recompute = 'retain': the least share of the trajectories in the rollout batches the first "
        "optimizer step touches that it must train for their retained graphs to be used; below it the update "
        "recomputes natively, because the retained backward runs over every trajectory of those batches, trained or "
        "not (zero-advantage ones, those of later steps). 0: always use them.",
    )
    step_weight: Literal["uniform", "noise-aware"] = Field(
        "uniform",
        description="Weight of each step's policy loss: 'uniform' (Flow-GRPO, TP-GRPO), or 'noise-aware' "
        "(TempFlow-GRPO: w = c·std, c making the mean weight over a trajectory's trained steps 1; "
        "tpflow.optim.step_weights). The KL term is not weighted.",
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOOptions:
        beta1, beta2 = self.adam_betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(
                f"adam_betas must both lie in [0, 1), got {self.adam_betas}; the paper uses (0.9, 0.999)."
            )
        return self

"""The ``grpo`` optimizer's options (:class:`GRPOOptions`): the SD3.5-M paper settings of docs/algorithm.md §6.3 as
defaults, every field documented where a recipe's ``[optimizer]`` table is validated (``tpflow.optim.grpo``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tpflow.optim.options import BETA, CLIP_RANGE, RECOMPUTE, AccumulationSteps, AdamWOptions, MicroBatchSize


class GRPOOptions(AdamWOptions):
    """Options of the ``grpo`` optimizer; defaults are the SD3.5-M paper settings (docs/algorithm.md §6.3). The AdamW,
    batching and advantage-clip fields are ``tpflow.optim.options.AdamWOptions``' (the paper's batching below)."""

    micro_batch_size: MicroBatchSize = 9
    gradient_accumulation_steps: AccumulationSteps = 2
    clip_range: float = Field(1e-5, gt=0, lt=1, description=CLIP_RANGE)
    beta: float = Field(1e-4, ge=0, description=BETA)
    advantage_std: Literal["population", "sample", "none"] = Field(
        "population",
        description="The std that divides the advantages: 'population' (ddof 0: Flow-GRPO, TP-GRPO) or 'sample' "
        "(ddof 1, torch.std's default: DanceGRPO, docs/algorithm.md §10.1); 'none' divides by nothing, the "
        "advantage is the reward minus its group's mean (GARDO's, with the diversity-shaped reward: §10.9).",
    )
    advantage_eps: float = Field(
        1e-4,
        ge=0,
        description="Added to the std before dividing: 1e-4 in Flow-GRPO and TP-GRPO, 1e-8 in DanceGRPO.",
    )
    advantage_fusion: Literal["none", "running-reward"] = Field(
        "none",
        description="AdaGRPO's cross-level advantage fusion: 'running-reward' adds to each advantage a global one, "
        "the reward's z against the running mean and variance of the policy's ODE rewards, its positive and negative "
        "parts in each group normalised by their sums, clamped to adv_clip_max (tpflow.optim.advantage_fusion; needs "
        "[train] prompt_policy = 'ability-matched', which keeps those values; docs/algorithm.md §10.10).",
    )
    filter_zero_advantage: bool = Field(
        True,
        description="Skip trajectories whose advantages are 0 at every window step, as the reference does "
        "(docs/algorithm.md §5 item 6, §8 D6).",
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
    recompute: Literal["native", "retain", "reweight"] = Field("native", description=RECOMPUTE)
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
    adaptive_reference: bool = Field(
        False,
        description="GARDO's adaptive reference: the KL's reference is a held copy of the adapter, reset to the "
        "policy when a step's mean KL exceeded reference_reset_kl or after reference_reset_every updates, instead "
        "of the adapter-disabled model (tpflow.optim.adaptive_reference; needs a KL weight > 0, grpo's beta or nft's "
        "kl_weight; docs/algorithm.md §10.9).",
    )
    reference_reset_every: int = Field(
        15,
        ge=1,
        description="With adaptive_reference: reset the copy when more than this many updates (epochs) passed since "
        "the last reset (GARDO's reset_freq, 15).",
    )
    reference_reset_kl: float = Field(
        3e-4,
        gt=0,
        description="With adaptive_reference: reset the copy before the next update when an optimizer step's mean KL "
        "over its rows exceeded this (GARDO's kl_thres: 3e-4 for OCR, set per task).",
    )
    kl_gate: bool = Field(
        False,
        description="GARDO's gated KL: the KL term only for the samples whose main reward ranks them lowest against "
        "the auxiliary rewards (a fraction φ of those with u ≥ 0, φ moved by a controller), each gated row's KL "
        "weighted by 1/(the epoch's gated fraction) (nft: see kl_gate_batch) (tpflow.optim.kl_gate; needs a KL "
        "weight > 0, grpo's beta or nft's kl_weight; docs/algorithm.md §10.9).",
    )
    kl_gate_main: str | None = Field(
        None,
        description="With kl_gate: the reward details key of the main (trained) reward, e.g. a weighted reward's "
        "part label such as 'ocr' (GARDO's main_reward).",
    )
    kl_gate_aux: list[str] = Field(
        default_factory=list,
        description="With kl_gate: the reward details keys of the auxiliary rewards the main one is ranked against "
        "(GARDO's OCR config: aesthetic and imagereward; a weighted part at weight 0 is ranked, not trained on).",
    )
    kl_gate_fraction: float = Field(
        0.1, gt=0, le=1, description="With kl_gate: φ at the first update (GARDO's RiskCompensator base, 0.1)."
    )
    kl_gate_min: float = Field(0.02, gt=0, le=1, description="With kl_gate: the least φ (GARDO: 0.02).")
    kl_gate_max: float = Field(0.2, gt=0, le=1, description="With kl_gate: the largest φ (GARDO: 0.2).")
    kl_gate_history: int = Field(
        20,
        ge=1,
        description="With kl_gate: how many updates' mean u the controller compares with (GARDO's window, 20).",
    )
    replay_weight: Literal["geometric", "product"] = Field(
        "geometric",
        description="Rows replayed from earlier epochs ([replay] capacity > 0): the sequence-level importance "
        "weight w of the shift from the policy that sampled a trajectory to the one the update starts from, over its "
        "kept steps: 'geometric' exp(mean of the per-step log-ratios), 'product' exp(their sum) (each log-prob a mean "
        "over latent elements). Detached, it multiplies the row's advantages; the clipped ratio is taken against the "
        "update's starting policy, recomputed for the row (tpflow.optim.replay_weights, docs/algorithm.md §10.12).",
    )
    replay_weight_max: float = Field(
        2.0,
        gt=0,
        description="Replayed rows: the importance weight w is clipped to [0, this] (truncated importance sampling).",
    )
    replay_min_sigma: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Replayed rows: train (and weigh) only their window steps that start at a noise level σ at or "
        "above this; the late, low-noise steps, whose off-policy ratios are ill-conditioned, are dropped. 0: every "
        "stored step.",
    )

"""The option fields several optimizers share, each declared and described once.

:class:`AdamWOptions` holds what every optimizer built on the update loop (``tpflow.optim.loop``) reads: AdamW, the
gradient clip, the batching, the advantage clip and its std scope. :class:`FinalSampleOptions` adds what the methods
that train final samples (``nft``, ``awm``, ``dgpo``; ``tpflow.optim.final``) read: the KL weight, the schedule the
training times come from, the lagged copy's decay, the seed of the draws. An optimizer's options subclass one of them
and declare only their own fields; where a shared field's default differs (a method's public config), they redeclare
it with its type alias below, which carries the limits and the description, so the name is still described once.

A few names mean a method's own knob in two models (``beta``: GRPO's KL weight, NFT's implicit-policy step;
``clip_range``; ``train_guidance``; ``train_timesteps``; ``recompute``; ``old_decay_unit``): their descriptions are
the constants below, one text per name that says what it is in each method (tests/test_option_descriptions.py holds it:
no two option models describe one name two ways).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SEED_LIMIT = 2**62  # the base seed of a final-sample optimizer's draws is below this

MicroBatchSize = Annotated[int, Field(
    ge=1,
    description="Rows per forward/backward pass: trajectories for grpo (the reference trains on its per-device "
    "sampling batch, B = 9 for SD3.5-M and 3 for FLUX.1-dev: docs/algorithm.md §6.3), final samples for nft, awm and "
    "dgpo (their public configs: 8, 3 and 16).",
)]  # fmt: skip
AccumulationSteps = Annotated[int, Field(
    ge=1,
    description="Micro-batches per optimizer step; a step's gradient is the mean over every trained row of its "
    "micro-batches on every process (a (trajectory, window step) for grpo, a (sample, time t) for the others: "
    "docs/algorithm.md §8 D10). grpo's SD3.5-M setting 2 gives 2 optimizer steps per epoch (the reference's "
    "Accelerate accumulation is this × W); the awm and dgpo code takes one step per epoch: set micro_batch_size × "
    "this ≥ the samples of a process's epoch to match it.",
)]  # fmt: skip
GlobalStd = Annotated[bool, Field(
    description="Normalise the rewards by the std of the whole epoch (column) instead of the prompt's; the mean "
    "stays per prompt. False in TP-GRPO and DGPO's GenEval config; True in upstream Flow-GRPO, DiffusionNFT, AWM and "
    "DGPO's OCR and PickScore configs (docs/algorithm.md §5 item 2).",
)]  # fmt: skip
KLWeight = Annotated[float, Field(
    ge=0,
    description="Weight of the KL term mean((v_θ − v_ref)²) to the adapter-disabled model; 0 skips the reference "
    "pass (dgpo still runs it for L_ref unless use_ema_ref). Public configs: nft 1e-4; awm 1e-3 GenEval, 3e-3 OCR, "
    "1e-4 PickScore; dgpo 0.02 GenEval. grpo's KL weight is its beta.",
)]  # fmt: skip
NumTimesteps = Annotated[int, Field(
    ge=1,
    le=1000,
    description="K of the K-step schedule σ_0..σ_{K-1} the training times are read from (the backbone's own, or "
    "dgpo's time_grid): the public nft and dgpo code trains at its K = 10 sampling timesteps, awm's at 14.",
)]  # fmt: skip
OldDecayMax = Annotated[float, Field(
    ge=0,
    lt=1,
    description="Cap of the lagged copy's decay η: θ_old ← η·θ_old + (1 − η)·θ (nft's GenEval config: 0.5; the awm "
    "and dgpo code: 0.3).",
)]  # fmt: skip
DecayUnit = Annotated[Literal["epoch", "step"], Field(
    description="What n of the lagged copy's decay min(rate·(n − flat), max) counts: 'epoch', the updates so far, "
    "what the public awm and dgpo code does in effect (it counts optimizer steps and takes one per epoch); 'step', "
    "the optimizer steps so far, what tpflow counted before this option (docs/results.md §2.8: 8 steps an epoch). "
    "awm moves its copy once per update either way; dgpo moves it once per update ('epoch') or after every optimizer "
    "step ('step'), and n also times its switch_ema_ref.",
)]  # fmt: skip

BETA = (
    "grpo: the KL weight β toward the adapter-disabled model (the reference config files say 0, its launch scripts "
    "set 1e-4, used here; the paper's Fig. 4 uses 0: docs/algorithm.md §6.3, §8 item 7). nft: how far the implicit "
    "policies v± = v_old ± β·(v_θ − v_old) move with v_θ, also scaling the loss by 1/β (1 in the public GenEval and "
    "PickScore configs, 0.1 for OCR: arXiv 2509.16117, §4)."
)
CLIP_RANGE = (
    "ε of the likelihood-ratio clip. grpo: the PPO ratio is clipped to [1 − ε, 1 + ε] (1e-5 in every published "
    "TP-GRPO config, upstream Flow-GRPO 1e-4: docs/algorithm.md §6.2, §8 item 12). awm: the clip of its ratio, inert "
    "on policy (the code: 1). dgpo: the trust region on exp(L_old − L_θ) (GenEval 1e-2)."
)
TRAIN_GUIDANCE = (
    "CFG of the loss's velocities. awm: v_θ, the KL-EMA copy's and the reference's; the code's train.cfg = False, in "
    "every public config, is 1 (the conditional prediction; the shipped recipes set it), None trains at the "
    "rollout's guidance, as train.cfg = True would and as tpflow did before this option (docs/results.md §2.8's AWM "
    "arm, at CFG 3). dgpo: v_θ and v_old (the code: 1)."
)
TRAIN_TIMESTEPS = (
    "Training times per sample and pass. awm: T stratified times, each sample its own (the code: 6). dgpo: M "
    "distinct times shared by every row of the pass (GenEval: 4)."
)
RECOMPUTE = (
    "How the update gets the policy's log-probabilities with gradients. grpo: 'native' recomputes each trained "
    "step's forward pass; 'retain' keeps the graphs of the rollout's own forward passes and back-propagates them at "
    "the first (on-policy) optimizer step of each update, later steps native (LeanGRPO's Retain; memory grows with "
    "the retained steps); 'reweight' back-propagates each step during the rollout into a gradient per trajectory "
    "(per trajectory and step for step credits) that the first step weighs by the advantages (LeanGRPO's Reweight; "
    "beta = 0 and no ratio_norm). Retain: the window, window-schedule and branch plans; reweight: every plan "
    "(docs/training.md). nft, awm, dgpo: only 'native': they train final samples at times t and noise they draw "
    "afresh, which no rollout forward computed, so the rollout has nothing their update could reuse."
)


class AdamWOptions(BaseModel):
    """The fields of AdamW, the gradient clip, the batching and the advantages that the update loop
    (``tpflow.optim.loop``) and every built-in optimizer read. Defaults: the SD3.5-M settings of the public code of
    each method (docs/algorithm.md §6.3)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(
        3e-4, gt=0, description="AdamW learning rate, constant, no warm-up (3e-4 in every method's public SD3.5-M "
        "and FLUX configs: docs/algorithm.md §6.3)."
    )  # fmt: skip
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (β1, β2), each in [0, 1).")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip at each optimizer step.")
    micro_batch_size: MicroBatchSize = 8
    gradient_accumulation_steps: AccumulationSteps = 1
    num_inner_epochs: int = Field(
        1, ge=1, description="Passes over each epoch's rollouts per update (1 in every published config)."
    )
    adv_clip_max: float = Field(
        5.0,
        gt=0,
        description="Advantages are clipped to ±adv_clip_max (every method's code: 5; for grpo it never binds with "
        "G = 24 and per-prompt std, |A| ≤ √(G−1) ≈ 4.8: docs/algorithm.md §5 item 7). nft also maps them to "
        "r = A / adv_clip_max / 2 + 1/2 in [0, 1] and scales its loss by it; awm rescales them to A / adv_clip_max.",
    )
    global_std: GlobalStd = False

    @model_validator(mode="after")
    def _betas(self) -> AdamWOptions:
        beta1, beta2 = self.adam_betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(
                f"adam_betas must both lie in [0, 1), got {self.adam_betas}; the paper uses (0.9, 0.999)."
            )
        return self


class FinalSampleOptions(AdamWOptions):
    """What the methods that train final samples (``tpflow.optim.final``) share beyond :class:`AdamWOptions`: the
    KL, the schedule of the training times, the lagged copy of the adapter and its decay, the seed of the draws."""

    global_std: GlobalStd = True
    kl_weight: KLWeight = 1e-4
    num_timesteps: NumTimesteps = 10
    old_decay_flat: int = Field(
        0, ge=0, description="n before the lagged copy starts to lag (its decay is 0 until then): optimizer steps for "
        "nft, what old_decay_unit says for awm and dgpo."
    )  # fmt: skip
    old_decay_rate: float = Field(
        1e-3, ge=0, description="Growth of the lagged copy's decay per unit of n after old_decay_flat."
    )
    old_decay_max: OldDecayMax = 0.5
    seed: int | None = Field(
        None,
        ge=0,
        lt=SEED_LIMIT,
        description="Seed of the update's draws (the sample order, the times t, the noise ε); None derives it from "
        "the run's seed. Saved in checkpoints, so a resumed run draws what the uninterrupted one would.",
    )
    recompute: str = Field("native", description=RECOMPUTE)

    @model_validator(mode="after")
    def _native(self) -> FinalSampleOptions:
        if self.recompute != "native":
            method = type(self).__name__.removesuffix("Options")  # NFT, AWM, DGPO
            raise ValueError(
                f'recompute = "{self.recompute}" reuses the rollout\'s forward passes of the stored SDE steps in the '
                f"update, and {method} has none to reuse: it trains on final samples, stores no transitions, and "
                "trains the samples at times t and noise it draws afresh, which no rollout forward computed. Drop "
                'recompute (or use [optimizer] name = "grpo" with recompute = "retain").'
            )
        return self

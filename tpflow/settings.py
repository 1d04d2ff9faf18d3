"""Options of the recipe sections that are not components: ``[rollout]``, ``[train]``, ``[eval]`` and ``[log]``.

Defaults are the SD3.5-Medium paper setting (docs/algorithm.md §2, §6.3) unless a field says otherwise; shipped recipes
override them per model.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tpflow.diversity_specs import diversity_problem
from tpflow.replay_settings import ReplaySettings

# Upper bounds of the counts: far above any real run (the paper's epoch is 48 prompts x 24 images; K = 10 steps), low
# enough that a typo (an extra three zeros) fails at validation instead of hanging the epoch planner or the sampler.
MAX_STEPS = 1000  # sampling steps K (and eval steps): a flow model's whole schedule is 1000 timesteps
MAX_COUNT = 1_000_000  # epochs, prompts, batch sizes
MAX_TRAJECTORIES_PER_EPOCH = 1_000_000  # prompts_per_epoch x group_size: days of sampling even on 64 GPUs
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes up to 2**64 - 1; tpflow adds offsets (eval: seed + 12345)


class RolloutSettings(BaseModel):
    """How trajectories are sampled during training (docs/algorithm.md §2-§3; docs/architecture.md, "Rollout
    engine")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_steps: int = Field(
        10, ge=1, le=MAX_STEPS, description="K, sampling steps per rollout (paper: 10 for SD3.5-M, 6 for FLUX)."
    )
    window_size: int = Field(
        9, ge=1, le=MAX_STEPS, description="W, SDE window steps, all of them trained (paper: 9 for SD3.5-M)."
    )
    window_range: tuple[int, int] = Field(
        (0, 9),
        description="(lo, hi): the window start s is drawn uniformly from lo..hi-W per rollout batch "
        "(docs/algorithm.md §2); (0, W) fixes s = 0 as in the published runs.",
    )
    noise_level: float = Field(0.7, ge=0.0, description="α inside the window (paper default 0.7); 0 gives the ODE.")
    guidance: float = Field(4.5, ge=0.0, description="CFG scale (SD3.5-M: 4.5) or distilled guidance (FLUX: 3.5).")
    completions: Literal["ode", "x0"] = Field(
        "ode",
        description="How R_j is measured: 'ode' completes by Euler ODE (exact, the paper); 'x0' uses the one-step "
        "estimate z - σ·v (no extra NFE; experimental).",
    )
    completion_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | Literal["all"] = Field(
        "all",
        description="Euler steps of each ODE completion (completions = 'ode'): 'all' takes one per remaining step "
        "(exact, the paper); k integrates the rest of the schedule in k steps on evenly spread nodes of it (fewer "
        "NFE, approximate; 1 equals 'x0'). benchmarks/completion_fidelity.py measures what each k keeps.",
    )
    baseline_noise: Literal["shared", "independent"] = Field(
        "shared",
        description="R_0 from the same z_0 as the trajectory ('shared', the paper) or from fresh noise "
        "('independent', the reference code; docs/algorithm.md §3.2).",
    )
    same_noise: bool = Field(False, description="All G copies of a prompt start from the same z_0.")
    max_batch: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Largest number of rows in one velocity call (None: no limit); lower it on OOM.",
    )

    @model_validator(mode="after")
    def _window_fits(self) -> RolloutSettings:
        if self.completions == "x0" and self.completion_steps != "all":
            raise ValueError(
                f"completion_steps = {self.completion_steps} applies to completions = 'ode'; 'x0' is the one-step "
                "estimate already. Use completions = 'ode' with completion_steps = k, or drop completion_steps."
            )
        lo, hi = self.window_range
        if self.window_size > self.num_steps:
            raise ValueError(
                f"window_size={self.window_size} exceeds "
                f"num_steps={self.num_steps}: the window is a part of the K steps."
            )
        if not (0 <= lo <= hi - self.window_size and hi <= self.num_steps):
            raise ValueError(
                f"window_range={list(self.window_range)} cannot hold a window of {self.window_size} steps within "
                f"{self.num_steps} steps: need 0 <= lo <= hi - window_size and hi <= num_steps, "
                f"e.g. window_range = [0, {self.window_size}]."
            )
        return self


class TrainSettings(BaseModel):
    """The epoch structure, run directory and bookkeeping (docs/algorithm.md §6.1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seed of prompts, noise and window draws (0 .. 2**63 - 1).")
    epochs: int = Field(
        100, ge=1, le=MAX_COUNT, description="Number of epochs to run (each: sample, score, credit, update)."
    )
    prompts_per_epoch: int = Field(
        48, ge=1, le=MAX_COUNT, description="Distinct prompts drawn per epoch (paper: 48 on 32 GPUs)."
    )
    group_size: int = Field(24, ge=1, le=MAX_COUNT, description="G, images per prompt (paper: 24).")
    prompts_per_round: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Prompts drawn per sampling round; their G copies are shuffled and cut into the round's rollout "
        "batches, which are dealt to the processes (the reference's DistributedKRepeatSampler: 12 = 32 GPUs x 9 / "
        "24). None: one round per epoch. Must divide prompts_per_epoch (docs/distributed.md).",
    )
    prompt_policy: Literal["uniform", "skip-solved", "ability-matched"] = Field(
        "uniform",
        description="Which training prompts an epoch may draw (tpflow.train.prompt_policy). 'uniform': any, "
        "uniformly. 'skip-solved': a prompt whose group's final rewards were all equal in an epoch (all solved or all "
        "failed: zero advantage, nothing to learn) is not drawn for prompt_skip_epochs epochs; a round that has too "
        "few other prompts left draws skipped ones back. 'ability-matched' (AdaGRPO's curriculum): each prompt of an "
        "epoch is the one of prompt_candidates candidates whose ODE sample's reward is closest to the running mean "
        "reward, the candidates sampled and scored first (tpflow.train.curriculum; docs/training.md).",
    )
    prompt_candidates: int = Field(
        10,
        ge=2,
        le=MAX_COUNT,
        description="With prompt_policy 'ability-matched': K, the candidates drawn for each prompt an epoch needs, "
        "each sampled once by ODE and scored (AdaGRPO's batch_size, 10): K ODE samples per prompt trained.",
    )
    prompt_ema_alpha: float = Field(
        0.8,
        ge=0.0,
        lt=1.0,
        description="With prompt_policy 'ability-matched': α of the running reward mean and variance, "
        "μ <- α·μ + (1 − α)·(the epoch's anchor mean), v likewise with their variance; the first epoch takes its own "
        "(AdaGRPO's ema_alpha, 0.8).",
    )
    prompt_skip_epochs: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="With prompt_policy 'skip-solved': how many epochs a prompt whose group had zero reward variance "
        "is not drawn (0: never again).",
    )
    rollout_batch: int = Field(
        9,
        ge=1,
        le=MAX_COUNT,
        description="Trajectories per rollout batch; turning-point balancing works within one (paper: 9 for SD3).",
    )
    score_batch: int = Field(
        16,
        ge=1,
        le=MAX_COUNT,
        description="Images decoded and scored per VAE / reward call: a rollout batch's n·(W+1) final and completion "
        "latents are split into chunks of this. The VAE decode at 512 px takes about 0.75 GiB per image in fp32 "
        "(docs/results/memory_estimate.md); lower it on OOM, raise it for speed.",
    )
    run_dir: str = Field("runs/{recipe}", description="Output directory; {recipe} is the recipe file's stem.")
    save_every: int = Field(
        20, ge=0, le=MAX_COUNT, description="Write a checkpoint every this many epochs (0: only at the end)."
    )
    keep_checkpoints: int = Field(
        3,
        ge=0,
        le=MAX_COUNT,
        description="How many of the newest checkpoints to keep in run_dir/checkpoints; older ones are deleted when a "
        "new one is written (0: keep every checkpoint). `tpflow eval RUN --checkpoint STEP` needs STEP kept.",
    )
    ema: bool = Field(True, description="Keep an EMA of the adapter for evaluation and export (paper: on).")
    ema_decay: float = Field(0.9, gt=0.0, lt=1.0, description="EMA decay cap (paper: 0.9).")
    ema_every: int = Field(8, ge=1, le=MAX_COUNT, description="EMA update interval in optimizer steps (paper: 8).")
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        "no", description="Accelerate mixed precision (paper: fp16 for SD3.5-M, bf16 for FLUX)."
    )
    shard: Literal["none", "fsdp"] = Field(
        "none",
        description="'fsdp': shard the trained transformer over the processes with PyTorch's FSDP2 (fully_shard per "
        "block; weights, gradients and AdamW moments 1/P each), for models whose training state does not fit one "
        "GPU; 'none': every process holds it whole (docs/distributed.md).",
    )
    checkpoint_layout: Literal["sharded", "gathered"] = Field(
        "sharded",
        description="How a sharded run (shard = 'fsdp', more than one process) writes checkpoints. 'sharded': every "
        "process writes its own shards (torch.distributed.checkpoint, safetensors files); nothing is gathered, and "
        "the checkpoint resumes on any number of processes, sharded or not. 'gathered': the main process gathers the "
        "whole state into its host memory and writes the unsharded format (an adapter folder, as unsharded runs "
        "write). Unsharded runs always write the unsharded format.",
    )
    reward_timeout_s: float = Field(
        600.0,
        ge=0.0,
        description="Longest one reward call (score_batch images in training, eval.batch_size at evaluation) may run, "
        "in seconds; a call still running then stops the run with an error instead of hanging it (0: no limit). "
        'Generous by default: a first call may load the reward\'s model (docs/rewards.md, "When a reward fails").',
    )
    reward_retries: int = Field(
        1,
        ge=0,
        description="Repeats of a reward call on the same images when it raises or returns non-finite scores, before "
        "the run stops (training, evaluation, tpflow eval, inspect-trajectory alike).",
    )
    quantise_reward_images: bool = Field(
        False,
        description="Give every reward call the images on the 8-bit grid, round(x·255)/255, as the remote reward's "
        "PNG transport does: in-process and remote scores are then equal for every reward. Off (the shipped runs' "
        "numbers), a reward that reads the floats itself (shapes-geneval, image-stat, most plugins) scores the "
        "decoded floats in-process and the 8-bit image remotely, which differ by up to half a grey level per pixel.",
    )

    @field_validator("run_dir")
    @classmethod
    def _run_dir_template(cls, value: str) -> str:
        try:
            value.format(recipe="recipe")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"not a valid template ({type(exc).__name__}: {exc}): its only field is {{recipe}}, the recipe file's "
                "stem; write other braces as {{ and }}"
            ) from None
        return value

    def _policy_fits(self) -> None:
        """prompt_skip_epochs belongs to 'skip-solved', prompt_candidates and prompt_ema_alpha to 'ability-matched';
        a group of one copy has zero variance always."""
        curriculum = sorted({"prompt_candidates", "prompt_ema_alpha"} & self.model_fields_set)
        if self.prompt_policy != "ability-matched" and curriculum:
            raise ValueError(
                f"{' and '.join(curriculum)} apply only to prompt_policy = 'ability-matched', and prompt_policy is "
                f"{self.prompt_policy!r}; set prompt_policy = 'ability-matched' or drop them."
            )
        if self.prompt_policy != "skip-solved" and self.prompt_skip_epochs:
            raise ValueError(
                f"prompt_skip_epochs={self.prompt_skip_epochs} applies only to prompt_policy = 'skip-solved', and "
                f"prompt_policy is {self.prompt_policy!r} (it sets no prompt aside); set prompt_policy = "
                "'skip-solved' or drop prompt_skip_epochs."
            )
        if self.prompt_policy == "skip-solved" and self.group_size < 2:
            raise ValueError(
                "prompt_policy = 'skip-solved' with group_size = 1 would skip every prompt it draws: a group of one "
                "copy has zero reward variance whatever its reward. Raise group_size or use prompt_policy = "
                "'uniform'."
            )

    @model_validator(mode="after")
    def _rounds_fit(self) -> TrainSettings:
        trajectories = self.prompts_per_epoch * self.group_size
        if trajectories > MAX_TRAJECTORIES_PER_EPOCH:
            raise ValueError(
                f"prompts_per_epoch x group_size = {self.prompts_per_epoch} x {self.group_size} = {trajectories:,} "
                f"trajectories per epoch is more than {MAX_TRAJECTORIES_PER_EPOCH:,} (the paper samples 48 x 24 = "
                "1,152); lower prompts_per_epoch or group_size."
            )
        self._policy_fits()
        m = self.prompts_per_round
        if m is not None and self.prompts_per_epoch % m:
            raise ValueError(
                f"prompts_per_round={m} must divide prompts_per_epoch={self.prompts_per_epoch}: an epoch is a whole "
                "number of sampling rounds."
            )
        if m is not None and m < self.prompts_per_epoch and (m * self.group_size) % self.rollout_batch:
            raise ValueError(
                f"a sampling round of prompts_per_round x group_size = {m} x {self.group_size} trajectories must "
                f"split into whole rollout batches of rollout_batch={self.rollout_batch}; pick sizes where "
                "rollout_batch divides prompts_per_round x group_size."
            )
        return self


class WatchedReward(BaseModel):
    """A reward the evaluation scores its images with beside the trained one, which training never optimises."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Registered reward name, e.g. 'aesthetic'.")
    options: dict = Field(default_factory=dict, description="The reward's own options.")
    label: str | None = Field(None, description="Its name in the metrics, eval_watch_<label> (default: its name).")

    @property
    def key(self) -> str:
        return self.label or self.name


class EvalSettings(BaseModel):
    """Periodic evaluation by ODE sampling on held-out prompts (docs/algorithm.md §6.3)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    every: int = Field(
        20, ge=0, le=MAX_COUNT, description="Evaluate every this many epochs, epoch 0 included (0: never)."
    )
    at_start: bool = Field(
        True,
        description="Evaluate at epoch 0 (the base model). A sweep whose runs share one base model and eval.seed "
        "may evaluate it once and turn this off in every run.",
    )
    num_steps: int = Field(
        40, ge=1, le=MAX_STEPS, description="ODE steps at evaluation (paper: 40 for SD3.5-M, 28 for FLUX)."
    )
    guidance: float = Field(4.5, ge=0.0, description="Guidance at evaluation (paper: as in training).")
    solver: Literal["euler", "dpm-solver++"] = Field(
        "euler",
        description="The evaluation's ODE solver: Euler steps on the backbone's schedule, or DPM-Solver++(2M) (as "
        "the dpm-solver rollout plan samples; DGPO's code evaluates with it) on the grid below.",
    )
    grid: Literal["schedule", "flow-sigmas"] = Field(
        "schedule", description="Nodes of solver = 'dpm-solver++': the backbone's schedule or diffusers' flow sigmas."
    )
    flow_shift: float = Field(3.0, gt=0, le=100, description="Shift of grid = 'flow-sigmas' (DGPO: 3).")
    num_prompts: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Test prompts to use (None: the whole test split)."
    )
    batch_size: int = Field(
        16, ge=1, le=MAX_COUNT, description="Images per evaluation batch (paper: 16, 14 for GenEval)."
    )
    images_per_prompt: int = Field(
        1,
        ge=1,
        le=MAX_COUNT,
        description="Images per eval prompt, each from its own fixed noise (GenEval: 4); `tpflow eval`'s default too.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="Noise seed of the evaluation images. None: train.seed + 12345 (each training seed its own eval "
        "noise); set it to evaluate every run, whatever its seed, on the same images' noise (a fixed eval set).",
    )
    nonfinite_rewards: Literal["stop", "warn"] = Field(
        "stop",
        description="Non-finite (NaN, inf) evaluation scores: 'stop' retries the call (train.reward_retries) then "
        "stops, as training always does; 'warn' keeps them, with one warning naming how many images (they are null "
        "in metrics.jsonl and eval.json).",
    )
    rewards: list[WatchedReward] = Field(
        default_factory=list,
        description="Rewards the run does not train on, scored on the same evaluation images (eval_watch_<label>): "
        "a guard against reward hacking. A run warns when its trained reward rose since the first evaluation while "
        "a watched one fell, each beyond twice its standard error (docs/rewards.md, 'Watching for reward hacking').",
    )
    diversity: str | None = Field(
        None,
        description="Diversity within groups, eval_diversity: the mean pairwise 1 - cos of the embeddings of each "
        "prompt's images_per_prompt (>= 2) images, by 'shapes-clip', 'clip:<arch>[:<pretrained>]' or 'pixels'.",
    )

    @model_validator(mode="after")
    def _grid_needs_a_solver(self) -> EvalSettings:
        """A grid only a DPM-Solver reads: refuse it with Euler steps rather than ignore it."""
        if self.solver == "euler" and self.grid != "schedule":
            raise ValueError(
                f'eval.grid = "{self.grid}" is read only by eval.solver = "dpm-solver++"; Euler steps run on the '
                'backbone\'s schedule. Set solver = "dpm-solver++" or drop grid.'
            )
        return self

    @model_validator(mode="after")
    def _diversity_needs_groups(self) -> EvalSettings:
        """A group of one image has no diversity: refuse the recipe rather than log a meaningless number."""
        if self.diversity is None:
            return self
        problem = diversity_problem(self.diversity)
        if problem is not None:
            raise ValueError(problem)
        if self.images_per_prompt < 2:
            raise ValueError(
                f"eval.diversity = {self.diversity!r} measures how a prompt's images differ from each other: set "
                "eval.images_per_prompt to 2 or more (4: GenEval's), or leave eval.diversity out."
            )
        return self


TRACKER_PACKAGES = {"tensorboard": "pip install tensorboard", "wandb": "pip install 'tpflow[wandb]'"}


class LogSettings(BaseModel):
    """Where a run's figures go besides ``metrics.jsonl`` / ``traces.jsonl``, which are always written.

    Trackers go through accelerate's tracker API (``Accelerator(log_with=...)``): epoch scalars, the evaluation
    sample grids, the turning-point statistics and the resolved recipe as the run's config. W&B runs without an
    account with ``WANDB_MODE=offline`` (the run lands in ``run_dir/wandb``; ``wandb sync`` uploads it later)."""

    model_config = ConfigDict(extra="forbid")

    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers: 'tensorboard' (run_dir/tensorboard) and/or 'wandb'; [] for JSONL only.",
    )
    project: str = Field("tpflow", min_length=1, description="Tracker project (W&B project, TensorBoard subfolder).")
    run_name: str | None = Field(None, description="Tracker run name (default: the run dir's name).")
    images: bool = Field(True, description="Send the evaluation sample grids to the trackers.")
    progress_lines_s: float = Field(
        30.0,
        ge=0.0,
        description="Without a terminal (nohup, a SLURM log, a pipe), print the current phase ('epoch 3: sampling "
        "5/12, 41 s') every this many seconds; 0 prints none. On a terminal a progress bar shows it instead.",
    )

    @field_validator("trackers")
    @classmethod
    def _installed(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError(f"trackers {trackers} names a tracker twice.")
        missing = [t for t in trackers if importlib.util.find_spec(t) is None]
        if missing:
            how = "; ".join(f"{t}: {TRACKER_PACKAGES[t]}" for t in missing)
            raise ValueError(
                f"tracker(s) {missing} are named but not installed ({how}), or drop them from [log] trackers."
            )
        return trackers


SETTINGS: dict[str, type[BaseModel]] = {
    "rollout": RolloutSettings,
    "train": TrainSettings,
    "eval": EvalSettings,
    "log": LogSettings,
    "replay": ReplaySettings,  # trajectories replayed in later epochs (tpflow.replay_settings)
}


def shard_problems(sections: dict[str, Any]) -> list[str]:
    """One sentence per part of a recipe that ``[train] shard = "fsdp"`` cannot run in lockstep (checked before
    anything loads, by ``tpflow.recipe``)."""
    if sections["train"].shard != "fsdp":
        return []
    problems = []
    optimizer = getattr(sections.get("optimizer"), "options", None)
    recompute = getattr(optimizer, "recompute", "native")
    if recompute != "native":
        problems.append(
            f'[train] shard = "fsdp" runs every forward pass in step on every process, and [optimizer] recompute = '
            f'"{recompute}" runs the update\'s first step inside the rollout, whose gradients FSDP would reduce while '
            'the processes sample. Use recompute = "native" with sharding.'
        )
    backbone = getattr(sections.get("backbone"), "options", None)
    if getattr(backbone, "compile_blocks", False):
        problems.append(
            '[train] shard = "fsdp" with [backbone] compile_blocks = true: compiling FSDP-sharded blocks is not '
            "supported here yet. Drop compile_blocks."
        )
    return problems

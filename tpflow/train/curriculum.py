"""The ``ability-matched`` prompt policy: each prompt an epoch trains is chosen by what the policy can do now.

AdaGRPO's online curriculum (Bu et al., arXiv 2606.06828; code Bujiazi/GRPO-Series at d0ddaa4,
``sample_evaluate_and_select_ema`` in ``src/method_adagrpo.py``; docs/algorithm.md §10.10): for each prompt the epoch
needs, K candidate prompts (``[train] prompt_candidates``) are drawn and each is sampled once by ODE with the current
weights (its *anchor*) and scored with the run's reward; the anchors' rewards move the running mean and variance

    μ ← α·μ + (1 − α)·mean(r),    v ← α·v + (1 − α)·var(r)      (var with ddof 0; the first epoch: μ, v = mean, var)

(α = ``prompt_ema_alpha``), and of each K candidates the one whose anchor reward is closest to μ (the first on a tie,
as ``np.argmin``) is the prompt trained: neither what the policy already does well nor what it cannot do yet.

How it maps onto the code (docs/algorithm.md §10.10 has the departures): the code's step is tpflow's epoch, its
``batch_size`` captions per process are the K candidates of one prompt, and each process keeps its own μ, v from its
own captions; here one μ, v is updated once per epoch from all the epoch's m·K anchors (m = prompts_per_epoch),
then each of the m prompts is chosen, so with m = 1 it is the code's step. The code branches its group off the
anchor's own trajectory; tpflow does not reuse the anchor: the group is rolled out as the recipe's plan says, from
its own noise, and the anchor costs K ODE samples per trained prompt (``prompt_anchor_nfe``, also added to the
epoch's ``nfe_per_traj``; its seconds are ``prompt_anchor_s``, inside ``epoch_s``). The run's first line on several
processes says how the batches fall from a plan of the split's counts alone (``plan_epoch``: the same batches,
whichever prompts fill them), so no anchor runs before its epoch.

Every process decides the same: the anchors are dealt to the processes (anchor r to process r mod P, as an
evaluation's images) and the rewards gathered (``score_prompts``), then each process runs the same selection on the
same gathered list. The candidates come from (seed, epoch, round) and anchor r's noise is row r of one draw from
(seed, epoch), so a resumed run, or a run on other processes, draws the same candidates from the same noise; μ and v
are the policy's state (``state_dict(epoch)``), in the checkpoint, for an exact resume. Measured on tiny-shapes
(3 candidates, 2 prompts an epoch): 2 processes score epoch 0's anchors, update μ and v and choose bitwise as 1 does;
later epochs differ as the two runs' weights do (their first updates are not bitwise equal: epoch 1's rollout rewards
differ too).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tpflow.optim.advantage_fusion import RunningReward
from tpflow.scoring.call import recipe_policy
from tpflow.settings import TrainSettings
from tpflow.train.evaluation import score_prompts
from tpflow.train.prompt_sampler import EpochPlan, _draw, noise_seed, plan_epoch


@dataclass(frozen=True)
class Anchors:
    """The anchors' rewards, in candidate order, and what they cost."""

    rewards: list[float]  # [M] the reward of each candidate's ODE sample
    nfe: float  # velocity evaluations per anchor (a CFG-doubled row counts once, as RolloutCost.nfe)
    seconds: float  # sampling, decoding and scoring, on this process


AnchorScore = Callable[[int, list[int]], Anchors]  # (epoch, candidate items) -> their anchors, on every process


def update_running(running: RunningReward, rewards: Tensor, alpha: float) -> RunningReward:
    """μ, v after one batch of anchor rewards [M] (the module docstring): the first batch's own mean and variance,
    then α·old + (1 − α)·batch's, in float64."""
    values = rewards.to(torch.float64)
    mean, var = float(values.mean()), float(values.var(correction=0))
    if running.mean is None or running.var is None:
        return RunningReward(mean, var)
    return RunningReward(alpha * running.mean + (1 - alpha) * mean, alpha * running.var + (1 - alpha) * var)


def closest(rewards: Tensor, mean: float) -> list[int]:
    """Per row of ``rewards`` [m, K] (one row per prompt, one column per candidate), the column whose reward is
    closest to ``mean``; the first on a tie (``np.argmin``'s)."""
    distance = (rewards.to(torch.float64) - mean).abs()  # [m, K]
    return [min(range(len(row)), key=row.__getitem__) for row in distance.tolist()]


class AbilityMatched:
    """Plans each epoch around the prompts its anchors chose (module docstring): ``plan`` runs the anchor stage once
    per epoch, ``observe`` reports it, ``state_dict`` / ``load_state_dict`` carry μ and v."""

    has_state = True

    def __init__(self, train: TrainSettings, num_items: int, score: AnchorScore) -> None:
        self.train, self.num_items, self.score = train, num_items, score
        self.running = RunningReward()  # the optimizer's advantage_fusion reads this object (tpflow.optim)
        self._before = RunningReward()  # μ, v before the epoch last planned
        self._planned: tuple[EpochPlan, Anchors, list[float]] | None = None  # its plan, anchors, chosen rewards

    def candidates(self, epoch: int) -> list[list[int]]:
        """Each round's candidates, K per prompt in prompt order: distinct when the split has enough, else drawn with
        repetition (``plan_epoch``'s rule)."""
        t = self.train
        per_round = t.prompts_per_round or t.prompts_per_epoch
        k = t.prompt_candidates
        rngs = [random.Random(f"{t.seed}/{epoch}/candidates/{r}") for r in range(t.prompts_per_epoch // per_round)]
        return [_draw(self.num_items, per_round * k, rng) for rng in rngs]

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's rollout batches, its prompts chosen from anchors scored now (once: a second call for the same
        epoch returns the first's plan)."""
        if self._planned is not None and self._planned[0].epoch == epoch:
            return self._planned[0]
        k = self.train.prompt_candidates
        rounds = self.candidates(epoch)
        flat = [item for drawn in rounds for item in drawn]
        anchors = self.score(epoch, flat)
        rewards = torch.tensor(anchors.rewards, dtype=torch.float64, device="cpu").reshape(-1, k)  # [m, K] host
        self._before = RunningReward(self.running.mean, self.running.var)
        after = update_running(self.running, rewards.reshape(-1), self.train.prompt_ema_alpha)
        self.running.mean, self.running.var = after.mean, after.var  # in place: the optimizer holds this object
        columns = closest(rewards, after.mean)
        chosen_rewards = [float(rewards[j, c]) for j, c in enumerate(columns)]
        picks = [flat[j * k + c] for j, c in enumerate(columns)]
        per_round = len(rounds[0]) // k
        chosen = [picks[r * per_round : (r + 1) * per_round] for r in range(len(rounds))]
        plan = plan_epoch(self.num_items, self.train, epoch, chosen=chosen)
        self._planned = (plan, anchors, chosen_rewards)
        return plan

    def nfe_per_traj(self, plan: EpochPlan) -> float:
        """The anchors' velocity evaluations per trajectory the epoch trains (``nfe_per_traj`` adds it)."""
        assert self._planned is not None and self._planned[0].epoch == plan.epoch, "observed before planned"
        anchors = self._planned[1]
        return anchors.nfe * len(anchors.rewards) / plan.num_trajectories

    def observe(self, plan: EpochPlan, items: Sequence[int], groups: Sequence[int], final: Tensor) -> dict[str, float]:
        """The epoch's metrics: what its anchors cost and what they found (the choice was made in ``plan``)."""
        assert self._planned is not None and self._planned[0].epoch == plan.epoch, "observed before planned"
        _, anchors, chosen_rewards = self._planned
        assert self.running.mean is not None and self.running.var is not None
        return {
            "prompt_anchor_nfe": anchors.nfe * len(anchors.rewards),  # the epoch's, over every process
            "prompt_anchor_s": anchors.seconds,
            "prompt_anchor_reward": sum(anchors.rewards) / len(anchors.rewards),
            "prompt_chosen_reward": sum(chosen_rewards) / len(chosen_rewards),
            "prompt_running_mean": self.running.mean,
            "prompt_running_std": math.sqrt(max(self.running.var, 0.0)),
        }

    def state_dict(self, epoch: int) -> list[list[float]]:
        """What a checkpoint whose next epoch is ``epoch`` holds: [[μ, v]] before ``epoch`` (an epoch planned and
        cut short by a stop leaves what it had before), [] before the first anchors."""
        planned = self._planned is not None and self._planned[0].epoch >= epoch
        values = self._before if planned else self.running
        return [] if values.mean is None else [[values.mean, values.var]]

    def load_state_dict(self, state: Sequence[Sequence[float]]) -> None:
        """Put back ``state_dict``'s list (another policy's rows, or none: no running values yet)."""
        mean, var = (float(state[0][0]), float(state[0][1])) if state and len(state[0]) == 2 else (None, None)
        self.running.mean, self.running.var = mean, var
        self._planned = None


def anchor_scorer(run: Any) -> AnchorScore:
    """The anchor stage of a run (the trainer: its recipe, backbone, reward, optimizer, processes and precision,
    read when called): the candidates' ODE samples with the rollout's steps and guidance, Euler on the backbone's
    schedule, under the optimizer's sampling weights, decoded and scored by the trained reward in batches of
    ``rollout_batch``, dealt to the processes and gathered (``score_prompts``)."""

    def score(epoch: int, items: list[int]) -> Anchors:
        train, rollout = run.recipe.train, run.recipe.rollout
        # sharded, the anchors split equally over the processes: check_layout refused any other recipe at the start
        assert not run.dist.sharded or len(items) % run.dist.world_size == 0, "anchors unequal over processes"
        run._phase(f"epoch {epoch}: choosing prompts ({len(items)} anchors)", None)  # what progress and OOM name
        update = {"num_steps": rollout.num_steps, "guidance": rollout.guidance, "solver": "euler"}
        settings = run.recipe.eval.model_copy(update={**update, "batch_size": train.rollout_batch})
        seed = random.Random(f"{train.seed}/{epoch}/anchors").getrandbits(63)
        everything = [run.train_items[i] for i in items]
        start = time.perf_counter()
        # with same_noise each anchor starts from the z_0 its prompt's group would share this epoch, so the group's
        # ODE path is the chosen anchor's own (AdaGRPO branches its group off the anchor's path)
        starts = [noise_seed(train, epoch, i) for i in items] if rollout.same_noise else None
        with run.optimizer.sampling_policy():
            scored = score_prompts(run.backbone, run.reward, everything, settings, seed, run.dist,
                                   run.precision.autocast, policy=recipe_policy(train), z0_seeds=starts)  # fmt: skip
        return Anchors(scored.scores, float(rollout.num_steps), time.perf_counter() - start)

    return score

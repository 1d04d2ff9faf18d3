"""Rollout plans: which steps of each trajectory are SDE and which of them train (one plan per file).

Importing this package registers them. docs/credit.md's method table says which published method each one serves.
"""

from tpflow.plans.base import BatchPlan
from tpflow.plans.branch import BranchPlan
from tpflow.plans.entropy_steps import EntropyStepsPlan
from tpflow.plans.per_image import WindowPerImagePlan
from tpflow.plans.schedule import WindowSchedulePlan
from tpflow.plans.solver import DpmSolverPlan, SaSolverPlan
from tpflow.plans.trained_fraction import TrainedFractionPlan
from tpflow.plans.window import WindowPlan

__all__ = [
    "BatchPlan",
    "BranchPlan",
    "DpmSolverPlan",
    "EntropyStepsPlan",
    "SaSolverPlan",
    "TrainedFractionPlan",
    "WindowPerImagePlan",
    "WindowPlan",
    "WindowSchedulePlan",
]

"""Reward models. Importing this package registers them."""

from tpflow.rewards.shapes_geneval import ShapesGenevalReward

__all__ = ["ShapesGenevalReward"]

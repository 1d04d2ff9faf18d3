"""Advantages, the GRPO loss and the registered optimizer. Importing this package registers it."""

from tpflow.optim.advantages import group_advantages, informative_trajectories
from tpflow.optim.grpo import GRPOOptions, clipped_surrogate, kl_to_reference

__all__ = ["GRPOOptions", "clipped_surrogate", "group_advantages", "informative_trajectories", "kl_to_reference"]

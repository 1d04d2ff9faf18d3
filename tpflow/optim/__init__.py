"""Advantages, the GRPO and DiffusionNFT losses and their registered optimizers. Importing this package registers
them."""

from tpflow.optim.advantages import group_advantages, informative_trajectories
from tpflow.optim.grpo import GRPOOptions
from tpflow.optim.grpo_loss import clipped_surrogate, kl_to_reference
from tpflow.optim.nft import NFTOptions
from tpflow.optim.nft_loss import nft_loss, optimality

__all__ = [
    "GRPOOptions",
    "NFTOptions",
    "clipped_surrogate",
    "group_advantages",
    "informative_trajectories",
    "kl_to_reference",
    "nft_loss",
    "optimality",
]

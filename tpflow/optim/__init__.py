"""Advantages, the GRPO, DiffusionNFT and AWM losses and their registered optimizers. Importing this package
registers them."""

from tpflow.optim.advantages import group_advantages, informative_trajectories
from tpflow.optim.awm import AWMOptions
from tpflow.optim.awm_loss import awm_loss
from tpflow.optim.grpo import GRPOOptions
from tpflow.optim.grpo_loss import clipped_surrogate, kl_to_reference
from tpflow.optim.nft import NFTOptions
from tpflow.optim.nft_loss import nft_loss, optimality

__all__ = [
    "AWMOptions",
    "GRPOOptions",
    "NFTOptions",
    "awm_loss",
    "clipped_surrogate",
    "group_advantages",
    "informative_trajectories",
    "kl_to_reference",
    "nft_loss",
    "optimality",
]

"""Advantages, the GRPO, DiffusionNFT, AWM and DGPO losses and their registered optimizers. Importing this package
registers them."""

from tpflow.optim.advantages import group_advantages, informative_trajectories
from tpflow.optim.awm import AWMOptions
from tpflow.optim.awm_loss import awm_loss
from tpflow.optim.dgpo import DGPOOptions
from tpflow.optim.dgpo_loss import dgpo_loss
from tpflow.optim.grpo import GRPOOptions
from tpflow.optim.grpo_loss import clipped_surrogate, kl_to_reference
from tpflow.optim.nft import NFTOptions
from tpflow.optim.nft_loss import nft_loss, optimality

__all__ = [
    "AWMOptions",
    "DGPOOptions",
    "GRPOOptions",
    "NFTOptions",
    "awm_loss",
    "clipped_surrogate",
    "dgpo_loss",
    "group_advantages",
    "informative_trajectories",
    "kl_to_reference",
    "nft_loss",
    "optimality",
]

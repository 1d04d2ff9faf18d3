"""Reward models. Importing this package registers them (heavy models load lazily, on the first call)."""

from tpflow.rewards import (
    aesthetic,
    clipscore,
    consistency,
    diversity_shaped,
    edit_consistency,
    frames,
    hpsv2,
    hpsv3,
    image_stat,
    imagereward,
    ocr,
    pairwise,
    pickscore,
    vlm_judge,
    weighted,
)
from tpflow.rewards.geneval import reward as geneval_reward
from tpflow.rewards.shapes_clip import ShapesClipReward
from tpflow.rewards.shapes_edit import ShapesEditReward
from tpflow.rewards.shapes_geneval import ShapesGenevalReward
from tpflow.rewards.shapes_video import ShapesVideoReward

__all__ = [
    "ShapesClipReward",
    "ShapesEditReward",
    "ShapesGenevalReward",
    "ShapesVideoReward",
    "aesthetic",
    "clipscore",
    "frames",
    "geneval_reward",
    "hpsv2",
    "hpsv3",
    "image_stat",
    "imagereward",
    "ocr",
    "pairwise",
    "pickscore",
    "consistency",
    "diversity_shaped",
    "edit_consistency",
    "vlm_judge",
    "weighted",
]

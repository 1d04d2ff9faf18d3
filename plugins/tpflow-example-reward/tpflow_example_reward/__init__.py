"""Example tpflow reward plugin: ``example-saturation`` (see saturation.py and the package README)."""

from tpflow_example_reward.saturation import SaturationOptions, SaturationReward

__all__ = ["SaturationOptions", "SaturationReward"]

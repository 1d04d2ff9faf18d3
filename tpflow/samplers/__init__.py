"""Samplers (one step rule per file) and the sigma schedules. Importing this package registers them."""

from tpflow.samplers.cps import CpsSampler
from tpflow.samplers.dance_sde import DanceSdeSampler
from tpflow.samplers.euler import euler_step
from tpflow.samplers.flow_sde import FlowSdeSampler
from tpflow.samplers.schedules import sd3_sigmas

__all__ = ["CpsSampler", "DanceSdeSampler", "FlowSdeSampler", "euler_step", "sd3_sigmas"]

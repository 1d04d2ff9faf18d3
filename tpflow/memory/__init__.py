"""Peak GPU memory per process of a recipe, ESTIMATED without a GPU: the real models at full size on fake tensors.

Why: whether a recipe fits a GPU is wanted before the GPUs are booked, and on machines that have none. The real
diffusers classes with the published configurations are built under ``FakeTensorMode`` (shapes, dtypes and
storage sizes, no data: nothing allocated or computed), wrapped in tpflow's own backbones with its own LoRA, and
tpflow's real code runs on them; a dispatch mode counts the live tensor bytes. Used by
``tpflow validate --gpu-memory`` (``fit``) and ``benchmarks/memory_estimate.py`` (``report``,
docs/results/memory_estimate.md).

    live_bytes   LiveBytes: the live-bytes dispatch mode
    autocast     CudaAutocast: CUDA autocast's casting policy without CUDA
    configs      the published configurations, and which backbone loads which
    models       tpflow's backbones around diffusers models of given configurations; text-encoder sizes
    wan          the Wan video backbones (Wan2.2's frozen expert) and their prompt embeddings
    measure      Setup (a recipe's view), Probe / measure: the activations of tpflow's calls
    accounting   per-process arithmetic: state, sharding, offload, epoch buffers, peaks
    rewards      the reward models' weights on the GPU, from a table of published checkpoint sizes
    flops        Flops: the FLOPs of the probe's calls (torch.utils.flop_counter's formulas)
    timing       the time of an epoch and of the recipe's epochs at a stated fraction of a GPU's peak
    report       the markdown report and its caveats
    fit          the verdict against a stated GPU memory (CUDA context and safety margin counted), with
                 re-estimated suggestions
"""

from tpflow.memory.accounting import (
    GIB,
    PerProcess,
    component_rows,
    epoch_buffers,
    host_bytes,
    peaks,
    per_process,
    state_rows,
    static_bytes,
)
from tpflow.memory.autocast import CudaAutocast
from tpflow.memory.configs import PUBLISHED, TINY_FLUX, TINY_SD3, TINY_VAE, TINY_WAN, TINY_WAN_VAE
from tpflow.memory.fit import Fit, estimate_fit
from tpflow.memory.live_bytes import LiveBytes
from tpflow.memory.measure import (
    NotModelled,
    Probe,
    Setup,
    largest_rollout_rows,
    load_setup,
    measure,
    measure_with,
    rollout_rows,
    setup_of,
    tiny_setup,
)
from tpflow.memory.models import build_backbone, conditioning, fake_module_to, latents, text_encoder_sizes
from tpflow.memory.report import CAVEATS, report
from tpflow.memory.rewards import reward_models
from tpflow.memory.timing import GPUS, EpochTime, epoch_time

__all__ = [
    "CAVEATS", "GIB", "GPUS", "PUBLISHED", "TINY_FLUX", "TINY_SD3", "TINY_VAE", "TINY_WAN", "TINY_WAN_VAE",
    "CudaAutocast", "EpochTime", "Fit", "LiveBytes", "NotModelled", "PerProcess", "Probe", "Setup", "build_backbone",
    "component_rows", "conditioning", "epoch_buffers", "epoch_time", "estimate_fit", "fake_module_to", "host_bytes",
    "largest_rollout_rows", "latents", "load_setup", "measure", "measure_with", "peaks", "per_process", "report",
    "reward_models", "rollout_rows", "setup_of", "state_rows", "static_bytes", "text_encoder_sizes", "tiny_setup",
]  # fmt: skip

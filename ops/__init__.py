"""Expert kernels of ds_optimus as PyTorch custom ops (`torch.ops.ds_optimus.*`), importable without
DeepSpeed or Triton: `moe_swiglu`, `swiglu_experts` and `routing`; Triton on GPUs, a reference elsewhere.
"""

from . import routing
from .moe import (
    ENV_VAR,
    interpreting,
    kernel_for,
    kernels_choice,
    moe_swiglu,
    swiglu_experts,
    triton_available,
    triton_runs_on,
)

__all__ = [
    "ENV_VAR",
    "interpreting",
    "kernel_for",
    "kernels_choice",
    "moe_swiglu",
    "routing",
    "swiglu_experts",
    "triton_available",
    "triton_runs_on",
]

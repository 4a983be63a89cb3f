"""Expert kernels of ds_optimus as PyTorch custom ops (installed as `ds_optimus.ops`).

Importable without DeepSpeed or Triton, so GPU machines that only carry PyTorch can load it.
`moe_swiglu` is the fused dropless MoE feed-forward (gather, SwiGLU experts, weighted combine),
`swiglu_experts` the experts on expert-sorted rows; both are `torch.ops.ds_optimus.*` custom ops
running Triton kernels on GPUs and their reference implementation elsewhere (see `ops/moe.py`).
`routing` holds the layer's routing, gather and combine ops (`torch.ops.ds_optimus.route`, `gather_rows`,
`combine_rows`): Triton on GPUs, a compiled C++ op on the CPU (`op_builder.py`, DeepSpeed's op builder).
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

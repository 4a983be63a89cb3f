"""Expert kernels of ds_optimus as PyTorch custom ops (installed as `ds_optimus.ops`).

Importable without DeepSpeed or Triton, so GPU machines that only carry PyTorch can load it.
`moe_swiglu` is the fused dropless MoE feed-forward (gather, SwiGLU experts, weighted combine),
`swiglu_experts` the experts on expert-sorted rows; both are `torch.ops.ds_optimus.*` custom ops
running Triton kernels on GPUs and their reference implementation elsewhere (see `ops/moe.py`).
"""

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
    "swiglu_experts",
    "triton_available",
    "triton_runs_on",
]

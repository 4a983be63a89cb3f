"""torch.distributed's single-tensor collectives under their current names: `all_gather_single` and
`reduce_scatter_single` from PyTorch 2.13 (whose `all_gather_into_tensor` and `reduce_scatter_tensor`
warn on every call), the older names before."""

from __future__ import annotations

import torch.distributed as dist

_OLD = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}


def collective(kind: str):
    """`dist.all_gather_single` or `dist.reduce_scatter_single` (`kind` "all_gather" or
    "reduce_scatter"), looked up at call time (tests patch torch.distributed)."""
    return getattr(dist, f"{kind}_single", None) or getattr(dist, _OLD[kind])

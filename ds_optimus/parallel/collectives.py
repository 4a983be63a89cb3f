"""torch.distributed's single-tensor collectives by their current names (PyTorch 2.13 warns on the old)."""

from __future__ import annotations

import torch.distributed as dist

_OLD = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}


def collective(kind: str):
    """`dist.{kind}_single` or its older name, looked up at call time (tests patch torch.distributed)."""
    return getattr(dist, f"{kind}_single", None) or getattr(dist, _OLD[kind])

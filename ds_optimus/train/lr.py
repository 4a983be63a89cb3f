"""The run's learning-rate schedule, as a scheduler for DeepSpeed's engine."""

from __future__ import annotations

from typing import Any

import torch


def lr_schedule(train, lr: float):
    """`optimizer -> LambdaLR`: warm-up, then cosine decay to min_lr_ratio x `lr`."""
    from ..optim.schedule import lr_factor, warmup_start

    start = warmup_start(train.lr_schedule, train.warmup_start_lr, train.min_lr_ratio, lr)
    factor = lr_factor(train.lr_schedule, train.steps, train.warmup_steps, train.min_lr_ratio, start)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def with_scheduler_length(ds_config: dict[str, Any], steps: int) -> dict[str, Any]:
    """`ds_config`, or a copy whose DeepSpeed decaying scheduler is given the run's length where it leaves it out."""
    scheduler = ds_config.get("scheduler")
    if not scheduler or scheduler.get("type") not in ("WarmupCosineLR", "WarmupDecayLR"):
        return ds_config
    params = scheduler.get("params", {})
    if "total_num_steps" in params:
        return ds_config
    return {**ds_config, "scheduler": {**scheduler, "params": {**params, "total_num_steps": steps}}}

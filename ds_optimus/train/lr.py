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


def scheduler_defaults(ds_config: dict[str, Any], steps: int) -> None:
    """Give DeepSpeed's decaying schedulers the run's length when the config leaves it out."""
    scheduler = ds_config.get("scheduler")
    if scheduler and scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        scheduler.setdefault("params", {}).setdefault("total_num_steps", steps)

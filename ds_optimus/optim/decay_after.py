"""Weight decay after the Adam update, in the seed's order (`optimus.train.decay_after_update`; docs/pretraining.md)."""

from __future__ import annotations

import torch

from ..schema import ConfigError
from .adam import adam_kind, decay_updated
from .spaces import ShardedOptimizerError


def master_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer holding the master weights inside a DeepSpeed wrapper (`.optimizer`), or `optimizer`
    itself."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer
    return inner


def apply_decay_after_update(engine) -> None:
    """Make `engine`'s Adam or AdamW decay the weights after its update instead of before it (an Adam's L2 term
    becomes decoupled decay)."""
    from .sharded import ShardedOptimizer

    if isinstance(engine.optimizer, ShardedOptimizer):
        engine.optimizer.decay_after_update = True
        return
    inner = master_optimizer(engine.optimizer)
    try:
        adam_kind(inner)
    except ShardedOptimizerError:
        raise ConfigError(
            f"optimus.train.decay_after_update applies to Adam and AdamW; the engine's optimizer is "
            f"{type(inner).__name__}"
        ) from None
    if getattr(inner, "decays_after_update", False):
        return
    step = inner.step

    # the kernel runs without decay; each group keeps its weight_decay (checkpoints read the same either way)
    def step_then_decay(*args, **kwargs):
        decays = [group.get("weight_decay", 0.0) for group in inner.param_groups]
        for group in inner.param_groups:
            group["weight_decay"] = 0.0
        try:
            result = step(*args, **kwargs)
        finally:
            for group, weight_decay in zip(inner.param_groups, decays, strict=True):
                group["weight_decay"] = weight_decay
        with torch.no_grad():
            for group, weight_decay in zip(inner.param_groups, decays, strict=True):
                updated = [p for p in group["params"] if p.grad is not None]  # those the step moved
                decay_updated(updated, float(group["lr"]), weight_decay)
        return result

    inner.step = step_then_decay
    inner.decays_after_update = True

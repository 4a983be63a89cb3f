"""Decoupled weight decay applied after the Adam update (`optimus.train.decay_after_update`).

torch's AdamW (and DeepSpeed's Adam in its AdamW mode) shrinks the weights before the update:
p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps). The seed system's optimizers shrink the updated
weights after it: p <- p - lr m_hat / (sqrt(v_hat) + eps); p <- p (1 - lr wd). The two differ by
lr^2 wd times the update, a relative 4e-5 at lr 4e-4 and wd 0.1: small, but a run that is to follow
the seed's step for step needs its order. Each group's `weight_decay` stays the coefficient (so a
checkpoint's param groups read the same either way); the Adam kernel runs with none, and the decay
follows it on the same fp32 master weights.

The sharded optimizer does it in its own update (`adam.fused_adam`); DeepSpeed's optimizers (ZeRO 0-2,
bf16 or fp32) get it around the step of the torch optimizer that holds their master weights.
"""

from __future__ import annotations

import torch

from ..schema import ConfigError
from .adam import adam_kind, decay_updated
from .spaces import ShardedOptimizerError


def master_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that updates the master weights inside a DeepSpeed wrapper (ZeRO's, bf16's,
    fp16's keep it as `.optimizer`), or `optimizer` itself."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer
    return inner


def apply_decay_after_update(engine) -> None:
    """Make `engine`'s optimizer decay the weights after its Adam update instead of before it (an Adam
    with L2 decay gets the decoupled decay in place of its L2 term); a one-line ConfigError for an
    optimizer that is not Adam or AdamW."""
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

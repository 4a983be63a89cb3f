"""The sharded optimizer's update: PyTorch's fused Adam/AdamW on this rank's shard, one call per param group."""

from __future__ import annotations

import torch

from .spaces import ShardedOptimizerError, Space


def adam_kind(optimizer) -> tuple[bool, bool]:
    """(decoupled weight decay, amsgrad) of a torch or DeepSpeed Adam/AdamW; an error otherwise."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.AdamW):
        return True, bool(optimizer.defaults.get("amsgrad"))
    if isinstance(optimizer, torch.optim.Adam):
        return bool(optimizer.defaults.get("decoupled_weight_decay", False)), bool(optimizer.defaults.get("amsgrad"))
    if name in ("FusedAdam", "DeepSpeedCPUAdam"):
        return bool(getattr(optimizer, "adam_w_mode", True)), bool(optimizer.defaults.get("amsgrad", False))
    raise ShardedOptimizerError(f"the sharded optimizer runs Adam or AdamW; the config's optimizer is {name}")


def adam_segments(spaces: list[Space], group_of: dict[int, int]) -> dict[int, list[tuple[Space, int, int]]]:
    """Per param group, this rank's (space, shard position, length) runs, adjacent ones merged (one fused call)."""
    segments: dict[int, list[list]] = {}
    for space in spaces:
        for param, _, length, pos in sorted(space.own_runs(), key=lambda r: r[3]):
            g = group_of[id(space.params[param])]
            mine = segments.setdefault(g, [])
            if mine and mine[-1][0] is space and mine[-1][1] + mine[-1][2] == pos:
                mine[-1][2] += length
            else:
                mine.append([space, pos, length])
    return {g: [tuple(s) for s in segs] for g, segs in segments.items()}


def fused_adam(
    segments: dict[int, list[tuple[Space, int, int]]],
    param_groups: list[dict],
    step: torch.Tensor,
    decoupled: bool,
    divisor: torch.Tensor,
    decay_after: bool = False,
) -> None:
    """One Adam/AdamW step of every segment, gradients divided by `divisor`; `step` already counts it.
    `decay_after`: the decoupled weight decay shrinks the updated weights."""
    for g, segs in segments.items():
        group = param_groups[g]
        views = {
            key: [getattr(s, key)[pos : pos + n] for s, pos, n in segs]
            for key in ("master", "grad", "exp_avg", "exp_avg_sq")
        }
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        update = torch._fused_adamw_ if decoupled and not decay_after else torch._fused_adam_
        weight_decay, lr = group.get("weight_decay", 0.0), float(group["lr"])
        update(
            views["master"],
            views["grad"],
            views["exp_avg"],
            views["exp_avg_sq"],
            [],
            [step] * len(segs),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=0.0 if decay_after else weight_decay,
            eps=group.get("eps", 1e-8),
            amsgrad=False,
            maximize=False,
            grad_scale=divisor,
            found_inf=None,
        )
        if decay_after:
            decay_updated(views["master"], lr, weight_decay)


def decay_updated(tensors: list[torch.Tensor], lr: float, weight_decay: float) -> None:
    """Shrink the just-updated `tensors` by (1 - lr x weight_decay), in place."""
    if weight_decay and tensors:
        torch._foreach_mul_(tensors, 1.0 - lr * weight_decay)

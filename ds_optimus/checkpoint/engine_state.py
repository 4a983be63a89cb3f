"""The DeepSpeed engine state of the per-rank checkpoints: optimizer partition, LR scheduler, step
counters. Written against DeepSpeed 0.19."""

from __future__ import annotations

from typing import Any


def engine_state_types() -> list[Any]:
    """The DeepSpeed classes that loading an `engine_state` may build, besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _takes_rank_list(optimizer) -> bool:
    # ZeRO-1/2 and the BF16 optimizer keep one partition per data-parallel rank and load from a
    # list indexed by that rank; a plain torch optimizer loads its own state dict.
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer))


def engine_state(engine) -> dict:
    """This rank's share of the engine's training state: optimizer partition, scheduler, counters."""
    state = {
        "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "counters": {name: getattr(engine, name) for name in _ENGINE_COUNTERS},
    }
    return state


def load_engine_state(engine, state: dict) -> None:
    """Restore what `engine_state` returned on this rank (same world size and layout)."""
    optimizer = engine.optimizer
    if state["optimizer"] is not None and optimizer is not None:
        if _takes_rank_list(optimizer):
            import torch.distributed as dist

            rank = dist.get_rank(group=optimizer.dp_process_group)
            states = [None] * dist.get_world_size(group=optimizer.dp_process_group)
            states[rank] = state["optimizer"]
            optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            optimizer.load_state_dict(state["optimizer"])
    if state["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for name, value in state["counters"].items():
        setattr(engine, name, value)

"""Auxiliary-loss-free balancing (DeepSeek-V3): one router-bias update per optimizer step."""

from __future__ import annotations

from ...moe.layer import uses_router_bias
from .base import Callback

__all__ = ["RouterBiasCallback", "uses_router_bias"]


class RouterBiasCallback(Callback):
    """After each optimizer step, move every MoE router's selection bias towards balance
    (`MulaForCausalLM.update_router_bias`); a skipped step moves nothing."""

    active = False

    def pre_train(self) -> None:
        self.active = uses_router_bias(self.trainer.engine.module)

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        model = trainer.engine.module
        if not self.active:
            return
        if trainer.update_skipped:
            model.discard_router_loads()
            return
        # the loads of every rank that routes other tokens: the data-parallel ranks, and under sequence
        # parallelism every TP position's
        group = trainer.groups.dp_group if trainer.groups is not None else None
        model.update_router_bias(getattr(trainer, "sequence_group", None) or group)

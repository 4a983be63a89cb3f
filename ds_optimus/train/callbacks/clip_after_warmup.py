"""Gradient clipping only after the learning-rate warm-up (`optimus.train.clip_after_warmup`)."""

from __future__ import annotations

from ...command_line import said_by_every_rank
from ...integrations.deepspeed_engine import set_gradient_clipping
from ...optim.warmup_clipping import clip_for_step, delayed_clipping
from ...schema import ConfigError
from .base import Callback


class ClipAfterWarmupCallback(Callback):
    """No clipping during the warm-up, the config's `gradient_clipping` after it (Optimus' recipe)."""

    clip = 0.0
    warmup_steps = 0

    def setup(self) -> None:
        try:  # every rank checks the same config: printed once
            self.clip, self.warmup_steps = delayed_clipping(self.trainer.ds_config, self.trainer.opt.train.warmup_steps)
        except ConfigError as err:
            raise said_by_every_rank(err) from None

    def pre_step(self, step: int) -> None:  # set every step, so a resume or a rollback gets the right one
        set_gradient_clipping(self.trainer.engine, clip_for_step(step, self.clip, self.warmup_steps))

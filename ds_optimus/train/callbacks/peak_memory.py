"""Each rank's peak tensor memory over the first `train.measure_memory_steps` steps."""

from __future__ import annotations

import torch.distributed as dist

from ..memory_meter import MemoryMeter
from .base import Callback


class MemoryCallback(Callback):
    """Starts measuring before the model is built, marks the end of the set-up, and after the
    measured steps gathers every rank's {"peak_bytes", "marks"} into the summary's "memory"."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.meter: MemoryMeter | None = None

    def setup(self) -> None:
        from deepspeed.accelerator import get_accelerator

        self.meter = MemoryMeter(get_accelerator().current_device_name())
        self.meter.start()

    def pre_train(self) -> None:
        self.meter.mark("initialized")

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        if not self.meter.running or step < trainer.start_step + self.steps:
            return
        per_rank = [None] * trainer.world
        dist.all_gather_object(per_rank, self.meter.stop())
        trainer.summary["memory"] = per_rank
        peaks = [m["peak_bytes"] / 2**20 for m in per_rank]
        trainer.message(
            f"memory: peak tensor memory per rank over steps {trainer.start_step + 1}-{step}: "
            f"max {max(peaks):.1f} MiB, min {min(peaks):.1f} MiB"
        )

    def close(self, error: BaseException | None) -> None:
        if self.meter is not None and self.meter.running:
            self.meter.stop()

"""Where a step's time goes: `torch.profiler` over steps `train.profile_steps = [first, last]`.

Rank 0 writes the top operators by device (or CPU) time to `<output_dir>/profile.txt`. Profiled steps
run slower: leave them out of throughput figures.
"""

from __future__ import annotations

import torch

from ...verbosity import without_profiler_chatter
from .base import Callback

ROWS = 25  # the table's operators, by self time


class ProfileCallback(Callback):
    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.profiler = None
        self.sort_key = "self_cpu_time_total"

    def pre_step(self, step: int) -> None:
        if step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            self.sort_key = "self_device_time_total"
        self.profiler = profile(activities=activities)
        with without_profiler_chatter():
            self.profiler.__enter__()

    def post_step(self, step: int) -> None:
        if self.profiler is None or step < self.last:
            return
        profiler, self.profiler = self.profiler, None
        with without_profiler_chatter():
            profiler.__exit__(None, None, None)
        trainer = self.trainer
        if trainer.rank != 0:
            return
        table = profiler.key_averages().table(sort_by=self.sort_key, row_limit=ROWS)
        path = trainer.output_dir / "profile.txt"
        path.write_text(f"steps {self.first}-{step}, rank 0, sorted by {self.sort_key}\n{table}\n")
        trainer.message(f"profile: steps {self.first}-{step} in {path}")

    def close(self, error: BaseException | None) -> None:
        if self.profiler is not None:
            with without_profiler_chatter():
                self.profiler.__exit__(None, None, None)
            self.profiler = None

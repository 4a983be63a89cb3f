"""The phase profiler (`optimus.profile`), cheap enough to stay on: every `interval`-th step timed by phase, with
its collectives and each rank's reduction wait, into the metrics (timers: `ds_optimus.train.phase_profile`).
"""

from __future__ import annotations

import torch

from ..phase_profile import CollectiveRecorder, ProfileWindow, StepProfile, StepTimer, clock_for
from .base import Callback


class PhaseProfileCallback(Callback):
    """Profiles every `interval`-th step in `trainer.phases`; `last` is this rank's latest `StepProfile`."""

    def __init__(self, config) -> None:
        self.interval, self.collectives = config.interval, config.collectives
        self.recorder = CollectiveRecorder()
        self.window = ProfileWindow()
        self.clock = None
        self.pending: tuple[int, float, float] | None = None  # (step, time before its reduction, wait there)
        self.sent: tuple[int, float, float] | None = None  # what this step's flags carry
        self.last: StepProfile | None = None

    def pre_train(self) -> None:
        self.clock = clock_for(torch.device(self.trainer.device))

    def pre_step(self, step: int) -> None:
        self._stop()  # a step that ended without its post_step (an error caught by a user) is dropped
        if step % self.interval == 0:
            timer = self.trainer.phases = StepTimer(self.clock)
            if self.collectives:
                self.recorder.install(timer)

    def step_flags(self) -> dict[str, float]:
        """Flags for this step's all-reduce: the last unsent profiled step's compute and wait, with squares."""
        # No collective of its own: the ranks' numbers ride on the next step's reduction, a step late.
        _, compute, wait = self.pending or (None, 0.0, 0.0)
        flags = {
            "profile/ranks": 1.0 if self.pending else 0.0,
            "profile/compute": compute,
            "profile/compute_sq": compute * compute,
            "profile/wait": wait,
            "profile/wait_sq": wait * wait,
        }
        self.sent, self.pending = self.pending, None
        return flags

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        timer = self._stop()
        profile = timer.finish() if timer is not None else None
        if profile is not None:
            self.last = profile
            self.window.add(profile.metrics())
            if profile.reduce_s is not None:
                self.pending = (step, profile.before_reduce_s, profile.reduce_s)
        if self.sent is not None and trainer.metrics.get("profile/ranks", 0) > 0:
            self.window.add_ranks(trainer.metrics, self.sent[0])
        self.sent = None
        if self.window and trainer.is_log_step(step):
            trainer.sink.log(step, self.window.take(), progress=False)

    def close(self, error: BaseException | None) -> None:
        self._stop()

    def _stop(self) -> StepTimer | None:
        """End the current profiled step, if any; returns its timer."""
        self.recorder.uninstall()
        trainer = getattr(self, "trainer", None)
        timer = getattr(trainer, "phases", None)
        if trainer is not None:
            trainer.phases = None
        return timer

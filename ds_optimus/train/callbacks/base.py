"""The callback interface: one concern around the training step per callback."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..trainer import Trainer


class Callback:
    """A concern around the training step (metrics, checkpoints, the watchdog, ...). The trainer
    calls each hook on every callback in the order they were given; every hook is a no-op unless
    overridden, and `self.trainer` is set before the first. A callback with a `state_key` has its
    `state_dict()` saved in every checkpoint under that key and handed back by `load_state_dict`
    when the run resumes."""

    trainer: Trainer
    state_key: str | None = None

    def setup(self) -> None:
        """Once torch.distributed is up, before the model, the data or the engine is built."""

    def pre_train(self) -> None:
        """Everything is built and the run resumed; the first step comes next."""

    def pre_step(self, step: int) -> None:
        """Step `step` begins (`trainer.step` is already `step`)."""

    def step_flags(self) -> dict[str, float]:
        """Numbers to sum over ranks with the step's losses, in its one all-reduce: their sums are
        in `trainer.metrics` under the same names by the time the update is made."""
        return {}

    def post_step(self, step: int) -> None:
        """The update of step `step` is done; its losses, reduced over ranks, are in `trainer.metrics`."""

    def on_long_work(self, what: str) -> None:
        """Work that may take long is about to start (an evaluation, a checkpoint, the export)."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """A checkpoint of step `step` was written (or, saved in the background, is being written)."""

    def post_train(self) -> None:
        """The loop is over: the last step ran, or the run stopped early."""

    def on_exit(self, error: BaseException | None) -> None:
        """First on the way out (success, `error` or a preemption), before any callback closes: quick,
        and never raises (the watchdog's heartbeat says the rank's last word here)."""

    def close(self, error: BaseException | None) -> None:
        """The one clean-up path, after success, an error (`error`) or a preemption."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

"""The callback interface."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..trainer import Trainer


class Callback:
    """A concern around the training step: hooks (no-ops unless overridden) run on every callback in order. A
    `state_key` checkpoints `state_dict()` and restores it on resume."""

    trainer: Trainer
    state_key: str | None = None

    def setup(self) -> None:
        """After torch.distributed starts, before the model, data and engine."""

    def pre_train(self) -> None:
        """All built and resumed; the first step is next."""

    def pre_step(self, step: int) -> None:
        """Step `step` begins (`trainer.step` is already `step`)."""

    def step_flags(self) -> dict[str, float]:
        """Numbers summed over ranks with the step's losses: in `trainer.metrics`, same names, by the update."""
        return {}

    def post_step(self, step: int) -> None:
        """Step `step`'s update is done; the reduced losses are in `trainer.metrics`."""

    def on_long_work(self, what: str) -> None:
        """Possibly long work (evaluation, checkpoint, export) starts."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        """A checkpoint of `step` was written (or is being, in the background)."""

    def post_train(self) -> None:
        """The loop is over (done, or stopped early)."""

    def on_exit(self, error: BaseException | None) -> None:
        """First on the way out, before any close: quick, never raises."""

    def close(self, error: BaseException | None) -> None:
        """The one clean-up path (success, `error` or a preemption)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

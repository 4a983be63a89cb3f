"""Checkpoints every `checkpoint.interval` steps, at the end of the run and before a stop; model-only
"cold" checkpoints every `checkpoint.keep_every` steps."""

from __future__ import annotations

from .base import Callback


class CheckpointCallback(Callback):
    """Saves through the trainer's `CheckpointManager` (in the background with `checkpoint.async_save`, but
    not an invocation's last save) and waits for a save in flight when the loop ends."""

    saved_step: int | None = None

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        interval = trainer.opt.checkpoint.interval
        stopping = trainer.stop_reason is not None
        if (interval and step % interval == 0) or step == trainer.end_step or stopping:
            background = trainer.opt.checkpoint.async_save and step != trainer.end_step and not stopping
            self._save(step, background)
        every = trainer.opt.checkpoint.keep_every
        if every and step % every == 0:  # the model alone, kept for good
            trainer.begin_long_work(f"the cold checkpoint of step {step}")
            path = trainer.checkpoints.save_cold(step, trainer.engine, trainer.train_loader.tokens_consumed)
            trainer.message(f"step {step}: cold checkpoint {path}")

    def post_train(self) -> None:  # a stop asked for by a callback after this one still gets its checkpoint
        trainer = self.trainer
        if trainer.stop_reason is not None and self.saved_step != trainer.step:
            self._save(trainer.step, background=False)
        trainer.checkpoints.wait()

    def _save(self, step: int, background: bool) -> None:
        trainer = self.trainer
        trainer.begin_long_work(f"the checkpoint of step {step}")
        path = trainer.checkpoints.save(
            step,
            trainer.engine,
            trainer.checkpoint_state(),
            background=background,
            manifest={"data": trainer.train_loader.state_dict()},
        )
        self.saved_step = step
        trainer.message(f"step {step}: checkpoint {path}" + (" (writing in the background)" if background else ""))
        trainer.notify_checkpoint(step, path)

"""Held-out evaluation every `train.eval_interval` steps and after the last step."""

from __future__ import annotations

from .base import Callback


class EvaluationCallback(Callback):
    """The held-out LM loss (averaged over ranks) into the metrics, the log and the summary."""

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        interval = trainer.opt.train.eval_interval
        if not ((interval and step % interval == 0) or step == trainer.last_step):
            return
        trainer.begin_long_work(f"the evaluation after step {step}")
        held_out_loss = trainer.evaluate()
        if held_out_loss is not None:
            trainer.summary["evals"][step] = held_out_loss
            trainer.sink.log(step, {"eval_loss": held_out_loss}, progress=False)
            trainer.message(f"step {step}: held-out loss {held_out_loss:.4f}")

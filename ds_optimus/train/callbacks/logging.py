"""Metrics every log interval (to the progress bar, `metrics.jsonl` and wandb) and the progress file
the supervisor reads."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ...checkpoint.files import write_text_atomic
from ...hf_models.mula.sizing import flops_per_token
from ..metrics import LOSS_PARTS, expert_imbalance, expert_token_counts
from .base import Callback


class MetricsCallback(Callback):
    """The loss into the summary each step; every `train.log_interval` steps the interval's metrics
    to the trainer's sink. A run ending without error or preemption: rank 0 draws `<output_dir>/plots/`."""

    loop_ended = False

    def pre_train(self) -> None:
        trainer = self.trainer
        self.flops_per_token = flops_per_token(trainer.engine.module.config, trainer.opt.data.seq_len)
        self.window_seconds, self.window_steps = 0.0, 0

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        loss = trainer.metrics["loss"]
        trainer.summary["losses"][step] = loss
        trainer.summary["step_seconds"][step] = trainer.step_seconds
        self.window_seconds += trainer.step_seconds
        self.window_steps += 1
        if not math.isfinite(loss) and not trainer.update_skipped:
            trainer.message(f"step {step}: loss is {loss}")
        for event in trainer.train_loader.take_events():  # a source that ran out and starts again
            trainer.message(event)
        if not trainer.is_log_step(step):
            return
        grad_norm = trainer.engine.get_global_grad_norm()
        seconds = self.window_seconds / self.window_steps
        metrics = {key: trainer.metrics[key] for key in LOSS_PARTS}
        metrics.update(
            lr=trainer.lr,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            tokens_per_s=trainer.tokens_per_step / seconds,
            step_seconds=seconds,
            tokens=trainer.train_loader.tokens_consumed,
            skipped_steps=trainer.engine.skipped_steps,
        )
        if "straggler_seconds" in trainer.metrics:  # the last rank's lateness to the reduction (FaultRecordCallback)
            metrics["straggler_seconds"] = trainer.metrics["straggler_seconds"]
        peak = trainer.opt.train.peak_tflops
        if peak:
            metrics["mfu"] = self.flops_per_token * trainer.tokens_per_step / seconds / (peak * 1e12 * trainer.world)
        loader = trainer.train_loader  # what each source has given so far (the same on every rank)
        metrics.update({f"tokens/{name}": count for name, count in loader.source_tokens().items()})
        metrics.update({f"epochs/{name}": count for name, count in loader.source_epochs().items()})
        if trainer.step_loads is not None:
            per_layer = expert_imbalance(trainer.step_loads)
            metrics["expert_imbalance_max"] = max(per_layer)
            metrics.update({f"expert_imbalance/layer_{i}": v for i, v in enumerate(per_layer)})
            metrics["expert_tokens"] = expert_token_counts(trainer.step_loads)  # already on the host
        if not trainer.engine.module.config.num_experts:
            for key in ("aux_loss", "z_loss"):
                metrics.pop(key)
        trainer.sink.log(step, metrics)
        self.window_seconds, self.window_steps = 0.0, 0

    def post_train(self) -> None:
        self.loop_ended = True

    def close(self, error: BaseException | None) -> None:
        trainer = self.trainer
        trained = trainer.step > trainer.start_step  # a finished run launched again is left as it is
        if (
            error is None
            and self.loop_ended
            and trained
            and trainer.rank == 0
            and trainer.stop_reason != "preempted"
            and trainer.opt.train.plots
        ):
            self._write_plots()

    def _write_plots(self) -> None:
        """The run's PNGs, after everything else; a drawing problem is one line, never an error."""
        from ...report import MissingMatplotlib, write_report

        trainer = self.trainer
        again = f"python -m ds_optimus.report {trainer.output_dir}"
        try:
            written = write_report(trainer.output_dir, say=trainer.message)
        except MissingMatplotlib:
            trainer.message(f"plots: pip install matplotlib, then {again}")
            return
        except Exception as err:  # the run itself succeeded
            first = (str(err).strip().splitlines() or [""])[0]
            trainer.message(f"plots not written ({type(err).__name__}: {first}); try {again}")
            return
        folder = written[0].parent if written else trainer.output_dir / "plots"
        trainer.message(f"plots: {len(written)} PNGs in {folder}/ ({again} draws them again)")


class ProgressFileCallback(Callback):
    """Rank 0 writes `<output_dir>/progress.json` ({"step", "time", "checkpoint"}) after every step and
    checkpoint: the supervisor tells crashes that made progress, and a launch not finding that checkpoint
    refuses to start over its metrics."""

    checkpoint: str | None = None  # the run's newest checkpoint, written or resumed from

    def pre_train(self) -> None:
        self.checkpoint = self.trainer.resumed_from

    def post_step(self, step: int) -> None:
        self._write(step)

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.checkpoint = str(path)
        self._write(step)

    def _write(self, step: int) -> None:
        if self.trainer.rank == 0:
            record = json.dumps({"step": step, "time": time.time(), "checkpoint": self.checkpoint})
            write_text_atomic(self.trainer.output_dir / "progress.json", record, fsync=False)

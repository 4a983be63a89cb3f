"""Downstream tasks scored at every checkpoint (`optimus.eval.downstream`), as the seed system scored
its checkpoints: rank 0 exports the checkpoint just written and scores it with lm-evaluation-harness
on its device (`ds_optimus.evaluate`); the scores go to `<output_dir>/eval/step_N.json`, the log and
the metrics (`downstream/<task>`), and the run's report plots them. The other ranks wait in a barrier
of a gloo group of its own with a long time-out (a task suite outlasts the default group's; polling a
file from thousands of ranks would load a shared file system's metadata servers). A failed evaluation
is said in the log and the run goes on: the checkpoint is what matters."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from .base import Callback

WAIT = timedelta(hours=24)  # the watchdog's long-work time-out, not this, is what catches a hang


class DownstreamCallback(Callback):
    """Scores each checkpoint on `config.tasks` (a `DownstreamConfig`)."""

    def __init__(self, config) -> None:
        self.config = config
        self.waiting = None  # the gloo group the other ranks wait in

    def setup(self) -> None:  # a missing lm-eval or an unknown task folder stops the run before it starts
        from ...evaluate.harness import EvaluationError, require_lm_eval
        from ...schema import ConfigError

        try:
            require_lm_eval()
        except EvaluationError as err:
            raise ConfigError(f"optimus.eval.downstream: {err}") from None
        for folder in self.config.include:
            if not Path(folder).expanduser().is_dir():
                raise ConfigError(f"optimus.eval.downstream.include: task folder {folder!r} does not exist")
        if dist.is_initialized() and dist.get_world_size() > 1:  # collective: every rank makes it
            self.waiting = dist.new_group(backend="gloo", timeout=WAIT)

    def on_checkpoint(self, step: int, path: Path) -> None:
        trainer = self.trainer
        trainer.checkpoints.wait()  # a background save must be on disk before it is read (collective)
        trainer.begin_long_work(f"the downstream evaluation of step {step}")
        if trainer.rank == 0:
            self._score(step, Path(path))
        if self.waiting is not None:
            dist.barrier(group=self.waiting)

    def _score(self, step: int, path: Path) -> None:
        from ...evaluate.harness import EvaluationError
        from ...evaluate.run import evaluate, summary_line

        trainer, config = self.trainer, self.config
        device = str(trainer.device)
        dtype = "float32" if device.startswith("cpu") else "bfloat16"
        try:
            _, record = evaluate(path, trainer.output_dir, step, list(config.tasks), include=list(config.include),
                                 limit=config.limit, num_fewshot=config.num_fewshot, batch_size=config.batch_size,
                                 device=device, dtype=dtype)
        except (EvaluationError, OSError, RuntimeError) as err:
            trainer.message(f"step {step}: downstream evaluation failed ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}); training goes on")
            return
        trainer.message(f"step {step}: downstream {summary_line(record)}")
        scores = {f"downstream/{task}": metrics.get("acc_norm", metrics.get("acc"))
                  for task, metrics in record["tasks"].items()}
        trainer.sink.log(step, {k: v for k, v in scores.items() if v is not None}, progress=False)

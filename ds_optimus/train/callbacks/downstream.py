"""Downstream tasks scored at every checkpoint (`optimus.eval.downstream`) without holding the run up: once
checkpoint N is on disk, rank 0 runs `python -m ds_optimus.evaluate RUN --step N` in a process of its own (one at
a time, on rank 0's device). Scores go to `eval/step_N.json`, the log and wandb (`downstream/<task>`), its output
to `eval/step_N.log`; a checkpoint waiting to be scored is not pruned. The run's end waits for evaluations due;
a preemption or an error stops them, saying how to score later. A failed evaluation is logged; training goes on."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from .base import Callback


class DownstreamCallback(Callback):
    """Scores each checkpoint on `config.tasks` (a `DownstreamConfig`) in a process of its own."""

    def __init__(self, config) -> None:
        self.config = config
        self.due: list[tuple[int, Path]] = []  # checkpoints to score, in order (rank 0)
        self.running: tuple[int, Path, subprocess.Popen] | None = None

    def setup(self) -> None:  # a missing lm-eval or task folder stops the run before it starts, on every rank
        from ...evaluate.harness import EvaluationError, require_lm_eval
        from ...schema import ConfigError

        try:
            require_lm_eval()
        except EvaluationError as err:
            raise ConfigError(f"optimus.eval.downstream: {err}") from None
        for folder in self.config.include:
            if not Path(folder).expanduser().is_dir():
                raise ConfigError(f"optimus.eval.downstream.include: task folder {folder!r} does not exist")

    def on_checkpoint(self, step: int, path: Path) -> None:
        if self.trainer.rank == 0:
            self.due.append((step, Path(path)))
            self.trainer.checkpoints.keep_for_now.add(Path(path))
            self._advance()

    def post_step(self, step: int) -> None:
        if self.trainer.rank == 0 and (self.due or self.running):
            self._advance()

    def close(self, error: BaseException | None = None) -> None:
        if self.trainer.rank != 0 or not (self.due or self.running):
            return
        trainer = self.trainer
        steps = sorted([s for s, _ in self.due] + ([self.running[0]] if self.running else []))
        if error is not None or trainer.stop_reason == "preempted":
            if self.running is not None:
                self.running[2].kill()
                self.running[2].wait()
            trainer.message(
                f"downstream evaluation of step(s) {', '.join(map(str, steps))} not done "
                f"(the run stopped); score them with: {self._command('--all')}"
            )
            return
        trainer.message(f"waiting for the downstream evaluation of step(s) {', '.join(map(str, steps))}")
        while self.due or self.running:
            if self.running is not None:
                self.running[2].wait()
            self._advance()

    # -- rank 0 ---------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Report an evaluation that ended, start the next one whose checkpoint is on disk."""
        if self.running is not None:
            step, path, process = self.running
            if process.poll() is None:
                return
            self.running = None
            self.trainer.checkpoints.keep_for_now.discard(path)
            self._report(step, process.returncode)
        if self.due and (self.due[0][1] / "meta.json").exists():  # a background save is complete
            step, path = self.due.pop(0)
            log = self.trainer.output_dir / "eval" / f"step_{step:08d}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("w") as out:
                process = subprocess.Popen(self._argv("--step", str(step)), stdout=out, stderr=subprocess.STDOUT)
            self.running = (step, path, process)

    def _argv(self, *which: str) -> list[str]:
        config, trainer = self.config, self.trainer
        argv = [
            sys.executable,
            "-m",
            "ds_optimus.evaluate",
            str(trainer.output_dir),
            *which,
            "--tasks",
            ",".join(config.tasks),
            "--num-fewshot",
            str(config.num_fewshot),
            "--batch-size",
            str(config.batch_size),
            "--device",
            str(trainer.device),
        ]
        for folder in config.include:
            argv += ["--include", str(folder)]
        return argv + (["--limit", str(config.limit)] if config.limit else [])

    def _command(self, *which: str) -> str:
        return shlex.join(["python", *self._argv(*which)[1:]])

    def _report(self, step: int, status: int) -> None:
        from ...evaluate.run import read_results, results_path, summary_line
        from ...evaluate.tasks import expand

        trainer = self.trainer
        record = read_results(results_path(trainer.output_dir, step))
        tasks = {t: m for t, m in record.get("tasks", {}).items() if t in expand(list(self.config.tasks))}
        if status != 0 or not tasks:
            log = trainer.output_dir / "eval" / f"step_{step:08d}.log"
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            why = lines[-1] if lines else f"exit status {status}"
            trainer.message(f"downstream evaluation of step {step} failed ({why}; {log}); training goes on")
            return
        trainer.message(f"step {step}: downstream {summary_line({'tasks': tasks})}")
        scores = {f"downstream/{t}": m.get("acc_norm", m.get("acc")) for t, m in tasks.items()}
        trainer.sink.log_to_wandb(
            trainer.step, {"downstream/checkpoint_step": step, **{k: v for k, v in scores.items() if v is not None}}
        )

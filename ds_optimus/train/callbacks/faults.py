"""Fault injection for recovery tests, installed only by `DS_OPTIMUS_FAULTS`: a JSON list of `{"kind": ..., "step": N,
"rank": R, "attempt": A}` (R and A default to 0; A: the supervisor's restart count).

At step N: `kill`, `raise` and `signal` (`signal`, default SIGTERM) at its start, `kill_in_save` after its
checkpoint's first file, `nan_loss` on this rank, `sleep` (`seconds`) before its collectives, `late` before its
reduction (`seconds`, or `times` the step's time so far).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from ...reliability.supervise import ATTEMPT_VAR
from .base import Callback

ENV_VAR = "DS_OPTIMUS_FAULTS"
KINDS = ("kill", "kill_in_save", "nan_loss", "sleep", "signal", "raise", "late")


class FaultInjectionCallback(Callback):
    """Strikes this rank's and attempt's faults, each once (not again after a rollback)."""

    def __init__(self, faults: list[dict]) -> None:
        for fault in faults:
            if not isinstance(fault, dict) or fault.get("kind") not in KINDS or not isinstance(fault.get("step"), int):
                raise ValueError(
                    f"{ENV_VAR}: each fault needs a kind ({', '.join(KINDS)}) and an integer step, got {fault!r}"
                )
        self.faults = list(faults)
        self.fired: set[int] = set()
        self.step_began = time.perf_counter()

    @classmethod
    def from_environment(cls) -> FaultInjectionCallback | None:
        text = os.environ.get(ENV_VAR)
        # {"kind": "probe", "host": H} is the node probe's (ds_optimus.reliability.probe), not the trainer's
        faults = [f for f in json.loads(text) if not (isinstance(f, dict) and f.get("kind") == "probe")] if text else []
        return cls(faults) if faults else None

    def due(self, kind: str, step: int | None) -> dict | None:
        """The fault of `kind` planned for `step` on this rank and attempt, if it has not struck yet."""
        rank, attempt = self.trainer.rank, int(os.environ.get(ATTEMPT_VAR, "0"))
        for i, fault in enumerate(self.faults):
            if (
                i not in self.fired
                and fault["kind"] == kind
                and fault["step"] == step
                and fault.get("rank", 0) == rank
                and fault.get("attempt", 0) == attempt
            ):
                self.fired.add(i)
                return fault
        return None

    def pre_train(self) -> None:
        self.trainer.checkpoints.writer.file_hooks.append(self._file_written)

    def pre_step(self, step: int) -> None:
        self.step_began = time.perf_counter()
        if self.due("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("raise", step):
            raise RuntimeError(f"fault injected on rank {self.trainer.rank} at step {step}")
        fault = self.due("signal", step)
        if fault:
            os.kill(os.getpid(), getattr(signal, fault.get("signal", "SIGTERM")))
        model, chunks = self.trainer.engine.module, self.trainer.train_module.chunks
        # with pipeline stages the schedule calls this rank's chunks of layers, not the model
        first, last = (model, model) if chunks is None else (chunks[0][1], chunks[-1][1])
        fault = self.due("sleep", step)
        if fault:
            _once(first.register_forward_pre_hook, _sleeper(float(fault.get("seconds", 3600))))
        if self.due("nan_loss", step):  # on a stage before the last, its NaN output makes the loss NaN
            _once(last.register_forward_hook, _poison_loss if chunks is None else _poison_output)

    def step_flags(self) -> dict[str, float]:
        fault = self.due("late", self.trainer.step)
        if fault:
            took = time.perf_counter() - self.step_began
            time.sleep(float(fault["times"]) * took if "times" in fault else float(fault.get("seconds", 1.0)))
        return {}

    def _file_written(self, path: Path, step: int | None) -> None:
        if step is not None and self.due("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)


def _sleeper(seconds: float):
    def sleep_inside_step(module, args):  # the name the watchdog's stack dump shows
        time.sleep(seconds)

    return sleep_inside_step


def _poison_loss(module, args, output):
    output.loss = output.loss * float("nan")
    return output


def _poison_output(module, args, output):
    if isinstance(output, tuple):
        return (output[0] * float("nan"), *output[1:])
    return output * float("nan")


def _once(register, hook) -> None:
    """Register `hook` for the module's next call only."""
    handles = []

    def run_once(*args):
        handles[0].remove()
        return hook(*args)

    handles.append(register(run_once))

"""Fault injection for testing recovery: `DS_OPTIMUS_FAULTS` holds a JSON list of faults, each
`{"kind": ..., "step": N, "rank": R, "attempt": A}` (rank and attempt default to 0; the attempt is
the supervisor's restart count, `DS_OPTIMUS_ATTEMPT`). Nothing happens when the variable is unset.

Kinds: `kill` (SIGKILL this process at the start of step N), `kill_in_save` (SIGKILL while the
checkpoint of step N is being written, after its first file), `nan_loss` (this rank's loss of step
N becomes NaN, so its gradients do), `sleep` (sleep `seconds` inside step N, before its
collectives), `signal` (send this process `signal`, default SIGTERM, at the start of step N).
"""

from __future__ import annotations

import json
import os
import signal
import time
from functools import cache

ENV_VAR = "DS_OPTIMUS_FAULTS"
ATTEMPT_VAR = "DS_OPTIMUS_ATTEMPT"
KINDS = ("kill", "kill_in_save", "nan_loss", "sleep", "signal")


@cache
def _planned() -> tuple[dict, ...]:
    text = os.environ.get(ENV_VAR)
    if not text:
        return ()
    faults = json.loads(text)
    for fault in faults:
        if fault.get("kind") not in KINDS or not isinstance(fault.get("step"), int):
            raise ValueError(f"{ENV_VAR}: each fault needs a kind ({', '.join(KINDS)}) and an integer step, "
                             f"got {fault!r}")
    return tuple(faults)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


_fired: set[int] = set()


def due(kind: str, step: int) -> dict | None:
    """The fault of `kind` planned for `step` on this rank and attempt, if any; each strikes once
    (a step run again after a rollback does not meet it again)."""
    attempt = int(os.environ.get(ATTEMPT_VAR, "0"))
    for i, fault in enumerate(_planned()):
        if (i not in _fired and fault["kind"] == kind and fault["step"] == step and fault.get("rank", 0) == _rank()
                and fault.get("attempt", 0) == attempt):
            _fired.add(i)
            return fault
    return None


def at_step_start(step: int) -> None:
    """Faults that strike when step `step` begins."""
    if not _planned():
        return
    if due("kill", step):
        os.kill(os.getpid(), signal.SIGKILL)
    fault = due("signal", step)
    if fault:
        os.kill(os.getpid(), getattr(signal, fault.get("signal", "SIGTERM")))


def inside_step(step: int) -> None:
    """Faults that strike in the middle of step `step` (before its collectives)."""
    fault = due("sleep", step) if _planned() else None
    if fault:
        time.sleep(float(fault.get("seconds", 3600)))


def loss_factor(step: int) -> float:
    """1.0, or NaN for the step whose loss is to be poisoned on this rank."""
    return float("nan") if _planned() and due("nan_loss", step) else 1.0


def in_save(step: int | None) -> None:
    """Called after a checkpoint's first file is written."""
    if step is not None and _planned() and due("kill_in_save", step):
        os.kill(os.getpid(), signal.SIGKILL)

"""Hang watchdog: every rank re-arms a deadline at each step boundary (its heartbeat); when a step,
a collective inside it, an evaluation or a checkpoint overruns its time-out, the rank writes which
phase hung and the stacks of all its threads to its log (stderr) and exits with `EXIT_HUNG`, so
the launcher stops the run and the supervisor restarts it from the last checkpoint instead of
letting a hung collective burn the allocation.

A Python thread watches the deadline and writes the message; as a backstop for a main thread that
holds the GIL in native code, `faulthandler`'s C timer dumps the stacks and exits `grace_s` later.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass

from ..schema import Section, need, number

EXIT_HUNG = 124  # as `timeout(1)` reports a command that ran past its limit


class Watchdog:
    """`beat(timeout_s, what)` at each boundary; `close()` at the end. A time-out of 0 disarms it."""

    def __init__(self, rank: int, log=None, grace_s: float = 30.0) -> None:
        self.rank, self.log, self.grace_s = rank, log or sys.stderr, grace_s
        self._deadline: float | None = None
        self._timeout = 0.0
        self._what = ""
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ds_optimus-watchdog", daemon=True)
        self._thread.start()

    def beat(self, timeout_s: float, what: str = "step") -> None:
        """Re-arm: the next beat must come within `timeout_s` seconds (0: no limit until then)."""
        faulthandler.cancel_dump_traceback_later()
        self._timeout, self._what = timeout_s, what
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        if timeout_s > 0:
            faulthandler.dump_traceback_later(timeout_s + self.grace_s, exit=True, file=self.log)
        self._wake.set()

    def close(self) -> None:
        self._deadline = None
        faulthandler.cancel_dump_traceback_later()
        self._wake.set()

    def _watch(self) -> None:
        while True:
            deadline = self._deadline
            self._wake.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._wake.clear()
            deadline = self._deadline
            if deadline is not None and time.monotonic() >= deadline:
                self._fire()

    def _fire(self) -> None:
        try:
            self.log.write(f"\n[ds_optimus watchdog] rank {self.rank}: {self._what} exceeded its "
                           f"{self._timeout:g} s time-out; stacks of all threads follow, then exit {EXIT_HUNG}\n")
            self.log.flush()
            faulthandler.dump_traceback(file=self.log, all_threads=True)
            self.log.flush()
        finally:
            os._exit(EXIT_HUNG)


@dataclass(frozen=True)
class WatchdogConfig(Section):
    """`optimus.watchdog`: the hang watchdog's time-outs; 0 turns that check off."""

    step_timeout_s: float = 900.0
    first_step_timeout_s: float = 3600.0  # the first step after a (re)start also compiles and warms up
    checkpoint_timeout_s: float = 3600.0  # a synchronous save, an evaluation or the final export

    def check(self, where: str) -> None:
        for key in ("step_timeout_s", "first_step_timeout_s", "checkpoint_timeout_s"):
            value = getattr(self, key)
            need(number(value) and value >= 0, f"{where}.{key} must be a number >= 0, got {value!r}")

    def build(self, rank: int) -> Watchdog:
        """This rank's watchdog (its thread starts; nothing is armed until the first `beat`)."""
        return Watchdog(rank)

"""Hang watchdog: past a deadline re-armed at each step boundary, a rank logs the hung phase and its
thread stacks and exits `EXIT_HUNG` (backstop: `faulthandler`'s C timer, for native code holding the GIL).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ..schema import Section, need, non_negative_int, number

EXIT_HUNG = 124  # as `timeout(1)` reports a command that ran past its limit


class Watchdog:
    """`beat(timeout_s, what)` at each boundary; `close()` at the end. A time-out of 0 disarms it."""

    def __init__(self, rank: int, log=None, grace_s: float = 30.0) -> None:
        self.rank, self.log, self.grace_s = rank, log or sys.stderr, grace_s
        self._deadline: float | None = None
        self._timeout = 0.0
        self._what = ""
        self._wake = threading.Event()
        self._closed = False
        # called when it fires, before the stacks: each may return a line to say (fault attribution)
        self.on_fire: list = []
        self.after_fire: list = []  # called once its message and stacks are written, right before the exit
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

    def describe(self) -> str:
        """What is armed, as `step 5 exceeded its 20 s time-out`."""
        return f"{self._what} exceeded its {self._timeout:g} s time-out"

    def close(self) -> None:
        """Disarm, end the watching thread and drop the hooks."""
        self._closed = True
        self._deadline = None
        faulthandler.cancel_dump_traceback_later()
        self.on_fire, self.after_fire = [], []
        self._wake.set()

    def _watch(self) -> None:
        while not self._closed:
            deadline = self._deadline
            self._wake.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._wake.clear()
            if self._closed:
                return
            deadline = self._deadline
            if deadline is not None and time.monotonic() >= deadline:
                self._fire()

    def _fire(self) -> None:
        try:
            notes = []
            for hook in self.on_fire:
                try:
                    note = hook()
                except Exception as err:  # noqa: BLE001  (attribution is best effort: the exit must happen)
                    note = f"[ds_optimus watchdog] fault attribution failed: {type(err).__name__}: {err}"
                if note:
                    notes.append(note)
            self._write(
                "".join(note + "\n" for note in notes)
                + f"[ds_optimus watchdog] rank {self.rank}: {self.describe()}; stacks of all threads follow, "
                f"then exit {EXIT_HUNG}\n" + thread_stacks()
            )
            for hook in self.after_fire:
                hook()
        finally:
            os._exit(EXIT_HUNG)

    def _write(self, text: str) -> None:
        """Write `text` with each line rank-prefixed, one `write` per line."""
        # all ranks fire at once into one launcher pipe; a write up to PIPE_BUF (4 KiB) stays whole
        try:
            fd = self.log.fileno()
        except (AttributeError, OSError):  # a stream with no descriptor (a test's StringIO)
            fd = None
        self.log.flush()
        prefix = f"[rank {self.rank}] "
        for i, line in enumerate(text.splitlines()):
            start = "" if i else "\n"  # off the end of a progress bar's line
            if fd is None:
                self.log.write(start + prefix + line + "\n")
            else:
                os.write(fd, (start + prefix + line).encode("utf-8", "replace")[: _PIPE_BUF - 1] + b"\n")
        self.log.flush()


_PIPE_BUF = 4096


def thread_stacks() -> str:
    """The Python stack of every thread of this process, as one text."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    current = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        here = " (the watchdog, writing this)" if ident == current else ""
        parts.append(f'Thread {ident:#x} "{names.get(ident, "?")}"{here}, most recent call last:\n')
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)


@dataclass(frozen=True)
class WatchdogConfig(Section):
    """`optimus.watchdog`: the hang watchdog's time-outs; 0 turns that check off."""

    step_timeout_s: float = 900.0  # time-out of any other step: past it the rank dumps its stacks and exits 124
    first_step_timeout_s: float = 3600.0  # time-out of the first step after a (re)start, which compiles and warms up
    checkpoint_timeout_s: float = 3600.0  # time-out of a synchronous save, an evaluation or the final export
    # seconds at most a rank whose watchdog fired waits for every other rank to say its watchdog fired too
    # before naming the ranks that did not reach the collective (in faults.jsonl); 0: no heartbeats
    heartbeat_grace_s: float = 10.0
    straggler_interval: int = 100  # every this many steps, gather each rank's step time (a small all-gather); 0: never
    straggler_factor: float = 1.5  # a rank this many times slower than the median is named a straggler

    def check(self, where: str) -> None:
        for key in ("step_timeout_s", "first_step_timeout_s", "checkpoint_timeout_s", "heartbeat_grace_s"):
            value = getattr(self, key)
            need(number(value) and value >= 0, f"{where}.{key} must be a number >= 0, got {value!r}")
        need(
            non_negative_int(self.straggler_interval),
            f"{where}.straggler_interval must be an integer >= 0, got {self.straggler_interval!r}",
        )
        need(
            number(self.straggler_factor) and self.straggler_factor > 1,
            f"{where}.straggler_factor must be a number > 1, got {self.straggler_factor!r}",
        )

    def build(self, rank: int) -> Watchdog:
        """This rank's watchdog, armed at its first `beat`."""
        # the backstop's grace covers the heartbeats' wait and one read of every rank's record
        return Watchdog(rank, grace_s=30.0 + 2 * self.heartbeat_grace_s + 60.0)

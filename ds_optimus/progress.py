"""Progress of long work: a tqdm bar on a terminal, else plain lines every `interval` seconds. A leaf: imports
nothing of ds_optimus.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def progress(
    total: int | None = None,
    initial: int = 0,
    desc: str = "",
    unit: str = "it",
    file: TextIO | None = None,
    interval: float = 30.0,
):
    """tqdm on a terminal, else `LineProgress` (tqdm's `update`, `set_postfix`, `write`, `close`, `n`)."""
    file = file or sys.stderr
    if getattr(file, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=file)
    return LineProgress(total, initial, desc, unit, file, interval)


class LineProgress:
    """tqdm's interface as lines `desc: n/total unit (k=v, ...)`, at most every `interval` seconds and at `close()`."""

    def __init__(self, total: int | None, initial: int, desc: str, unit: str, file: TextIO, interval: float) -> None:
        self.total, self.n, self.desc, self.unit, self.file, self.interval = total, initial, desc, unit, file, interval
        self.initial = initial
        self.postfix: dict[str, Any] = {}
        self.started = self.last = time.monotonic()
        self.shown = initial

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = {**(values or {}), **kwargs}

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._line()

    def write(self, text: str, file: TextIO | None = None) -> None:
        print(text, file=file or self.file, flush=True)

    def close(self) -> None:
        if self.n != self.shown:
            self._line()
        self.shown = self.n

    def _line(self) -> None:
        done = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        rate = (self.n - self.initial) / max(time.monotonic() - self.started, 1e-9)
        extra = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(
            f"{self.desc}: {done} {self.unit}s ({rate:,.2f} {self.unit}s/s{', ' + extra if extra else ''})",
            file=self.file,
            flush=True,
        )
        self.last, self.shown = time.monotonic(), self.n

"""Preemption: SIGTERM and SIGUSR1 (a scheduler's warning) ask for a checkpoint at the next step boundary and an exit
with `EXIT_PREEMPTED`; the ranks all-reduce the flag there, so all stop after the same step."""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the supervisor reads EXIT_PREEMPTED without PyTorch
    import torch

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", the checkpoint to resume from is written
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Installs the handlers (restored by `close()`)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        self._wakeup = _WakeupWatcher() if threading.current_thread() is threading.main_thread() else None

    def _handle(self, signum, frame) -> None:
        from .heartbeat import say_everywhere

        self.received = signal.Signals(signum).name
        say_everywhere("signal")  # (the wake-up thread has said it already, unless the pipe was full)

    def requested(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank received a signal (collective, at a step boundary)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if self._wakeup is not None:
            self._wakeup.close()
            self._wakeup = None


class _WakeupWatcher:
    """Says `signal` in the heartbeats at once from a thread reading `set_wakeup_fd`'s pipe (a rank blocked in a
    collective may never run the Python handler); bytes go on to an earlier wake-up fd."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler never blocks
        self._before = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="ds_optimus-signals", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from .heartbeat import say_everywhere

        watched = {int(sig) for sig in SIGNALS}
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:  # closed
                return
            if watched & set(data):
                say_everywhere("signal")
            if self._before != -1:
                try:
                    os.write(self._before, data)
                except OSError:
                    pass

    def close(self) -> None:
        signal.set_wakeup_fd(self._before)  # the main thread's, as the handlers' restore is
        os.close(self._write)  # the thread reads end-of-file and ends
        self._thread.join(timeout=5)
        os.close(self._read)

"""Preemption: SIGTERM and SIGUSR1 (a scheduler's warning before it kills the job or at its time
limit) ask for a checkpoint at the next step boundary and a clean exit with `EXIT_PREEMPTED`.

The handler only sets a flag. At each step boundary the ranks all-reduce it (a signal may reach only
some ranks), so they all stop after the same step, write the same checkpoint and exit together.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the supervisor reads EXIT_PREEMPTED without PyTorch
    import torch

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", the checkpoint to resume from is written
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Installs the handlers (restored by `close()`); `requested()` is collective."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank received a signal (collective: every rank calls it at the same boundary)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

"""Per-rank tensor memory of a training run, the check on the layout planner's memory model: the
allocator's statistics on accelerators, the profiler's allocation events summed on the CPU (tensor
memory only, not the allocator's caching or fragmentation).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..verbosity import without_profiler_chatter


class MemoryMeter:
    """Tensor bytes this rank held since `start`: `stop` returns {"peak_bytes", "marks": {label: bytes}}."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._profiler = None
        self._marks: dict[str, Any] = {}
        self._accelerator = None
        self._base = 0
        self.result: dict[str, Any] | None = None

    def start(self) -> None:
        if self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with without_profiler_chatter():
                self._profiler.__enter__()
        else:
            from deepspeed.accelerator import get_accelerator

            self._accelerator = get_accelerator()
            self._accelerator.synchronize()
            self._accelerator.reset_peak_memory_stats()
            self._base = self._accelerator.memory_allocated()

    @property
    def running(self) -> bool:
        return self.result is None and (self._profiler is not None or self._accelerator is not None)

    def mark(self, label: str) -> None:
        """Remember the bytes held now under `label`."""
        if not self.running:
            return
        if self._profiler is not None:
            self._marks[label] = time.time_ns()  # the clock the profiler stamps its events with
        else:
            self._accelerator.synchronize()
            self._marks[label] = self._accelerator.memory_allocated() - self._base

    def stop(self) -> dict[str, Any]:
        if self.result is not None:
            return self.result
        if self._profiler is not None:
            with without_profiler_chatter():
                self._profiler.__exit__(None, None, None)
            events = sorted(
                (e.start_ns(), e.nbytes())
                for e in self._profiler.profiler.kineto_results.events()
                if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
            )
            held = peak = 0
            marks = dict.fromkeys(self._marks, 0)
            pending = sorted(self._marks.items(), key=lambda kv: kv[1])
            for t, nbytes in events:
                while pending and pending[0][1] < t:
                    marks[pending.pop(0)[0]] = held
                held += nbytes
                peak = max(peak, held)
            for label, _ in pending:
                marks[label] = held
            self._profiler = None
            self.result = {"peak_bytes": peak, "marks": marks}
        elif self._accelerator is not None:
            self._accelerator.synchronize()
            peak = self._accelerator.max_memory_allocated() - self._base
            self.result = {"peak_bytes": peak, "marks": dict(self._marks)}
        else:
            self.result = {"peak_bytes": 0, "marks": {}}
        return self.result

"""Per-phase and per-collective timing of a profiled training step (`optimus.profile`).

`StepTimer` marks phase edges (device events, or `perf_counter` on the CPU), read once in `finish()`.
`CollectiveRecorder` wraps torch.distributed's collectives (and DeepSpeed's backend-bound two) for one step,
counting per phase each call's kind, bytes sent, group size and time (async: issue time only).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed functions counted: name -> (kind, the argument holding what this rank sends; None: nothing sized)
COLLECTIVES: dict[str, tuple[str, str | None]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "all_gather_single": ("all_gather", "input_tensor"),
    "_all_gather_base": ("all_gather", "input_tensor"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", "scatter_list"),
    "send": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
    "barrier": ("barrier", None),
    "monitored_barrier": ("barrier", None),
    "all_gather_object": ("all_gather_object", None),
    "broadcast_object_list": ("broadcast_object_list", None),
    "gather_object": ("gather_object", None),
    "scatter_object_list": ("scatter_object_list", None),
    "send_object_list": ("send", None),
    "recv_object_list": ("recv", None),
}
BATCH_P2P = "batch_isend_irecv"
POINT_TO_POINT = ("send", "recv")  # kinds whose "group" is the two ranks
P2P_OPS = ("isend", "irecv")  # asynchronous always; replaced in distributed_c10d as well (P2POp compares them there)
# DeepSpeed's comm backend (deepspeed.comm.comm.cdb) keeps these torch.distributed functions from its start
DEEPSPEED_BOUND = ("all_gather_function", "reduce_scatter_function")


# -- clocks ---------------------------------------------------------------------------------------------


class HostClock:
    """Host clock: marks are `time.perf_counter()` readings."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def settle(self) -> None:
        """Nothing to wait for on the host."""

    def recycle(self, marks: list) -> None:
        pass


class EventClock:
    """Marks are timing events recorded on the current stream (no wait); `settle` waits for the device once."""

    def __init__(self, event_type, synchronize) -> None:
        self.event_type, self.synchronize = event_type, synchronize
        self.free: list = []  # kept for the next profiled step: creating events is not free

    def mark(self):
        event = self.free.pop() if self.free else self.event_type(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def settle(self) -> None:
        self.synchronize()

    def recycle(self, marks: list) -> None:
        self.free.extend(marks)


def clock_for(device: torch.device | str) -> HostClock | EventClock:
    """Device timing events where DeepSpeed's accelerator has them, else the host clock."""
    if torch.device(device).type == "cpu":
        return HostClock()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    event_type = accelerator.Event
    return HostClock() if event_type is None else EventClock(event_type, accelerator.synchronize)


# -- one profiled step ----------------------------------------------------------------------------------


class _Phase:
    """Context marking phase `name` of `timer`'s step."""

    __slots__ = ("timer", "name", "start", "outer")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.outer, self.timer.current = self.timer.current, self.name
        self.start = self.timer.clock.mark()

    def __exit__(self, *exc) -> None:
        timer = self.timer
        timer.spans.append((self.name, self.start, timer.clock.mark()))
        timer.current = self.outer


@dataclass
class StepProfile:
    """One rank's numbers of one profiled step, in seconds and bytes."""

    phases: dict[str, float]  # each phase's time, summed over the step's micro-batches, in the order first seen
    step_s: float  # from the first phase's start to the last one's end
    before_reduce_s: float | None  # from the step's start to its reduction's (None: no reduction timed)
    reduce_s: float | None  # the step's reduction: the wait for the slowest rank, the all-reduce, the read
    comm: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> {"s", "bytes", "calls", "ranks"}

    def metrics(self) -> dict[str, float]:
        """The numbers under their metrics.jsonl `profile/...` names (`rest_s`: the step's time in no phase)."""
        out = {f"profile/{name}_s": seconds for name, seconds in self.phases.items()}
        out["profile/rest_s"] = max(0.0, self.step_s - sum(self.phases.values()))
        out["profile/step_s"] = self.step_s
        for kind, numbers in self.comm.items():
            out.update({f"profile/comm/{kind}_{key}": value for key, value in numbers.items()})
        return out


class StepTimer:
    """The marks of one profiled step: phase spans and counted collective calls."""

    def __init__(self, clock: HostClock | EventClock) -> None:
        self.clock = clock
        self.spans: list[tuple[str, Any, Any]] = []
        self.calls: list[tuple[str, str, int, int, Any]] = []  # timing: (start, end) marks, or issue seconds
        self.current: str | None = None  # the phase running now

    def phase(self, name: str) -> _Phase:
        """A context timing phase `name`; repeats (each micro-batch's forward) add up."""
        return _Phase(self, name)

    def finish(self) -> StepProfile | None:
        """Wait for the device once and read the step's marks (None if no phase ran)."""
        if not self.spans:
            return None
        clock = self.clock
        clock.settle()
        first = self.spans[0][1]
        phases: dict[str, float] = {}
        reduce_span = None
        for name, start, end in self.spans:
            phases[name] = phases.get(name, 0.0) + clock.seconds(start, end)
            if name == "reduce" and reduce_span is None:
                reduce_span = (start, end)
        comm: dict[str, dict[str, float]] = {}
        for kind, _phase, nbytes, ranks, timing in self.calls:
            seconds = clock.seconds(*timing) if isinstance(timing, tuple) else timing
            entry = comm.setdefault(kind, {"s": 0.0, "bytes": 0, "calls": 0, "ranks": 0})
            entry["s"] += seconds
            entry["bytes"] += nbytes
            entry["calls"] += 1
            entry["ranks"] = max(entry["ranks"], ranks)
        profile = StepProfile(
            phases,
            clock.seconds(first, self.spans[-1][2]),
            None if reduce_span is None else clock.seconds(first, reduce_span[0]),
            None if reduce_span is None else clock.seconds(*reduce_span),
            comm,
        )
        clock.recycle(
            [m for _, start, end in self.spans for m in (start, end)]
            + [m for *_, timing in self.calls if isinstance(timing, tuple) for m in timing]
        )
        return profile


# -- collectives ----------------------------------------------------------------------------------------


def _nbytes(value) -> int:
    """Bytes of a tensor or of a (nested) list of tensors; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _argument(args: tuple, kwargs: dict, position: dict[str, int], name: str | None):
    if name is None:
        return None
    if name in kwargs:
        return kwargs[name]
    index = position.get(name)
    return args[index] if index is not None and index < len(args) else None


class CollectiveRecorder:
    """Counting wrappers over torch.distributed's collectives for one profiled step (`install`/`uninstall`)."""

    def __init__(self) -> None:
        self.timer: StepTimer | None = None
        self.thread = threading.get_ident()  # calls of other threads (a background writer) are not the step's
        self.inside = False  # in a counted call: a collective it makes is its own
        self.installed: list[tuple[Any, str, Any, Any]] = []  # (holder, name, original, wrapper)
        self._wrappers: dict[int, Any] = {}  # id(original) -> its wrapper, built once

    def install(self, timer: StepTimer) -> None:
        self.uninstall()
        self.timer, self.thread = timer, threading.get_ident()
        for holder, name, original, spec in _targets():
            wrapper = self._wrappers.get(id(original))
            if wrapper is None or wrapper.__wrapped__ is not original:
                wrapper = self._wrappers[id(original)] = self._wrap(original, spec)
            setattr(holder, name, wrapper)
            self.installed.append((holder, name, original, wrapper))

    def uninstall(self) -> None:
        for holder, name, original, wrapper in reversed(self.installed):
            # one patched over by someone after us stays (removing it would undo theirs) but counts nothing
            if getattr(holder, name, None) is wrapper:
                setattr(holder, name, original)
        self.installed.clear()
        self.timer = None

    def _counting(self) -> StepTimer | None:
        """The step's timer if a call now counts: inside a phase, on the step's thread, not nested."""
        timer = self.timer
        if timer is None or timer.current is None or self.inside or threading.get_ident() != self.thread:
            return None
        return timer

    def _wrap(self, original, spec: tuple[str, str | None] | None):
        if spec is None:
            return self._wrap_batch(original)
        kind, sent = spec
        names = list(inspect.signature(original).parameters)
        position = {name: names.index(name) for name in (sent, "group", "async_op") if name in names}
        always_async, is_isend = original.__name__ in P2P_OPS, original.__name__ == "isend"
        recorder = self

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if is_isend and "group_src" in kwargs:  # a P2POp made while wrapped, run after: `op is isend` failed
                kwargs["group_dst"] = kwargs.pop("group_src")
            timer = recorder._counting()
            if timer is None:
                return original(*args, **kwargs)
            asynchronous = always_async or bool(_argument(args, kwargs, position, "async_op"))
            clock = timer.clock
            recorder.inside = True
            try:
                if asynchronous:  # the time to issue it, on the host
                    began = time.perf_counter()
                    result = original(*args, **kwargs)
                    timing = time.perf_counter() - began
                else:
                    start = clock.mark()
                    result = original(*args, **kwargs)
                    timing = (start, clock.mark())
            finally:
                recorder.inside = False
            ranks = 2 if kind in POINT_TO_POINT else dist.get_world_size(_argument(args, kwargs, position, "group"))
            timer.calls.append((kind, timer.current, _nbytes(_argument(args, kwargs, position, sent)), ranks, timing))
            return result

        return counted

    def _wrap_batch(self, original):
        """Counts each op as a `send` or `recv`, the batch's issue time on the first."""
        recorder = self

        @functools.wraps(original)
        def counted(p2p_op_list, *args, **kwargs):
            for op in p2p_op_list:  # one made before the wrappers went in: what `op is isend` now expects
                wrapper = recorder._wrappers.get(id(op.op))
                if wrapper is not None and recorder.installed:
                    op.op = wrapper
            timer = recorder._counting()
            if timer is None:
                return original(p2p_op_list, *args, **kwargs)
            recorder.inside = True
            try:
                began = time.perf_counter()
                result = original(p2p_op_list, *args, **kwargs)
                issue = time.perf_counter() - began
            finally:
                recorder.inside = False
            for i, op in enumerate(p2p_op_list):
                kind = "recv" if "recv" in getattr(op.op, "__name__", "") else "send"
                timer.calls.append((kind, timer.current, _nbytes(op.tensor), 2, issue if i == 0 else 0.0))
            return result

        return counted


def _targets():
    """(holder, attribute, function, spec or None for batch_isend_irecv) of every function to wrap."""
    from torch.distributed import distributed_c10d

    for name, spec in COLLECTIVES.items():
        function = getattr(dist, name, None)
        if function is not None:
            yield dist, name, _unwrapped(function), spec
            if name in P2P_OPS and _unwrapped(getattr(distributed_c10d, name, None)) is _unwrapped(function):
                yield distributed_c10d, name, _unwrapped(function), spec
    batch = getattr(dist, BATCH_P2P, None)
    if batch is not None:
        yield dist, BATCH_P2P, _unwrapped(batch), None
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    for attribute in DEEPSPEED_BOUND:
        function = _unwrapped(getattr(backend, attribute, None))
        spec = COLLECTIVES.get(getattr(function, "__name__", ""))
        if spec is not None and callable(function):
            yield backend, attribute, function, spec


def _unwrapped(function):
    """`function` with any leftover counting wrappers peeled off."""
    while getattr(function, "__qualname__", "").startswith("CollectiveRecorder._wrap"):
        function = function.__wrapped__
    return function


# -- a log interval's worth ------------------------------------------------------------------------------


class ProfileWindow:
    """Profiled steps since the last log: per-step means (group sizes: the largest) and pooled rank times."""

    RANK_FLAGS = ("profile/ranks", "profile/compute", "profile/compute_sq", "profile/wait", "profile/wait_sq")

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.ranks = dict.fromkeys(self.RANK_FLAGS, 0.0)
        self.ranks_step: int | None = None

    def __bool__(self) -> bool:
        return bool(self.steps or self.ranks["profile/ranks"])

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] = (
                max(self.sums.get(key, 0), value) if key.endswith("_ranks") else self.sums.get(key, 0.0) + value
            )
        self.steps += 1

    def add_ranks(self, summed: dict[str, float], step: int) -> None:
        """Add the flags' sums over ranks (from the step's reduction) of profiled step `step`."""
        for key in self.RANK_FLAGS:
            self.ranks[key] += summed[key]
        self.ranks_step = step

    def take(self) -> dict[str, float]:
        """The record (then empty): per-step means, and over ranks `profile/compute_s` (before the reduction)
        and `profile/jitter_s` (waiting in it), with stds."""
        record = (
            {key: value if key.endswith("_ranks") else value / self.steps for key, value in self.sums.items()}
            if self.steps
            else {}
        )
        record = {key: _whole(value) if key.endswith(COUNTS) else value for key, value in record.items()}
        count = self.ranks["profile/ranks"]
        if count:
            for name, flag in (("compute", "profile/compute"), ("jitter", "profile/wait")):
                mean = self.ranks[flag] / count
                record[f"profile/{name}_s"] = mean
                record[f"profile/{name}_std_s"] = math.sqrt(max(0.0, self.ranks[f"{flag}_sq"] / count - mean * mean))
            record["profile/ranks_step"] = self.ranks_step
        self._clear()
        return record


COUNTS = ("_bytes", "_calls", "_ranks")  # metrics that are counts: whole ones are written as integers


def _whole(value: float) -> float | int:
    """A count or size that came out whole, as an integer."""
    return int(value) if isinstance(value, int) or (value.is_integer() and abs(value) < 2**53) else value

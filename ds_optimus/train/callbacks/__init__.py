"""Everything around the training step, one concern per callback (`Callback` lists the hooks);
`default_callbacks` orders them.
"""

from __future__ import annotations

from .base import Callback
from .checkpointing import CheckpointCallback
from .clip_after_warmup import ClipAfterWarmupCallback
from .downstream import DownstreamCallback
from .evaluation import EvaluationCallback
from .fault_record import FaultRecordCallback
from .faults import FaultInjectionCallback
from .logging import MetricsCallback, ProgressFileCallback
from .peak_memory import MemoryCallback
from .phase_timing import PhaseProfileCallback
from .profiling import ProfileCallback
from .reliability import GuardCallback, PreemptionCallback, WatchdogCallback
from .router_bias import RouterBiasCallback, uses_router_bias

__all__ = [
    "Callback",
    "CheckpointCallback",
    "FaultRecordCallback",
    "ClipAfterWarmupCallback",
    "DownstreamCallback",
    "EvaluationCallback",
    "FaultInjectionCallback",
    "GuardCallback",
    "MemoryCallback",
    "MetricsCallback",
    "PhaseProfileCallback",
    "PreemptionCallback",
    "ProfileCallback",
    "ProgressFileCallback",
    "RouterBiasCallback",
    "WatchdogCallback",
    "default_callbacks",
    "uses_router_bias",
]


def default_callbacks(opt, extra: list[Callback] = ()) -> list[Callback]:
    """The callbacks of a run of `opt`, with the user's `extra`, in hook order."""
    # downstream evaluation first, so that it closes last: after the watchdog, while waiting for its scores
    callbacks: list[Callback] = [DownstreamCallback(opt.eval.downstream)] if opt.eval.downstream.enabled else []
    callbacks.append(WatchdogCallback(opt.watchdog))  # re-arms before anything else can hang
    faults = FaultInjectionCallback.from_environment()
    if faults is not None:
        callbacks.append(faults)
    callbacks.append(FaultRecordCallback(opt.watchdog.straggler_interval, opt.watchdog.straggler_factor))
    if opt.train.measure_memory_steps:
        callbacks.append(MemoryCallback(opt.train.measure_memory_steps))
    if opt.train.profile_steps:
        callbacks.append(ProfileCallback(*opt.train.profile_steps))
    if opt.profile.enabled:  # its post_step before the guards' rollback can skip it
        callbacks.append(PhaseProfileCallback(opt.profile))
    if opt.train.clip_after_warmup:
        callbacks.append(ClipAfterWarmupCallback())
    callbacks += [
        RouterBiasCallback(),
        MetricsCallback(),
        ProgressFileCallback(),
        GuardCallback(opt.guards),  # a rollback ends the step's remaining post_step calls
        *extra,  # before evaluation and checkpoints, so what they do or ask (a stop) is in them
        EvaluationCallback(),
        PreemptionCallback(),  # its stop wins over others
    ]
    if opt.checkpoint.enabled:
        callbacks.append(CheckpointCallback())
    return callbacks

"""Everything around the training step, one concern per callback (`Callback` lists the hooks).

`default_callbacks(opt, extra)` gives a run's callbacks in the order their hooks run: the watchdog
first (it re-arms before anything else can hang), fault injection (only with `DS_OPTIMUS_FAULTS`),
the naming of ranks behind a non-finite loss and of stragglers (into faults.jsonl), the memory
meter, the profilers (`optimus.train.profile_steps`, then the phase profiler of `optimus.profile`, whose
`post_step` comes before the guards' rollback can skip it), clipping after the warm-up
(`optimus.train.clip_after_warmup`), the router-bias update right after the optimizer step, metrics
and the progress file, the guards (whose rollback ends the step's remaining `post_step` calls), then
the `extra` callbacks of the user, so that what they do or ask for (a stop) is in the step's
evaluation and checkpoint, then evaluation, preemption (whose stop wins over others) and the
checkpoints, last. The downstream tasks scored on each checkpoint (`optimus.eval.downstream`) come
first, so they close last.
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
    """The callbacks of a run of the parsed `optimus` section `opt`, with the user's `extra`, in
    hook order."""
    # downstream evaluation first, so that it closes last: after the watchdog, while waiting for its scores
    callbacks: list[Callback] = [DownstreamCallback(opt.eval.downstream)] if opt.eval.downstream.enabled else []
    callbacks.append(WatchdogCallback(opt.watchdog))
    faults = FaultInjectionCallback.from_environment()
    if faults is not None:
        callbacks.append(faults)
    callbacks.append(FaultRecordCallback(opt.watchdog.straggler_interval, opt.watchdog.straggler_factor))
    if opt.train.measure_memory_steps:
        callbacks.append(MemoryCallback(opt.train.measure_memory_steps))
    if opt.train.profile_steps:
        callbacks.append(ProfileCallback(*opt.train.profile_steps))
    if opt.profile.enabled:
        callbacks.append(PhaseProfileCallback(opt.profile))
    if opt.train.clip_after_warmup:
        callbacks.append(ClipAfterWarmupCallback())
    callbacks += [
        RouterBiasCallback(),
        MetricsCallback(),
        ProgressFileCallback(),
        GuardCallback(opt.guards),
        *extra,
        EvaluationCallback(),
        PreemptionCallback(),
    ]
    if opt.checkpoint.enabled:
        callbacks.append(CheckpointCallback())
    return callbacks

"""The hang watchdog, preemption by a signal, and the numerical guards with their rollback."""

from __future__ import annotations

from functools import partial
from typing import Any

from ...reliability.guards import GuardsConfig
from ...reliability.signals import EXIT_PREEMPTED, PreemptionHandler
from ...reliability.watchdog import EXIT_HUNG, WatchdogConfig
from ...run_log import append_log
from .base import Callback


class WatchdogCallback(Callback):
    """Re-arms this rank's watchdog at every boundary: the step's time-out before a step (a longer
    one for the first step of an invocation, which also compiles and warms up) and for the short
    work after it, the checkpoint time-out before each evaluation, checkpoint and the export."""

    def __init__(self, config: WatchdogConfig) -> None:
        self.config = config
        self.watchdog = None
        self.heartbeat = None  # set up with the watchdog (optimus.watchdog.heartbeat_grace_s > 0)

    def setup(self) -> None:
        from ...launch.environment import this_host
        from ...reliability.heartbeat import Heartbeat

        self.watchdog = self.config.build(self.trainer.rank)
        self.heartbeat = None
        if self.config.heartbeat_grace_s > 0:
            self.heartbeat = Heartbeat(self.trainer.output_dir, self.trainer.rank, this_host())
            self.watchdog.on_fire.append(self._name_the_missing)

    def _name_the_missing(self) -> str | None:
        """On a fired watchdog: the ranks that did not reach the collective the others wait in,
        named (by the lowest rank that waits) and recorded in faults.jsonl."""
        from ...reliability.fault_log import append_fault, describe
        from ...reliability.heartbeat import name_the_missing, report_written

        behind, reporter = name_the_missing(self.heartbeat, self.trainer.world, self.config.heartbeat_grace_s)
        if reporter:  # the others wait for its report before they exit
            self.watchdog.after_fire.append(partial(report_written, self.heartbeat))
        if not reporter or not behind:
            return None
        ranks = [b if isinstance(b, int) else b.rank for b in behind]
        known = getattr(self.trainer, "rank_hosts", None) or []  # every rank's host, gathered at the start
        hosts = [b.host if not isinstance(b, int) else known[b] if b < len(known) else "unknown" for b in behind]
        step = self.heartbeat.step
        detail = "; ".join(
            f"rank {b}: no heartbeat" if isinstance(b, int) else f"rank {b.rank}: {_state(b, step)}"
            for b in behind[:16]
        )
        append_fault(self.trainer.output_dir, step, "hang", ranks, hosts, detail)
        note = (
            f"[ds_optimus watchdog] step {step}: {describe(ranks, hosts)} did not reach the collective the "
            f"others wait in ({detail}); recorded in {self.trainer.output_dir}/faults.jsonl"
        )
        # the run's record too (rank 0's stderr may be gone with the job): the naming and the stop
        append_log(
            self.trainer.output_dir,
            note
            + "\nthe watchdog stopped the run: "
            + self.watchdog.describe()
            + f" (exit {EXIT_HUNG}; every rank's stacks on its stderr)",
        )
        return note

    def on_exit(self, error: BaseException | None) -> None:
        if self.heartbeat is not None:  # before anything can block: a launcher may kill this rank soon
            self.heartbeat.last_word("error" if error is not None else "done")

    def pre_step(self, step: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(step)
        first = step == self.trainer.start_step + 1
        self.watchdog.beat(self.config.first_step_timeout_s if first else self.config.step_timeout_s, f"step {step}")

    def post_step(self, step: int) -> None:
        self.watchdog.beat(self.config.step_timeout_s, f"the work after step {step}")

    def on_long_work(self, what: str) -> None:
        self.watchdog.beat(self.config.checkpoint_timeout_s, what)

    def post_train(self) -> None:
        self.watchdog.beat(self.config.checkpoint_timeout_s, "the end of the run")

    def close(self, error: BaseException | None) -> None:
        if self.watchdog is not None:  # the process may live on (a notebook, a test): no dump later
            self.watchdog.close()
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.close()


def _state(beat, step: int) -> str:
    if beat.step < step:
        return f"last at step {beat.step}"
    return "busy outside any collective" if beat.fired else "not answering (dead, or hung holding the interpreter)"


class PreemptionCallback(Callback):
    """SIGTERM/SIGUSR1 set a flag; the step's all-reduce carries it (a signal may reach only some
    ranks), so every rank stops after the same step, writes the same checkpoint and exits with
    `EXIT_PREEMPTED`."""

    def __init__(self) -> None:
        self.handler: PreemptionHandler | None = None

    def setup(self) -> None:
        self.handler = PreemptionHandler()

    def step_flags(self) -> dict[str, float]:
        return {"preempt": 1.0 if self.handler is not None and self.handler.received else 0.0}

    def post_step(self, step: int) -> None:
        if self.trainer.metrics.pop("preempt", 0.0) > 0:
            self.trainer.request_stop("preempted")

    def on_checkpoint(self, step, path) -> None:
        if self.trainer.stop_reason == "preempted":
            self.trainer.message(
                f"step {step}: {self.handler.received or 'a signal on another rank'}: checkpoint "
                f"written, exiting with status {EXIT_PREEMPTED} (run again to resume)"
            )

    def close(self, error: BaseException | None) -> None:
        if self.handler is not None:
            self.handler.close()
            self.handler = None


class GuardCallback(Callback):
    """Plugs the numerical guard into the sharded optimizer's step (it judges the step's loss,
    reduced over ranks, and its gradient norm), reports skipped updates, and after
    `guards.rollback_after` bad steps in a row rolls the run back to the last intact checkpoint,
    keeping the data loader where it is (the batches that went wrong are not seen again). After
    `guards.max_rollbacks` rollbacks to one checkpoint, lasting spikes become the run's new level
    and non-finite steps stop it: rolling back again would only throw more data away."""

    state_key = "guard"

    def __init__(self, config: GuardsConfig) -> None:
        self.guard = config.build()
        self.max_rollbacks = config.max_rollbacks
        self.rollbacks: dict[str, int] = {}  # rollbacks to each checkpoint in this invocation
        self.note: str | None = None  # said once the run's log is open

    def pre_train(self) -> None:
        from ...optim.sharded import ShardedOptimizer

        trainer = self.trainer
        if self.guard is None:  # optimus.guards.enabled is false
            return
        if not isinstance(trainer.engine.optimizer, ShardedOptimizer):
            trainer.message(
                "numerical guards act through the sharded optimizer (optimus.sharded_optimizer.enabled); "
                "they are off for this run"
            )
            self.guard = None
            return
        trainer.engine.optimizer.step_filter = self._decide
        if self.note:
            trainer.message(self.note)

    def _decide(self, grad_norm: float):
        self.guard.observe_loss(self.trainer.metrics["loss"])
        return self.guard.decide(grad_norm)

    def post_step(self, step: int) -> None:
        guard, trainer = self.guard, self.trainer
        if guard is None:
            return
        if guard.last.skip:
            trainer.message(f"step {step}: update skipped on every rank ({guard.last.reason})")
        if guard.wants_rollback:
            self._roll_back(step)

    def _roll_back(self, step: int) -> None:
        from ...checkpoint.files import CheckpointError

        trainer, guard = self.trainer, self.guard
        trainer.checkpoints.wait()  # a save in flight finishes first
        target = trainer.checkpoints.latest_good(report=trainer.message)
        again = self.rollbacks.get(target.name, 0) if target is not None else 0
        if target is not None and 0 < self.max_rollbacks <= again:
            if not guard.spikes_only:
                raise CheckpointError(
                    f"step {step}: {guard.bad_in_a_row} bad steps in a row ({guard.last.reason}) "
                    f"after {again} rollbacks to {target.name}: the run does not get past them; "
                    "look at the learning rate and the data"
                )
            trainer.message(
                f"step {step}: {guard.bad_in_a_row} spikes in a row ({guard.last.reason}) after {again} "
                f"rollbacks to {target.name}; taking them as the new level (the guards' statistics start "
                "afresh)"
            )
            guard.accept_new_level()
            return
        if target is None and guard.spikes_only:
            # Finite spikes that last have become the run's level (a routing shift, a new data mix):
            # with nothing to roll back to, stopping would only lose the run.
            trainer.message(
                f"step {step}: {guard.bad_in_a_row} spikes in a row ({guard.last.reason}) and no "
                "checkpoint to roll back to yet; taking them as the new level (the guards' statistics "
                "start afresh)"
            )
            guard.accept_new_level()
            return
        if target is None:
            interval = trainer.opt.checkpoint.interval
            hint = f"the first checkpoint is due at step {interval}" if interval else "set optimus.checkpoint.interval"
            raise CheckpointError(
                f"step {step}: {guard.bad_in_a_row} bad steps in a row ({guard.last.reason}) and no "
                f"checkpoint to roll back to ({hint})"
            )
        position = trainer.train_loader.state_dict()
        resumed, extra = trainer.checkpoints.load(target, trainer.engine)
        trainer.train_loader.load_state_dict(position)
        for callback in trainer.callbacks:  # the others' state as it was then (the guard keeps its own)
            if callback.state_key is not None and callback is not self:
                callback.load_state_dict(extra.get(callback.state_key, {}))
        trainer.message(
            f"step {step}: {guard.bad_in_a_row} bad steps in a row ({guard.last.reason}); rolled back to "
            f"{target.name} and skipping the data read since"
        )
        guard.reset_after_rollback()
        self.rollbacks[target.name] = again + 1
        trainer.summary["rollbacks"] += 1
        trainer.rewind(resumed)

    def state_dict(self) -> dict[str, Any]:
        if self.guard is None:
            return {}
        return {**self.guard.state_dict(), "tokens_per_step": self.trainer.tokens_per_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.guard is None:
            return
        saved = state.get("tokens_per_step")
        if saved is not None and saved != self.trainer.tokens_per_step:  # another batch: another noise level
            state = {k: v for k, v in state.items() if k not in ("losses", "norms")}
            self.note = f"the numerical guards' statistics start afresh: they were measured at {saved:,} tokens a step"
        self.guard.load_state_dict(state)

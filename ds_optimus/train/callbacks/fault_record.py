"""Naming the ranks and hosts behind a fault: a non-finite loss (which ranks computed it) and
stragglers (which ranks are slow), said in one line and appended to `<output_dir>/faults.jsonl`
for the supervisor (hangs are named by the watchdog's heartbeats: `WatchdogCallback`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel.collectives import collective
from .base import Callback


class FaultRecordCallback(Callback):
    """Each rank's own loss finiteness rides on the step's all-reduce as a count (the trainer's
    `nonfinite_ranks`); only when it is not 0 do the ranks say which they are (one all-gather, on bad
    steps alone). Every `straggler_interval` steps the ranks' arrival times at the step's reduction
    are gathered (one all-gather of a number a rank) and those that made the step `straggler_factor`
    times longer than the others needed are named."""

    def __init__(self, straggler_interval: int, straggler_factor: float) -> None:
        self.interval, self.factor = straggler_interval, straggler_factor
        self.hosts: list[str] = []

    def pre_train(self) -> None:
        from ...launch.environment import this_host

        trainer = self.trainer
        self.hosts = [this_host()]
        if trainer.world > 1:  # every rank's host, once
            self.hosts = [""] * trainer.world
            dist.all_gather_object(self.hosts, this_host())
        trainer.rank_hosts = self.hosts  # the watchdog names a rank that never beat by it

    def step_flags(self) -> dict[str, float]:
        """Right before the step's reduction: on a straggler step, wait for this rank's device, so
        that its arrival is its work's end, not its queueing's."""
        trainer = self.trainer
        if self.interval and trainer.step % self.interval == 0 and trainer.world > 1:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()
        return {}

    def post_step(self, step: int) -> None:
        trainer = self.trainer
        if getattr(trainer, "nonfinite_ranks", 0) > 0:
            self._name_nonfinite(step)
        if self.interval and step % self.interval == 0 and trainer.world > 1:
            self._stragglers(step)

    def _name_nonfinite(self, step: int) -> None:
        from ...reliability.fault_log import append_fault, describe

        trainer = self.trainer
        mine = torch.tensor([float(trainer.local_nonfinite.item())])
        flags = _gather(mine, trainer.world)
        ranks = [r for r, flag in enumerate(flags) if flag > 0]
        hosts = [self.hosts[r] for r in ranks]
        if trainer.rank == 0:
            append_fault(trainer.output_dir, step, "nonfinite", ranks, hosts, "the rank's own loss was not finite")
        trainer.message(
            f"step {step}: non-finite loss computed on {describe(ranks, hosts)}; recorded in "
            f"{trainer.output_dir}/faults.jsonl"
        )

    def _stragglers(self, step: int) -> None:
        """Each rank's arrival at the step's reduction, against the first rank's: the ranks wait
        for the last to arrive there, so its lateness is the time the step lost to it (step times
        themselves are alike on every rank, all waiting for the slowest). A delay that an exchange
        inside the step absorbs (expert all-to-all, pipeline sends) shows at that exchange instead."""
        from ...reliability.fault_log import append_fault, describe

        trainer = self.trainer
        arrivals = _gather(torch.tensor([trainer.reduce_arrival], dtype=torch.float64), trainer.world)
        first = min(arrivals)
        late = [a - first for a in arrivals]
        step_seconds = max(trainer.step_seconds, 1e-9)
        worst = max(range(len(late)), key=late.__getitem__)
        trainer.metrics["straggler_seconds"] = late[worst]
        # late by more than (factor - 1) of a step: the step took `factor` times what the others needed
        slow = [r for r, lag in enumerate(late) if lag > (self.factor - 1) * (step_seconds - late[worst])]
        if slow and late[worst] > 0:
            hosts = [self.hosts[r] for r in slow]
            detail = f"the last {late[worst]:.3g} s after the first, in a {step_seconds:.3g}-s step"
            if trainer.rank == 0:
                append_fault(trainer.output_dir, step, "straggler", slow, hosts, detail)
            trainer.message(
                f"step {step}: stragglers: {describe(slow, hosts)} came to the step's reduction late ({detail})"
            )


def _gather(value: torch.Tensor, world: int) -> list[float]:
    """Every rank's one number, on the host (gloo or the accelerator's backend, on the CPU tensor's
    device where the backend takes it)."""
    out = torch.zeros(world, dtype=value.dtype)
    collective("all_gather")(out, value) if dist.get_backend() == "gloo" else _on_device(out, value)
    return out.tolist()


def _on_device(out: torch.Tensor, value: torch.Tensor) -> None:
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    result = out.to(device)
    collective("all_gather")(result, value.to(device))
    out.copy_(result.cpu())

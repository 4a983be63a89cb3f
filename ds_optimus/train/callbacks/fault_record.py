"""Naming the ranks and hosts behind a non-finite loss or a straggler step, in one line and in
`<output_dir>/faults.jsonl` (hangs: `WatchdogCallback`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel.collectives import collective
from .base import Callback


class FaultRecordCallback(Callback):
    """Names the ranks of a non-finite loss (gathered only when the trainer's `nonfinite_ranks` is not 0)
    and, every `straggler_interval` steps, those making the step `straggler_factor` times longer."""

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
        """On a straggler step, sync the device before the reduction, so arrival marks the work's end."""
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
        """Name the ranks arriving late at the step's reduction, against the first rank."""
        # step times are alike on every rank (all wait for the slowest): lateness is what the step lost.
        # A delay an exchange inside the step absorbs (expert all-to-all, pipeline sends) shows there instead
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
    """Every rank's one number, on the host."""
    out = torch.zeros(world, dtype=value.dtype)
    collective("all_gather")(out, value) if dist.get_backend() == "gloo" else _on_device(out, value)
    return out.tolist()


def _on_device(out: torch.Tensor, value: torch.Tensor) -> None:
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    result = out.to(device)
    collective("all_gather")(result, value.to(device))
    out.copy_(result.cpu())

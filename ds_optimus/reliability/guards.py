"""Numerical guards: skip updates whose loss or gradient norm is not finite or spikes, alike on every rank (the
sharded optimizer decides from all-reduced numbers), and ask for a rollback after too many bad steps in a row.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ..schema import Section, need, non_negative_int, number, positive_int


@dataclass
class GuardDecision:
    skip: bool
    reason: str | None = None
    spike: bool = False  # skipped for lying far above the recent steps, not for being non-finite


class StepGuard:
    """Rolling statistics of accepted steps' loss and gradient norm; a step is bad if either is not finite or lies
    over `sigmas` deviations above the mean (from `min_window` steps)."""

    def __init__(
        self,
        window: int = 100,
        min_window: int = 20,
        sigmas: float = 6.0,
        rollback_after: int = 3,
        skip_spikes: bool = True,
    ) -> None:
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.min_window, self.sigmas, self.rollback_after = min_window, sigmas, rollback_after
        self.skip_spikes = skip_spikes
        self.loss: float | None = None  # the all-reduced loss of the step being taken
        self.bad_in_a_row = 0
        self.spikes_only = True  # every bad step in the current row was a finite spike
        self.skipped = 0
        self.last: GuardDecision = GuardDecision(False)

    def observe_loss(self, loss: float) -> None:
        """The step's loss, reduced over ranks, before the optimizer step."""
        self.loss = loss

    def _spike(self, values: deque[float], value: float) -> float | None:
        if not self.skip_spikes or len(values) < self.min_window:
            return None
        mean, std = statistics.fmean(values), statistics.pstdev(values)
        z = (value - mean) / max(std, 1e-12 * max(1.0, abs(mean)))
        return z if z > self.sigmas else None

    def decide(self, grad_norm: float) -> GuardDecision:
        """Whether to skip this update, given the global gradient norm."""
        loss = self.loss
        if loss is not None and not math.isfinite(loss):
            decision = GuardDecision(True, f"loss is {loss}")
        elif not math.isfinite(grad_norm):
            decision = GuardDecision(True, f"gradient norm is {grad_norm}")
        elif loss is not None and (z := self._spike(self.losses, loss)) is not None:
            decision = GuardDecision(
                True,
                f"loss {loss:.4g} is {z:.1f} standard deviations above the last {len(self.losses)} steps",
                spike=True,
            )
        elif (z := self._spike(self.norms, grad_norm)) is not None:
            decision = GuardDecision(
                True,
                f"gradient norm {grad_norm:.4g} is {z:.1f} standard deviations above the last {len(self.norms)} steps",
                spike=True,
            )
        else:
            decision = GuardDecision(False)
            if loss is not None:
                self.losses.append(loss)
            self.norms.append(grad_norm)
        self.bad_in_a_row = self.bad_in_a_row + 1 if decision.skip else 0
        if not decision.skip or self.bad_in_a_row == 1:
            self.spikes_only = not decision.skip or decision.spike
        else:
            self.spikes_only = self.spikes_only and decision.spike
        self.skipped += decision.skip
        self.loss = None
        self.last = decision
        return decision

    @property
    def wants_rollback(self) -> bool:
        return self.rollback_after > 0 and self.bad_in_a_row >= self.rollback_after

    def reset_after_rollback(self) -> None:
        self.bad_in_a_row = 0

    def accept_new_level(self) -> None:
        """Take a run of finite spikes as the new level: forget the statistics and the bad steps."""
        self.losses.clear()
        self.norms.clear()
        self.bad_in_a_row = 0
        self.spikes_only = True

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(state.get("losses", []))
        self.norms.extend(state.get("norms", []))
        self.skipped = state.get("skipped", 0)


@dataclass(frozen=True)
class GuardsConfig(Section):
    """`optimus.guards`: the numerical guards (they act through the sharded optimizer)."""

    enabled: bool = True  # skip non-finite and spiking steps, and roll back after a run of them
    window: int = 100  # accepted steps in the rolling loss and gradient-norm statistics
    min_window: int = 20  # spikes are judged once the window holds this many steps
    sigmas: float = 6.0  # a loss or gradient norm this many standard deviations above the mean is a spike
    skip_spikes: bool = True  # skip spiking steps (non-finite ones are always skipped)
    rollback_after: int = 3  # consecutive bad steps before rolling back to the last checkpoint; 0: never
    # rollbacks to one checkpoint before lasting spikes are taken as the new level (non-finite steps
    # stop the run instead); 0: no limit
    max_rollbacks: int = 3

    def check(self, where: str) -> None:
        need(positive_int(self.window), f"{where}.window must be a positive integer, got {self.window!r}")
        need(
            positive_int(self.min_window) and self.min_window <= self.window,
            f"{where}.min_window must be a positive integer <= window, got {self.min_window!r}",
        )
        need(number(self.sigmas) and self.sigmas > 0, f"{where}.sigmas must be a positive number, got {self.sigmas!r}")
        need(
            non_negative_int(self.rollback_after),
            f"{where}.rollback_after must be an integer >= 0, got {self.rollback_after!r}",
        )
        need(
            non_negative_int(self.max_rollbacks),
            f"{where}.max_rollbacks must be an integer >= 0, got {self.max_rollbacks!r}",
        )

    def build(self) -> StepGuard | None:
        """The guard these settings describe, or None when they are off."""
        if not self.enabled:
            return None
        return StepGuard(self.window, self.min_window, self.sigmas, self.rollback_after, self.skip_spikes)

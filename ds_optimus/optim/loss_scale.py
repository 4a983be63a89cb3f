"""Loss scaling for fp16 training with the sharded optimizer."""

from __future__ import annotations

from typing import Any

import torch


class LossScaler:
    """Static or dynamic fp16 loss scaling: the scale halves on overflow (with `hysteresis`) and doubles
    after `window` clean steps."""

    def __init__(
        self, scale: float = 1.0, dynamic: bool = False, window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0
    ) -> None:
        self.cur_scale, self.dynamic, self.window = float(scale), dynamic, window
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self.good_steps, self.bad_left = 0, hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current scale."""
        return loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        """Move the scale after a step (`overflow` or not)."""
        if not self.dynamic:
            return
        if overflow:  # tolerated `hysteresis` - 1 times, then the scale halves at every overflow
            self.good_steps = 0
            if self.bad_left <= 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.bad_left -= 1
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.cur_scale *= 2
                self.bad_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """Settings and counters, for a checkpoint."""
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        vars(self).update(state)

"""The learning-rate schedule of a run without a DeepSpeed "scheduler" section (a warm-up, then a cosine decay; the
formulas: docs/pretraining.md), and its length in tokens."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from ..schema import ConfigError

SCHEDULES = ("cosine", "optimus")
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def token_count(value, key: str) -> int | None:
    """A token count from an integer or a string such as "4T" or "2.5e9"; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f'{key} must be a token count such as 100000000000 or "100B", got {value!r}')
    match = _COUNT.match(value) if isinstance(value, str) else None
    if isinstance(value, str) and match is None:
        raise ConfigError(f'{key} must be a token count such as 100000000000, "100B" or "4T", got {value!r}')
    try:  # decimal arithmetic: "4.1T" is 4,100,000,000,000, not 4099999999999.9995
        count = Decimal(match.group(1)) * _SUFFIX[match.group(2).upper()] if match else Decimal(str(value))
    except InvalidOperation:
        count = Decimal("NaN")
    if not count.is_finite() or count < 1 or count != count.to_integral_value():
        raise ConfigError(f"{key} must be a whole, positive number of tokens, got {value!r}")
    return int(count)


def steps_for_tokens(tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps that train at least `tokens` tokens."""
    return max(1, -(-tokens // tokens_per_step))


def warmup_start(schedule: str, warmup_start_lr, min_lr_ratio: float, lr: float) -> float | None:
    """The warm-up's first factor of lr; None for "cosine"'s default lr / W start."""
    if warmup_start_lr is None:
        return min_lr_ratio if schedule == "optimus" else None
    if warmup_start_lr == "min":
        return min_lr_ratio
    return float(warmup_start_lr) / lr


def lr_factor(
    schedule: str, steps: int, warmup_steps: int, min_lr_ratio: float, start: float | None = None
) -> Callable[[int], float]:
    """The factor of the optimizer's lr at 0-based optimizer step k (`LambdaLR`'s argument)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"optimus.train.lr_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    # "cosine" reaches the minimum at the last step, the seed's formula one step after it
    span = steps - warmup_steps if schedule == "optimus" else steps - warmup_steps - 1

    def factor(k: int) -> float:
        if k < warmup_steps:
            if start is None:
                return (k + 1) / warmup_steps
            return start + (1.0 - start) * k / warmup_steps
        progress = min(1.0, (k - warmup_steps) / max(1, span))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor

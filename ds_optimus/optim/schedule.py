"""The learning-rate schedule of a run without a DeepSpeed "scheduler" section, and its length in tokens.

Two shapes (`optimus.train.lr_schedule`), both a linear warm-up over `warmup_steps` optimizer steps and
a cosine decay to `min_lr_ratio` x lr, as factors of the optimizer's lr for the k-th optimizer step
(k = 0, 1, ...; W warm-up steps, T steps in all, s the warm-up's start as a factor, m = min_lr_ratio):

    "cosine"   warm-up  (k + 1) / W                 (s = null: the first step already at lr / W)
                        s + (1 - s) k / W          (s given: the first step at s, step W at lr)
               decay    m + (1 - m) (1 + cos(pi (k - W) / (T - W - 1))) / 2   (m at the last step)
    "optimus"  the seed's own formula (its dist_train.get_learning_rate):
               warm-up  s + (1 - s) k / W          (s = m unless `warmup_start_lr` says otherwise)
               decay    m + (1 - m) (1 + cos(pi (k - W) / (T - W))) / 2       (m one step after the last)

The seed sized T as one pass over its data; here T is `optimus.train.steps`, or `train.tokens` over
the tokens of one optimizer step (`steps_for_tokens`), so a 100B-token or one-pass schedule needs no
arithmetic by hand. Token counts may be written "4T", "100B", "2.5e9" or as integers.
"""

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
    """A token count from a config value: an integer, or a string such as "4T", "100B", "2.5e9"
    (None stays None); a one-line ConfigError naming `key` otherwise."""
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
    """Optimizer steps that train at least `tokens` tokens at `tokens_per_step` a step."""
    return max(1, -(-tokens // tokens_per_step))


def warmup_start(schedule: str, warmup_start_lr, min_lr_ratio: float, lr: float) -> float | None:
    """The warm-up's first factor: None for "cosine"'s lr / W start, else a fraction of lr ("min": the
    minimum LR's; a number: that LR over the optimizer's `lr`)."""
    if warmup_start_lr is None:
        return min_lr_ratio if schedule == "optimus" else None
    if warmup_start_lr == "min":
        return min_lr_ratio
    return float(warmup_start_lr) / lr


def lr_factor(
    schedule: str, steps: int, warmup_steps: int, min_lr_ratio: float, start: float | None = None
) -> Callable[[int], float]:
    """The factor of the optimizer's lr for optimizer step k (0-based; `LambdaLR`'s argument), for a
    run of `steps` steps in all; `start` from `warmup_start`."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"optimus.train.lr_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    span = steps - warmup_steps if schedule == "optimus" else steps - warmup_steps - 1

    def factor(k: int) -> float:
        if k < warmup_steps:
            if start is None:
                return (k + 1) / warmup_steps
            return start + (1.0 - start) * k / warmup_steps
        progress = min(1.0, (k - warmup_steps) / max(1, span))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor

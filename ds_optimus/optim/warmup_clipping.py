"""Gradient clipping from the end of the learning-rate warm-up on (`optimus.train.clip_after_warmup`): the config's
arithmetic only, without DeepSpeed; `deepspeed_engine.set_gradient_clipping` applies it."""

from __future__ import annotations

from typing import Any

from ..schema import ConfigError

# DeepSpeed's schedulers with a linear warm-up, and their default warm-up length (deepspeed.runtime.lr_schedules).
WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
DEEPSPEED_DEFAULT_WARMUP = 1000


def delayed_clipping(ds_config: dict[str, Any], warmup_steps: int) -> tuple[float, int]:
    """(clip value, warm-up steps): `gradient_clipping`, the scheduler's warm-up or `warmup_steps`; or ConfigError."""
    clip = ds_config.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0:
        got = "none" if clip is None or "gradient_clipping" not in ds_config else repr(clip)
        raise ConfigError(f"optimus.train.clip_after_warmup needs gradient_clipping > 0, got {got}")
    scheduler = ds_config.get("scheduler")
    if not scheduler:
        if not warmup_steps:
            raise ConfigError(
                "optimus.train.clip_after_warmup needs a warm-up, but optimus.train.warmup_steps is 0 "
                "(clipping would start at the first step)"
            )
        return float(clip), warmup_steps
    if scheduler.get("type") not in WARMUP_SCHEDULERS:
        raise ConfigError(
            f"optimus.train.clip_after_warmup needs a warm-up, but scheduler {scheduler.get('type')!r} "
            f"has none (use one of {', '.join(WARMUP_SCHEDULERS)}, or no scheduler section and "
            "optimus.train.warmup_steps)"
        )
    steps = scheduler.get("params", {}).get("warmup_num_steps", DEEPSPEED_DEFAULT_WARMUP)
    if not steps:
        raise ConfigError("optimus.train.clip_after_warmup needs a warm-up, but the scheduler's warmup_num_steps is 0")
    return float(clip), int(steps)


def clip_for_step(step: int, clip: float, warmup_steps: int) -> float:
    """The clip value of 1-based step `step`: none during the first `warmup_steps`."""
    return clip if step > warmup_steps else 0.0

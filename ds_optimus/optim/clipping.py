"""Gradient clipping that starts after the learning-rate warm-up (`optimus.train.clip_after_warmup`,
the seed system's recipe: its optimizers clip the global norm only once `step >= warmup_steps`).

The engine is built once, with the config's `gradient_clipping`; clipping is then switched off and
on in place before each step. DeepSpeed's engine reads the value through `gradient_clipping()` (its
config) when it clips fp32 gradients itself, and its ZeRO-1/2, BF16 and FP16 optimizers, like the
EP-aware sharded optimizer, keep the value they were built with as `clip_grad` and read it at every
step; both are set. The engine's config is a private attribute of DeepSpeed's: this module is, with
`deepspeed_compat` (which checks DeepSpeed's version), where ds_optimus touches DeepSpeed's internals.
It needs no DeepSpeed to import.
"""

from __future__ import annotations

from typing import Any

from ..schema import ConfigError

# DeepSpeed's schedulers with a linear warm-up, and their default warm-up length (deepspeed.runtime.lr_schedules).
WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
DEEPSPEED_DEFAULT_WARMUP = 1000


def delayed_clipping(ds_config: dict[str, Any], warmup_steps: int) -> tuple[float, int]:
    """`(clip value, warm-up steps)` for clipping after the warm-up: the config's `gradient_clipping`
    and the warm-up of its `scheduler` section, or `warmup_steps` (optimus.train's) without one. A
    config with nothing to clip, or a scheduler without a warm-up, is a one-line ConfigError."""
    clip = ds_config.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0:
        got = "none" if clip is None or "gradient_clipping" not in ds_config else repr(clip)
        raise ConfigError(f"optimus.train.clip_after_warmup needs gradient_clipping > 0, got {got}")
    scheduler = ds_config.get("scheduler")
    if not scheduler:
        if not warmup_steps:
            raise ConfigError("optimus.train.clip_after_warmup needs a warm-up, but optimus.train.warmup_steps is 0 "
                              "(clipping would start at the first step)")
        return float(clip), warmup_steps
    if scheduler.get("type") not in WARMUP_SCHEDULERS:
        raise ConfigError(f"optimus.train.clip_after_warmup needs a warm-up, but scheduler {scheduler.get('type')!r} "
                          f"has none (use one of {', '.join(WARMUP_SCHEDULERS)}, or no scheduler section and "
                          "optimus.train.warmup_steps)")
    steps = scheduler.get("params", {}).get("warmup_num_steps", DEEPSPEED_DEFAULT_WARMUP)
    if not steps:
        raise ConfigError("optimus.train.clip_after_warmup needs a warm-up, but the scheduler's warmup_num_steps is 0")
    return float(clip), int(steps)


def clip_for_step(step: int, clip: float, warmup_steps: int) -> float:
    """The clip value of optimizer step `step` (1-based): none during the first `warmup_steps` steps."""
    return clip if step > warmup_steps else 0.0


def set_gradient_clipping(engine, value: float) -> None:
    """Clip the global gradient norm at `value` (0: not at all) from the engine's next step on."""
    engine._config.gradient_clipping = float(value)  # what engine.gradient_clipping() returns
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "clip_grad"):  # ZeRO-1/2, BF16, FP16 and the sharded optimizer
        optimizer.clip_grad = float(value)

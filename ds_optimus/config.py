"""The "optimus" section of a DeepSpeed JSON config: what DeepSpeed does not know, parsed and
validated up front. An unknown key or a bad value is a one-line `ConfigError` naming the key.

    "optimus": {
      "model": {"preset": "mula-tiny-moe", "path": null, "overrides": {}},
      "expert_parallel": {"size": 4, "node_size": 2},   # EP size; node_size selects the hierarchical exchange
      "moe": {"experts_backend": "auto"},                # or "grouped_mm", "looped", "reference", ...
      "data": {"sources": ["embedded"], "tokenizer": null, "seq_len": 256, "val_fraction": 0.02,
               "cache_dir": "data_cache"},
      "train": {"steps": 100, "seed": 0, "output_dir": "runs/mula", "eval_interval": 50, "eval_batches": 8,
                "log_interval": 1, "peak_tflops": null, "warmup_steps": 0, "min_lr_ratio": 0.1,
                "sample_prompt": "...", "sample_tokens": 48, "activation_checkpointing": false,
                "measure_memory_steps": 0},
      "checkpoint": {"interval": 0, "keep_last": 2, "dir": null, "resume": true, "async_save": false},
      "wandb": {"mode": null, "project": "ds_optimus", "name": null, "entity": null},
      "sharded_optimizer": {"enabled": false, "bucket_size": 50000000, "reduce_dtype": null,
                            "overlap_comm": null},
      "guards": {"enabled": true, "window": 100, "min_window": 20, "sigmas": 6.0, "skip_spikes": true,
                 "rollback_after": 3},
      "watchdog": {"step_timeout_s": 900, "first_step_timeout_s": 3600, "checkpoint_timeout_s": 3600}
    }

Every section and key is optional; the defaults are above (`mode: null` means online when
WANDB_API_KEY is set, offline otherwise).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad "optimus" config section; the message names the key."""


@dataclass(frozen=True)
class ExpertParallelConfig:
    size: int = 1
    node_size: int | None = None

    def check(self, where: str) -> None:
        _need(_positive_int(self.size), f"{where}.size must be a positive integer, got {self.size!r}")
        _need(self.node_size is None or _positive_int(self.node_size),
              f"{where}.node_size must be null or a positive integer, got {self.node_size!r}")
        _need(self.node_size is None or self.size % self.node_size == 0,
              f"{where}.node_size {self.node_size} does not divide {where}.size {self.size}")


@dataclass(frozen=True)
class MoEConfig:
    experts_backend: str = "auto"

    def check(self, where: str) -> None:
        from .moe.experts import registered_backends

        known = ["auto", *registered_backends()]
        _need(self.experts_backend in known,
              f"{where}.experts_backend must be one of {', '.join(known)}, got {self.experts_backend!r}")


@dataclass(frozen=True)
class ModelConfig:
    preset: str | None = "mula-tiny-moe"
    path: str | None = None  # an HF folder: its config (and weights, if it has them)
    overrides: dict = field(default_factory=dict)  # MulaConfig fields over the preset's or folder's

    def check(self, where: str) -> None:
        from .hf_models.mula import PRESETS

        _need((self.preset is None) != (self.path is None),
              f"{where}: give exactly one of preset and path, got preset={self.preset!r} path={self.path!r}")
        _need(self.preset is None or self.preset in PRESETS,
              f"{where}.preset {self.preset!r} is not one of {', '.join(PRESETS)}")
        _need(isinstance(self.overrides, dict), f"{where}.overrides must be a JSON object")


@dataclass(frozen=True)
class DataConfig:
    sources: list = field(default_factory=lambda: ["embedded"])
    tokenizer: str | None = None  # an HF tokenizer name or folder; null: the embedded default
    seq_len: int = 256
    val_fraction: float = 0.02
    cache_dir: str = "data_cache"

    def check(self, where: str) -> None:
        from .data.corpus import DataError, parse_source

        _need(isinstance(self.sources, list) and len(self.sources) > 0, f"{where}.sources must be a non-empty list")
        for i, spec in enumerate(self.sources):
            try:
                parse_source(spec)
            except DataError as err:
                raise ConfigError(f"{where}.sources[{i}]: {err}") from None
        _need(_positive_int(self.seq_len) and self.seq_len >= 8, f"{where}.seq_len must be an integer >= 8")
        _need(_number(self.val_fraction) and 0 <= self.val_fraction < 0.5,
              f"{where}.val_fraction must be in [0, 0.5), got {self.val_fraction!r}")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    seed: int = 0
    output_dir: str = "runs/mula"
    eval_interval: int = 50  # 0: evaluate only at the end
    eval_batches: int = 8
    log_interval: int = 1
    peak_tflops: float | None = None  # per device, for model FLOPs utilisation; null: not reported
    # The LR schedule when the DeepSpeed config has no "scheduler" section: linear warm-up to the
    # optimizer's lr over warmup_steps, then cosine decay to min_lr_ratio x lr at the last step.
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    # End this invocation cleanly (with a checkpoint) after this many steps, e.g. to fit a job's
    # time limit; the next invocation resumes. null: run to `steps`.
    stop_after_steps: int | None = None
    sample_prompt: str = "The with statement"
    sample_tokens: int = 48
    # Recompute each decoder layer's activations in the backward pass instead of keeping them.
    activation_checkpointing: bool = False
    # Record each rank's peak tensor memory over the first `measure_memory_steps` steps into the
    # summary (on CPU through the profiler's allocation events, which slows those steps; on
    # accelerators from the allocator's statistics). 0: off.
    measure_memory_steps: int = 0

    def check(self, where: str) -> None:
        _need(isinstance(self.activation_checkpointing, bool),
              f"{where}.activation_checkpointing must be true or false, got {self.activation_checkpointing!r}")
        _need(isinstance(self.measure_memory_steps, int) and not isinstance(self.measure_memory_steps, bool)
              and self.measure_memory_steps >= 0,
              f"{where}.measure_memory_steps must be an integer >= 0, got {self.measure_memory_steps!r}")
        _need(_positive_int(self.steps), f"{where}.steps must be a positive integer, got {self.steps!r}")
        _need(isinstance(self.seed, int), f"{where}.seed must be an integer, got {self.seed!r}")
        _need(_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
              f"{where}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        for key in ("eval_interval", "sample_tokens", "warmup_steps"):
            value = getattr(self, key)
            _need(isinstance(value, int) and value >= 0, f"{where}.{key} must be an integer >= 0, got {value!r}")
        for key in ("eval_batches", "log_interval"):
            value = getattr(self, key)
            _need(_positive_int(value), f"{where}.{key} must be a positive integer, got {value!r}")
        _need(self.stop_after_steps is None or _positive_int(self.stop_after_steps),
              f"{where}.stop_after_steps must be null or a positive integer, got {self.stop_after_steps!r}")
        _need(self.peak_tflops is None or (_number(self.peak_tflops) and self.peak_tflops > 0),
              f"{where}.peak_tflops must be null or a positive number, got {self.peak_tflops!r}")


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 0  # every N steps, and always at the end; 0: only at the end
    keep_last: int = 2
    dir: str | None = None  # null: <train.output_dir>/checkpoints
    resume: bool = True  # continue from the latest complete checkpoint in dir, if there is one
    async_save: bool = False  # write checkpoints in a background thread while training goes on

    def check(self, where: str) -> None:
        _need(isinstance(self.interval, int) and self.interval >= 0,
              f"{where}.interval must be an integer >= 0, got {self.interval!r}")
        _need(_positive_int(self.keep_last), f"{where}.keep_last must be a positive integer, got {self.keep_last!r}")
        _need(isinstance(self.resume, bool), f"{where}.resume must be true or false, got {self.resume!r}")
        _need(isinstance(self.async_save, bool), f"{where}.async_save must be true or false, got {self.async_save!r}")


@dataclass(frozen=True)
class WandbConfig:
    mode: str | None = None  # online | offline | disabled; null: online with WANDB_API_KEY, else offline
    project: str = "ds_optimus"
    name: str | None = None
    entity: str | None = None

    def check(self, where: str) -> None:
        _need(self.mode in (None, "online", "offline", "disabled"),
              f"{where}.mode must be online, offline, disabled or null, got {self.mode!r}")


@dataclass(frozen=True)
class ShardedOptimizerConfig:
    """The EP-aware sharded optimizer (`ds_optimus.optim`), in place of DeepSpeed's ZeRO stage 1/2
    optimizer; the stage is DeepSpeed's `zero_optimization.stage`."""

    enabled: bool = False
    bucket_size: int = 50_000_000  # elements per reduce-scatter / all-gather bucket
    reduce_dtype: str | None = None  # fp32 | bf16 | fp16; null: DeepSpeed's grad accumulation dtype
    # reduce buckets while the backward pass goes on; null: yes, except on gloo (CPU), where the
    # collectives' threads compete with the backward pass for the same cores
    overlap_comm: bool | None = None

    def check(self, where: str) -> None:
        _need(isinstance(self.enabled, bool), f"{where}.enabled must be true or false, got {self.enabled!r}")
        _need(_positive_int(self.bucket_size),
              f"{where}.bucket_size must be a positive integer, got {self.bucket_size!r}")
        _need(self.reduce_dtype in (None, "fp32", "bf16", "fp16"),
              f"{where}.reduce_dtype must be fp32, bf16, fp16 or null, got {self.reduce_dtype!r}")
        _need(self.overlap_comm is None or isinstance(self.overlap_comm, bool),
              f"{where}.overlap_comm must be true, false or null, got {self.overlap_comm!r}")


@dataclass(frozen=True)
class GuardsConfig:
    """Numerical guards (`ds_optimus.reliability.guards`; they act through the sharded optimizer)."""

    enabled: bool = True
    window: int = 100  # accepted steps in the rolling loss and gradient-norm statistics
    min_window: int = 20  # spikes are judged once the window holds this many steps
    sigmas: float = 6.0  # a loss or gradient norm this many standard deviations above the mean is a spike
    skip_spikes: bool = True  # skip spiking steps (non-finite ones are always skipped)
    rollback_after: int = 3  # consecutive bad steps before rolling back to the last checkpoint; 0: never

    def check(self, where: str) -> None:
        for key in ("enabled", "skip_spikes"):
            _need(isinstance(getattr(self, key), bool), f"{where}.{key} must be true or false, "
                                                        f"got {getattr(self, key)!r}")
        _need(_positive_int(self.window), f"{where}.window must be a positive integer, got {self.window!r}")
        _need(_positive_int(self.min_window) and self.min_window <= self.window,
              f"{where}.min_window must be a positive integer <= window, got {self.min_window!r}")
        _need(_number(self.sigmas) and self.sigmas > 0,
              f"{where}.sigmas must be a positive number, got {self.sigmas!r}")
        _need(isinstance(self.rollback_after, int) and not isinstance(self.rollback_after, bool)
              and self.rollback_after >= 0,
              f"{where}.rollback_after must be an integer >= 0, got {self.rollback_after!r}")


@dataclass(frozen=True)
class WatchdogConfig:
    """Hang watchdog (`ds_optimus.reliability.watchdog`); a time-out of 0 turns that check off."""

    step_timeout_s: float = 900.0
    first_step_timeout_s: float = 3600.0  # the first step after a (re)start also compiles and warms up
    checkpoint_timeout_s: float = 3600.0  # a synchronous save, an evaluation or the final export

    def check(self, where: str) -> None:
        for key in ("step_timeout_s", "first_step_timeout_s", "checkpoint_timeout_s"):
            value = getattr(self, key)
            _need(_number(value) and value >= 0, f"{where}.{key} must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class OptimusConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    sharded_optimizer: ShardedOptimizerConfig = field(default_factory=ShardedOptimizerConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    @classmethod
    def from_ds_config(cls, config: dict[str, Any] | str | Path) -> OptimusConfig:
        """Parse the "optimus" section of a DeepSpeed config (a dict or a JSON file's path)."""
        config = load_json_config(config)
        section = config.get("optimus", {})
        return _build(cls, section, "optimus")


def _build(cls, values: Any, where: str):
    _need(isinstance(values, dict), f"{where} must be a JSON object, got {type(values).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    _need(not unknown, f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})" if unknown else "")
    kwargs = {}
    for name, value in values.items():
        nested = known[name].default_factory
        is_section = nested is not MISSING and is_dataclass(nested)
        kwargs[name] = _build(nested, value, f"{where}.{name}") if is_section else value
    built = cls(**kwargs)
    if hasattr(built, "check"):
        built.check(where)
    return built


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_json_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A DeepSpeed config as a dict (a copy), from a dict or a JSON file's path."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = Path(config)
    try:
        loaded = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"config {path} is not valid JSON: {err.msg} (line {err.lineno})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must hold a JSON object")
    return loaded


def apply_overrides(config: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Set dotted keys from `KEY=VALUE` strings (`optimus.train.steps=20`); a VALUE that parses as
    JSON is used as such (numbers, true/false/null, lists, objects), anything else as a string."""
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set expects KEY=VALUE with a dotted KEY, got {assignment!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = config
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parts[:i + 1])} is not an object")
            node = child
        node[parts[-1]] = value
    return config


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)

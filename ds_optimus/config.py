"""The "optimus" section of a DeepSpeed JSON config: what DeepSpeed does not know, parsed and
validated up front. An unknown key or a bad value is a one-line `ConfigError` naming the key.

    "optimus": {
      "expert_parallel": {"size": 4, "node_size": 2},   # EP size; node_size selects the hierarchical exchange
      "moe": {"experts_backend": "auto"}                 # or "grouped_mm", "looped", "reference", ...
    }
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
class OptimusConfig:
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @classmethod
    def from_ds_config(cls, config: dict[str, Any] | str | Path) -> OptimusConfig:
        """Parse the "optimus" section of a DeepSpeed config (a dict or a JSON file's path)."""
        if not isinstance(config, dict):
            path = Path(config)
            try:
                config = json.loads(path.read_text())
            except OSError as err:
                raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
            except json.JSONDecodeError as err:
                raise ConfigError(f"config {path} is not valid JSON: {err.msg} (line {err.lineno})") from None
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


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)

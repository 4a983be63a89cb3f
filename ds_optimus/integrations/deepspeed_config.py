"""DeepSpeed's part of a config checked against the keys the installed DeepSpeed reads, learned by letting its own
`DeepSpeedConfig` read the config through a dict that records every key asked for.
"""

from __future__ import annotations

from ..schema import ConfigError

# Top-level keys read outside `DeepSpeedConfig` (by `deepspeed.initialize`, accelerate, this library).
_KEYS_READ_ELSEWHERE = ("optimus", "sequence_parallel_size", "data_parallel_size", "msamp")


class _ReadRecorder(dict):
    """A dict that records every key asked for, present or not."""

    def __init__(self, data, seen: set) -> None:
        super().__init__(data)
        self.seen = seen

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self.seen.add(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.seen.add(key)
        return super().setdefault(key, default)

    def keys(self):
        from collections.abc import KeysView

        return KeysView(self)  # `key in config.keys()` goes through __contains__


def check_config_keys(ds_config: dict) -> None:
    """One ConfigError naming the closest known key for a key the installed DeepSpeed would ignore (top level:
    `gradient_clippng` trains without clipping) or refuse with a traceback (inside its validated sections); and for
    any other value `DeepSpeedConfig` refuses."""
    import difflib

    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    from .deepspeed_version import check_version

    check_version()
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    # Batch sizes checked for this world size elsewhere, and the Trainer's "auto" values, stay out of
    # the probe (it runs as one process); every other value is read as the run will read it.
    probe = {k: v for k, v in ds_config.items() if k not in batch_keys and v != "auto"}
    probe.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)  # fits any world size
    seen: set = set()
    try:
        DeepSpeedConfig(_ReadRecorder(_without_auto(probe), seen))
    except pydantic.ValidationError as err:
        raise ConfigError(_validation_message(err, ds_config, DeepSpeedConfigModel, difflib)) from None
    except Exception as err:  # DeepSpeed's own checks: a traceback from deep inside initialize otherwise
        text = str(err).strip()
        raise ConfigError(
            f"DeepSpeed refuses the config: {text.splitlines()[0] if text else type(err).__name__}"
        ) from None
    known = seen | set(batch_keys) | set(_KEYS_READ_ELSEWHERE)
    for key in ds_config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown DeepSpeed config key {key!r}{hint}: DeepSpeed {_version()} would ignore it")


def _without_auto(section):
    if isinstance(section, dict):
        return {k: _without_auto(v) for k, v in section.items() if v != "auto"}
    return section


def _validation_message(err, ds_config: dict, base, difflib) -> str:
    """One line for pydantic's report on one of DeepSpeed's validated sections."""
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    where = _section_path(ds_config, loc[0]) if loc else None
    key = ".".join(([where] if where else []) + loc)
    if first.get("type") == "extra_forbidden" and loc:
        model = next((m for m in _subclasses(base) if m.__name__ == err.title), None)
        for part in loc[:-1]:  # down to the section that holds the key
            model = _field_model(model, part)
        names = sorted({n for name, f in getattr(model, "model_fields", {}).items() for n in (name, f.alias) if n})
        close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown DeepSpeed config key {key!r}{hint}"
    return f"DeepSpeed config key {key!r}: {first.get('msg', 'invalid value')}"


def _field_model(model, name: str):
    # the pydantic model that field `name` of `model` holds (through Optional/Union), or None
    import typing

    import pydantic

    field = getattr(model, "model_fields", {}).get(name)
    candidates = [field.annotation] if field is not None else []
    while candidates:
        kind = candidates.pop()
        if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
            return kind
        candidates.extend(typing.get_args(kind))
    return None


def _section_path(config, key: str, prefix: str = "") -> str | None:
    # the dotted path of the first nested section of `config` that holds `key`
    for name, value in config.items():
        if isinstance(value, dict) and name != "optimus":
            if key in value:
                return prefix + name
            found = _section_path(value, key, f"{prefix}{name}.")
            if found:
                return found
    return None


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _version() -> str:
    import deepspeed

    return deepspeed.__version__

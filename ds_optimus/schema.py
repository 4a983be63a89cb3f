"""Typed config sections (frozen dataclasses parsed from JSON objects, one-line errors) and JSON helpers.

Components declare their `optimus` settings as `Section`s beside their code. Imports nothing of ds_optimus.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad config value; the one-line message names the key."""


@dataclass(frozen=True)
class Section:
    """A frozen dataclass of a section's keys and defaults; `Section`-valued fields nest."""

    def check(self, where: str) -> None:
        """Raise ConfigError naming `where.key` for an unusable value."""

    @classmethod
    def parse(cls, values: Any, where: str):
        """Parse JSON object `values` found at `where` ("optimus.guards"); bad keys or values raise ConfigError."""
        need(isinstance(values, dict), f"{where} must be a JSON object, got {type(values).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
        kwargs = {}
        for name, value in values.items():
            nested = known[name].default_factory
            is_section = nested is not MISSING and is_dataclass(nested) and issubclass(nested, Section)
            kwargs[name] = nested.parse(value, f"{where}.{name}") if is_section else value
        section = cls(**kwargs)
        section.check(where)  # its own messages first: a range or a cross-field rule says more than a type
        hints = _hints(cls)
        for name in values:
            value, hint = getattr(section, name), hints[name]
            need(matches(value, hint), f"{where}.{name} must be {describe(hint)}, got {value!r}")
        return section


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:  # the annotations are strings (postponed evaluation): resolved once per class
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def matches(value: Any, hint: Any) -> bool:
    """Whether JSON `value` has the type `hint` declares (int, float, bool, str, None, list[...], dict,
    Literal, unions, nested sections); an int is a float, a bool is not a number."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arg) for arg in args)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin is list or hint is list:
        return isinstance(value, list) and all(matches(item, args[0]) for item in value if args)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return number(value)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, Section):
        return isinstance(value, hint)
    return True  # a type JSON cannot carry (a tuple default): the section's check() holds it


_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a JSON object"}


def describe(hint: Any, plural: bool = False) -> str:
    """`hint` in the words of the errors: "an integer", "a string or null", "true, false or a list of strings"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [arg for arg in args if arg is not type(None)]
        words = ["true, false" if kind is bool else describe(kind) for kind in kinds]
        words += ["null"] if len(kinds) < len(args) else []
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(arg) for arg in args)
    if origin is list or hint is list:
        return f"a list of {describe(args[0], plural=True)}" if args else "a list"
    if hint is type(None):
        return "null"
    word = _WORDS.get(hint, getattr(hint, "__name__", str(hint)))
    if plural:  # "an integer" -> "integers"
        return {"true or false": "true or false values"}.get(word, word.split(" ", 1)[-1] + "s")
    return word


def need(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_json_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A copy of a DeepSpeed config, from a dict or a JSON file's path."""
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
    """Set dotted keys (list items by index) from `KEY=VALUE` strings; VALUE is JSON if it parses, else a string."""
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
            if isinstance(node, list):  # a list's item by its index: optimus.data.sources.1.weight
                node = _item(node, part, key, ".".join(parts[:i]))
                if not isinstance(node, (dict, list)):
                    raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not an object")
                continue
            child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not an object")
            node = child
        if isinstance(node, list):
            _item(node, parts[-1], key, ".".join(parts[:-1]))
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value
    return config


def _item(items: list, index: str, key: str, where: str):
    if not index.isdigit() or int(index) >= len(items):
        raise ConfigError(
            f"--set {key}: {where} is a list of {len(items)}; give an index from 0 to {len(items) - 1}, not {index!r}"
        )
    return items[int(index)]

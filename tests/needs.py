"""What a test needs that the README's test command installs (Triton, lm-evaluation-harness, DeepSpeed,
Open MPI, the console scripts, Transformers' test mixins). Where it is missing the test skips, saying what
to install, and under CI (`CI` set, as `.ci/run` sets it) it fails instead: there a missing piece is a
broken install step, never a reason for a green run."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def missing(what: str) -> NoReturn:
    """Skip, saying what is missing (`what`: what it is and how to install it); under CI, fail."""
    if under_ci():
        pytest.fail(f"{what}: the test command installs it, so under CI this fails instead of skipping", pytrace=False)
    pytest.skip(what)


def module(name: str, install: str) -> ModuleType:
    """`import name`, or `missing(...)` saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        missing(f"{name} is not installed ({install}): {err}")


def unless(available: bool, what: str) -> pytest.MarkDecorator:
    """A mark skipping the test where `available` is false (under CI it runs and fails there instead)."""
    return pytest.mark.skipif(not available and not under_ci(), reason=what)

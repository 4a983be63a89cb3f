"""`ds_optimus.integrations`: every patched upstream callable still has the signature its
replacement was written against (an upgrade that changes one fails here, by name), the private state
read or written still exists, and an engine without an `optimus` section and without ds_optimus'
modules is built exactly as DeepSpeed builds it."""

from __future__ import annotations

import importlib
import inspect

import pytest
from distributed import run_distributed
from engine_workers import plain_engine_worker

from ds_optimus.integrations import PATCHES, PRIVATE_STATE


def _resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target.split(":")[1])
def test_each_patched_callable_is_replaced_and_upstream_kept_its_signature(patch):
    importlib.import_module("deepspeed")  # each integration hooks its library as it is imported
    importlib.import_module("accelerate.accelerator")
    replacement = _resolve(patch.target)
    original = getattr(replacement, "__wrapped__", None)
    assert original is not None, f"{patch.target} is not patched (no __wrapped__ on it)"
    assert replacement.__module__.startswith("ds_optimus.integrations."), replacement.__module__
    signature = str(inspect.signature(original, follow_wrapped=False))
    assert signature == patch.signature, (
        f"{patch.target} changed upstream: {signature} (the patch was written against {patch.written_against}, "
        f"{patch.signature}); check the replacement in {replacement.__module__} ({patch.why})"
    )
    assert patch.why and patch.written_against


@pytest.mark.parametrize("where, name, why", PRIVATE_STATE, ids=[f"{w}.{n}" for w, n, _ in PRIVATE_STATE])
def test_the_private_state_read_or_written_still_exists(where, name, why):
    from deepspeed.runtime.config import DeepSpeedConfig

    holder = DeepSpeedConfig({"train_batch_size": 1}) if where.endswith(":DeepSpeedConfig") else _resolve(where)
    assert hasattr(holder, name), f"{where} has no {name} any more ({why})"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_engine_without_an_optimus_section_is_deepspeeds_own(stage):
    got = run_distributed(plain_engine_worker, 1, stage)[0]
    assert got["hooked"] == "ds_optimus.integrations.deepspeed_engine"  # the patched method ran
    assert got["optimizer"] == ("DeepSpeedZeroOptimizer" if stage else "AdamW")
    assert got["ours"] == [] and got["moe"] is False  # nothing of ds_optimus left on it

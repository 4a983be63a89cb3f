# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""DeepSpeed's own unit tests of the engine methods ds_optimus replaces, run with ds_optimus imported
(tests/conftest.py imports it, and the first test checks the engine is hooked), so that a patch that
changes DeepSpeed's behaviour for a config without an `optimus` section fails here.

Ported from deepspeedai/DeepSpeed, tests/unit/v1/moe/test_autoep_unit.py (class TestAutoEPConfig),
commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (2026-08-22), under the Apache License 2.0: the three
tests that call `DeepSpeedEngine._configure_expert_parallel` on an engine whose config is not a
`DeepSpeedConfig`. Changed: the imports (only what these tests use), this docstring and the first
test; the test bodies are upstream's.
"""

from types import SimpleNamespace

import deepspeed.runtime.engine as ds_engine
import pytest
import torch.nn as nn
from deepspeed.module_inject.auto_ep_config import AutoEPConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups


def test_the_engine_is_hooked_by_ds_optimus():
    assert DeepSpeedEngine._configure_expert_parallel.__module__ == "ds_optimus.integrations.deepspeed_engine"


class TestAutoEPConfig:
    def test_configure_expert_parallel_uses_engine_mpu_sequence_parallel_size(self, monkeypatch):

        class SequenceParallelMPU:
            def get_model_parallel_world_size(self):
                return 1

            def get_sequence_parallel_world_size(self):
                return 2

        class EmptyAutoEP:
            def __init__(self, model, config):
                pass

            def ep_parser(self):
                return []

        observed = {}

        def record_validate(config, world_size, pp_size, tp_size, sp_size):
            observed["validate"] = {
                "world_size": world_size,
                "pp_size": pp_size,
                "tp_size": tp_size,
                "sp_size": sp_size,
            }

        def record_create(**kwargs):
            observed["create"] = kwargs

        monkeypatch.setattr(groups, "mpu", None)
        monkeypatch.setattr(groups, "_get_sequence_parallel_world_size", lambda: 1)
        monkeypatch.setattr(groups, "_create_expert_and_data_parallel", record_create)
        monkeypatch.setattr(groups, "_get_expert_parallel_group", lambda name: object())
        monkeypatch.setattr(ds_engine.dist, "get_world_size", lambda: 4)
        monkeypatch.setattr(ds_engine.dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr("deepspeed.module_inject.auto_ep.AutoEP", EmptyAutoEP)
        monkeypatch.setattr("deepspeed.module_inject.auto_ep_config.validate_autoep_config", record_validate)

        engine = object.__new__(DeepSpeedEngine)
        engine.mpu = SequenceParallelMPU()
        engine._config = SimpleNamespace(
            expert_parallel_config=AutoEPConfig(enabled=True, autoep_size=2),
            tensor_parallel_config=SimpleNamespace(autotp_size=1),
            use_data_before_expert_parallel_=False,
            zero_config=SimpleNamespace(offload_optimizer=None, offload_param=None),
            zero_optimization_stage=0,
        )

        engine._configure_expert_parallel(model=nn.Module())

        assert groups.mpu is None
        assert observed["validate"]["sp_size"] == 2
        assert observed["create"]["mp_size"] == 2
        assert observed["create"]["mp_mode"] == "sp"

    def test_configure_expert_parallel_rejects_bwc_tensor_model_parallel_mpu(self, monkeypatch):

        class TensorParallelMPU:
            def get_tensor_model_parallel_world_size(self):
                return 2

        monkeypatch.setattr(groups, "_get_sequence_parallel_world_size", lambda: 1)

        engine = object.__new__(DeepSpeedEngine)
        engine.mpu = TensorParallelMPU()
        engine._config = SimpleNamespace(
            expert_parallel_config=AutoEPConfig(enabled=True, autoep_size=2),
            tensor_parallel_config=SimpleNamespace(autotp_size=1),
            use_data_before_expert_parallel_=False,
        )

        with pytest.raises(ValueError, match="bwc_tensor_model_parallel_world_size=2"):
            engine._configure_expert_parallel(model=nn.Module())

    def test_autoep_sequence_parallel_size_falls_back_to_groups_helper(self, monkeypatch):
        monkeypatch.setattr(groups, "_get_sequence_parallel_world_size", lambda: 3)

        engine = object.__new__(DeepSpeedEngine)
        engine.mpu = object()

        assert engine._autoep_sequence_parallel_world_size() == 3

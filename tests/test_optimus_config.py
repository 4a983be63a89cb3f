"""The "optimus" section of a DeepSpeed config and `setup_moe` on one process."""

import json

import pytest
import torch

from ds_optimus.config import ConfigError, OptimusConfig
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.parallel import setup_moe


def test_defaults_without_a_section():
    config = OptimusConfig.from_ds_config({"train_batch_size": 8})
    assert config.expert_parallel.size == 1 and config.expert_parallel.node_size is None
    assert config.expert_parallel.dedup == "auto" and config.expert_parallel.chunks == 1
    assert config.moe.experts_backend == "auto"


def test_reads_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimus": {"expert_parallel": {"size": 8, "node_size": 4}}}))
    config = OptimusConfig.from_ds_config(path)
    assert (config.expert_parallel.size, config.expert_parallel.node_size) == (8, 4)


@pytest.mark.parametrize(
    "section, message",
    [
        (
            {"expert_parallel": {"sise": 2}},
            r"^optimus\.expert_parallel: unknown key 'sise' \(known: size, node_size, dedup, chunks, dispatch\)$",
        ),
        ({"expert_parallel": {"size": 0}}, r"^optimus\.expert_parallel\.size must be a positive integer, got 0$"),
        ({"expert_parallel": {"size": True}}, r"^optimus\.expert_parallel\.size must be a positive integer"),
        ({"expert_parallel": {"size": 4, "node_size": 3}}, r"^optimus\.expert_parallel\.node_size 3 does not divide"),
        (
            {"expert_parallel": {"size": 4, "dedup": "yes"}},
            r'^optimus\.expert_parallel\.dedup must be true, false or "auto", got \'yes\'$',
        ),
        (
            {"expert_parallel": {"size": 4, "chunks": 0}},
            r"^optimus\.expert_parallel\.chunks must be a positive integer, got 0$",
        ),
        (
            {"expert_parallel": {"size": 4, "dedup": False, "chunks": 2}},
            r"^optimus\.expert_parallel\.chunks 2 overlaps the deduplicated exchange, "
            r"which optimus\.expert_parallel\.dedup false turns off$",
        ),
        ({"moe": {"experts_backend": "fast"}}, r"^optimus\.moe\.experts_backend must be one of auto, .*got 'fast'$"),
        ({"layout": {}}, r"^optimus: unknown key 'layout'"),
        ({"moe": []}, r"^optimus\.moe must be a JSON object, got list$"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        OptimusConfig.from_ds_config({"optimus": section})


@pytest.mark.parametrize(
    "section, message",
    [
        ({"train": {"compile": "yes"}}, r"^optimus\.train\.compile must be true or false, got 'yes'$"),
        ({"train": {"seed": 1.5}}, r"^optimus\.train\.seed must be an integer, got 1\.5$"),
        ({"train": {"sample_prompt": 3}}, r"^optimus\.train\.sample_prompt must be a string or null, got 3$"),
        ({"checkpoint": {"dir": ["a"]}}, r"^optimus\.checkpoint\.dir must be a string or null, got \['a'\]$"),
        ({"wandb": {"project": 3}}, r"^optimus\.wandb\.project must be a string, got 3$"),
        ({"model": {"overrides": []}}, r"^optimus\.model\.overrides must be a JSON object, got \[\]$"),
        ({"checkpoint": {"resume": 1}}, r"^optimus\.checkpoint\.resume must be true or false, got 1$"),
        (
            {"sharded_optimizer": {"overlap_comm": "on"}},
            r"^optimus\.sharded_optimizer\.overlap_comm must be true, false or null, got 'on'$",
        ),
        ({"data": {"tokenizer": 5}}, r"^optimus\.data\.tokenizer must be a string or null, got 5$"),
        (
            {"guards": {"skip_spikes": None}},
            r"^optimus\.guards\.skip_spikes must be true or false, got None$",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_named_by_the_type_its_key_declares(section, message):
    """No section's check() tests these types: `Section.parse` holds every value to its annotation."""
    with pytest.raises(ConfigError, match=message):
        OptimusConfig.from_ds_config({"optimus": section})


def test_the_declared_types_accept_what_json_gives_them():
    from typing import Literal

    from ds_optimus.schema import matches

    assert matches(2, float) and not matches(True, float) and not matches(True, int) and matches(False, bool)
    assert matches(None, int | None) and matches("100B", int | str | None) and not matches(1.5, int | str | None)
    assert matches(["moe"], bool | list[str]) and not matches([1], bool | list[str]) and matches([], list[int])
    assert matches("gloo", Literal["gloo", "nccl"]) and not matches("mpi", Literal["gloo", "nccl"])
    config = OptimusConfig.from_ds_config(
        {"optimus": {"watchdog": {"step_timeout_s": 60}, "train": {"activation_checkpointing": ["moe"]}}}
    )
    assert config.watchdog.step_timeout_s == 60 and config.train.activation_checkpointing == ["moe"]


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^cannot read config .*missing\.json"):
        OptimusConfig.from_ds_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"^config .*bad\.json is not valid JSON"):
        OptimusConfig.from_ds_config(bad)


def test_setup_moe_sets_the_backend_of_every_moe_layer():
    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe"))
    model.set_experts_implementation("eager")
    looped_config = OptimusConfig.from_ds_config({"optimus": {"moe": {"experts_backend": "looped"}}})
    assert setup_moe(model, looped_config) is None  # size 1: no EP
    assert model.config._experts_implementation == "ds_optimus"
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert {e.experts_backend for e in experts} == {"looped"}
    x = torch.randint(2, 100, (2, 8))
    looped = model(x).logits
    setup_moe(model, OptimusConfig.from_ds_config({}))
    assert {e.experts_backend for e in experts} == {None}  # auto
    torch.testing.assert_close(model(x).logits, looped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dedup": "yes"}, r'^apply_expert_parallel: dedup must be True, False or "auto", got \'yes\'$'),
        ({"chunks": 0}, r"^apply_expert_parallel: chunks must be a positive integer, got 0$"),
        ({"chunks": True}, r"^apply_expert_parallel: chunks must be a positive integer, got True$"),
        ({"dedup": False, "chunks": 2}, r"^apply_expert_parallel: chunks 2 overlaps the deduplicated exchange"),
    ],
)
def test_apply_expert_parallel_refuses_a_bad_exchange_before_changing_anything(kwargs, message):
    from ds_optimus.parallel import apply_expert_parallel

    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe"))
    before = model.model.layers[0].mlp.experts.gate_up_proj
    with pytest.raises(ValueError, match=message):
        apply_expert_parallel(model, 2, **kwargs)  # refused before any process group is needed
    assert model.model.layers[0].mlp.experts.gate_up_proj is before

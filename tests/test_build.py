"""The model build: on the meta device, each rank materialising (and reading) only the experts it holds,
with initial values that do not depend on the layout."""

import hashlib
import json
import os
import resource
import sys
import zlib
from pathlib import Path

import pytest
import torch

from ds_optimus.config import ConfigError, ModelConfig
from ds_optimus.hf_models.mula import MulaConfig
from ds_optimus.parallel.build import build_model
from ds_optimus.plan.measure import free_port

EXPERT_KEYS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
CONFIG = dict(num_experts=8, tie_word_embeddings=False, router_bias_update_rate=0.01)


def _concat_ranks(config, ep_size, **kwargs):
    """The state of an EP `ep_size` build, its ranks' expert rows put back together (dense tensors must
    be equal on every rank: checked here)."""
    parts = [build_model(config, ep_size=ep_size, ep_rank=r, **kwargs).state_dict() for r in range(ep_size)]
    out = {}
    for name, tensor in parts[0].items():
        if name.endswith(EXPERT_KEYS):
            assert tensor.shape[0] == config.num_experts // ep_size
            out[name] = torch.cat([p[name] for p in parts])
        else:
            assert all(torch.equal(p[name], tensor) for p in parts), name
            out[name] = tensor
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_initial_values_do_not_depend_on_the_layout(tied):
    config = MulaConfig.from_preset("mula-tiny-moe", **{**CONFIG, "tie_word_embeddings": tied})
    whole = build_model(config, seed=7).state_dict()
    for ep_size in (2, 4, 8):
        sliced = _concat_ranks(config, ep_size, seed=7)
        assert sliced.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(sliced[name], tensor), (ep_size, name)
    other = build_model(config, seed=8).state_dict()
    assert not torch.equal(other["model.layers.0.mlp.experts.down_proj"], whole["model.layers.0.mlp.experts.down_proj"])
    # the values are those of the model's own initialisation: N(0, 0.02) weights, unit norms, zero bias
    experts = whole["model.layers.1.mlp.experts.gate_up_proj"]
    assert abs(experts.std().item() - config.initializer_range) < 1e-3 and abs(experts.mean().item()) < 1e-3
    assert torch.equal(whole["model.norm.weight"], torch.ones(config.hidden_size))
    assert torch.equal(whole["model.layers.0.mlp.gate.expert_bias"], torch.zeros(config.num_experts))
    assert torch.equal(whole["model.embed_tokens.weight"][config.pad_token_id], torch.zeros(config.hidden_size))
    distinct = {hashlib.sha1(experts[e].numpy().tobytes()).hexdigest() for e in range(config.num_experts)}
    assert len(distinct) == config.num_experts  # each expert its own draw


def test_sliced_build_runs_as_the_whole_one():
    from ds_optimus.hf_models.mula import MulaForCausalLM

    config = MulaConfig.from_preset("mula-tiny-moe", **CONFIG)
    model = build_model(config, seed=1)
    reference = MulaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    for (name, buffer), (_, want) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(buffer, want), name  # RoPE frequencies recomputed, the router bias zero
    ids = torch.randint(2, config.vocab_size, (2, 12))
    assert torch.equal(model(ids, labels=ids).loss, reference(ids, labels=ids).loss)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_each_rank_reads_its_rows_of_a_folder(tmp_path, fmt):
    config = MulaConfig.from_preset("mula-tiny-moe", **CONFIG)
    whole = build_model(config, seed=3)
    whole.save_pretrained(tmp_path, safe_serialization=fmt == "safetensors")
    want = whole.state_dict()
    for ep_size in (1, 4):
        got = _concat_ranks(config, ep_size, folder=tmp_path)
        assert all(torch.equal(got[name], want[name]) for name in want)


def test_an_olmoe_folder_is_stacked_for_the_rank_s_experts_only(tmp_path):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from ds_optimus.hf_models.mula.convert_olmoe import olmoe_to_mula_config, read_config

    torch.manual_seed(0)
    OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).save_pretrained(tmp_path, save_original_format=True)
    config = olmoe_to_mula_config(read_config(tmp_path))
    whole = build_model(config, folder=tmp_path, kind="olmoe").state_dict()
    assert whole["model.layers.1.mlp.experts.down_proj"].shape[0] == 8
    sliced = _concat_ranks(config, 4, folder=tmp_path, kind="olmoe")
    assert all(torch.equal(sliced[name], whole[name]) for name in whole)


@pytest.mark.parametrize("tied", [False, True])
def test_an_olmo_folder_trains_as_mula(tmp_path, tied):
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(0)
    olmo = OlmoForCausalLM(
        OlmoConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            pad_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=tied,
        )
    ).eval()
    olmo.save_pretrained(tmp_path)
    spec = ModelConfig(path=str(tmp_path))
    assert spec.describe() == f"{tmp_path} (an OLMo folder, read as Mula, with its weights)"
    model = spec.build().eval()
    assert model.config.norm_type == "layer_norm" and not model.config.norm_elementwise_affine
    assert model.config.tie_word_embeddings == tied
    ids = torch.randint(2, 96, (2, 12))
    assert torch.equal(model(ids).logits, olmo(ids).logits)


def test_model_config_builds_the_slice_and_names_bad_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    config = MulaConfig.from_preset("mula-tiny-moe", **CONFIG)
    build_model(config, seed=0).save_pretrained(tmp_path)
    model = ModelConfig(path=str(tmp_path)).build(ep_size=2, ep_rank=1)
    experts = model.model.layers[0].mlp.experts
    assert (experts.num_local_experts, experts.expert_offset, experts.down_proj.shape[0]) == (4, 4, 4)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"] = tensors["model.layers.0.mlp.experts.down_proj"][:6]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"has weights of another shape for model.layers.0.mlp.experts.down_proj: "
        r"they would train from random values",
    ):
        ModelConfig(path=str(tmp_path)).build(ep_size=2, ep_rank=1)


# -- memory: 4 processes at EP 4, each holding a quarter of experts too large for 4 whole copies ----------------


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal")


def _memory_overrides(expert_bytes: float) -> dict:
    """mula-tiny-moe with two MoE layers of 64 experts whose fp32 expert weights come to about `expert_bytes`."""
    hidden, layers, experts = 1024, 2, 64
    intermediate = max(64, int(expert_bytes / (layers * experts * 3 * hidden * 4)) // 64 * 64)
    return dict(
        hidden_size=hidden,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=intermediate,
    )


def _expert_digests(model) -> dict[str, int]:
    """A CRC-32 per expert (global index) of every MoE layer's weights, read in place."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "expert_offset"):
            for j in range(module.num_local_experts):
                crc = 0
                for weight in ("gate_up_proj", "down_proj"):
                    crc = zlib.crc32(getattr(module, weight)[j].detach().numpy(), crc)
                out[f"{name}[{module.expert_offset + j}]"] = crc
    return out


def _memory_rank(rank: int, world: int, port: int, expert_bytes: float, out: str) -> None:
    import torch.distributed as dist

    from ds_optimus.parallel import apply_expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = ModelConfig(preset="mula-tiny-moe", overrides=_memory_overrides(expert_bytes)).build(
        ep_size=world, ep_rank=rank, seed=5
    )
    apply_expert_parallel(model, world)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    Path(out, f"{rank}.json").write_text(
        json.dumps({"growth": peak - before, "held": held, "digests": _expert_digests(model)})
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ep4_ranks_hold_a_quarter_of_experts_four_whole_copies_of_which_exceed_the_machine(tmp_path):
    import torch.multiprocessing as mp

    from ds_optimus.plan.layout import Layout
    from ds_optimus.plan.memory import local_params
    from ds_optimus.plan.model import ModelShape

    total = _mem_total()
    expert_bytes = min(1.1 * total / 4, 9 * 2**30)  # four whole copies would not fit (on machines up to 32 GiB)
    config = MulaConfig.from_preset("mula-tiny-moe", **_memory_overrides(expert_bytes))
    shape = ModelShape.from_config(config)
    whole_bytes = 4 * (shape.dense_params + shape.expert_params)
    assert 4 * whole_bytes > total or total > 32 * 2**30
    dense, expert = local_params(shape, Layout(world=4, ep=4))
    planned = 4 * (dense + expert)  # fp32 parameters one rank holds, by the planner

    port = free_port()
    mp.start_processes(_memory_rank, args=(4, port, expert_bytes, str(tmp_path)), nprocs=4, start_method="spawn")
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for r, result in enumerate(ranks):
        assert abs(result["held"] / planned - 1) < 0.01, (r, result["held"], planned)
        # the peak grew by what the rank keeps (and little more): never by the whole model
        assert result["growth"] < 1.15 * planned + 64 * 2**20, (r, result["growth"] / 2**30, planned / 2**30)
        assert result["growth"] < 0.4 * whole_bytes
    print(
        f"\nexperts {shape.expert_params * 4 / 2**30:.2f} GiB fp32 (x4 = {4 * whole_bytes / 2**30:.1f} GiB whole "
        f"copies, machine {total / 2**30:.1f} GiB); per rank planned {planned / 2**30:.2f} GiB, peak growth "
        + ", ".join(f"{r['growth'] / 2**30:.2f}" for r in ranks)
        + " GiB",
        file=sys.stderr,
    )

    digests = {}
    for result in ranks:
        digests.update(result["digests"])
    one_process = build_model(config, seed=5)  # the whole model, in this process (the ranks are gone)
    assert digests == _expert_digests(one_process)


def test_a_rank_outside_the_ep_group_is_refused():
    config = MulaConfig.from_preset("mula-tiny-moe", **CONFIG)
    for rank in (-1, 2, 5):
        with pytest.raises(ValueError, match=rf"^build_model: ep_rank must be in \[0, ep_size=2\), got {rank}$"):
            build_model(config, ep_size=2, ep_rank=rank)


def test_a_folder_s_vocabulary_and_a_dense_model_under_ep_say_what_to_change(tmp_path):
    from ds_optimus.data import load_tokenizer
    from ds_optimus.train.preflight import check_run

    small = MulaConfig.from_preset("mula-tiny-dense", vocab_size=1000)
    build_model(small).save_pretrained(tmp_path / "small")
    with pytest.raises(
        ConfigError,
        match=r"more than the model's vocab_size 1000 \(set optimus.data.tokenizer to the "
        r"model's own tokenizer: its weights fix the vocabulary\)$",
    ):
        ModelConfig(path=str(tmp_path / "small")).mula_config(load_tokenizer(None))
    with pytest.raises(
        ConfigError,
        match=r"more than the model's vocab_size 1000 \(set optimus.model.overrides."
        r"vocab_size\)$",
    ):
        ModelConfig(preset="mula-tiny-dense", overrides={"vocab_size": 1000}).mula_config(load_tokenizer(None))
    config = json.loads((Path(__file__).parents[1] / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    config["optimus"]["model"] = {"preset": "mula-tiny-dense"}
    with pytest.raises(
        ConfigError,
        match=r"needs an MoE model \(num_experts > 0\); this one is dense: set "
        r"optimus.expert_parallel.size=1$",
    ):
        check_run(config, 2)


def test_overrides_take_every_setting_the_config_takes_and_name_a_misspelled_one():
    """What PretrainedConfig converts or pops (rope_theta into rope_parameters, attn_implementation,
    torch_dtype) stays accepted; a name MulaConfig has nowhere is one line with the closest one."""
    config = ModelConfig(
        preset="mula-tiny-moe",
        overrides={
            "rope_theta": 5e5,
            "attn_implementation": "eager",
            "torch_dtype": "float32",
            "tie_word_embeddings": False,
            "num_experts_per_tok": 1,
        },
    ).mula_config()
    assert config.rope_parameters["rope_theta"] == 5e5 and config._attn_implementation == "eager"
    assert config.num_experts_per_tok == 1
    with pytest.raises(
        ConfigError,
        match=r"^optimus.model.overrides.hiden_size is not a MulaConfig setting \(did "
        r"you mean 'hidden_size'\?\)$",
    ):
        ModelConfig(preset="mula-tiny-moe", overrides={"hiden_size": 6}).mula_config()

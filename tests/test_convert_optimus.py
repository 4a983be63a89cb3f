"""Tests of the importer of the seed's checkpoints (ds_optimus.hf_models.mula.convert_optimus).

A tiny random Mula model is the reference: its weights, under the seed's names, are written in the seed's
layout (`seed_checkpoints.py`: PP x EP files, local layer and expert indices, interleaved virtual stages,
merged experts, a `module.` prefix, views into one flat buffer), imported, and the Mula folder is held to
the reference's logits. Both are loaded the same way (`from_pretrained`) and compute in float32 on the CPU
from the same bits in the same order, so the logits must be equal bit for bit, not just close. Broken
folders fail with one line and exit code 2, before anything is written; an imported folder trains.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import conversion
import pytest
import torch
from conversion import VOCAB, load, logits, random_ids
from doc_blocks import doc_commands, ran
from safetensors.torch import load_file
from seed_checkpoints import seed_names, write_checkpoint

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, count_parameters
from ds_optimus.hf_models.mula import convert_optimus as importer
from ds_optimus.hf_models.mula.convert_optimus import ConversionError, config_from_model_choice, main

PROG = "ds_optimus.hf_models.mula.convert_optimus"
LAYERS, EXPERTS = 4, 8


# -- helpers ------------------------------------------------------------------------------------
def moe_config(**overrides) -> MulaConfig:
    """A tiny OLMoE-style Mula (QK-norm, RMSNorm, softmax top-2 of 8 experts), untied as the seed's models.
    initializer_range 0.2 makes the logits O(1) and the routing decisive."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return MulaConfig.from_preset("mula-tiny-moe", **{**values, **overrides})


def dense_config(**overrides) -> MulaConfig:
    """A tiny OLMo-style dense Mula (mula-1b's architecture: parameter-free LayerNorms, no QK-norm)."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        initializer_range=0.2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
    )
    return MulaConfig.from_preset("mula-1b", **{**values, **overrides})


def reference(tmp_path: Path, config: MulaConfig, seed: int = 0, dtype=torch.float32):
    """A random model saved as a Mula folder (`tmp_path/ref`, whose config.json is what --config reads) and
    loaded back as the import will be, with its weights under the seed's names."""
    torch.manual_seed(seed)
    MulaForCausalLM(config).to(dtype).save_pretrained(tmp_path / "ref")
    model = load(tmp_path / "ref")
    return model, seed_names(model.state_dict())


def run(src: Path, dst: Path, *extra) -> Path:
    """The importer's main(); it must succeed."""
    assert main([str(src), str(dst), *map(str, extra)]) == 0
    return dst


def expect_error(capsys, argv) -> str:
    return conversion.expect_error(capsys, main, PROG, argv)


def assert_same_model(got, want) -> None:
    ids = random_ids()
    ref = logits(want, ids)
    assert ref.abs().max() > 0.5  # not a comparison of near-zero numbers
    assert torch.equal(logits(got, ids), ref)


@pytest.fixture
def moe_checkpoint(tmp_path):
    """A PP2 x EP2 checkpoint of a tiny MoE reference model (fp32), and the reference."""
    model, whole = reference(tmp_path, moe_config())
    folder = write_checkpoint(tmp_path / "ckpt", whole, layers=LAYERS, experts=EXPERTS, pp=2, ep=2, dtype=torch.float32)
    return folder, model


# -- 1. MoE layouts -----------------------------------------------------------------------------
LAYOUTS = {
    "pp1-ep1-single-file": dict(pp=1, ep=1),
    "pp2-ep2": dict(pp=2, ep=2, optimizer="sharded"),
    "pp2-vpp2": dict(pp=2, ep=1, vpp=2),
    "pp2-ep2-vpp2-merged-mlp": dict(pp=2, ep=2, vpp=2, merged=True),
    "ep4-merged-mlp-module-prefix": dict(pp=1, ep=4, merged=True, module_prefix=True, optimizer="ddp"),
    "pp4-ep2-module-prefix-unshared": dict(pp=4, ep=2, module_prefix=True, flat_buffer=False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_checkpoint_imports_to_the_same_model_in_each_layout(tmp_path, name):
    layout = LAYOUTS[name]
    model, whole = reference(tmp_path, moe_config(), seed=len(name))
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=LAYERS, experts=EXPERTS, dtype=torch.float32, **layout)
    files = sorted(p.name for p in src.iterdir() if p.name.startswith("model_"))
    pp, ep = layout["pp"], layout["ep"]
    assert files == (
        ["model_checkpoint.pth"] if pp * ep == 1 else sorted(f"model_checkpoint_shard-{k}.pth" for k in range(pp * ep))
    )
    shard0 = torch.load(src / files[0], weights_only=True)
    keys = list(shard0["state_dict"])
    assert shard0["train_step_id"] == 1000 and (src / "completed").read_text() == "1000"
    assert all(k.startswith("module.") for k in keys) == bool(layout.get("module_prefix"))
    assert any("_merged_weight" in k for k in keys) == bool(layout.get("merged"))

    extra = ["--vpp", layout["vpp"]] if "vpp" in layout else []
    if name.startswith("pp4"):
        extra += ["--pp", 4, "--ep", 2]  # given: they must agree with what the files say
    out = run(src, tmp_path / "mula", "--config", tmp_path / "ref" / "config.json", *extra)
    written = load_file(out / "model.safetensors")
    assert set(written) == set(model.state_dict())
    for key, tensor in model.state_dict().items():
        assert torch.equal(written[key], tensor), key
    imported = load(out)
    assert type(imported) is MulaForCausalLM and imported.config.tie_word_embeddings is False
    assert_same_model(imported, model)


def test_virtual_stages_must_be_given_and_matter(tmp_path):
    """The files of an interleaved run look like contiguous ones: read without --vpp the layers are
    misplaced, so the logits differ (the importer cannot tell; the docs say to give --vpp)."""
    model, whole = reference(tmp_path, moe_config())
    src = write_checkpoint(
        tmp_path / "ckpt", whole, layers=LAYERS, experts=EXPERTS, pp=2, ep=2, vpp=2, dtype=torch.float32
    )
    right = load(run(src, tmp_path / "right", "--config", tmp_path / "ref", "--vpp", 2))
    wrong = load(run(src, tmp_path / "wrong", "--config", tmp_path / "ref"))
    assert_same_model(right, model)
    ids = random_ids()
    assert (logits(wrong, ids) - logits(model, ids)).abs().max() > 1e-2


def test_several_output_files_with_an_index(tmp_path, moe_checkpoint, monkeypatch):
    src, model = moe_checkpoint
    monkeypatch.setattr(importer, "MAX_FILE_BYTES", 20_000)
    out = run(src, tmp_path / "mula", "--config", tmp_path / "ref")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == set(files)
    assert not list(out.glob("*.partial"))
    assert_same_model(load(out), model)


def test_each_file_is_read_memory_mapped_once_to_check_and_once_to_write(tmp_path, moe_checkpoint, monkeypatch):
    src, model = moe_checkpoint
    calls = []
    original = torch.load

    def spy(path, *args, **kwargs):
        calls.append((Path(path).name, kwargs.get("mmap"), kwargs.get("weights_only")))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    out = run(src, tmp_path / "mula", "--config", tmp_path / "ref")
    files = [f"model_checkpoint_shard-{k}.pth" for k in range(4)]
    assert calls == [(name, True, True) for name in files + files]  # the optimizer files are never opened
    assert_same_model(load(out), model)


# -- 2. dense OLMo-style models -----------------------------------------------------------------
@pytest.mark.parametrize("norm", ["parameter-free-layer-norm", "rms-norm"])
@pytest.mark.parametrize(
    "layout", [dict(pp=1), dict(pp=2, ep=2), dict(pp=2, vpp=2)], ids=["pp1", "pp2-ep2", "pp2-vpp2"]
)
def test_dense_checkpoint_imports_to_the_same_model(tmp_path, norm, layout):
    """The seed's OLMo: no norm tensors with its parameter-free LayerNorm, a weight each with RMS; under EP
    (more data-parallel ranks for a dense model) every file of a stage holds the whole stage."""
    overrides = dict(norm_type="rms_norm", norm_elementwise_affine=True) if norm == "rms-norm" else {}
    model, whole = reference(tmp_path, dense_config(**overrides), seed=3)
    assert any("layernorm" in k for k in whole) == (norm == "rms-norm")
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=LAYERS, dtype=torch.float32, **layout)
    out = run(src, tmp_path / "mula", "--config", tmp_path / "ref", "--vpp", layout.get("vpp", 1))
    imported = load(out)
    assert imported.config.num_experts == 0 and imported.config.norm_type == model.config.norm_type
    assert_same_model(imported, model)


# -- the seed's model-choice grammar ------------------------------------------------------------
TINY_OLMOE = "allenai/OLMoE-1B-7B-0924--SA0.25-SH0.03125-SE0.125-SC0.25-SI0.03125-L2"
TINY_OLMO = "allenai/OLMo-1B-hf--S0.0625-L2"


def test_model_choice_end_to_end_moe_in_bf16(tmp_path):
    """A run of the seed's grammar (OLMoE base shrunk by tags; vocabulary 50304), saved in bf16 as the seed
    saves, imported with --model-choice and --dtype keep: the same bf16 model."""
    want = MulaConfig(
        vocab_size=50304,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=32,
        max_position_embeddings=4096,
        pad_token_id=1,
        eos_token_id=50279,
        initializer_range=0.2,
    )
    model, whole = reference(tmp_path, want, dtype=torch.bfloat16)
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=2, experts=8, pp=2, ep=2)  # bf16
    imported = load(run(src, tmp_path / "mula", "--model-choice", TINY_OLMOE))
    assert imported.dtype == torch.bfloat16
    config = imported.config
    assert (config.router_aux_loss_type, config.router_z_loss_coef, config.router_aux_loss_coef) == (
        "transformers",
        0.0,
        0.01,
    )  # the seed's recipe
    assert_same_model(imported, model)


def test_model_choice_skip_qk_norm_leaves_the_stored_norm_weights_out(tmp_path):
    want = MulaConfig(
        vocab_size=50304,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=32,
        qk_norm=False,
        initializer_range=0.2,
    )
    model, whole = reference(tmp_path, want)
    for layer in range(2):  # stored by the seed, never applied
        whole[f"model.layers.{layer}.self_attn.q_norm.weight"] = torch.randn(64)
        whole[f"model.layers.{layer}.self_attn.k_norm.weight"] = torch.randn(64)
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=2, experts=8, ep=2, dtype=torch.float32)
    imported = load(run(src, tmp_path / "mula", "--model-choice", TINY_OLMOE + "-SKIPQKNORM-NAL"))
    assert imported.config.qk_norm is False and imported.config.router_aux_loss_coef == 0.0
    assert_same_model(imported, model)


def test_model_choice_end_to_end_dense(tmp_path):
    want = dense_config(
        vocab_size=50304,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=1,
        max_position_embeddings=4096,
        pad_token_id=1,
        eos_token_id=50279,
        initializer_range=0.1,
    )
    model, whole = reference(tmp_path, want)
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=2, pp=2, dtype=torch.float32)
    assert_same_model(load(run(src, tmp_path / "mula", "--model-choice", TINY_OLMO)), model)


def test_model_choice_grammar_gives_the_seeds_shapes():
    def shape(config):
        return {
            k: getattr(config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "qk_norm",
                "norm_topk_prob",
                "tie_word_embeddings",
            )
        }

    for tags, preset in (
        ("SA1.5-SH1.5-SE3.75-SI1.5-L64", "mula-220b-a10b"),
        ("SA1.5-SH1.5-SE2.25-SI1.5-L48", "mula-100b-a7b"),
        ("SE1.5-L32", "mula-20b-a2b"),
        ("", "mula-7b-a1b"),
    ):
        config, skip = config_from_model_choice(
            f"allenai/OLMoE-1B-7B-0924--{tags}" if tags else "allenai/OLMoE-1B-7B-0924"
        )
        assert shape(config) == shape(MulaConfig.from_preset(preset)) and not skip
        assert count_parameters(config) == count_parameters(MulaConfig.from_preset(preset))
    # the seed's own example, in the forms its folder names take (no org; `/` as `__`)
    run_name = "OLMoE-1B-7B-0924--SA3-SH1.5-SE2.25-SC0.5-SI2-L36_om_omcached_gral_ac1_bf16_n256xg12"
    for choice in (
        "allenai/OLMoE-1B-7B-0924--SA3-SH1.5-SE2.25-SC0.5-SI2-L36",
        "allenai__OLMoE-1B-7B-0924--SA3-SH1.5-SE2.25-SC0.5-SI2-L36",
        run_name,
    ):
        config, _ = config_from_model_choice(choice)
        assert (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.num_hidden_layers,
        ) == (3072, 48, 48, 64, 144, 4, 2048, 36)
    assert config_from_model_choice("allenai/OLMoE-1B-7B-0924--S2")[0].num_experts == 128  # S: SA, SH, SE, SI
    assert config_from_model_choice("allenai/OLMoE-1B-7B-0924--SM2")[0].num_experts == 64  # SM: SA and SH
    dense, _ = config_from_model_choice("allenai/OLMo-1B-hf")
    assert shape(dense) == shape(MulaConfig.from_preset("mula-1b")) and dense.max_position_embeddings == 4096
    assert (dense.norm_type, dense.norm_elementwise_affine) == ("layer_norm", False)
    rms, _ = config_from_model_choice("allenai/OLMo-1B-hf--S0.5-L8-RMS-TWE")
    assert (rms.hidden_size, rms.intermediate_size, rms.num_hidden_layers, rms.norm_type) == (1024, 4096, 8, "rms_norm")
    assert rms.norm_elementwise_affine and not rms.tie_word_embeddings  # the seed's head stays separate under TWE


@pytest.mark.parametrize(
    "choice, expected",
    [
        ("meta-llama/Llama-3.2-1B--L4", "is not allenai/OLMoE-1B-7B-0924 or allenai/OLMo-1B-hf"),
        ("allenai/OLMoE-1B-7B-0924--SX2", "unknown OLMoE tag 'SX'"),
        ("allenai/OLMoE-1B-7B-0924--S2-SA1.5", "S scales SA, SH, SE, SI together"),
        ("allenai/OLMoE-1B-7B-0924--L1.5", "tag L needs an integer"),
        ("allenai/OLMoE-1B-7B-0924--SA", "tag SA needs a number"),
        ("allenai/OLMoE-1B-7B-0924--sa2", "tag 'sa2' is not capitals"),
        ("allenai/OLMo-1B-hf--SA2", "unknown OLMo tag 'SA'"),
        ("allenai/OLMoE-1B-7B-0924--SA0.01", "num_attention_heads must be a positive integer"),
    ],
)
def test_model_choice_errors(choice, expected):
    with pytest.raises(ConversionError, match=expected.replace("(", r"\(")) as err:
        config_from_model_choice(choice)
    assert "\n" not in str(err.value)


def test_preset(tmp_path):
    model, whole = reference(tmp_path, MulaConfig.from_preset("mula-tiny-moe", initializer_range=0.2))
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=4, experts=8, pp=2, ep=4, dtype=torch.float32)
    assert_same_model(load(run(src, tmp_path / "mula", "--preset", "mula-tiny-moe")), model)


# -- dtypes -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "saved, option, written",
    [
        (torch.bfloat16, "keep", torch.bfloat16),
        (torch.bfloat16, "fp32", torch.float32),
        (torch.float32, "bf16", torch.bfloat16),
        (torch.float32, "keep", torch.float32),
    ],
)
def test_dtype(tmp_path, saved, option, written):
    model, whole = reference(tmp_path, moe_config())
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=LAYERS, experts=EXPERTS, ep=2, dtype=saved)
    out = run(src, tmp_path / "mula", "--config", tmp_path / "ref", "--dtype", option)
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {written}
    for key, tensor in model.state_dict().items():  # bf16 -> fp32 is exact; fp32 -> bf16 rounds as .to() does
        assert torch.equal(tensors[key], tensor.to(saved).to(written)), key
    assert json.loads((out / "config.json").read_text())["dtype"] == str(written).removeprefix("torch.")


# -- 3. errors ----------------------------------------------------------------------------------
def test_error_missing_shard(moe_checkpoint, tmp_path, capsys):
    src, _ = moe_checkpoint
    (src / "model_checkpoint_shard-1.pth").unlink()
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])
    assert "model_checkpoint_shard-1.pth is missing" in line
    assert not (tmp_path / "out").exists()


def test_error_last_shard_missing(moe_checkpoint, tmp_path, capsys):
    src, _ = moe_checkpoint
    (src / "model_checkpoint_shard-3.pth").unlink()
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref", "--pp", 2, "--ep", 2])
    assert "has 3 model files, but pp 2 x ep 2 makes 4: model_checkpoint_shard-3.pth is missing" in line
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])  # inferred: pp 2 from shard 0
    assert (
        "3 model files, which do not divide over 2 pipeline stages (model_checkpoint_shard-0.pth holds 2 of the "
        "config's 4 layers)" in line
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--pp", 1, "--ep", 2], "has 4 model files, but pp 1 x ep 2 makes 2: more files than that layout has"),
        (
            ["--pp", 4],
            "model_checkpoint_shard-0.pth holds 2 decoder layers, but the config's 4 over pp 4 make 1 per stage",
        ),
        (["--pp", 1, "--ep", 4], "holds 2 decoder layers, but the config's 4 over pp 1 make 4 per stage"),
        (["--ep", 3], "has 4 model files, but pp 2 x ep 3 makes 6: model_checkpoint_shard-4.pth is missing"),
    ],
)
def test_error_layout_does_not_fit_the_files(moe_checkpoint, tmp_path, capsys, flags, expected):
    src, _ = moe_checkpoint
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref", *flags])
    assert expected in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            dict(hidden_size=64),
            "tensor model.embed_tokens.weight in model_checkpoint_shard-0.pth has shape [112, 32], "
            "the config implies [112, 64]",
        ),
        (dict(num_experts=16), "holds 4 experts per layer, but 16 experts over ep 2 make 8"),
        (
            dict(moe_intermediate_size=8),
            "experts.0.gate_proj.weight in model_checkpoint_shard-0.pth has shape [16, 32], the config implies [8, 32]",
        ),
        (dict(num_hidden_layers=6), "4 model files, which do not divide over 3 pipeline stages"),
        (
            dict(num_experts=0),
            "model_checkpoint_shard-0.pth holds 4 experts per layer, but the config's model is dense",
        ),
        (
            dict(qk_norm=False),
            "unexpected tensor model.layers.0.self_attn.q_norm.weight in model_checkpoint_shard-0.pth",
        ),
        (
            dict(num_key_value_heads=4),
            "k_proj.weight in model_checkpoint_shard-0.pth has shape [16, 32], the config "
            "implies [32, 32] (a tensor-parallel part? only TP 1 is read)",
        ),
    ],
)
def test_error_config_does_not_match_the_tensors(moe_checkpoint, tmp_path, capsys, overrides, expected):
    src, _ = moe_checkpoint
    moe_config(**overrides).save_pretrained(tmp_path / "other")
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "other" / "config.json"])
    assert expected in line
    assert not (tmp_path / "out").exists()


def test_error_missing_and_unexpected_tensors(moe_checkpoint, tmp_path, capsys):
    src, _ = moe_checkpoint
    path = src / "model_checkpoint_shard-3.pth"
    saved = torch.load(path, weights_only=True)
    del saved["state_dict"]["model.layers.1.mlp.experts.2.up_proj.weight"]  # layer 3, expert 6
    torch.save(saved, path)
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])
    assert (
        "missing tensor model.layers.3.mlp.experts.6.up_proj (local expert 2 in model_checkpoint_shard-3.pth)" in line
    )
    saved["state_dict"]["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(16, 32)
    saved["state_dict"]["model.layers.1.extra.weight"] = torch.zeros(3)
    torch.save(saved, path)
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])
    assert "unexpected tensor model.layers.1.extra.weight in model_checkpoint_shard-3.pth" in line


def test_error_empty_folder_and_not_a_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "is empty" in expect_error(capsys, [tmp_path / "empty", tmp_path / "out", "--preset", "mula-tiny-moe"])
    assert "is not a folder" in expect_error(
        capsys, [tmp_path / "nowhere", tmp_path / "out", "--preset", "mula-tiny-moe"]
    )
    assert not (tmp_path / "out").exists()


def test_error_folders_that_are_not_a_seed_checkpoint(moe_checkpoint, tmp_path, capsys):
    src, _ = moe_checkpoint
    argv = [tmp_path / "out", "--config", tmp_path / "ref"]
    line = expect_error(capsys, [tmp_path / "ref", *argv])  # a Hugging Face folder
    assert "is a Hugging Face folder (it has config.json), not a checkpoint of the seed" in line
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    src.rename(run_dir / "checkpoints" / "main")
    assert "is a run folder of the seed: import one of its checkpoints" in expect_error(capsys, [run_dir, *argv])
    line = expect_error(capsys, [run_dir / "checkpoints", *argv])
    assert "its folders are checkpoints of the seed: import one of them (main)" in line
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    line = expect_error(capsys, [other, *argv])
    assert "is not a checkpoint of the seed: it has no model_checkpoint.pth or model_checkpoint_shard-N.pth" in line
    torch.save([1, 2, 3], other / "model_checkpoint.pth")
    assert "is not a model checkpoint of the seed" in expect_error(capsys, [other, *argv])
    (other / "model_checkpoint.pth").write_bytes(b"not a zip file at all")
    assert "cannot read" in expect_error(capsys, [other, *argv])
    assert not (tmp_path / "out").exists()


def test_error_unfinished_save_and_force(moe_checkpoint, tmp_path, capsys):
    src, model = moe_checkpoint
    (src / "completed").unlink()
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])
    assert "has no `completed` marker" in line and "--force" in line
    (src / "completed").write_text("999")
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])
    assert "completed says step 999, the shards are from step 1000" in line
    assert not (tmp_path / "out").exists()
    out = run(src, tmp_path / "out", "--config", tmp_path / "ref", "--force")
    assert "imported anyway (--force)" in capsys.readouterr().out
    assert_same_model(load(out), model)


def test_error_files_of_two_saves(moe_checkpoint, tmp_path, capsys):
    src, _ = moe_checkpoint
    path = src / "model_checkpoint_shard-2.pth"
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "train_step_id": 500}, path)
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref", "--force"])
    assert "model_checkpoint_shard-2.pth is from step 500, model_checkpoint_shard-0.pth from step 1000" in line


def test_error_replicas_that_differ_and_force(moe_checkpoint, tmp_path, capsys):
    src, model = moe_checkpoint
    path = src / "model_checkpoint_shard-1.pth"
    saved = torch.load(path, weights_only=True)
    saved["state_dict"]["model.layers.0.mlp.gate.weight"] = saved["state_dict"]["model.layers.0.mlp.gate.weight"] + 1
    torch.save(saved, path)
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref"])
    assert "the expert-parallel copies of model.layers.0.mlp.gate.weight differ" in line
    out = run(src, tmp_path / "out", "--config", tmp_path / "ref", "--force")  # each stage's first file's copy
    assert "note: the expert-parallel copies of model.layers.0.mlp.gate.weight differ" in capsys.readouterr().out
    assert_same_model(load(out), model)


def test_error_output_not_empty_and_nothing_left_after_a_failure(moe_checkpoint, tmp_path, capsys, monkeypatch):
    src, _ = moe_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "not empty" in expect_error(capsys, [src, out, "--config", tmp_path / "ref"])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    calls = []
    original = importer.assemble

    def failing(*args):  # a read error in the middle of the writing pass
        calls.append(1)
        if len(calls) > 20:
            raise ConversionError("cannot read the disk")
        return original(*args)

    monkeypatch.setattr(importer, "assemble", failing)
    assert "cannot read the disk" in expect_error(capsys, [src, tmp_path / "new", "--config", tmp_path / "ref"])
    assert len(calls) > 20 and not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    calls.clear()
    expect_error(capsys, [src, tmp_path / "empty", "--config", tmp_path / "ref"])
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())


def test_error_tokenizer_and_shape_options(moe_checkpoint, tmp_path, capsys):
    from ds_optimus.data import load_tokenizer

    src, _ = moe_checkpoint
    load_tokenizer().save_pretrained(tmp_path / "tok")  # 4096 tokens, the model has 112
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref", "--tokenizer", tmp_path / "tok"])
    assert "has 4096 tokens, more than the model's vocab_size 112" in line
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "ref", "--tokenizer", tmp_path / "no"])
    assert "--tokenizer" in line and "is not a folder" in line
    assert "unknown Mula preset 'mula-9z'" in expect_error(capsys, [src, tmp_path / "out", "--preset", "mula-9z"])
    line = expect_error(capsys, [src, tmp_path / "out", "--config", tmp_path / "missing.json"])
    assert "--config" in line and "no such file" in line
    with pytest.raises(ConversionError, match="give exactly one of --model-choice, --config and --preset"):
        importer.import_checkpoint(src, tmp_path / "out")
    for argv in (
        [src, tmp_path / "out"],
        [src, tmp_path / "out", "--preset", "a", "--config", "b"],
        [src, tmp_path / "out", "--preset", "mula-tiny-moe", "--pp", "0"],
    ):
        with pytest.raises(SystemExit) as exit:
            main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and "Traceback" not in err
        assert [line for line in err.splitlines() if "error" in line][0].startswith(f"{PROG}: error: ")
    assert not (tmp_path / "out").exists()


def test_error_cli_subprocess(tmp_path):
    """The real command line: exit status 2 and one clean line on stderr."""
    (tmp_path / "empty").mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", PROG, str(tmp_path / "empty"), str(tmp_path / "out"), "--preset", "mula-tiny-moe"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"{PROG}: error: {tmp_path / 'empty'} is empty"], proc.stderr
    assert not (tmp_path / "out").exists()


# -- 4. the imported folder trains here ----------------------------------------------------------
def test_the_imported_folder_trains(tmp_path):
    """A PP2 x EP2 bf16 checkpoint of mula-tiny-moe with the tokenizer, imported, then two training steps
    of the pretraining entry point from `optimus.model.path` (the tokenizer from the same folder)."""
    from distributed import run_distributed
    from train_workers import pretrain_worker, tiny_config

    from ds_optimus.config import OptimusConfig
    from ds_optimus.data import load_tokenizer

    model, whole = reference(tmp_path, MulaConfig.from_preset("mula-tiny-moe"))
    src = write_checkpoint(tmp_path / "ckpt", whole, layers=4, experts=8, pp=2, ep=2, optimizer="sharded")
    load_tokenizer().save_pretrained(tmp_path / "tok")
    out = run(src, tmp_path / "mula", "--preset", "mula-tiny-moe", "--tokenizer", tmp_path / "tok")
    assert (out / "tokenizer.json").is_file()

    config = tiny_config(tmp_path, tmp_path / "cache", model={"path": str(out)})
    config["optimus"]["data"]["tokenizer"] = str(out)
    config["optimus"]["train"].update(steps=2, eval_interval=0, eval_batches=1)
    config["optimus"]["checkpoint"]["interval"] = 0
    opt = OptimusConfig.from_ds_config(config)  # what the run builds: the folder's weights, in float32
    built = opt.model.build(load_tokenizer(str(out)))
    for key, tensor in model.state_dict().items():
        assert torch.equal(built.state_dict()[key], tensor.to(torch.bfloat16).float()), key
    summary = run_distributed(pretrain_worker, 1, config)[0]
    losses = [summary["losses"][step] for step in sorted(summary["losses"])]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert 4 < losses[0] < 12  # a language model's first loss over 4096 tokens (ln 4096 = 8.3), not a broken one


# -- the docs -----------------------------------------------------------------------------------
def test_the_docs_import_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """docs/models.md's commands: the one on a tiny checkpoint runs as written (paths made under a temporary
    folder); the 220B one's --model-choice is mula-220b-a10b's shape."""
    from ds_optimus.data import load_tokenizer

    commands = sorted({c.text for c in doc_commands() if c.text.startswith(f"python -m {PROG} ")})
    assert len(commands) == 2, commands
    big, tiny = (c for c in sorted(commands, key=lambda c: "--model-choice" not in c))
    argv = shlex.split(big)
    choice = argv[argv.index("--model-choice") + 1]
    assert count_parameters(config_from_model_choice(choice)[0]) == count_parameters(
        MulaConfig.from_preset("mula-220b-a10b")
    )

    argv = shlex.split(tiny)[3:]
    vpp = int(argv[argv.index("--vpp") + 1]) if "--vpp" in argv else 1
    monkeypatch.chdir(tmp_path)
    model, whole = reference(tmp_path, moe_config(vocab_size=4096))
    write_checkpoint(Path(argv[0]), whole, layers=LAYERS, experts=EXPERTS, pp=2, ep=2, vpp=vpp)
    config_file = Path(argv[argv.index("--config") + 1])
    config_file.write_text((tmp_path / "ref" / "config.json").read_text())
    load_tokenizer().save_pretrained(argv[argv.index("--tokenizer") + 1])
    ran(tiny)
    assert main(argv) == 0
    imported = load(Path(argv[1]))
    assert_same_model(imported, load(tmp_path / "ref", dtype=torch.bfloat16))
    assert "wrote" in capsys.readouterr().out

"""Tests of the OLMo <-> Mula checkpoint converter (ds_optimus.hf_models.mula.convert_olmo), and of the
mula-1b preset being OLMo-1B's architecture.

Tiny random `OlmoForCausalLM` models (no downloads) are saved, converted, reloaded through the Auto classes
and held to OLMo's float32 logits (bit-exact: the same operations in the same order) and greedy
generations; converted back, every tensor must equal the original. Bad input fails with one clean line
and exit code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import conversion
import pytest
import torch
from conversion import VOCAB, load, logits, random_ids
from safetensors.torch import load_file, save_file
from transformers import OlmoConfig, OlmoForCausalLM

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM, count_parameters
from ds_optimus.hf_models.mula.convert_olmo import main, mula_to_olmo_config, olmo_to_mula_config

ROOT = Path(__file__).resolve().parents[1]
PROG = "ds_optimus.hf_models.mula.convert_olmo"
ATOL = 1e-5

# Tiny OLMo shapes. initializer_range is raised from 0.02 so that logits are O(1): a conversion error
# then moves them far beyond ATOL.
CONFIGS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False),
    "gqa-bias-clip-theta": dict(
        tie_word_embeddings=False,
        num_key_value_heads=2,
        attention_bias=True,
        clip_qkv=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}

# OLMo-1B as allenai/OLMo-1B-hf's config.json gives it (Transformers v4 style, as the Hub file is).
OLMO_1B = dict(
    model_type="olmo",
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    hidden_act="silu",
    max_position_embeddings=2048,
    initializer_range=0.02,
    use_cache=True,
    pad_token_id=1,
    bos_token_id=None,
    eos_token_id=50279,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    rope_scaling=None,
    attention_bias=False,
    attention_dropout=0.0,
    clip_qkv=None,
    torch_dtype="float32",
)


# -- helpers ------------------------------------------------------------------------------------
def make_olmo(seed: int = 0, **overrides) -> OlmoForCausalLM:
    """A random float32 OLMo model with 2 layers; `overrides` change the config."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return OlmoForCausalLM(OlmoConfig(**values)).eval()


def tiny_mula(**overrides) -> MulaConfig:
    """mula-1b's architecture at a CPU size."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
    )
    return MulaConfig.from_preset("mula-1b", **{**values, **overrides})


def convert(src: Path, dst: Path, *extra: str) -> Path:
    """Run the converter's main(); it must succeed."""
    assert main([str(src), str(dst), *extra]) == 0
    return dst


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32
    assert want.abs().max() > 0.5  # the comparison is not between near-zero numbers
    assert (got - want).abs().max().item() <= ATOL
    assert torch.equal(got, want)  # bit-exact today: the same float32 operations in the same order


def expect_error(capsys, argv) -> str:
    return conversion.expect_error(capsys, main, PROG, argv)


# -- 1. equivalence ---------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_olmo_to_mula_gives_the_same_logits_and_generations(tmp_path, name, attn):
    olmo = make_olmo(seed=len(name), **CONFIGS[name])
    olmo.save_pretrained(tmp_path / "olmo")
    mula = load(convert(tmp_path / "olmo", tmp_path / "mula"), attn_implementation=attn)
    olmo.set_attn_implementation(attn)
    assert type(mula) is MulaForCausalLM
    c = mula.config
    assert (c.norm_type, c.norm_elementwise_affine, c.rms_norm_eps, c.qk_norm, c.num_experts) == (
        "layer_norm",
        False,
        1e-5,
        False,
        0,
    )
    assert c.tie_word_embeddings == olmo.config.tie_word_embeddings  # a tied OLMo stays tied
    assert (mula.lm_head.weight.data_ptr() == mula.model.embed_tokens.weight.data_ptr()) == c.tie_word_embeddings
    assert c.clip_qkv == olmo.config.clip_qkv and c.rope_parameters == olmo.config.rope_parameters
    assert not any(p.dim() == 1 and "norm" in n for n, p in mula.named_parameters())  # parameter-free norms

    ids = random_ids()
    assert_same_logits(logits(mula, ids), logits(olmo, ids))
    want = olmo.generate(ids, max_new_tokens=8, do_sample=False)
    assert want.shape[1] > ids.shape[1]
    assert torch.equal(mula.generate(ids, max_new_tokens=8, do_sample=False), want)


def test_left_padding_matches_at_real_positions(tmp_path):
    olmo = make_olmo(seed=3, **CONFIGS["gqa-bias-clip-theta"])
    olmo.save_pretrained(tmp_path / "olmo")
    mula = load(convert(tmp_path / "olmo", tmp_path / "mula"))
    ids = random_ids(seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = olmo.config.pad_token_id
    real = mask.bool()
    got, want = logits(mula, ids, attention_mask=mask), logits(olmo, ids, attention_mask=mask)
    assert (got[real] - want[real]).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_converted_tensors_are_olmos_and_convert_back_exactly(tmp_path, name):
    olmo = make_olmo(seed=7, **CONFIGS[name])
    olmo.save_pretrained(tmp_path / "olmo")
    mula_dir = convert(tmp_path / "olmo", tmp_path / "mula")
    written = load_file(mula_dir / "model.safetensors")
    assert set(written) == set(load_file(tmp_path / "olmo" / "model.safetensors"))  # the same names
    assert ("lm_head.weight" in written) == (name == "untied")

    back = convert(mula_dir, tmp_path / "back", "--to-olmo")
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == "olmo" and config["tie_word_embeddings"] == (name == "tied")
    reloaded = load(back, OlmoForCausalLM)
    assert type(reloaded) is OlmoForCausalLM
    assert reloaded.state_dict().keys() == olmo.state_dict().keys()
    for key, tensor in olmo.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rope_parameters",
        "pad_token_id",
        "eos_token_id",
        "clip_qkv",
        "attention_bias",
    ):
        assert getattr(reloaded.config, key) == getattr(olmo.config, key), key


@pytest.mark.parametrize("tied", [True, False])
def test_native_mula_to_olmo(tmp_path, tied):
    """A Mula model of mula-1b's architecture that never was OLMo converts to OLMo with the same logits."""
    torch.manual_seed(13)
    mula = MulaForCausalLM(tiny_mula(tie_word_embeddings=tied, clip_qkv=0.7)).eval()
    mula.save_pretrained(tmp_path / "mula")
    olmo = load(convert(tmp_path / "mula", tmp_path / "olmo", "--to-olmo"), OlmoForCausalLM)
    assert olmo.config.tie_word_embeddings == tied and olmo.config.clip_qkv == 0.7
    ids = random_ids(seed=4)
    assert_same_logits(logits(olmo, ids), logits(mula, ids))


def test_bfloat16_is_kept(tmp_path):
    olmo = make_olmo(seed=19).to(torch.bfloat16)
    olmo.save_pretrained(tmp_path / "olmo")
    out = convert(tmp_path / "olmo", tmp_path / "mula")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    written = load_file(out / "model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    mula = load(out)
    assert mula.dtype == torch.bfloat16
    for key, tensor in olmo.state_dict().items():
        assert torch.equal(mula.state_dict()[key], tensor), key
    # Not bit-exact in bfloat16: OLMo keeps the RoPE tables in float32, Mula rounds them to the input's dtype.
    ids = random_ids(seed=8)
    got, want = logits(mula, ids).float(), logits(olmo, ids).float()
    assert (got - want).abs().max() / want.abs().max() < 5e-2


def test_v4_hub_style_config(tmp_path):
    """OLMo-1B-hf's config.json is v4-style: top-level rope_theta, rope_scaling null, torch_dtype."""
    olmo = make_olmo(seed=29, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    olmo.save_pretrained(tmp_path / "olmo")
    path = tmp_path / "olmo" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg))
    out = convert(tmp_path / "olmo", tmp_path / "mula")
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_theta"] == 20000.0
    ids = random_ids(seed=8)
    assert_same_logits(logits(load(out), ids), logits(olmo, ids))


# -- 2. mula-1b is OLMo-1B ----------------------------------------------------------------------
def test_mula_1b_preset_is_olmo_1b_untied():
    preset = MulaConfig.from_preset("mula-1b")
    from_olmo = olmo_to_mula_config(OLMO_1B)
    assert from_olmo.tie_word_embeddings and not preset.tie_word_embeddings  # the one difference
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "rope_parameters",
        "attention_bias",
        "clip_qkv",
        "qk_norm",
        "norm_type",
        "norm_elementwise_affine",
        "num_experts",
    )
    for field in fields:
        assert getattr(preset, field) == getattr(from_olmo, field), field
    assert (
        preset.hidden_size,
        preset.num_hidden_layers,
        preset.num_attention_heads,
        preset.intermediate_size,
        preset.max_position_embeddings,
        preset.rope_parameters["rope_theta"],
    ) == (2048, 16, 16, 8192, 2048, 10000)
    assert (preset.norm_type, preset.norm_elementwise_affine, preset.qk_norm) == ("layer_norm", False, False)

    # The same tensors, name by name and shape by shape, as OlmoForCausalLM of OLMo-1B untied (meta device).
    with torch.device("meta"):
        mula = MulaForCausalLM(preset)
        olmo = OlmoForCausalLM(mula_to_olmo_config(preset))
    shapes = {name: t.shape for name, t in mula.state_dict().items()}
    assert shapes == {name: t.shape for name, t in olmo.state_dict().items()}
    # 1.28B untied; tied, OLMo-1B's 1.18B
    assert count_parameters(preset) == (1_279_787_008, 1_279_787_008)
    assert sum(p.numel() for p in mula.parameters()) == 1_279_787_008
    assert count_parameters(from_olmo)[0] == 1_176_764_416


# -- 3. command line ----------------------------------------------------------------------------
def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", PROG, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_cli_both_ways(tmp_path):
    olmo = make_olmo(seed=37, tie_word_embeddings=True)
    olmo.save_pretrained(tmp_path / "olmo")
    there = _run(str(tmp_path / "olmo"), str(tmp_path / "mula"), cwd=tmp_path)
    assert there.returncode == 0, there.stderr
    assert f"wrote {tmp_path / 'mula'}" in there.stdout and "tie_word_embeddings=true" in there.stdout
    back = _run(str(tmp_path / "mula"), str(tmp_path / "back"), "--to-olmo", cwd=tmp_path)
    assert back.returncode == 0, back.stderr
    # its own line only: no DeepSpeed accelerator line, no Transformers shard bar or warning
    assert back.stdout.splitlines() == [f"wrote {tmp_path / 'back'}"] and back.stderr == "", back.stdout + back.stderr
    assert "Writing model shards" not in there.stderr and "accelerator" not in there.stdout
    reloaded = load(tmp_path / "back", OlmoForCausalLM)
    for key, tensor in olmo.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key
    failed = _run(str(tmp_path / "olmo"), str(tmp_path / "mula"), cwd=tmp_path)  # the output is not empty now
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert [line for line in failed.stderr.splitlines() if line.strip()] == [
        f"{PROG}: error: output folder {tmp_path / 'mula'} exists and is not empty"
    ]


def test_help_imports_neither_torch_nor_transformers():
    probe = (
        "import runpy, sys\nsys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
        "print('IMPORTED', *[m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe, PROG], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m {PROG}") and "--to-olmo" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "IMPORTED"


# -- 4. errors ----------------------------------------------------------------------------------
@pytest.fixture
def olmo_dir(tmp_path) -> Path:
    """A valid untied OLMo checkpoint folder, for the tests to break."""
    make_olmo(seed=23).save_pretrained(tmp_path / "olmo")
    return tmp_path / "olmo"


@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("llama", "model_type='llama'"),
        ("olmoe", "convert_olmoe"),
        ("hf_olmo", "OLMo-1B-hf"),
        ("olmo2", "is not an OLMo checkpoint"),
    ],
)
def test_error_other_model_type(tmp_path, capsys, model_type, expected):
    src = tmp_path / "other"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 32}))
    assert expected in expect_error(capsys, [src, tmp_path / "out"])
    assert not (tmp_path / "out").exists()


def test_error_input_and_output_folders(olmo_dir, tmp_path, capsys):
    assert "not a folder" in expect_error(capsys, [tmp_path / "nowhere", tmp_path / "out"])
    (tmp_path / "empty").mkdir()
    assert "config.json" in expect_error(capsys, [tmp_path / "empty", tmp_path / "out"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert "not empty" in expect_error(capsys, [olmo_dir, tmp_path / "out"])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def _rewrite(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, expected",
    [
        pytest.param(
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            ["missing tensor", "model.layers.1.mlp.up_proj.weight"],
            id="missing",
        ),
        pytest.param(
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(7, 32)}),
            ["model.layers.0.self_attn.k_proj.weight", "[7, 32]"],
            id="misshaped",
        ),
        pytest.param(
            lambda t: t.update({"model.norm.weight": torch.ones(32)}),
            ["unexpected tensor model.norm.weight"],
            id="a-norm-weight-olmo-does-not-have",
        ),
    ],
)
def test_error_bad_tensors(olmo_dir, tmp_path, capsys, edit, expected):
    _rewrite(olmo_dir, edit)
    line = expect_error(capsys, [olmo_dir, tmp_path / "out"])
    for text in expected:
        assert text in line
    assert not (tmp_path / "out").exists()


def test_error_invalid_olmo_config(olmo_dir, tmp_path, capsys):
    cfg = json.loads((olmo_dir / "config.json").read_text())
    cfg["num_attention_heads"] = 0
    (olmo_dir / "config.json").write_text(json.dumps(cfg))
    assert "num_attention_heads must be a positive integer" in expect_error(capsys, [olmo_dir, tmp_path / "out"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        pytest.param(dict(qk_norm=True), "qk_norm=True", id="qk-norm"),
        pytest.param(dict(norm_type="rms_norm"), "norm_type='rms_norm'", id="rms-norm"),
        pytest.param(dict(norm_elementwise_affine=True), "norm_elementwise_affine=True", id="affine"),
        pytest.param(dict(rms_norm_eps=1e-6), "rms_norm_eps=1e-06", id="eps"),
        pytest.param(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), "MoE layers", id="moe"),
        pytest.param(dict(head_dim=16), "head_dim", id="head-dim"),
    ],
)
def test_error_to_olmo_refuses_what_olmo_cannot_express(tmp_path, capsys, overrides, expected):
    MulaForCausalLM(tiny_mula(**overrides)).save_pretrained(tmp_path / "mula")
    line = expect_error(capsys, [tmp_path / "mula", tmp_path / "out", "--to-olmo"])
    assert "OLMo cannot express this Mula model" in line and expected in line
    assert not (tmp_path / "out").exists()


def test_error_to_olmo_on_an_olmo_folder(olmo_dir, tmp_path, capsys):
    line = expect_error(capsys, [olmo_dir, tmp_path / "out", "--to-olmo"])
    assert "not a Mula checkpoint" in line and "'olmo'" in line


def test_olmoe_converter_refuses_layer_norm_mula(tmp_path, capsys):
    from ds_optimus.hf_models.mula.convert_olmoe import main as olmoe_main

    config = tiny_mula(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True)
    MulaForCausalLM(config).save_pretrained(tmp_path / "mula")
    capsys.readouterr()
    assert olmoe_main([str(tmp_path / "mula"), str(tmp_path / "out"), "--to-olmoe"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "norm_type='layer_norm'" in lines[0] and "norm_elementwise_affine=False" in lines[0]

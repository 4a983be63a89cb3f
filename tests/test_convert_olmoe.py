"""Tests of the OLMoE <-> Mula checkpoint converter (ds_optimus.hf_models.mula.convert_olmoe).

Tiny random OLMoE models are saved in both Transformers layouts (per expert, as v4 and the Hub
files store them, and stacked, as v5 does), converted, reloaded through the Auto classes and held
to the OLMoE model's logits and greedy generations. Broken inputs must fail with one clean line
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
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import OlmoeConfig, OlmoeForCausalLM

from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM  # importing ds_optimus registers Mula
from ds_optimus.hf_models.mula.convert_olmoe import main

ATOL = 1e-4
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")

# Tiny OLMoE shapes. initializer_range is raised from 0.02 so that logits are O(1) and routing
# is decisive: a conversion error then moves the logits far beyond ATOL.
CONFIGS = {
    "e4-top1-mha-topknorm": dict(
        num_experts=4,
        num_experts_per_tok=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        norm_topk_prob=True,
    ),
    "e8-top2-gqa": dict(
        num_experts=8,
        num_experts_per_tok=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        norm_topk_prob=False,
    ),
    "e16-top4-mqa-topknorm": dict(
        num_experts=16,
        num_experts_per_tok=4,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=1,
        norm_topk_prob=True,
    ),
    "e6-top3-gqa-tied-clip-theta": dict(
        num_experts=6,
        num_experts_per_tok=3,
        hidden_size=48,
        num_attention_heads=8,
        num_key_value_heads=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        clip_qkv=0.8,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}


# -- helpers ------------------------------------------------------------------------------------
def make_olmoe(seed: int = 0, **overrides) -> OlmoeForCausalLM:
    """A random float32 OLMoE model with 2 layers; `overrides` change the config."""
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return OlmoeForCausalLM(OlmoeConfig(**values)).eval()


def save_olmoe(model, folder: Path, layout: str = "per-expert", **kwargs) -> Path:
    """Save an OLMoE model with experts per module ("per-expert") or stacked (v5, "stacked")."""
    model.save_pretrained(folder, save_original_format=(layout == "per-expert"), **kwargs)
    return folder


def convert(src: Path, dst: Path, *extra: str) -> Path:
    """Run the converter's main(); it must succeed."""
    assert main([str(src), str(dst), *extra]) == 0
    return dst


def safetensor_keys(folder: Path) -> set[str]:
    keys = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys.update(f.keys())
    return keys


def load_mula(folder: Path):
    return load(folder)


def load_olmoe(folder: Path):
    return load(folder, OlmoeForCausalLM)


def expect_error(capsys, argv) -> str:
    return conversion.expect_error(capsys, main, "ds_optimus.hf_models.mula.convert_olmoe", argv)


def rewrite_weights(folder: Path, edit) -> None:
    """Apply `edit(tensors)` (in place) to the single model.safetensors of `folder`."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# -- 1. equivalence ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_olmoe_to_mula_matches_logits_and_generation(tmp_path, name, layout):
    olmoe = make_olmoe(seed=len(name), **CONFIGS[name])
    src = save_olmoe(olmoe, tmp_path / "olmoe", layout)
    per_expert_on_disk = any(".mlp.experts.0.gate_proj.weight" in k for k in safetensor_keys(src))
    assert per_expert_on_disk == (layout == "per-expert")  # the input really has the layout under test
    out = convert(src, tmp_path / "mula")

    mula = load_mula(out)
    assert type(mula) is MulaForCausalLM
    assert mula.config.num_experts == olmoe.config.num_experts
    assert mula.config.num_experts_per_tok == olmoe.config.num_experts_per_tok
    assert mula.config.norm_topk_prob == olmoe.config.norm_topk_prob

    ids = random_ids()
    ref = logits(olmoe, ids)
    assert ref.abs().max() > 0.5  # the comparison below is not between near-zero numbers
    assert mula.config._experts_implementation == "ds_optimus"  # the library's dropless MoE layer
    assert (logits(mula, ids) - ref).abs().max().item() <= ATOL
    mula.set_experts_implementation("eager")
    assert mula.config._experts_implementation == "eager"
    assert (logits(mula, ids) - ref).abs().max().item() <= ATOL

    want = olmoe.generate(ids, max_new_tokens=8, do_sample=False)
    got = mula.generate(ids, max_new_tokens=8, do_sample=False)
    assert want.shape[1] > ids.shape[1]
    assert torch.equal(got, want)


def test_left_padding_matches_at_real_positions(tmp_path):
    olmoe = make_olmoe(seed=3, **CONFIGS["e8-top2-gqa"])
    mula = load_mula(convert(save_olmoe(olmoe, tmp_path / "olmoe"), tmp_path / "mula"))
    ids = random_ids(seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = olmoe.config.pad_token_id
    real = mask.bool()

    ref = logits(olmoe, ids, attention_mask=mask)
    got = logits(mula, ids, attention_mask=mask)
    assert ref.abs().max() > 0.5
    assert (got[real] - ref[real]).abs().max().item() <= ATOL
    # The mask matters: without it the first row's real positions attend to the padding.
    unmasked = logits(mula, ids)
    assert (unmasked[0, 4:] - got[0, 4:]).abs().max().item() > 1e-3

    want = olmoe.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(mula.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), want)


def test_converted_tensors_equal_olmoe_state_dict(tmp_path):
    """Mula's stacked tensors carry OLMoE v5's names; a per-expert input must be stacked bit-exactly."""
    olmoe = make_olmoe(seed=7, **CONFIGS["e6-top3-gqa-tied-clip-theta"])
    out = convert(save_olmoe(olmoe, tmp_path / "olmoe"), tmp_path / "mula")
    written = load_file(out / "model.safetensors")
    expected = {k: v for k, v in olmoe.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(written) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(written[key], tensor), key
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mula"
    assert config["tie_word_embeddings"] is True
    assert config["clip_qkv"] == 0.8
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert config["qk_norm"] is True and config["moe_layer_freq"] == 1


# -- 2. round trip ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_round_trip_back_to_olmoe(tmp_path, layout):
    olmoe = make_olmoe(seed=11, **CONFIGS["e16-top4-mqa-topknorm"])
    mula_dir = convert(save_olmoe(olmoe, tmp_path / "olmoe", "stacked"), tmp_path / "mula")
    back = convert(mula_dir, tmp_path / "back", "--to-olmoe", "--layout", layout)

    keys = safetensor_keys(back)
    if layout == "per-expert":
        for e in range(olmoe.config.num_experts):
            for kind in EXPERT_PARTS:
                assert f"model.layers.0.mlp.experts.{e}.{kind}.weight" in keys
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    else:
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} <= keys
        assert not any(".mlp.experts.0." in k for k in keys)
    assert json.loads((back / "config.json").read_text())["model_type"] == "olmoe"

    reloaded = load_olmoe(back)
    assert type(reloaded) is OlmoeForCausalLM
    for key, tensor in olmoe.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key
    ids = random_ids(seed=2)
    ref = logits(olmoe, ids)
    assert (logits(reloaded, ids) - ref).abs().max().item() <= ATOL


def test_native_mula_moe_to_olmoe(tmp_path):
    """A Mula MoE model that never was OLMoE converts to an OLMoE model with the same logits."""
    config = MulaConfig.from_preset(
        "mula-tiny-moe",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.2,
        max_position_embeddings=128,
    )
    torch.manual_seed(13)
    mula = MulaForCausalLM(config).eval()
    mula.save_pretrained(tmp_path / "mula")
    olmoe = load_olmoe(convert(tmp_path / "mula", tmp_path / "olmoe", "--to-olmoe"))
    ids = random_ids(seed=4)
    ref = logits(mula, ids)
    assert ref.abs().max() > 0.5
    assert (logits(olmoe, ids) - ref).abs().max().item() <= ATOL


# -- 3. sharded input ---------------------------------------------------------------------------
def test_sharded_input(tmp_path):
    olmoe = make_olmoe(seed=17, **CONFIGS["e8-top2-gqa"])
    src = save_olmoe(olmoe, tmp_path / "olmoe", max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    assert not (src / "model.safetensors").exists()
    assert len(list(src.glob("model-*.safetensors"))) > 1
    mula = load_mula(convert(src, tmp_path / "mula"))
    ids = random_ids(seed=6)
    assert (logits(mula, ids) - logits(olmoe, ids)).abs().max().item() <= ATOL


def test_v4_hub_style_config(tmp_path):
    """Hub OLMoE config.json files are v4-style: top-level rope_theta, rope_scaling null, torch_dtype."""
    olmoe = make_olmoe(seed=29, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    src = save_olmoe(olmoe, tmp_path / "olmoe")
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype")
    (src / "config.json").write_text(json.dumps(cfg))
    out = convert(src, tmp_path / "mula")
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_theta"] == 500000.0
    ids = random_ids(seed=8)
    assert (logits(load_mula(out), ids) - logits(olmoe, ids)).abs().max().item() <= ATOL


# -- 4. dtype -----------------------------------------------------------------------------------
def test_bfloat16_is_kept(tmp_path):
    olmoe = make_olmoe(seed=19).to(torch.bfloat16)
    src = save_olmoe(olmoe, tmp_path / "olmoe")
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"
    out = convert(src, tmp_path / "mula")

    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    written = load_file(out / "model.safetensors")
    assert written and {t.dtype for t in written.values()} == {torch.bfloat16}
    for key, tensor in olmoe.state_dict().items():
        assert torch.equal(written[key], tensor), key
    assert load_mula(out).dtype == torch.bfloat16


# -- 5. errors ----------------------------------------------------------------------------------
@pytest.fixture
def olmoe_dir(tmp_path) -> Path:
    """A valid per-expert OLMoE checkpoint folder with 4 experts, for the tests to break."""
    return save_olmoe(make_olmoe(seed=23, num_experts=4, num_experts_per_tok=2), tmp_path / "olmoe")


def test_error_input_not_a_folder(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert "not a folder" in expect_error(capsys, [missing, tmp_path / "out"])
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert "not a folder" in expect_error(capsys, [a_file, tmp_path / "out"])
    assert not (tmp_path / "out").exists()


def test_error_no_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "config.json" in expect_error(capsys, [tmp_path / "empty", tmp_path / "out"])
    assert not (tmp_path / "out").exists()


def test_error_other_model_type(tmp_path, capsys):
    src = tmp_path / "llama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    line = expect_error(capsys, [src, tmp_path / "out"])
    assert "llama" in line and "OLMoE" in line
    assert not (tmp_path / "out").exists()


def _drop(*keys):
    def edit(tensors):
        for key in keys:
            del tensors[key]

    return edit


def _reshape(key, shape):
    def edit(tensors):
        tensors[key] = torch.zeros(shape, dtype=tensors[key].dtype)

    return edit


def _copy(pattern, src_expert, dst_expert):
    def edit(tensors):
        for kind in EXPERT_PARTS:
            tensors[pattern.format(f"{dst_expert}.{kind}")] = tensors[pattern.format(f"{src_expert}.{kind}")].clone()

    return edit


def _add(key):
    def edit(tensors):
        tensors[key] = torch.zeros(3)

    return edit


@pytest.mark.parametrize(
    "edit, expected",
    [
        pytest.param(
            _drop("model.layers.1.self_attn.q_proj.weight"),
            ["missing tensor", "model.layers.1.self_attn.q_proj.weight"],
            id="missing-q_proj",
        ),
        pytest.param(_drop("model.norm.weight"), ["missing tensor", "model.norm.weight"], id="missing-final-norm"),
        pytest.param(
            _reshape("model.layers.0.self_attn.k_proj.weight", (7, 32)),
            ["model.layers.0.self_attn.k_proj.weight", "[7, 32]"],
            id="misshaped-k_proj",
        ),
        pytest.param(
            _reshape("model.layers.1.mlp.gate.weight", (5, 32)),
            ["model.layers.1.mlp.gate.weight", "[5, 32]"],
            id="misshaped-router",
        ),
        pytest.param(
            _drop(*(f"model.layers.0.mlp.experts.2.{k}.weight" for k in EXPERT_PARTS)),
            ["layer 0", "missing experts [2]"],
            id="missing-expert",
        ),
        pytest.param(
            _drop("model.layers.1.mlp.experts.3.up_proj.weight"),
            ["model.layers.1.mlp.experts.3.up_proj.weight"],
            id="missing-expert-part",
        ),
        pytest.param(
            _reshape("model.layers.0.mlp.experts.1.down_proj.weight", (32, 23)),
            ["model.layers.0.mlp.experts", "shape"],
            id="misshaped-expert",
        ),
        pytest.param(
            _reshape("model.layers.0.mlp.experts.1.gate_proj.weight", (23, 32)),
            ["model.layers.0.mlp.experts.1", "gate_proj and up_proj"],
            id="gate-up-differ",
        ),
        pytest.param(
            _copy("model.layers.0.mlp.experts.{}.weight", 0, 4),
            ["layer 0", "experts [4] beyond num_experts=4"],
            id="extra-expert",
        ),
        pytest.param(_add("model.extra.weight"), ["unexpected tensor model.extra.weight"], id="unexpected-tensor"),
    ],
)
def test_error_bad_tensors(olmoe_dir, tmp_path, capsys, edit, expected):
    rewrite_weights(olmoe_dir, edit)
    line = expect_error(capsys, [olmoe_dir, tmp_path / "out"])
    for text in expected:
        assert text in line
    assert not (tmp_path / "out").exists()


def test_error_invalid_config(olmoe_dir, tmp_path, capsys):
    cfg = json.loads((olmoe_dir / "config.json").read_text())
    cfg["num_experts_per_tok"] = cfg["num_experts"] + 1
    (olmoe_dir / "config.json").write_text(json.dumps(cfg))
    line = expect_error(capsys, [olmoe_dir, tmp_path / "out"])
    assert "num_experts_per_tok" in line
    assert not (tmp_path / "out").exists()


def test_error_output_not_empty(olmoe_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = expect_error(capsys, [olmoe_dir, out])
    assert str(out) in line and "not empty" in line
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"


def test_error_unreadable_weights(olmoe_dir, tmp_path, capsys):
    (olmoe_dir / "model.safetensors").unlink()
    assert "has no weights" in expect_error(capsys, [olmoe_dir, tmp_path / "out1"])

    olmoe_dir.joinpath("model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    line = expect_error(capsys, [olmoe_dir, tmp_path / "out2"])
    assert "cannot read" in line and "model.safetensors" in line
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_error_missing_shard(tmp_path, capsys):
    src = save_olmoe(make_olmoe(seed=31), tmp_path / "olmoe", max_shard_size="20KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    line = expect_error(capsys, [src, tmp_path / "out"])
    assert shards[-1].name in line and "missing" in line
    assert not (tmp_path / "out").exists()


def test_error_to_olmoe_on_olmoe_folder(olmoe_dir, tmp_path, capsys):
    line = expect_error(capsys, [olmoe_dir, tmp_path / "out", "--to-olmoe"])
    assert "not a Mula checkpoint" in line and "olmoe" in line


@pytest.mark.parametrize(
    "overrides, expected",
    [
        pytest.param(dict(router_scoring_func="sigmoid"), "router_scoring_func", id="sigmoid"),
        pytest.param(dict(qk_norm=False), "qk_norm", id="no-qk-norm"),
        pytest.param(dict(router_bias_update_rate=0.01), "router bias", id="router-bias"),
    ],
)
def test_error_to_olmoe_refuses_other_features(tmp_path, capsys, overrides, expected):
    config = MulaConfig.from_preset(
        "mula-tiny-moe",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=16,
        **overrides,
    )
    MulaForCausalLM(config).save_pretrained(tmp_path / "mula")
    assert expected in expect_error(capsys, [tmp_path / "mula", tmp_path / "out", "--to-olmoe"])
    assert not (tmp_path / "out").exists()


def test_error_output_is_a_file(olmoe_dir, tmp_path, capsys):
    out = tmp_path / "out.txt"
    out.write_text("mine")
    assert "is not a folder" in expect_error(capsys, [olmoe_dir, out])
    assert out.read_text() == "mine"


def test_error_config_not_an_object(tmp_path, capsys):
    src = tmp_path / "odd"
    src.mkdir()
    (src / "config.json").write_text("[]")
    assert "config.json is not a JSON object" in expect_error(capsys, [src, tmp_path / "out"])


def test_error_config_field_of_the_wrong_type(olmoe_dir, tmp_path, capsys):
    config = json.loads((olmoe_dir / "config.json").read_text())
    config["hidden_size"] = None
    (olmoe_dir / "config.json").write_text(json.dumps(config))
    assert "hidden_size must be a positive integer" in expect_error(capsys, [olmoe_dir, tmp_path / "out"])


@pytest.mark.parametrize(
    "overrides",
    [pytest.param(dict(moe_layer_freq=2), id="moe_layer_freq=2"), pytest.param(dict(num_experts=0), id="no-experts")],
)
def test_error_to_olmoe_refuses_dense_layers(tmp_path, capsys, overrides):
    config = MulaConfig.from_preset(
        "mula-tiny-moe",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        **overrides,
    )
    assert config.num_experts == 0 or config.moe_layer_freq == 2
    MulaForCausalLM(config).save_pretrained(tmp_path / "mula")
    line = expect_error(capsys, [tmp_path / "mula", tmp_path / "out", "--to-olmoe"])
    assert "dense" in line
    assert not (tmp_path / "out").exists()


def test_error_cli_subprocess(tmp_path):
    """The real command line: exit status 2 and one clean line on stderr."""
    src = tmp_path / "llama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ds_optimus.hf_models.mula.convert_olmoe", str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ds_optimus.hf_models.mula.convert_olmoe: error:") and "llama" in lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists()

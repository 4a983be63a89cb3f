import json

import pytest

from ds_optimus.hf_models.mula import PRESETS, MulaConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_a_valid_config(name):
    config = MulaConfig.from_preset(name)
    assert config.model_type == "mula"
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    if config.num_experts:
        assert config.moe_layers == list(range(config.num_hidden_layers))
    else:
        assert config.moe_layers == []


def test_olmoe_shape_of_mula_7b_a1b():
    c = MulaConfig.from_preset("mula-7b-a1b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 16, 16, 16)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (64, 8, 1024)
    assert (c.vocab_size, c.eos_token_id, c.pad_token_id) == (50304, 50279, 1)
    assert c.rms_norm_eps == 1e-5 and c.qk_norm and not c.norm_topk_prob and not c.tie_word_embeddings
    assert c.rope_parameters["rope_theta"] == 10000
    assert (c.router_aux_loss_coef, c.router_z_loss_coef) == (0.01, 0.001)


def test_olmo_shape_of_mula_1b():
    c = MulaConfig.from_preset("mula-1b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (2048, 16, 16, 8192)
    assert c.num_experts == 0 and not c.tie_word_embeddings and not c.qk_norm and c.vocab_size == 50304


def test_preset_overrides_and_unknown_preset():
    c = MulaConfig.from_preset("mula-tiny-moe", num_experts=4, moe_layer_freq=2)
    assert c.num_experts == 4 and c.moe_layers == [1, 3]
    with pytest.raises(ValueError, match="unknown Mula preset 'mula-3b'"):
        MulaConfig.from_preset("mula-3b")


def test_config_json_round_trip(tmp_path):
    c = MulaConfig.from_preset("mula-tiny-moe", router_bias_update_rate=0.01, router_scoring_func="sigmoid")
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mula" and saved["router_scoring_func"] == "sigmoid"
    loaded = MulaConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == c.to_dict()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_experts=4, num_experts_per_tok=8), r"num_experts_per_tok \(8\) is larger than num_experts \(4\)"),
        (dict(hidden_size=100, num_attention_heads=3), r"hidden_size \(100\) is not divisible by num_attention_heads"),
        (dict(num_attention_heads=4, num_key_value_heads=3), r"not divisible by num_key_value_heads \(3\)"),
        (dict(router_scoring_func="relu"), r"router_scoring_func must be"),
        (dict(router_aux_loss_coef=-1.0), r"router_aux_loss_coef must be a number >= 0"),
        (dict(moe_layer_freq=0), r"moe_layer_freq must be"),
        (dict(num_experts=-2), r"num_experts must be an integer >= 0"),
        (dict(hidden_size=0), r"hidden_size must be a positive integer"),
        (dict(hidden_act="nope"), r"hidden_act 'nope' is not a known activation"),
        (dict(num_experts_per_tok=0), r"num_experts_per_tok must be >= 1"),
        (dict(hidden_size=None), r"hidden_size must be a positive integer, got None"),
        (dict(moe_layer_freq="2"), r"moe_layer_freq must be an integer"),
        (dict(rms_norm_eps=None), r"rms_norm_eps must be a number > 0"),
        (dict(clip_qkv=0), r"clip_qkv must be None or a number > 0"),
        (dict(pad_token_id=5000), r"pad_token_id must be None or a token id below vocab_size \(4096\)"),
        (dict(rope_parameters={"rope_type": "bogus"}), r"unknown rope_type 'bogus'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), r"rope_parameters: .*factor"),
    ],
)
def test_invalid_configs_raise_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        MulaConfig.from_preset("mula-tiny-moe", **overrides)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("invalid MulaConfig:")

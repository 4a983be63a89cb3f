import pytest
import torch

from ds_optimus.hf_models.mula import PRESETS, MulaConfig, MulaForCausalLM, count_parameters
from ds_optimus.hf_models.mula.modeling_mula import MulaExperts

# (total, active) of the seed's Mula family (IntelLabs/Optimus-LM, README "Paper variants"), to 0.5 %:
# OLMo-1B untied, OLMoE-1B-7B and its scaled variants.
EXPECTED = {
    "mula-1b": (1.28e9, 1.28e9),
    "mula-7b-a1b": (6.92e9, 1.28e9),
    "mula-20b-a2b": (20.08e9, 2.36e9),
    "mula-100b-a7b": (99.99e9, 7.58e9),
    "mula-220b-a10b": (220.21e9, 10.02e9),
}


def _meta_counts(config):
    """(total, active) counted from a model built on the meta device."""
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights are yielded once
    unused = 0
    for module in model.modules():
        if isinstance(module, MulaExperts):
            per_expert = module.gate_up_proj[0].numel() + module.down_proj[0].numel()
            unused += (module.num_experts - config.num_experts_per_tok) * per_expert
    return total, total - unused


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_parameters_matches_meta_model_exactly(name):
    config = MulaConfig.from_preset(name)
    assert count_parameters(config) == _meta_counts(config)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(moe_layer_freq=2),
        dict(num_experts=0),
        dict(tie_word_embeddings=True, qk_norm=False),
        dict(attention_bias=True, router_bias_update_rate=0.001),
        dict(intermediate_size=None),
        dict(norm_type="layer_norm"),
        dict(norm_type="layer_norm", norm_elementwise_affine=False),
        dict(norm_elementwise_affine=False, moe_layer_freq=2),
    ],
)
def test_count_parameters_matches_meta_model_for_variants(overrides):
    config = MulaConfig.from_preset("mula-tiny-moe", **overrides)
    assert count_parameters(config) == _meta_counts(config)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_sizes_are_the_seeds(name):
    total, active = count_parameters(MulaConfig.from_preset(name))
    want_total, want_active = EXPECTED[name]
    assert abs(total / want_total - 1) <= 0.005, f"{name}: total {total / 1e9:.2f}B"
    assert abs(active / want_active - 1) <= 0.005, f"{name}: active {active / 1e9:.2f}B"


def test_tiny_presets_are_cpu_sized():
    for name in ("mula-tiny-dense", "mula-tiny-moe"):
        total, active = count_parameters(MulaConfig.from_preset(name))
        assert total < 5e6 and active <= total


# The seed's table: (layers, hidden, heads = kv heads, experts, expert FFN or dense FFN size); top-8 throughout.
SEED_SHAPES = {
    "mula-1b": (16, 2048, 16, 0, 8192),
    "mula-7b-a1b": (16, 2048, 16, 64, 1024),
    "mula-20b-a2b": (32, 2048, 16, 96, 1024),
    "mula-100b-a7b": (48, 3072, 24, 144, 1536),
    "mula-220b-a10b": (64, 3072, 24, 240, 1536),
}


@pytest.mark.parametrize("name", sorted(SEED_SHAPES))
def test_presets_have_the_seed_s_fields(name):
    c = MulaConfig.from_preset(name)
    layers, hidden, heads, experts, ffn = SEED_SHAPES[name]
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_experts) == (
        layers,
        hidden,
        heads,
        heads,
        experts,
    )
    assert c.head_dim == 128 and c.vocab_size == 50304 and not c.tie_word_embeddings
    assert c.rope_parameters["rope_theta"] == 10000
    if experts:  # OLMoE's recipe: QK-norm, RMSNorm, softmax top-8 without renormalisation, every layer MoE
        assert (c.moe_intermediate_size, c.num_experts_per_tok, c.moe_layer_freq) == (ffn, 8, 1)
        assert c.qk_norm and c.norm_type == "rms_norm" and c.router_scoring_func == "softmax"
        assert not c.norm_topk_prob and c.router_bias_update_rate == 0
    else:  # OLMo-1B: non-parametric LayerNorm, no QK-norm, 2048 positions
        assert c.intermediate_size == ffn and not c.qk_norm and c.max_position_embeddings == 2048
        assert c.norm_type == "layer_norm" and not c.norm_elementwise_affine
    with torch.device("meta"):
        model = MulaForCausalLM(c)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(c)[0]

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
    [dict(moe_layer_freq=2), dict(num_experts=0), dict(tie_word_embeddings=True, qk_norm=False),
     dict(attention_bias=True, router_bias_update_rate=0.001), dict(intermediate_size=None)],
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

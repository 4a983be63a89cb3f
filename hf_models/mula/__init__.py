"""The Mula model family: configuration, presets, modeling classes and parameter counting."""

from .configuration_mula import PRESETS, MulaConfig
from .modeling_mula import (
    MulaCausalLMOutputWithPast,
    MulaForCausalLM,
    MulaModel,
    MulaPreTrainedModel,
)
from .sizing import count_parameters, flops_per_token

__all__ = [
    "PRESETS",
    "MulaCausalLMOutputWithPast",
    "MulaConfig",
    "MulaForCausalLM",
    "MulaModel",
    "MulaPreTrainedModel",
    "count_parameters",
    "flops_per_token",
]

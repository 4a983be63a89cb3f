"""The Mula model family: configuration, presets, modeling classes and parameter counting. Names are
imported on first use (the converter's `--help` needs neither PyTorch nor Transformers)."""

import importlib

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
_WHERE = {
    "PRESETS": ".configuration_mula",
    "MulaConfig": ".configuration_mula",
    **dict.fromkeys(
        ("MulaCausalLMOutputWithPast", "MulaForCausalLM", "MulaModel", "MulaPreTrainedModel"), ".modeling_mula"
    ),
    "count_parameters": ".sizing",
    "flops_per_token": ".sizing",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

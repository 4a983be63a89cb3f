"""Registers Mula with Transformers' public APIs (no patching); for Transformers 5.17 to 5.x."""

from __future__ import annotations


def register_mula() -> None:
    """Register Mula with the Auto classes and the MoE experts path as "ds_optimus"."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from ..hf_models.mula import MulaConfig, MulaForCausalLM, MulaModel
    from ..moe.layer import register_experts_implementation

    AutoConfig.register(MulaConfig.model_type, MulaConfig, exist_ok=True)
    AutoModel.register(MulaConfig, MulaModel, exist_ok=True)
    AutoModelForCausalLM.register(MulaConfig, MulaForCausalLM, exist_ok=True)
    # save_pretrained then writes `auto_map` and copies the configuration and modeling files into
    # the folder, so it also loads with trust_remote_code=True where ds_optimus is not installed.
    MulaConfig.register_for_auto_class("AutoConfig")
    MulaModel.register_for_auto_class("AutoModel")
    MulaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    register_experts_implementation()

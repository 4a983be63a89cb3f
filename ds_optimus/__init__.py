"""ds_optimus: pretraining Mixture-of-Experts language models on DeepSpeed.

Importing the package registers the Mula models with Transformers' Auto classes and the dropless
MoE layer with Transformers' experts interface (as "ds_optimus", the Mula default). It imports
neither DeepSpeed nor Triton, so the models and kernels load on machines that have only PyTorch.
"""

from __future__ import annotations

__version__ = "0.1.0"


def _register_with_transformers() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .hf_models.mula import MulaConfig, MulaForCausalLM, MulaModel
    from .moe.layer import register_experts_implementation

    AutoConfig.register(MulaConfig.model_type, MulaConfig, exist_ok=True)
    AutoModel.register(MulaConfig, MulaModel, exist_ok=True)
    AutoModelForCausalLM.register(MulaConfig, MulaForCausalLM, exist_ok=True)
    # save_pretrained then writes `auto_map` and copies the configuration and modeling files into
    # the folder, so it also loads with trust_remote_code=True where ds_optimus is not installed.
    MulaConfig.register_for_auto_class("AutoConfig")
    MulaModel.register_for_auto_class("AutoModel")
    MulaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    register_experts_implementation()


_register_with_transformers()

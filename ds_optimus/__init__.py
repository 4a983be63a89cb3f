"""ds_optimus: pretraining Mixture-of-Experts language models on DeepSpeed.

Importing the package registers the Mula models with Transformers' Auto classes and the dropless
MoE layer with Transformers' experts interface (as "ds_optimus", the Mula default). Where DeepSpeed
is installed it also hooks DeepSpeed's engine (`ds_optimus.optim.deepspeed_compat`), so a config
with `optimus.sharded_optimizer` gets the EP-aware sharded optimizer from `deepspeed.initialize`,
including under the Hugging Face Trainer. Without DeepSpeed (and without Triton) the models and
kernels still load.
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


def _hook_deepspeed() -> None:
    import importlib.util
    import warnings

    if importlib.util.find_spec("deepspeed") is None:
        return
    try:
        from .optim.deepspeed_compat import install_engine_hook

        install_engine_hook()
    except Exception as err:  # an untested DeepSpeed version, or one that fails to import here
        warnings.warn(f"ds_optimus: DeepSpeed's engine is not hooked ({err})", stacklevel=2)


_register_with_transformers()
_hook_deepspeed()

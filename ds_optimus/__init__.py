"""ds_optimus: pretraining Mixture-of-Experts language models on DeepSpeed.

Importing the package registers the Mula models with Transformers' Auto classes and the dropless
MoE layer with Transformers' experts interface (as "ds_optimus", the Mula default). It imports
neither DeepSpeed nor Triton, so the models and kernels load on machines that have only PyTorch;
but once DeepSpeed is imported (before or after), its engine is hooked
(`ds_optimus.optim.deepspeed_compat`), so a config with `optimus.sharded_optimizer` gets the
EP-aware sharded optimizer from `deepspeed.initialize`, also under the Hugging Face Trainer.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

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


def _install_engine_hook() -> None:
    import warnings

    try:
        # The module hooks the engine when its import completes (this may run while it is being
        # imported: deepspeed_compat's own `import deepspeed` brings us here).
        importlib.import_module(f"{__name__}.optim.deepspeed_compat")
    except Exception as err:  # an untested DeepSpeed version, or one that fails to import here
        warnings.warn(f"ds_optimus: DeepSpeed's engine is not hooked ({err})", stacklevel=2)


class _AfterDeepSpeedImport(importlib.abc.MetaPathFinder):
    """Hooks DeepSpeed's engine right after `import deepspeed` completes, so importing ds_optimus
    does not import DeepSpeed (slow, and absent on some machines) but every engine is hooked."""

    # It stays registered until DeepSpeed's import has run: `importlib.util.find_spec("deepspeed")`
    # (transformers and accelerate probe with it) asks here too but imports nothing.
    busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _install_engine_hook()

        spec.loader.exec_module = exec_module
        return spec


def _hook_deepspeed() -> None:
    if "deepspeed" in sys.modules:
        if sys.modules["deepspeed"] is not None:  # None marks DeepSpeed as absent: nothing to hook
            _install_engine_hook()
    elif not any(isinstance(f, _AfterDeepSpeedImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDeepSpeedImport())


_register_with_transformers()
_hook_deepspeed()

"""ds_optimus: pretraining Mixture-of-Experts language models on DeepSpeed.

Importing the package is cheap (it imports neither PyTorch, Transformers nor DeepSpeed), and it
hooks the three libraries it extends so that each is extended as soon as it is imported (at once
where it already is):

- Transformers: the Mula models are registered with its Auto classes and the dropless MoE layer
  with its experts interface (as "ds_optimus", the Mula default);
- DeepSpeed: its engine is hooked (`ds_optimus.optim.deepspeed_compat`), so a config with an
  `optimus` section gets expert parallelism and the EP-aware sharded optimizer from
  `deepspeed.initialize`, also under the Hugging Face Trainer;
- accelerate: it leaves the `optimus` section of a DeepSpeed config alone (it would take the
  section's `"auto"` values for its own placeholders and stop).

So `python -m ds_optimus.train --help` starts in a fraction of a second, and the models, kernels
and planner load on machines without DeepSpeed.
"""

from __future__ import annotations

import copy
import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings

__version__ = "0.1.0"

_registered = False


def _register_with_transformers(finishing: str | None = None) -> None:
    global _registered
    if _registered:
        return
    if _own_import_running(finishing):
        # A module of ours imports Transformers while it is itself being imported: register once the
        # import of ours has finished (the Mula classes may not be defined yet).
        _Hooks.pending = True
        return
    _registered = True
    _Hooks.pending = False
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


def _own_import_running(finishing: str | None = None) -> bool:
    """Whether a module of this package other than `finishing` is being imported right now."""
    for name, module in list(sys.modules.items()):
        if name.startswith(f"{__name__}.") and name != finishing:
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                return True
    return False


def _install_engine_hook() -> None:
    try:
        # The module hooks the engine when its import completes (this may run while it is being
        # imported: deepspeed_compat's own `import deepspeed` brings us here).
        importlib.import_module(f"{__name__}.optim.deepspeed_compat")
    except Exception as err:  # an untested DeepSpeed version, or one that fails to import here
        warnings.warn(f"ds_optimus: DeepSpeed's engine is not hooked ({err})", stacklevel=2)


def _leave_optimus_to_us() -> None:
    """accelerate fills every `"auto"` of a DeepSpeed config from the Trainer's arguments and stops
    at one it has no value for (`optimus.moe.experts_backend not found in kwargs`); the `optimus`
    section is this library's, so its walk skips it."""
    plugin = getattr(sys.modules.get("accelerate.utils.dataclasses"), "DeepSpeedPlugin", None)
    original = getattr(plugin, "deepspeed_config_process", None)
    if original is None or getattr(original, "skips_optimus", False):
        return

    def deepspeed_config_process(self, prefix="", mismatches=None, config=None, must_match=True, **kwargs):
        top = self.deepspeed_config if config is None else config
        section = top.pop("optimus", None) if prefix == "" and isinstance(top, dict) else None
        try:
            return original(self, prefix=prefix, mismatches=mismatches, config=config, must_match=must_match,
                            **kwargs)
        finally:
            if section is not None:
                top["optimus"] = section

    deepspeed_config_process.skips_optimus = True
    plugin.deepspeed_config_process = deepspeed_config_process


class _Then(importlib.abc.Loader):
    """A module's own loader, then `after()` once the module has run (everything else asked of it,
    such as `get_source` or resources, goes to the module's loader)."""

    def __init__(self, loader, after) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.after()

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Hooks(importlib.abc.MetaPathFinder):
    """Runs the hooks of a watched module right after its import completes (`WATCHED`), and a deferred
    Transformers registration once no import of ours is still running. It finds the module through
    the other finders and hands back a copy of their spec whose loader runs the hooks afterwards;
    it imports nothing itself (`importlib.util.find_spec(name)`, with which Transformers and
    accelerate probe for packages, asks here too), and leaves reloads alone."""

    WATCHED: dict[str, list] = {"transformers": [_register_with_transformers], "deepspeed": [_install_engine_hook],
                                "accelerate.utils.dataclasses": [_leave_optimus_to_us]}
    pending = False  # the registration waits for an import of ours to finish
    local = threading.local()  # `busy`: this thread is finding the spec (other threads import freely)

    def find_spec(self, name, path=None, target=None):
        hooks = self.WATCHED.get(name)
        ours = name.startswith(f"{__name__}.") and not _registered  # a registration may still be due
        if target is not None or (hooks is None and not ours):
            return None
        if getattr(self.local, "busy", False):
            return None
        self.local.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec

        def after() -> None:
            if hooks is not None:
                for hook in list(hooks):
                    hook()
            elif self.pending:
                _register_with_transformers(finishing=name)

        spec = copy.copy(spec)
        spec.loader = _Then(spec.loader, after)
        return spec


def _hook(name: str) -> None:
    if sys.modules.get(name) is not None:  # None marks a module as absent: nothing to hook
        for hook in list(_Hooks.WATCHED[name]):
            hook()


def after_import(name: str, hook) -> None:
    """Call `hook()` once module `name` is imported: now if it is, else right after its import."""
    if sys.modules.get(name) is not None:
        hook()
    else:
        _Hooks.WATCHED.setdefault(name, []).append(hook)


if not any(isinstance(f, _Hooks) for f in sys.meta_path):
    sys.meta_path.insert(0, _Hooks())
for _name in list(_Hooks.WATCHED):
    _hook(_name)

"""ds_optimus: pretraining Mixture-of-Experts language models on DeepSpeed.

Importing it is cheap (no PyTorch, Transformers or DeepSpeed import), so `--help` is fast; it hooks Transformers,
DeepSpeed's engine and accelerate as each is imported (what and why: `ds_optimus.integrations.PATCHES`).
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
    from .integrations.transformers import register_mula

    register_mula()


def _own_import_running(finishing: str | None = None) -> bool:
    """Whether a module of this package other than `finishing` is being imported right now."""
    for name, module in list(sys.modules.items()):
        if name.startswith(f"{__name__}.") and name != finishing:
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                return True
    return False


def _hook_deepspeed() -> None:
    try:
        # Each module hooks its part when its import completes (this may run while one of them is
        # being imported: its own `import deepspeed` brings us here; it hooks when it finishes).
        importlib.import_module(f"{__name__}.integrations.deepspeed_ops")
        importlib.import_module(f"{__name__}.integrations.deepspeed_engine")
    except Exception as err:  # an untested DeepSpeed version, or one that fails to import here
        warnings.warn(f"ds_optimus: DeepSpeed's engine is not hooked ({err})", stacklevel=2)


def _hook_accelerate_plugin() -> None:
    importlib.import_module(f"{__name__}.integrations.accelerate").skip_optimus_section()


def _hook_accelerator() -> None:
    importlib.import_module(f"{__name__}.integrations.accelerate").gather_experts_in_state_dict()


class _Then(importlib.abc.Loader):
    """A module's own loader, then `after()` once the module has run."""

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
    """Runs a `WATCHED` module's hooks right after its import, and a deferred Transformers registration once
    no import of ours is running; leaves reloads alone."""

    WATCHED: dict[str, list] = {
        "transformers": [_register_with_transformers],
        "deepspeed": [_hook_deepspeed],
        "accelerate.utils.dataclasses": [_hook_accelerate_plugin],
        "accelerate.accelerator": [_hook_accelerator],
    }
    pending = False  # the registration waits for an import of ours to finish
    local = threading.local()  # `busy`: this thread is finding the spec (other threads import freely)

    def find_spec(self, name, path=None, target=None):
        hooks = self.WATCHED.get(name)
        ours = name.startswith(f"{__name__}.") and not _registered  # a registration may still be due
        if target is not None or (hooks is None and not ours):
            return None
        if getattr(self.local, "busy", False):
            return None
        # imports nothing itself: Transformers and accelerate probe for packages with find_spec, which asks here
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
    """Call `hook()` once module `name` is imported (now if it is)."""
    if sys.modules.get(name) is not None:
        hook()
    else:
        _Hooks.WATCHED.setdefault(name, []).append(hook)


if not any(isinstance(f, _Hooks) for f in sys.meta_path):
    sys.meta_path.insert(0, _Hooks())
for _name in list(_Hooks.WATCHED):
    _hook(_name)

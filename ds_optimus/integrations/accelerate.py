"""accelerate 1.x, patched for the `optimus` section and expert-parallel models (`integrations.PATCHES`)."""

from __future__ import annotations

import sys


def skip_optimus_section() -> None:
    """Make accelerate's DeepSpeed plugin skip the `optimus` section, whose "auto" values it would stop at
    (idempotent; needs `accelerate.utils.dataclasses` imported)."""
    plugin = getattr(sys.modules.get("accelerate.utils.dataclasses"), "DeepSpeedPlugin", None)
    original = getattr(plugin, "deepspeed_config_process", None)
    if original is None or getattr(original, "skips_optimus", False):
        return

    def deepspeed_config_process(self, prefix="", mismatches=None, config=None, must_match=True, **kwargs):
        top = self.deepspeed_config if config is None else config
        section = top.pop("optimus", None) if prefix == "" and isinstance(top, dict) else None
        try:
            return original(self, prefix=prefix, mismatches=mismatches, config=config, must_match=must_match, **kwargs)
        finally:
            if section is not None:
                top["optimus"] = section

    deepspeed_config_process.skips_optimus = True
    deepspeed_config_process.__wrapped__ = original
    plugin.deepspeed_config_process = deepspeed_config_process


def gather_experts_in_state_dict() -> None:
    """Make `Accelerator.get_state_dict` gather every expert of an expert-parallel DeepSpeed model
    (idempotent; needs `accelerate.accelerator` imported)."""
    accelerator_class = sys.modules["accelerate.accelerator"].Accelerator
    original = accelerator_class.get_state_dict
    if getattr(original, "gathers_experts", False):
        return

    def get_state_dict(self, model, unwrap=True):
        engine = sys.modules.get("deepspeed.runtime.engine")  # not imported: no DeepSpeed engine here
        if engine is None or not isinstance(model, engine.DeepSpeedEngine):
            return original(self, model, unwrap)
        from ..parallel.expert_parallel import expert_groups_of, full_state_dict

        groups = expert_groups_of(self.unwrap_model(model) if unwrap else model)
        if groups is None or groups.ep_size == 1:
            return original(self, model, unwrap)
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

        return clone_tensors_for_torch_save(full_state_dict(self.unwrap_model(model) if unwrap else model, groups))

    get_state_dict.gathers_experts = True
    get_state_dict.__wrapped__ = original
    accelerator_class.get_state_dict = get_state_dict

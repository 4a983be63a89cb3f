"""The one module that touches DeepSpeed's private API, pinned to the tested DeepSpeed versions.

- `register_expert_groups`: puts ds_optimus' EP/EDP process groups into DeepSpeed's group registry
  (`deepspeed.utils.groups`) under DeepSpeed's name ``ep_size_{P}``, which is what ZeRO looks up
  through a parameter's `group_name`.
- `install_engine_hook`: DeepSpeed's engine enables its MoE gradient handling only when the model
  contains its own `deepspeed.moe.layer.MoE` modules; the hook also enables it for models that
  `apply_expert_parallel` has sharded, so ZeRO-1/2 reduce expert gradients over the EDP group.
- `engine_state` / `load_engine_state`: this rank's optimizer partition (through the ZeRO and BF16
  optimizers' list-of-ranks `load_state_dict`), LR scheduler and the engine's step counters, for
  ds_optimus' own per-rank checkpoints (`ds_optimus.reliability.checkpoint`).
"""

from __future__ import annotations

import deepspeed
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as ds_groups

TESTED_VERSIONS = ("0.19.",)


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless DeepSpeed's version is one this module was tested with."""
    version = version or deepspeed.__version__
    if not version.startswith(TESTED_VERSIONS):
        raise RuntimeError(
            f"ds_optimus supports DeepSpeed {', '.join(v + 'x' for v in TESTED_VERSIONS)}, found {version}; "
            "install a supported version (pip install 'deepspeed>=0.19.8,<0.20')"
        )


def register_expert_groups(groups) -> None:
    """Register an `ExpertParallelGroups` layout with DeepSpeed's group registry."""
    check_version()
    ds_groups._EXPERT_PARALLEL_GROUP[groups.name] = groups.ep_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[groups.name] = list(groups.ep_ranks)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[groups.name] = groups.edp_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[groups.name] = list(groups.edp_ranks)
    install_engine_hook()


_ORIGINAL = {
    "configure": DeepSpeedEngine._configure_distributed_model,
    "save": DeepSpeedEngine.save_checkpoint,
    "load": DeepSpeedEngine.load_checkpoint,
}


def _configure_distributed_model(self, model):
    _ORIGINAL["configure"](self, model)
    # Experts sharded by apply_expert_parallel carry DeepSpeed's MoE marks (allreduce=False).
    experts = [m for m in self.module.modules() if hasattr(m, "num_local_experts")
               and any(getattr(p, "allreduce", True) is False for p in m.parameters(recurse=False))]
    self._ds_optimus_expert_parallel = bool(experts)
    if experts and not self.has_moe_layers:
        self.has_moe_layers = True
        self.num_experts.extend(m.num_experts for m in experts)


def _refuse_expert_parallel_checkpoints(name):
    original = _ORIGINAL[name]

    def method(self, *args, **kwargs):
        if getattr(self, "_ds_optimus_expert_parallel", False):
            # DeepSpeed's MoE checkpoint code only knows its own MoE modules: it would write one
            # rank's expert shard for all and load it into every rank without an error.
            raise NotImplementedError(
                "DeepSpeed checkpoints of a ds_optimus expert-parallel model are not supported yet; "
                "save the model with model.save_pretrained() on every rank"
            )
        return original(self, *args, **kwargs)

    return method


def install_engine_hook() -> None:
    """Make DeepSpeed's engine treat ds_optimus expert-parallel experts as MoE layers, and refuse its
    checkpoints of them until they are supported (idempotent)."""
    check_version()
    DeepSpeedEngine._configure_distributed_model = _configure_distributed_model
    DeepSpeedEngine.save_checkpoint = _refuse_expert_parallel_checkpoints("save")
    DeepSpeedEngine.load_checkpoint = _refuse_expert_parallel_checkpoints("load")


_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _takes_rank_list(optimizer) -> bool:
    # ZeRO-1/2 and the BF16 optimizer keep one partition per data-parallel rank and load from a
    # list indexed by that rank; a plain torch optimizer loads its own state dict.
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer))


def engine_state(engine) -> dict:
    """This rank's share of the engine's training state: optimizer partition, scheduler, counters."""
    check_version()
    state = {"optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
             "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
             "counters": {name: getattr(engine, name) for name in _ENGINE_COUNTERS}}
    return state


def load_engine_state(engine, state: dict) -> None:
    """Restore what `engine_state` returned on this rank (same world size and layout)."""
    check_version()
    optimizer = engine.optimizer
    if state["optimizer"] is not None and optimizer is not None:
        if _takes_rank_list(optimizer):
            import torch.distributed as dist

            rank = dist.get_rank(group=optimizer.dp_process_group)
            states = [None] * dist.get_world_size(group=optimizer.dp_process_group)
            states[rank] = state["optimizer"]
            optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            optimizer.load_state_dict(state["optimizer"])
    if state["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    for name, value in state["counters"].items():
        setattr(engine, name, value)

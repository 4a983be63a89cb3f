"""The one module that touches DeepSpeed's private API, pinned to the tested DeepSpeed versions.

- `install_engine_hook`: DeepSpeed's engine enables its MoE gradient handling only when the model
  contains its own `deepspeed.moe.layer.MoE` modules. When the engine meets the model, the hook
  registers the EP/EDP groups that the model's expert modules declare (`expert_groups`, set by
  `apply_expert_parallel`) in DeepSpeed's group registry (`register_expert_groups`, under DeepSpeed's
  name ``ep_size_{P}``, which ZeRO looks up through a parameter's `group_name`) and enables the MoE
  handling, so DeepSpeed's own ZeRO-1/2 reduce expert gradients over the EDP group.
- `ShardedOptimizer` (the adapter) and the builders installed by `install_engine_hook`: when the
  config's `optimus.sharded_optimizer.enabled` is true, the engine builds the EP-aware sharded
  optimizer (`ds_optimus.optim.sharded`, pure PyTorch) as a DeepSpeed `ZeROOptimizer` where it would
  build its ZeRO stage 1/2 (or BF16) optimizer, and `engine.save_checkpoint` /
  `engine.load_checkpoint` write and read ds_optimus' layout-independent checkpoints
  (`ds_optimus.optim.checkpointing`).
- `engine_state` / `load_engine_state`: this rank's optimizer partition (through the ZeRO and BF16
  optimizers' list-of-ranks `load_state_dict`), LR scheduler and the engine's step counters, for
  ds_optimus' own per-rank checkpoints (`ds_optimus.reliability.checkpoint`).
"""

from __future__ import annotations

import deepspeed
import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as ds_groups

from ..parallel.expert_parallel import expert_layouts, expert_parallel_modules
from . import sharded

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


class ShardedOptimizer(sharded.ShardedOptimizer, ZeROOptimizer):
    """The EP-aware sharded optimizer as DeepSpeed's engine drives it: a `ZeROOptimizer`, so the
    engine runs its backward through it (`backward_prologue`/`epilogue`, PyTorch-style
    `loss.backward()` through the backward-hook state manager) and every gradient hook reports to
    that manager. It keeps the core's name: the engine's optimizer reports itself as "ShardedOptimizer"."""

    def __init__(self, init_optimizer, **kwargs) -> None:
        ZeROOptimizer.__init__(self)  # the backward-hook state manager and the boundary flag
        # What DeepSpeed's `needs_scaler` reads besides `dynamic_loss_scale`: no other loss scaler here.
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        sharded.ShardedOptimizer.__init__(self, init_optimizer, **kwargs)
        self.dp_process_group = self.dense_group  # what the engine reads

    def _backward_started(self) -> None:
        self.enter_backward()

    def _backward_ended(self) -> None:
        self.exit_backward()

    def _gradient_arrived(self) -> None:
        # The engine's post-backward hook (PyTorch-style backward) runs once every gradient is in.
        self.update_hook_state_and_maybe_run_epilogue(self._num_params)

    def step(self, closure=None) -> None:
        super().step(closure)
        # The engine's LR scheduler is built on the torch optimizer, whose own `step` never runs
        # here: mark it stepped, as torch's schedulers check (they would warn on every run).
        self.optimizer._opt_called = True


_ORIGINAL = {
    "configure": DeepSpeedEngine._configure_distributed_model,
    "save": DeepSpeedEngine.save_checkpoint,
    "load": DeepSpeedEngine.load_checkpoint,
    "zero": DeepSpeedEngine._configure_zero_optimizer,
    "bf16": DeepSpeedEngine._configure_bf16_optimizer,
}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sharded_optimizer_settings(engine):
    """The `optimus.sharded_optimizer` section of the engine's config when enabled, else None (a
    bad key or value there is a one-line ConfigError)."""
    from ..schema import need
    from .config import ShardedOptimizerConfig

    cached = getattr(engine, "_ds_optimus_sharded_settings", False)
    if cached is not False:
        return cached
    section = engine._config._param_dict.get("optimus", {})
    need(isinstance(section, dict), f"optimus must be a JSON object, got {type(section).__name__}")
    settings = ShardedOptimizerConfig.parse(section.get("sharded_optimizer", {}), "optimus.sharded_optimizer")
    engine._ds_optimus_sharded_settings = settings if settings.enabled else None
    return engine._ds_optimus_sharded_settings


def build_sharded_optimizer(engine, basic_optimizer, settings) -> ShardedOptimizer:
    """The engine's `ShardedOptimizer` over `basic_optimizer`'s param groups, sharding expert
    parameters over the expert-parallel layouts the engine's model declares."""
    import torch.distributed as dist

    from ..schema import ConfigError

    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2):
        raise ConfigError(f"optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, got {stage}")
    if engine.zero_offload_optimizer() is not None and engine.zero_use_cpu_optimizer():
        raise ConfigError("optimus.sharded_optimizer does not offload optimizer state; remove "
                          "zero_optimization.offload_optimizer or disable the sharded optimizer")
    group = engine.seq_data_parallel_group
    if engine.mpu is not None or dist.get_world_size(group=group) != dist.get_world_size():
        raise ConfigError("optimus.sharded_optimizer supports data and expert parallelism only "
                          "(no tensor, pipeline or sequence parallelism)")
    if settings.reduce_dtype is not None:
        reduce_dtype = _DTYPES[settings.reduce_dtype]
    elif engine._config.communication_data_type is not None:
        reduce_dtype = engine._config.communication_data_type
    else:
        reduce_dtype = engine.get_data_types()[1]
    scaler = None
    if engine.fp16_enabled():
        if engine.dynamic_loss_scale():
            args = engine.dynamic_loss_scale_args()
            scaler = sharded.LossScaler(args["init_scale"], dynamic=True, window=args["scale_window"],
                                        hysteresis=args["delayed_shift"], min_scale=args["min_scale"])
        else:
            scaler = sharded.LossScaler(engine.loss_scale())
    return ShardedOptimizer(basic_optimizer, param_names=dict(engine.param_names), stage=stage,
                            expert_groups=expert_layouts(engine.module), dense_group=group,
                            clip_grad=engine.gradient_clipping(), bucket_size=settings.bucket_size,
                            reduce_dtype=reduce_dtype, overlap_comm=settings.overlap_comm, loss_scaler=scaler)


def _configure_zero_optimizer(self, optimizer):
    settings = sharded_optimizer_settings(self)
    if settings is None:
        return _ORIGINAL["zero"](self, optimizer)
    return build_sharded_optimizer(self, optimizer, settings)


def _configure_bf16_optimizer(self, optimizer):
    # DeepSpeed picks its BF16 optimizer for ZeRO-1 with bf16 weights and fp32 accumulation.
    settings = sharded_optimizer_settings(self) if self.zero_optimization() else None
    if settings is None:
        return _ORIGINAL["bf16"](self, optimizer)
    return build_sharded_optimizer(self, optimizer, settings)


def _configure_distributed_model(self, model):
    from ..schema import ConfigError

    settings = sharded_optimizer_settings(self)
    if settings is not None and int(self.zero_optimization_stage()) not in (1, 2):
        raise ConfigError("optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, "
                          f"got {int(self.zero_optimization_stage())}")
    # Before DeepSpeed reads its group registry (here) and builds its optimizer (after): the layouts
    # the model's experts declare, so its ZeRO finds the EDP group under each parameter's group_name.
    for groups in expert_layouts(model):
        register_expert_groups(groups)
    _ORIGINAL["configure"](self, model)
    experts = expert_parallel_modules(self.module)
    self._ds_optimus_expert_parallel = bool(experts)
    if experts and not self.has_moe_layers:
        self.has_moe_layers = True
        self.num_experts.extend(m.num_experts for m in experts)


def _checkpoint_method(name):
    original = _ORIGINAL[name]

    def method(self, *args, **kwargs):
        from . import checkpointing

        if isinstance(self.optimizer, sharded.ShardedOptimizer):
            ours = checkpointing.save_checkpoint if name == "save" else checkpointing.load_checkpoint
            return ours(self, *args, **kwargs)
        if getattr(self, "_ds_optimus_expert_parallel", False):
            # DeepSpeed's MoE checkpoint code only knows its own MoE modules: it would write one
            # rank's expert shard for all and load it into every rank without an error.
            raise NotImplementedError(
                "DeepSpeed's own checkpoints cannot hold a ds_optimus expert-parallel model; enable "
                "optimus.sharded_optimizer (its checkpoints can), or export the model with "
                "ds_optimus.parallel.export_pretrained() on every rank"
            )
        return original(self, *args, **kwargs)

    return method


def install_engine_hook() -> None:
    """Make DeepSpeed's engine treat ds_optimus expert-parallel experts as MoE layers (registering the
    groups they declare), build the sharded optimizer when the config enables it, route its
    checkpoints to ds_optimus, and refuse DeepSpeed's own checkpoints of expert-parallel models
    (idempotent)."""
    check_version()
    DeepSpeedEngine._configure_distributed_model = _configure_distributed_model
    DeepSpeedEngine._configure_zero_optimizer = _configure_zero_optimizer
    DeepSpeedEngine._configure_bf16_optimizer = _configure_bf16_optimizer
    DeepSpeedEngine.save_checkpoint = _checkpoint_method("save")
    DeepSpeedEngine.load_checkpoint = _checkpoint_method("load")


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


# Importing this module hooks the engine (`import ds_optimus` imports it right after `import deepspeed`).
install_engine_hook()

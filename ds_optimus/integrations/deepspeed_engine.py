"""DeepSpeed's engine, patched so that a config's `optimus` section works however `deepspeed.initialize`
is reached (`ds_optimus.train`, the HF Trainer through accelerate, a script). Written against DeepSpeed 0.19.8
(`TESTED_VERSIONS`); each replaced method is listed with its reason in `ds_optimus.integrations.PATCHES`.

An engine is left as DeepSpeed built it unless its config has an `optimus` section or its model holds
ds_optimus' expert-parallel experts or a Mula router bias. Then it applies the section's `moe`, `expert_parallel`
and `sharded_optimizer`, registers the experts' EP/EDP groups as DeepSpeed's ``ep_size_{P}`` MoE groups, and
routes checkpoints to ds_optimus' (refusing DeepSpeed's own for an expert-parallel model).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as ds_groups

from ..moe.layer import uses_router_bias
from ..optim import sharded
from ..optim.engine_section import EngineSection
from ..parallel.dims import ParallelDims
from ..parallel.expert_parallel import (
    EXPERT_WEIGHTS,
    expert_layouts,
    expert_parallel_modules,
    experts_modules,
    is_expert_param,
    setup_moe,
)
from ..parallel.groups import EngineParallelism, init_layout_groups
from ..parallel.tensor_parallel import split_parameters
from ..schema import ConfigError
from .deepspeed_version import check_version


def register_expert_groups(groups) -> None:
    """Register an `ExpertParallelGroups` layout with DeepSpeed's group registry."""
    check_version()
    ds_groups._EXPERT_PARALLEL_GROUP[groups.name] = groups.ep_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[groups.name] = list(groups.ep_ranks)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[groups.name] = groups.edp_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[groups.name] = list(groups.edp_ranks)


# the core's name kept: the engine's optimizer reports itself as "ShardedOptimizer"
class ShardedOptimizer(sharded.ShardedOptimizer, ZeROOptimizer):
    """The sharded optimizer as a DeepSpeed `ZeROOptimizer`: the engine runs backward through it, and its
    gradient hooks report to the backward-hook state manager."""

    def __init__(self, init_optimizer, **kwargs) -> None:
        ZeROOptimizer.__init__(self)  # the backward-hook state manager and the boundary flag
        # What DeepSpeed's `needs_scaler` reads besides `dynamic_loss_scale`: no other loss scaler here.
        self.custom_loss_scaler, self.torch_autocast_gradscaler = False, None
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
    "expert_parallel": DeepSpeedEngine._configure_expert_parallel,
    "optimizer": DeepSpeedEngine._configure_optimizer,
    "model_step": DeepSpeedEngine._take_model_step,
    "configure": DeepSpeedEngine._configure_distributed_model,
    "save": DeepSpeedEngine.save_checkpoint,
    "load": DeepSpeedEngine.load_checkpoint,
    "zero": DeepSpeedEngine._configure_zero_optimizer,
    "bf16": DeepSpeedEngine._configure_bf16_optimizer,
}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def optimus_given(engine) -> dict | None:
    """The `optimus` section of the engine's config as written, or None (also for a non-DeepSpeed config)."""
    # `engine.config`: the config as `deepspeed.initialize` gives it to the engine, a dict (it loads a path first)
    params = getattr(engine, "config", None)
    section = params.get("optimus") if isinstance(params, dict) else None
    return section if isinstance(section, dict) else None


def _communication_data_type(engine) -> torch.dtype | None:
    """DeepSpeed's `communication_data_type` as the config sets it (DeepSpeed has checked the name), or None."""
    params = getattr(engine, "config", None)
    given = params.get("communication_data_type") if isinstance(params, dict) else None
    return _DTYPES[given.lower()] if given is not None else None


def engine_section(engine) -> EngineSection:
    """The engine's `optimus` section, parsed once (the defaults without one)."""
    given = optimus_given(engine)
    if given is None:
        return EngineSection.of({})
    cached = getattr(engine, "_ds_optimus_section", None)
    if cached is None:
        cached = engine._ds_optimus_section = EngineSection.of(given)
    return cached


def sharded_optimizer_settings(engine):
    """The `optimus.sharded_optimizer` section of the engine's config when enabled, else None."""
    if optimus_given(engine) is None:
        return None
    settings = engine_section(engine).sharded_optimizer
    return settings if settings.enabled else None


def ours(engine, model) -> bool:
    """Whether ds_optimus handles this engine: an `optimus` section, expert-parallel experts or a router bias."""
    return optimus_given(engine) is not None or bool(expert_layouts(model)) or uses_router_bias(model)


def build_sharded_optimizer(engine, basic_optimizer, settings) -> ShardedOptimizer:
    """The engine's `ShardedOptimizer` over `basic_optimizer`'s param groups and the model's expert layouts."""
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2):
        raise ConfigError(f"optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, got {stage}")
    if engine.zero_offload_optimizer() is not None and engine.zero_use_cpu_optimizer():
        raise ConfigError(
            "optimus.sharded_optimizer does not offload optimizer state; remove "
            "zero_optimization.offload_optimizer or disable the sharded optimizer"
        )
    group, ours = engine.seq_data_parallel_group, isinstance(engine.mpu, EngineParallelism)  # ds_optimus' layout
    if not ours and (engine.mpu is not None or dist.get_world_size(group=group) != dist.get_world_size()):
        raise ConfigError(
            "optimus.sharded_optimizer supports data, expert and ds_optimus' pipeline and tensor parallelism only"
        )
    tensor = engine.mpu.tensor if ours else None
    reduce_dtype = (
        _DTYPES[settings.reduce_dtype]
        if settings.reduce_dtype is not None
        else _communication_data_type(engine) or engine.get_data_types()[1]
    )
    scaler = None
    if engine.fp16_enabled():
        if engine.dynamic_loss_scale():
            args = engine.dynamic_loss_scale_args()
            scaler = sharded.LossScaler(
                args["init_scale"],
                dynamic=True,
                window=args["scale_window"],
                hysteresis=args["delayed_shift"],
                min_scale=args["min_scale"],
            )
        else:
            scaler = sharded.LossScaler(engine.loss_scale())
    keys = ("bucket_size", "overlap_comm", "shard_group_size", "overlap_param_gather")
    options = {k: getattr(settings, k) for k in keys}
    return ShardedOptimizer(
        basic_optimizer,
        param_names=dict(engine.param_names),
        stage=stage,
        expert_groups=expert_layouts(engine.module),
        dense_group=group,
        module=engine.module,
        clip_grad=engine.gradient_clipping(),
        reduce_dtype=reduce_dtype,
        loss_scaler=scaler,
        norm_group=dist.group.WORLD if ours else None,  # stages, or TP ranks: the world
        accumulation_steps=engine.gradient_accumulation_steps(),
        tensor_splits=split_parameters(engine.module) if tensor is not None else None,
        tensor_rank=tensor.rank if tensor is not None else 0,
        replicated_group=engine.mpu.replicated_group if ours else None,
        **options,
    )


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


def _configure_expert_parallel(self, model, collect_sources=None):
    replaced = _ORIGINAL["expert_parallel"](self, model, collect_sources)  # DeepSpeed's AutoEP, when enabled
    given = optimus_given(self)
    if given is None or ("moe" not in given and "expert_parallel" not in given):
        return replaced
    section = engine_section(self)
    size, layouts = section.expert_parallel.size, expert_layouts(model)
    if layouts and "expert_parallel" in given and layouts[0].ep_size != size:
        raise ConfigError(
            f"the model is already expert-parallel at size {layouts[0].ep_size}, but "
            f"optimus.expert_parallel.size is {size}"
        )
    if layouts or size == 1:  # applied before (e.g. by ds_optimus.train): the experts backend only
        setup_moe(model, EngineSection(moe=section.moe))
        return replaced
    if replaced:
        raise ConfigError(
            "optimus.expert_parallel and DeepSpeed's expert_parallel (AutoEP) both shard the "
            "experts: enable one of them"
        )
    experts = experts_modules(model)
    if not experts:
        raise ConfigError(
            f"optimus.expert_parallel.size is {size}, but {type(model).__name__} has no experts "
            "to shard (expert parallelism needs stacked gate_up_proj/down_proj experts, as Mula's)"
        )
    before = [(m, {name: getattr(m, name) for name in EXPERT_WEIGHTS}) for m in experts]
    ep = section.expert_parallel
    try:  # the layout object and the one group-making function the trainer uses (no stages or TP here)
        groups = init_layout_groups(ParallelDims(dist.get_world_size(), ep=ep.size, node_size=ep.node_size))
        setup_moe(model, section, groups)
    except ValueError as err:  # a layout that does not fit (EP size vs. world size or experts)
        raise ConfigError(f"optimus.expert_parallel: {err}") from None
    # Told as a module replacement, DeepSpeed re-points the parameter lists and the client optimizer
    # made before (the Hugging Face Trainer makes both) from the full expert weights to the shards.
    for module, weights in before:
        for name, full in weights.items():
            replaced.sources[id(getattr(module, name))] = [full]
            replaced.discarded.add(id(full))
    return replaced


def split_expert_param_groups(optimizer) -> None:
    """Move expert parameters into DeepSpeed's `moe` param groups (one per layout), in place, before any step;
    a no-op if a `moe` group exists."""
    if any(group.get("moe") for group in optimizer.param_groups):
        return
    kept, added = [], []
    for group in optimizer.param_groups:
        experts: dict[str, list] = {}
        for param in group["params"]:
            if is_expert_param(param):
                experts.setdefault(param.group_name, []).append(param)
        settings = {k: v for k, v in group.items() if k != "params"}
        dense = [p for p in group["params"] if not is_expert_param(p)]
        if dense or not experts:
            kept.append({**group, "params": dense})
        added += [{**settings, "name": name, "moe": True, "params": params} for name, params in experts.items()]
    if added:
        optimizer.param_groups[:] = kept + added


def _configure_optimizer(self, client_optimizer, model_parameters):
    if expert_parallel_modules(self.module) and hasattr(client_optimizer, "param_groups"):
        split_expert_param_groups(client_optimizer)
    return _ORIGINAL["optimizer"](self, client_optimizer, model_parameters)


def _take_model_step(self, lr_kwargs):
    _ORIGINAL["model_step"](self, lr_kwargs)
    if getattr(self, "drives_router_bias", False):  # after the gradient step, once per optimizer step
        if getattr(self.optimizer, "overflow", False):  # a skipped step moves nothing
            self.module.discard_router_loads()
        else:
            self.module.update_router_bias()


def _configure_distributed_model(self, model):
    if not ours(self, model):
        return _ORIGINAL["configure"](self, model)
    settings = sharded_optimizer_settings(self)
    if settings is not None and int(self.zero_optimization_stage()) not in (1, 2):
        raise ConfigError(
            f"optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, got {int(self.zero_optimization_stage())}"
        )
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
    # The engine moves a Mula router's bias after each optimizer step (auxiliary-loss-free
    # balancing); ds_optimus.train turns this off and does it in its own step.
    self.drives_router_bias = uses_router_bias(self.module)
    from .deepspeed_ops import release_shm_workspace  # here: that module may still be importing DeepSpeed

    release_shm_workspace()


def _checkpoint_method(name):
    original = _ORIGINAL[name]

    def method(self, *args, **kwargs):
        from ..checkpoint import optimizer_state as checkpointing

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
    """Patch DeepSpeed's engine (idempotent); each replacement keeps DeepSpeed's method as `__wrapped__`."""
    check_version()
    replacements = {
        "expert_parallel": _configure_expert_parallel,
        "optimizer": _configure_optimizer,
        "model_step": _take_model_step,
        "configure": _configure_distributed_model,
        "zero": _configure_zero_optimizer,
        "bf16": _configure_bf16_optimizer,
        "save": _checkpoint_method("save"),
        "load": _checkpoint_method("load"),
    }
    for key, replacement in replacements.items():
        original = _ORIGINAL[key]
        replacement.__wrapped__ = original
        setattr(DeepSpeedEngine, original.__name__, replacement)


def set_gradient_clipping(engine, value: float) -> None:
    """Clip the global gradient norm at `value` (0: off) from the engine's next step on."""
    engine._config.gradient_clipping = float(value)  # what engine.gradient_clipping() returns
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(optimizer, "clip_grad"):  # ZeRO-1/2, BF16, FP16 and the sharded optimizer
        optimizer.clip_grad = float(value)


# Importing this module hooks the engine (`import ds_optimus` imports it right after `import deepspeed`).
install_engine_hook()

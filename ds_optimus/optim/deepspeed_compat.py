"""The one module that touches DeepSpeed's private API, pinned to the tested DeepSpeed versions.

- The `optimus` section of the engine's config (`EngineSection`: `moe`, `expert_parallel`,
  `sharded_optimizer`) is applied by the engine itself to the model it is given, however
  `deepspeed.initialize` is reached (the Hugging Face Trainer through accelerate, `accelerate
  launch`, a script): the experts backend, expert parallelism where the model is not yet
  expert-parallel (reported to DeepSpeed as a module replacement, so the parameter lists and the
  client optimizer built before it are re-pointed at the shards), expert parameters split into
  DeepSpeed's `moe` param groups, the router-bias update after each optimizer step, and
  `Accelerator.get_state_dict` gathering every expert (what `Trainer.save_model` calls on every
  rank). CPU runs release DeepSpeed's shared-memory workspace once the engine exists.
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

import hashlib
import os
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as ds_groups

from ..moe.layer import uses_router_bias
from ..parallel.expert_parallel import (
    EXPERT_WEIGHTS,
    expert_groups_of,
    expert_layouts,
    expert_parallel_modules,
    experts_modules,
    full_state_dict,
    is_expert_param,
    setup_moe,
)
from ..schema import ConfigError
from . import sharded
from .config import EngineSection

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


def engine_section(engine) -> EngineSection:
    """The engine's `optimus` section, parsed once (a bad key or value there is a one-line ConfigError)."""
    cached = getattr(engine, "_ds_optimus_section", None)
    if cached is None:
        cached = engine._ds_optimus_section = EngineSection.of(engine._config._param_dict.get("optimus", {}))
    return cached


def sharded_optimizer_settings(engine):
    """The `optimus.sharded_optimizer` section of the engine's config when enabled, else None."""
    settings = engine_section(engine).sharded_optimizer
    return settings if settings.enabled else None


def build_sharded_optimizer(engine, basic_optimizer, settings) -> ShardedOptimizer:
    """The engine's `ShardedOptimizer` over `basic_optimizer`'s param groups, sharding expert
    parameters over the expert-parallel layouts the engine's model declares."""
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2):
        raise ConfigError(f"optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, got {stage}")
    if engine.zero_offload_optimizer() is not None and engine.zero_use_cpu_optimizer():
        raise ConfigError("optimus.sharded_optimizer does not offload optimizer state; remove "
                          "zero_optimization.offload_optimizer or disable the sharded optimizer")
    group, stages = engine.seq_data_parallel_group, getattr(engine.mpu, "pipeline", None)  # ds_optimus' pipeline
    if stages is None and (engine.mpu is not None or dist.get_world_size(group=group) != dist.get_world_size()):
        raise ConfigError("optimus.sharded_optimizer supports data, expert and ds_optimus' pipeline parallelism only")
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
    keys = ("bucket_size", "overlap_comm", "shard_group_size", "overlap_param_gather")
    options = {k: getattr(settings, k) for k in keys}
    return ShardedOptimizer(basic_optimizer, param_names=dict(engine.param_names), stage=stage,
                            expert_groups=expert_layouts(engine.module), dense_group=group, module=engine.module,
                            clip_grad=engine.gradient_clipping(), reduce_dtype=reduce_dtype, loss_scaler=scaler,
                            norm_group=dist.group.WORLD if stages is not None else None, **options)


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
    given = self._config._param_dict.get("optimus", {})
    section = engine_section(self)
    if "moe" not in given and "expert_parallel" not in given:
        return replaced
    size, layouts = section.expert_parallel.size, expert_layouts(model)
    if layouts and "expert_parallel" in given and layouts[0].ep_size != size:
        raise ConfigError(f"the model is already expert-parallel at size {layouts[0].ep_size}, but "
                          f"optimus.expert_parallel.size is {size}")
    if layouts or size == 1:  # applied before (e.g. by ds_optimus.train): the experts backend only
        setup_moe(model, EngineSection(moe=section.moe))
        return replaced
    if replaced:
        raise ConfigError("optimus.expert_parallel and DeepSpeed's expert_parallel (AutoEP) both shard the "
                          "experts: enable one of them")
    experts = experts_modules(model)
    if not experts:
        raise ConfigError(f"optimus.expert_parallel.size is {size}, but {type(model).__name__} has no experts "
                          "to shard (expert parallelism needs stacked gate_up_proj/down_proj experts, as Mula's)")
    before = [(m, {name: getattr(m, name) for name in EXPERT_WEIGHTS}) for m in experts]
    try:
        setup_moe(model, section)
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
    """Move expert parameters out of `optimizer`'s param groups into DeepSpeed's `moe` groups (one per
    expert layout, keeping the group's settings), unless some group is already one: what an
    optimizer built over `model.parameters()` (the Hugging Face Trainer's) needs for expert
    parallelism. In place; the optimizer must not have stepped yet."""
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
    # The engine moves a Mula router's bias after each optimizer step (auxiliary-loss-free
    # balancing); ds_optimus.train turns this off and does it in its own step.
    self.drives_router_bias = uses_router_bias(self.module)
    if "accelerate.accelerator" in sys.modules:
        _hook_accelerate(sys.modules["accelerate.accelerator"].Accelerator)
    release_shm_workspace()


# Ops DeepSpeed builds at start-up that training never calls: the CPU shared-memory all-reduce serves
# `inference_all_reduce` (AutoTP inference) only, yet costs a ~75 s compile and a 69 MB /dev/shm
# workspace per rank.
UNNEEDED_OPS = ("deepspeed_shm_comm",)
_ADAM = "DeepSpeed's Adam on this device; optimizer.params.torch_adam: true uses PyTorch's, unbuilt"
_WHY = {"fused_adam": _ADAM, "cpu_adam": _ADAM}


def extensions_dir() -> Path:
    """Where this Python environment keeps DeepSpeed's compiled ops: a folder of its own, so that two
    environments do not rebuild each other's ops in turn, as in PyTorch's one shared default folder."""
    key = hashlib.sha256(f"{sys.prefix}|{torch.__version__}|{deepspeed.__version__}".encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "torch_extensions" / f"ds_optimus-{Path(sys.prefix).name}-{key}"


def prepare_op_builds(say=None) -> None:
    """Before DeepSpeed builds or loads its ops: keep them per environment (`TORCH_EXTENSIONS_DIR`,
    unless set), skip those training never calls (`UNNEEDED_OPS`), and say in one line (`say`, on
    the first local rank) what is being compiled and why before a build starts. Idempotent."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    check_version()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    for name in UNNEEDED_OPS:
        deepspeed.ops.__compatible_ops__[name] = False
    original = OpBuilder.jit_load
    if getattr(original, "says_builds", False):
        return
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))

    def jit_load(self, verbose=True):
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir()))
        first = os.environ.get("LOCAL_RANK", "0") in ("", "0") and not any((root / self.name).glob(f"{self.name}*.so"))
        if first:
            say(f"ds_optimus: compiling DeepSpeed's {self.name} op ({_WHY.get(self.name, 'this config needs it')}): "
                f"a few minutes, once per environment, kept in {root}")
        began = time.perf_counter()
        module = original(self, verbose=os.environ.get("DS_OPTIMUS_VERBOSE", "") not in ("", "0", "false"))
        if first:
            say(f"ds_optimus: DeepSpeed's {self.name} op is ready ({time.perf_counter() - began:.0f} s)")
        return module

    jit_load.says_builds = True
    OpBuilder.jit_load = jit_load


def release_shm_workspace() -> None:
    """Remove the name of this rank's shared-memory workspace that DeepSpeed's CPU communication
    backend creates when all ranks share a host (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_
    <port>_<rank>, 69 MB) and never removes: every run on a new port would leave one per rank behind,
    until /dev/shm (RAM) is full. Every rank maps every other rank's workspace while the backend
    starts, so after a barrier the names can go; the mappings stay valid. Collective; CPU only."""
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() or get_accelerator().device_name() != "cpu":
        return
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    dist.barrier()
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _hook_accelerate(accelerator_class) -> None:
    """`Accelerator.get_state_dict` of an expert-parallel model under DeepSpeed: every expert, gathered
    over the EP group (it is collective: `Trainer.save_model` and `Accelerator.save_model` call it on
    every rank), instead of this rank's shard. Idempotent."""
    original = accelerator_class.get_state_dict
    if getattr(original, "gathers_experts", False):
        return

    def get_state_dict(self, model, unwrap=True):
        inner = self.unwrap_model(model) if unwrap else model
        groups = expert_groups_of(inner) if isinstance(inner, torch.nn.Module) else None
        if groups is None or groups.ep_size == 1 or not isinstance(model, DeepSpeedEngine):
            return original(self, model, unwrap)
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

        return clone_tensors_for_torch_save(full_state_dict(inner, groups))

    get_state_dict.gathers_experts = True
    accelerator_class.get_state_dict = get_state_dict


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
    """Make DeepSpeed's engine apply the config's `optimus` section to its model, treat ds_optimus
    expert-parallel experts as MoE layers (registering the groups they declare), build the sharded
    optimizer when the config enables it, route its checkpoints to ds_optimus, and refuse
    DeepSpeed's own checkpoints of expert-parallel models (idempotent)."""
    check_version()
    DeepSpeedEngine._configure_expert_parallel = _configure_expert_parallel
    DeepSpeedEngine._configure_optimizer = _configure_optimizer
    DeepSpeedEngine._take_model_step = _take_model_step
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


# Importing this module hooks the engine and the op builds (`import ds_optimus` imports it right after
# `import deepspeed`), before anything of DeepSpeed's builds or loads an op.
install_engine_hook()
prepare_op_builds()

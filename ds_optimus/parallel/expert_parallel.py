"""Shard a model's stacked experts over an expert-parallel group and mark them for DeepSpeed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..schema import Section, need, positive_int
from .dispatch import ExpertParallelDispatcher
from .groups import ExpertParallelGroups, check_layout, init_expert_parallel_groups

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertParallelConfig(Section):
    """`optimus.expert_parallel`: the EP size; `node_size` selects the hierarchical exchange."""

    size: int = 1
    node_size: int | None = None

    def check(self, where: str) -> None:
        need(positive_int(self.size), f"{where}.size must be a positive integer, got {self.size!r}")
        need(self.node_size is None or positive_int(self.node_size),
             f"{where}.node_size must be null or a positive integer, got {self.node_size!r}")
        need(self.node_size is None or self.size % self.node_size == 0,
             f"{where}.node_size {self.node_size} does not divide {where}.size {self.size}")


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules()
            if all(isinstance(getattr(m, w, None), nn.Parameter) for w in EXPERT_WEIGHTS) and hasattr(m, "num_experts")]


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether `param` is a sharded expert weight (what `deepspeed.moe.utils.is_moe_param` checks)."""
    return getattr(param, "allreduce", True) is False


def apply_expert_parallel(model: nn.Module, ep_size: int | ExpertParallelGroups,
                          node_size: int | None = None) -> ExpertParallelGroups:
    """Keep this rank's slice of every MoE layer's stacked experts and route tokens to their owners.

    `ep_size` ranks share each layer's experts (rank i of an EP group keeps experts
    [i*E/P, (i+1)*E/P)); `node_size` selects the hierarchical exchange with nodes of that many ranks.
    Expert weights are marked for DeepSpeed (`allreduce=False`, `group_name`) so ZeRO reduces their
    gradients over the expert-data-parallel group. Every rank must start from the same weights.
    Collective; returns the process groups.
    """
    experts = _experts_modules(model)
    if not experts:
        raise ValueError("apply_expert_parallel: the model has no stacked experts (gate_up_proj/down_proj)")
    if any(hasattr(m, "num_local_experts") for m in experts):
        raise ValueError("apply_expert_parallel: the model is already expert-parallel")
    groups = ep_size if isinstance(ep_size, ExpertParallelGroups) else init_expert_parallel_groups(ep_size, node_size)
    for module in experts:  # every layer is checked before any is changed
        check_layout(groups.world_size, groups.ep_size, module.num_experts, groups.node_size)
    for module in experts:
        local = module.num_experts // groups.ep_size
        start = groups.ep_rank * local
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            shard = nn.Parameter(full.detach()[start:start + local].clone(), requires_grad=full.requires_grad)
            shard.allreduce = False  # deepspeed.moe.utils.is_moe_param
            shard.group_name = groups.name  # DeepSpeed's name for the EDP group of this EP size
            setattr(module, name, shard)
        module.num_local_experts = local
        # EP size 1 keeps every expert: nothing to exchange.
        module.expert_parallel = ExpertParallelDispatcher(groups, local) if groups.ep_size > 1 else None
    _use_ds_optimus_experts(model)
    if hasattr(model, "save_pretrained"):
        _save_full_experts(model, groups)
    return groups


def expert_groups_of(model: nn.Module) -> ExpertParallelGroups | None:
    """The layout `apply_expert_parallel` gave `model` (on this rank), or None if it has none."""
    from .groups import expert_parallel_groups

    for p in model.parameters():
        if is_expert_param(p):
            return expert_parallel_groups(p.group_name)
    return None


def full_state_dict(model: nn.Module, groups: ExpertParallelGroups) -> dict[str, torch.Tensor]:
    """The model's state dict with every expert-parallel weight gathered to its full [E, ...] shape
    (collective over the EP group; every rank gets the whole dict)."""
    state = model.state_dict()
    sharded = [name for name, p in model.named_parameters() if is_expert_param(p)]  # same order on every rank
    for name in sharded:
        local = state[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(groups.ep_size)]
        torch.distributed.all_gather(parts, local, group=groups.ep_group)
        state[name] = torch.cat(parts)
    return state


def _save_full_experts(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Make `model.save_pretrained` write the full experts (a folder any single process can load),
    from global rank 0 only. It becomes collective: call it on every rank."""
    original = model.save_pretrained

    def save_pretrained(save_directory, *args, **kwargs):
        given = kwargs.get("state_dict")
        if given is not None:  # e.g. the HF Trainer's, on the main process only: no collective here
            for name, p in model.named_parameters():
                if is_expert_param(p) and name in given and given[name].shape == p.shape and groups.ep_size > 1:
                    raise ValueError(f"save_pretrained: state_dict holds this rank's expert shard of {name}; "
                                     "pass ds_optimus.parallel.full_state_dict(model, groups) or call "
                                     "save_pretrained on every rank without a state_dict")
            return original(save_directory, *args, **kwargs)
        kwargs["state_dict"] = full_state_dict(model, groups)
        kwargs.setdefault("is_main_process", groups.rank == 0)
        result = original(save_directory, *args, **kwargs)
        torch.distributed.barrier()  # the folder is complete when any rank returns
        return result

    model.save_pretrained = save_pretrained


def setup_moe(model: nn.Module, config) -> ExpertParallelGroups | None:
    """Apply the MoE settings of a parsed `optimus` section (`ds_optimus.config.OptimusConfig`, or
    anything with its `moe` and `expert_parallel` sections): the experts backend of every MoE layer,
    and expert parallelism when `expert_parallel.size > 1`. Returns the EP groups, or None without
    expert parallelism."""
    backend = None if config.moe.experts_backend == "auto" else config.moe.experts_backend
    for module in _experts_modules(model):
        module.experts_backend = backend
    _use_ds_optimus_experts(model)
    ep = config.expert_parallel
    if ep.size == 1:
        return None
    return apply_expert_parallel(model, ep.size, node_size=ep.node_size)


def _use_ds_optimus_experts(model: nn.Module) -> None:
    from ..moe.layer import IMPLEMENTATION_NAME, register_experts_implementation

    register_experts_implementation()
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_experts_implementation", None) == IMPLEMENTATION_NAME:
        return
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION_NAME)
    else:
        config._experts_implementation = IMPLEMENTATION_NAME


def moe_param_groups(model: nn.Module, weight_decay: float = 0.0, **options: Any) -> list[dict[str, Any]]:
    """Optimizer param groups as DeepSpeed's MoE support expects them.

    Dense parameters go to "dense" (weight decay) and "dense_no_decay" (norms, biases and other 1-D
    parameters: the usual rule); expert weights to one group per EP layout, named by its DeepSpeed
    group name with `moe=True`. `options` (lr, betas, ...) are copied into every group.
    """
    dense, no_decay, experts = [], [], {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if is_expert_param(param):
            experts.setdefault(param.group_name, []).append(param)
        elif param.ndim < 2:
            no_decay.append(param)
        else:
            dense.append(param)
    param_groups = [
        {"name": "dense", "params": dense, "weight_decay": weight_decay, **options},
        {"name": "dense_no_decay", "params": no_decay, "weight_decay": 0.0, **options},
    ]
    for name, params in experts.items():
        param_groups.append({"name": name, "moe": True, "params": params, "weight_decay": weight_decay, **options})
    return [g for g in param_groups if g["params"]]

"""Shard a model's stacked experts over an expert-parallel group, mark them for DeepSpeed, and export an
expert-parallel model as one Hugging Face folder; the layout lives in attributes `MulaExperts` declares."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..moe.layer import IMPLEMENTATION_NAME, declare_expert_attributes, register_experts_implementation
from ..schema import Section, need, positive_int
from .allgather import AllGatherDispatcher
from .dispatch import ExpertParallelDispatcher, wire
from .groups import ExpertParallelGroups, check_layout, init_expert_parallel_groups
from .overlap import dedup_dispatcher
from .traffic import dedup_sends_fewer_bytes

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
DISPATCHES = ("alltoall", "allgather")


@dataclass(frozen=True)
class ExpertParallelConfig(Section):
    """`optimus.expert_parallel`: the EP size and the token exchange."""

    size: int = 1  # expert-parallel size: consecutive ranks that share each MoE layer's experts
    node_size: int | None = None  # ranks per node; below `size` it selects the hierarchical exchange
    # send a token once per destination rank (or node) instead of once per routed slot; "auto": where
    # that is expected to send fewer bytes
    dedup: bool | str = "auto"
    chunks: int = 1  # pieces of the deduplicated exchange, one travelling while the experts compute another
    dispatch: str = "alltoall"  # "alltoall" (every mode above) or "allgather" (Optimus'; flat, no dedup)

    def check(self, where: str) -> None:
        need(positive_int(self.size), f"{where}.size must be a positive integer, got {self.size!r}")
        need(
            self.node_size is None or positive_int(self.node_size),
            f"{where}.node_size must be null or a positive integer, got {self.node_size!r}",
        )
        need(
            self.node_size is None or self.size % self.node_size == 0,
            f"{where}.node_size {self.node_size} does not divide {where}.size {self.size}",
        )
        need(self.dedup in (True, False, "auto"), f'{where}.dedup must be true, false or "auto", got {self.dedup!r}')
        need(positive_int(self.chunks), f"{where}.chunks must be a positive integer, got {self.chunks!r}")
        need(
            self.chunks == 1 or self.dedup is not False,
            f"{where}.chunks {self.chunks} overlaps the deduplicated exchange, which {where}.dedup false turns off",
        )
        need(self.dispatch in DISPATCHES, f'{where}.dispatch must be "alltoall" or "allgather", got {self.dispatch!r}')
        if self.dispatch == "allgather":
            hierarchical = self.node_size is not None and 1 < self.node_size < self.size
            wrong = [
                f"{where}.{key} {value}"
                for key, value, bad in (
                    ("dedup", "true", self.dedup is True),
                    ("chunks", self.chunks, self.chunks > 1),
                    ("node_size", self.node_size, hierarchical),
                )
                if bad
            ]
            need(
                not wrong,
                f'{where}.dispatch "allgather" is a flat exchange in one chunk without dedup; '
                f"it does not take {' and '.join(wrong)}",
            )


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding stacked experts, their expert-parallel attributes declared (at defaults if not Mula's)."""
    return [
        declare_expert_attributes(m)
        for m in model.modules()
        if all(isinstance(getattr(m, w, None), nn.Parameter) for w in EXPERT_WEIGHTS) and hasattr(m, "num_experts")
    ]


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether `param` is a sharded expert weight (what `deepspeed.moe.utils.is_moe_param` checks)."""
    return getattr(param, "allreduce", True) is False


def apply_expert_parallel(
    model: nn.Module,
    ep_size: int | ExpertParallelGroups,
    node_size: int | None = None,
    *,
    dedup: bool | str = "auto",
    chunks: int = 1,
    dispatch: str = "alltoall",
) -> ExpertParallelGroups:
    """Keep this rank's slice of every MoE layer's stacked experts and route tokens to their owners (keywords:
    `ExpertParallelConfig`'s). Expert weights get `allreduce=False` and `group_name`, so ZeRO reduces them over the
    expert-data-parallel group. Every rank must start from the same weights; collective."""
    hierarchical = (
        ep_size.hierarchical
        if isinstance(ep_size, ExpertParallelGroups)
        else (isinstance(node_size, int) and isinstance(ep_size, int) and 1 < node_size < ep_size)
    )
    _check_exchange(dedup, chunks, dispatch, hierarchical)  # before anything changes
    experts = experts_modules(model)
    if not experts:
        raise ValueError("apply_expert_parallel: the model has no stacked experts (gate_up_proj/down_proj)")
    if any(m.expert_groups is not None for m in experts):
        raise ValueError("apply_expert_parallel: the model is already expert-parallel")
    groups = ep_size if isinstance(ep_size, ExpertParallelGroups) else init_expert_parallel_groups(ep_size, node_size)
    for module in experts:  # every layer is checked before any is changed
        check_layout(groups.world_size, groups.ep_size, module.num_experts, groups.node_size)
    for module in experts:
        local = module.num_experts // groups.ep_size
        start = groups.ep_rank * local
        built_sliced = module.num_local_experts != module.num_experts  # by ds_optimus.parallel.build_model
        if built_sliced and (module.num_local_experts, module.expert_offset) != (local, start):
            raise ValueError(
                f"apply_expert_parallel: the model was built holding experts {module.expert_offset}.."
                f"{module.expert_offset + module.num_local_experts - 1}, but EP rank {groups.ep_rank} of "
                f"{groups.ep_size} holds {start}..{start + local - 1}"
            )
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            if built_sliced:  # already this rank's rows: kept as they are
                shard = full
            else:
                shard = nn.Parameter(full.detach()[start : start + local].clone(), requires_grad=full.requires_grad)
            shard.allreduce = False  # deepspeed.moe.utils.is_moe_param
            shard.group_name = groups.name  # DeepSpeed's name for the EDP group of this EP size
            setattr(module, name, shard)
        module.num_local_experts = local
        module.expert_offset = start
        module.expert_groups = groups
        # EP size 1 keeps every expert: nothing to exchange.
        module.expert_parallel = _dispatcher(module, groups, dedup, chunks, dispatch) if groups.ep_size > 1 else None
    _use_ds_optimus_experts(model)
    return groups


def _check_exchange(dedup, chunks, dispatch="alltoall", hierarchical=False) -> None:
    if dedup not in (True, False, "auto") or not isinstance(dedup, (bool, str)):
        raise ValueError(f'apply_expert_parallel: dedup must be True, False or "auto", got {dedup!r}')
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"apply_expert_parallel: chunks must be a positive integer, got {chunks!r}")
    if chunks > 1 and dedup is False:
        raise ValueError(
            f"apply_expert_parallel: chunks {chunks} overlaps the deduplicated exchange, which dedup=False turns off"
        )
    if dispatch not in DISPATCHES:
        raise ValueError(f'apply_expert_parallel: dispatch must be "alltoall" or "allgather", got {dispatch!r}')
    wrong = [
        what
        for what, bad in (
            ("dedup=True", dedup is True),
            (f"chunks={chunks}", chunks > 1),
            ("a hierarchical node_size", hierarchical),
        )
        if bad
    ]
    if dispatch == "allgather" and wrong:
        raise ValueError(
            'apply_expert_parallel: dispatch="allgather" is a flat exchange in one chunk without '
            f"dedup; it does not take {' and '.join(wrong)}"
        )


def _dispatcher(
    module: nn.Module, groups: ExpertParallelGroups, dedup: bool | str, chunks: int, dispatch: str = "alltoall"
):
    if dispatch == "allgather":  # "auto" dedup means none here
        return AllGatherDispatcher(groups, module.num_local_experts)
    if dedup == "auto":
        # overlap (chunks > 1) needs the deduplicated exchange; else the one expected to send fewer
        # bytes, between nodes when the exchange is hierarchical (where the bytes cost most)
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        size = module.down_proj.element_size()
        destinations = groups.ep_size // groups.node_size if groups.hierarchical else groups.ep_size
        dedup = (
            chunks > 1
            or top_k is None
            or dedup_sends_fewer_bytes(
                module.num_experts, top_k, destinations, row_bytes=module.down_proj.shape[1] * size, weight_bytes=size
            )
        )
    if dedup:
        return dedup_dispatcher(groups, module.num_local_experts, chunks)
    return ExpertParallelDispatcher(groups, module.num_local_experts)


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules of `model` that `apply_expert_parallel` has sharded."""
    return [m for m in experts_modules(model) if m.expert_groups is not None]


def expert_layouts(model: nn.Module) -> list[ExpertParallelGroups]:
    """The distinct expert-parallel layouts `model`'s experts modules declare (empty without EP)."""
    layouts: list[ExpertParallelGroups] = []
    for module in expert_parallel_modules(model):
        if not any(module.expert_groups is known for known in layouts):
            layouts.append(module.expert_groups)
    return layouts


def expert_groups_of(model: nn.Module) -> ExpertParallelGroups | None:
    """The layout `apply_expert_parallel` gave `model` (on this rank), or None if it has none."""
    layouts = expert_layouts(model)
    return layouts[0] if layouts else None


def full_state_dict(model: nn.Module, groups: ExpertParallelGroups) -> dict[str, torch.Tensor]:
    """The state dict with every expert weight gathered whole ([E, ...]) on every EP rank."""
    state = model.state_dict()
    sharded = [name for name, p in model.named_parameters() if is_expert_param(p)]  # same order on every rank
    for name in sharded:
        local = state[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(groups.ep_size)]
        dist.all_gather(parts, local, group=groups.ep_group)
        state[name] = torch.cat(parts)
    return state


def gather_experts(model: nn.Module, groups: ExpertParallelGroups, dst: int) -> dict[str, torch.Tensor] | None:
    """Like `full_state_dict`, but on the host of global rank `dst` alone, one weight at a time; None elsewhere."""
    state, rank = model.state_dict(), dist.get_rank()
    for name in [n for n, p in model.named_parameters() if is_expert_param(p)]:  # same order on every rank
        local = state[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(groups.ep_size)] if rank == dst else None
        dist.gather(
            wire(local, groups.ep_group),
            [wire(p, groups.ep_group) for p in parts] if parts else None,
            dst=dst,
            group=groups.ep_group,
        )
        if parts is not None:
            state[name] = torch.cat(parts).cpu()
            del parts
    return state if rank == dst else None


def readable_as_umask(paths) -> None:
    """Give `paths` the permissions the umask gives new files (safetensors writes them owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


def export_pretrained(
    model: nn.Module,
    folder: str | os.PathLike,
    groups: ExpertParallelGroups | None = None,
    tokenizer=None,
    *,
    model_card: str | None = None,
    generation_config=None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write `model` with every expert, `tokenizer`, `model_card` (README.md) and `generation_config` as a Hugging
    Face folder; collective: rank 0 writes, all return once it is complete. A `state_dict` given is written instead
    (empty: no weights)."""
    groups = groups if groups is not None else expert_groups_of(model)
    distributed = dist.is_available() and dist.is_initialized()
    gather = state_dict is None and groups is not None and groups.ep_size > 1 and groups.pipeline is None
    # the experts joined on rank 0 alone, by rank 0's EP group alone
    full = gather_experts(model, groups, 0) if gather and 0 in groups.ep_ranks else state_dict
    if not distributed or dist.get_rank() == 0:
        # An earlier export's weights (one file, or shards and their index) would be loaded instead of these.
        for stale in glob.glob(os.path.join(glob.escape(os.fspath(folder)), "model*.safetensors*")):
            os.remove(stale)
        if full is None:
            model.save_pretrained(folder, is_main_process=True)
        else:
            model.save_pretrained(folder, state_dict=full, is_main_process=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            # Transformers 5 names its generic fast tokenizer "TokenizersBackend" in tokenizer_config.json,
            # a name earlier versions and other readers of the file do not know; all know it by its older name.
            path = os.path.join(folder, "tokenizer_config.json")
            saved = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    saved = json.load(f)
            if saved.get("tokenizer_class") == "TokenizersBackend":
                with open(path, "w", encoding="utf-8") as f:
                    json.dump({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2, sort_keys=True)
        if generation_config is not None:
            generation_config.save_pretrained(folder)
        readable_as_umask(glob.glob(os.path.join(glob.escape(os.fspath(folder)), "model*.safetensors")))
        if model_card is not None:
            with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
                f.write(model_card)
    if distributed:
        dist.barrier()  # the folder is complete when any rank returns


def setup_moe(model: nn.Module, config, groups: ExpertParallelGroups | None = None) -> ExpertParallelGroups | None:
    """Apply a parsed `optimus` section's MoE settings (experts backend, uniform routing, expert parallelism over
    `groups` if given); returns the EP groups or None."""
    if not (hasattr(config, "moe") and hasattr(config, "expert_parallel")):
        raise TypeError(
            f"setup_moe takes a parsed optimus section, not {type(config).__name__}: "
            "setup_moe(model, ds_optimus.config.OptimusConfig.from_ds_config(ds_config))"
        )
    backend = None if config.moe.experts_backend == "auto" else config.moe.experts_backend
    for module in experts_modules(model):
        module.experts_backend = backend
    _use_ds_optimus_experts(model)
    ep = config.expert_parallel
    applied = None
    if ep.size > 1:
        layout = groups if groups is not None else ep.size
        applied = apply_expert_parallel(
            model, layout, node_size=ep.node_size, dedup=ep.dedup, chunks=ep.chunks, dispatch=ep.dispatch
        )
    set_uniform_routing(model, getattr(config.moe, "force_uniform_routing", False))
    return applied


def set_uniform_routing(model: nn.Module, enabled: bool) -> None:
    """Turn uniform routing (a benchmark mode) on or off in every router, at its rank's EP place."""
    routers = [m for m in model.modules() if hasattr(m, "force_uniform_routing")]  # Mula's routers declare it
    if enabled and experts_modules(model) and not routers:
        raise ValueError(
            "optimus.moe.force_uniform_routing needs Mula's router (MulaTopKRouter); "
            f"{type(model).__name__} routes with another"
        )
    groups = expert_groups_of(model)  # an earlier setup_moe's too: a later one with no EP section keeps it
    for router in routers:
        router.force_uniform_routing = enabled
        router.uniform_routing_rank = groups.ep_rank if groups is not None else 0


def _use_ds_optimus_experts(model: nn.Module) -> None:
    register_experts_implementation()
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_experts_implementation", None) == IMPLEMENTATION_NAME:
        return
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION_NAME)
    else:
        config._experts_implementation = IMPLEMENTATION_NAME


def moe_param_groups(
    model: nn.Module, weight_decay: float = 0.0, *, decay_all: bool = False, **options: Any
) -> list[dict[str, Any]]:
    """DeepSpeed-MoE param groups: "dense", "dense_no_decay" (1-D, unless `decay_all`) and one `moe=True` group per
    EP layout; `options` go into each."""
    dense, no_decay, experts = [], [], {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if is_expert_param(param):
            experts.setdefault(param.group_name, []).append(param)
        elif param.ndim < 2 and not decay_all:
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

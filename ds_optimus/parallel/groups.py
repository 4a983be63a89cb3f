"""Process groups for tensor (TP), data (DP), expert (EP) and expert-data (EDP) parallelism.

DeepSpeed's layout: EP groups are runs of P consecutive ranks, EDP groups {i, i+P, ...}. TP groups are
innermost; EP/DP groups are made inside each pipeline stage over the ranks of one TP position. The
DeepSpeed engine hook registers these layouts under DeepSpeed's names (``ep_size_{P}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .dims import LayoutError, check_layout  # noqa: F401  (the layout's checks, torch-free, for the planner too)


@dataclass
class ExpertParallelGroups:
    """This rank's view of the DP/EP/EDP layout; groups are torch.distributed process groups."""

    world_size: int
    rank: int
    ep_size: int
    ep_rank: int
    ep_ranks: list[int]
    ep_group: object
    edp_ranks: list[int]
    edp_group: object
    dp_group: object
    node_size: int | None = None
    intra_node_group: object = None
    inter_node_group: object = None
    pipeline: PipelineGroups | None = None  # the pipeline layout these groups live in, with stages
    tensor: TensorParallelGroups | None = None  # the tensor-parallel layout, with T > 1
    dp_ranks: list[int] = field(default_factory=list)  # the data-parallel group's ranks
    # with T > 1: the ranks holding this rank's experts at every TP position (the EDP groups of the T
    # positions joined), over which sequence parallelism reduces the experts' gradients
    edp_tp_group: object = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = f"ep_size_{self.ep_size}"  # DeepSpeed's group name for this EP size

    def __deepcopy__(self, memo) -> ExpertParallelGroups:
        return self  # handles of process groups: a copied model shares its original's layout

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)

    @property
    def tp_size(self) -> int:
        return self.tensor.size if self.tensor is not None else 1

    @property
    def hierarchical(self) -> bool:
        return self.node_size is not None and 1 < self.node_size < self.ep_size


@dataclass
class TensorParallelGroups:
    """This rank's tensor-parallel group: `size` consecutive ranks (`ranks`), this rank `rank` of them."""

    size: int
    rank: int
    ranks: list[int]
    group: object

    def __deepcopy__(self, memo) -> TensorParallelGroups:
        return self


_TENSOR: dict[int, TensorParallelGroups] = {}


def init_tensor_parallel_groups(size: int) -> TensorParallelGroups:
    """This rank's tensor-parallel group of `size` consecutive ranks (made once). Collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs torch.distributed to be initialised first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
        raise LayoutError(f"tensor parallel size {size!r} does not divide the world size {world}")
    if size not in _TENSOR:
        mine = None
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks) if size > 1 else None  # collective over the world
            if rank in ranks:
                mine = TensorParallelGroups(size, rank - start, ranks, group)
        _TENSOR[size] = mine
    return _TENSOR[size]


def init_layout_groups(dims) -> ExpertParallelGroups | None:
    """Every process group of `ParallelDims` `dims`; None for plain data parallelism. Collective."""
    if dims.tp == dims.pp == dims.ep == 1:
        return None
    return init_expert_parallel_groups(dims.ep, dims.node_size, dims.pp, dims.tp)


@dataclass
class PipelineGroups:
    """This rank's pipeline layout: stage s on ranks [s*D, (s+1)*D), D = world / `size`. `group`: one
    pipeline (the same place in every stage); `stage_group`: this rank's stage."""

    size: int
    stage: int
    ranks: list[int]
    group: object
    stage_ranks: list[int]
    stage_group: object

    def __deepcopy__(self, memo) -> PipelineGroups:
        return self


_PIPELINES: dict[int, PipelineGroups] = {}


def init_pipeline_groups(size: int) -> PipelineGroups:
    """This rank's pipeline and stage groups for `size` stages (made once). Collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pipeline parallelism needs torch.distributed to be initialised first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(size, int) or size < 1 or world % size:
        raise LayoutError(f"pipeline parallel size {size!r} does not divide the world size {world}")
    if size in _PIPELINES:
        return _PIPELINES[size]
    per_stage = world // size
    mine: dict[str, tuple[list[int], object]] = {}
    for offset in range(per_stage):
        ranks = list(range(offset, world, per_stage))
        group = dist.new_group(ranks) if size > 1 else None  # one stage: nothing to send
        if rank in ranks:
            mine["pipeline"] = (ranks, group)
    for stage in range(size):
        ranks = list(range(stage * per_stage, (stage + 1) * per_stage))
        group = dist.new_group(ranks) if size > 1 else dist.group.WORLD
        if rank in ranks:
            mine["stage"] = (ranks, group)
    (ranks, group), (stage_ranks, stage_group) = mine["pipeline"], mine["stage"]
    _PIPELINES[size] = PipelineGroups(size, rank // per_stage, ranks, group, stage_ranks, stage_group)
    return _PIPELINES[size]


_CACHE: dict[tuple[int, int | None, int, int], ExpertParallelGroups] = {}


def init_expert_parallel_groups(
    ep_size: int, node_size: int | None = None, pipeline_size: int | None = None, tensor_size: int | None = None
) -> ExpertParallelGroups:
    """This rank's EP/EDP groups of `ep_size` (made once per layout), inside each pipeline stage and TP
    position; `pipeline_size`/`tensor_size` None: the layouts made already. Collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed to be initialised first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if pipeline_size is None:
        pipeline_size = max((size for size in _PIPELINES), default=1)
    if tensor_size is None:
        tensor_size = max((size for size in _TENSOR), default=1)
    pipeline = init_pipeline_groups(pipeline_size)
    tensor = init_tensor_parallel_groups(tensor_size)
    key = (ep_size, node_size, pipeline_size, tensor_size)
    if key in _CACHE:
        return _CACHE[key]
    per_stage = world // pipeline_size
    if per_stage % tensor_size:
        raise LayoutError(
            f"tensor parallel size {tensor_size} does not divide the {per_stage} ranks of each of the "
            f"{pipeline_size} pipeline stages"
        )
    check_layout(per_stage // tensor_size, ep_size, node_size=node_size, stages=pipeline_size)

    mine: dict[str, tuple[list[int], object]] = {}

    def new_group(kind: str, ranks: list[int]) -> None:
        group = dist.new_group(ranks)  # collective over the world: every rank creates every group
        if rank in ranks:
            mine[kind] = (ranks, group)

    # the data-parallel ranks of each stage and TP position; with one TP rank, the stage's ranks
    runs = [
        list(range(base + t, base + per_stage, tensor_size))
        for base in range(0, world, per_stage)
        for t in range(tensor_size)
    ]
    for ranks in runs:
        if tensor_size > 1:
            new_group("dp", ranks)
        elif rank in ranks:
            mine["dp"] = (ranks, pipeline.stage_group)
        for start in range(0, len(ranks), ep_size):
            new_group("ep", ranks[start : start + ep_size])
        for i in range(ep_size):
            new_group("edp", ranks[i::ep_size])
        if node_size is not None and 1 < node_size < ep_size:
            for start in range(0, len(ranks), node_size):
                new_group("intra", ranks[start : start + node_size])
            for ep_start in range(0, len(ranks), ep_size):
                for local in range(node_size):
                    new_group("inter", ranks[ep_start + local : ep_start + ep_size : node_size])
    if tensor_size > 1:  # the same experts at every TP position of a stage
        for first in range(0, len(runs), tensor_size):
            for i in range(ep_size):
                new_group("edp_tp", sorted(r for run in runs[first : first + tensor_size] for r in run[i::ep_size]))

    ep_ranks, ep_group = mine["ep"]
    edp_ranks, edp_group = mine["edp"]
    dp_ranks, dp_group = mine["dp"]
    groups = ExpertParallelGroups(
        world_size=len(dp_ranks),
        rank=rank,
        ep_size=ep_size,
        ep_rank=ep_ranks.index(rank),
        ep_ranks=ep_ranks,
        ep_group=ep_group,
        edp_ranks=edp_ranks,
        edp_group=edp_group,
        dp_group=dp_group,
        node_size=node_size,
        intra_node_group=mine.get("intra", (None, None))[1],
        inter_node_group=mine.get("inter", (None, None))[1],
        pipeline=pipeline if pipeline_size > 1 else None,
        tensor=tensor if tensor_size > 1 else None,
        dp_ranks=dp_ranks,
        edp_tp_group=mine.get("edp_tp", (None, None))[1],
    )
    _CACHE[key] = groups
    return groups


def destroy_expert_parallel_groups() -> None:
    """Forget the cached layouts (call before `dist.destroy_process_group`)."""
    _CACHE.clear()
    _PIPELINES.clear()
    _TENSOR.clear()
    _SHARD_GROUPS.clear()


_SHARD_GROUPS: dict[tuple, dict[str, tuple[object, object]]] = {}


def hybrid_shard_groups(groups: dict[str, object], size: int | None) -> dict[str, tuple[object, object]]:
    """(shard group, replica group) of each of `groups` (by kind) under hybrid sharding: runs of `size`
    ranks, and the ranks at one place of every run (None if the group is no larger).
    Collective over the world: every rank passes the same `size` and kinds."""
    if size is None:
        return {kind: (group, None) for kind, group in groups.items()}
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise LayoutError(f"shard group size must be a positive integer, got {size!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {}
    for kind, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        mine[kind] = (ranks[0], len(ranks), ranks.index(rank))
    places: list = [None] * world
    dist.all_gather_object(places, sorted(mine.items()))
    # every group of every kind: {(kind, first rank): [members by index]}
    members: dict[tuple[str, int], list[int]] = {}
    for r, held in enumerate(places):
        for kind, (first, count, index) in held:
            members.setdefault((kind, first), [None] * count)[index] = r
    for (kind, _), ranks in sorted(members.items()):  # checked on every rank alike, even one without the kind
        if len(ranks) > size and len(ranks) % size:
            raise LayoutError(
                f"shard group size {size} does not divide the {len(ranks)} ranks of the "
                f"{'data' if kind == 'dense' else 'expert-data'}-parallel group ({kind})"
            )
    key = (size, tuple(tuple(p) for p in places))
    if key in _SHARD_GROUPS:
        return {
            kind: (shard if shard is not None else groups[kind], replica)
            for kind, (shard, replica) in _SHARD_GROUPS[key].items()
            if kind in groups
        }
    made: dict[str, list] = {kind: [None, None] for kind in groups}  # None: the group itself
    for (kind, _), ranks in sorted(members.items()):
        if len(ranks) <= size:
            continue  # one shard group: the group itself
        runs = [ranks[i : i + size] for i in range(0, len(ranks), size)]
        for run in runs:
            group = dist.new_group(run)  # collective over the world: every rank makes every group
            if rank in run and kind in made:
                made[kind][0] = group
        for place in range(size):
            across = [run[place] for run in runs]
            group = dist.new_group(across)
            if rank in across and kind in made:
                made[kind][1] = group
    _SHARD_GROUPS[key] = {kind: (shard, replica) for kind, (shard, replica) in made.items()}
    return {kind: (shard if shard is not None else groups[kind], replica) for kind, (shard, replica) in made.items()}


class EngineParallelism:
    """DeepSpeed's model-parallel unit (`deepspeed.initialize(mpu=...)`) for `ExpertParallelGroups`:
    data parallelism is the DP group, model parallelism the TP group."""

    def __init__(self, groups: ExpertParallelGroups, sequence_parallel: bool = False) -> None:
        self.groups, self.pipeline, self.tensor = groups, groups.pipeline, groups.tensor
        # with sequence parallelism a replicated weight's gradient is part of the whole on each TP rank: it is
        # reduced over the stage's ranks (every TP position's data-parallel ranks)
        stage = groups.pipeline.stage_group if groups.pipeline is not None else dist.group.WORLD
        self.replicated_group = stage if sequence_parallel else None

    def get_data_parallel_group(self):
        return self.groups.dp_group

    def get_data_parallel_world_size(self) -> int:
        return len(self.groups.dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return self.groups.tp_size

    def get_model_parallel_rank(self) -> int:
        return self.tensor.rank if self.tensor is not None else 0

    def get_model_parallel_group(self):
        return self.tensor.group if self.tensor is not None else None

    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipeline.size if self.pipeline is not None else 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pipeline.stage if self.pipeline is not None else 0

    def get_pipeline_model_parallel_group(self):
        return self.pipeline.group if self.pipeline is not None else None

"""Rank layout arithmetic. Outermost first: pipeline stages, data parallelism (EP groups: consecutive DP ranks),
tensor parallelism (consecutive ranks in a node).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import ConfigError


class LayoutError(ValueError):
    """An impossible parallel layout."""


def check_layout(
    world_size: int, ep_size: int, num_experts: int | None = None, node_size: int | None = None, stages: int = 1
) -> None:
    """A one-line `LayoutError` unless the sizes fit (`world_size`: one stage's ranks)."""
    if not isinstance(ep_size, int) or ep_size < 1:
        raise LayoutError(f"expert parallel size must be a positive integer, got {ep_size!r}")
    if world_size % ep_size:
        where = (
            f"the {world_size} ranks of each of the {stages} pipeline stages"
            if stages > 1
            else f"the world size {world_size}"
        )
        raise LayoutError(f"expert parallel size {ep_size} does not divide {where}")
    if num_experts is not None and num_experts % ep_size:
        raise LayoutError(f"expert parallel size {ep_size} does not divide the number of experts {num_experts}")
    if node_size is not None:
        if not isinstance(node_size, int) or node_size < 1:
            raise LayoutError(f"node size must be a positive integer, got {node_size!r}")
        if ep_size % node_size:
            raise LayoutError(f"node size {node_size} does not divide the expert parallel size {ep_size}")


@dataclass(frozen=True)
class RankPosition:
    """Where one rank sits."""

    stage: int
    tp_rank: int
    dp_rank: int
    ep_rank: int


@dataclass(frozen=True)
class ParallelDims:
    """A layout's sizes; `dp` and `edp` follow."""

    world: int
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel size
    ep: int = 1  # expert-parallel size (inside each stage's data-parallel ranks)
    sp: bool = False  # the sequence cut over each TP group between the split blocks
    node_size: int | None = None  # ranks of an EP group per node (the hierarchical exchange)

    @classmethod
    def from_config(cls, opt, world: int) -> ParallelDims:
        """The layout `opt` asks of `world` ranks, or a one-line ConfigError."""
        size, tensor = opt.pipeline_parallel.size, opt.tensor_parallel.size
        if world % size:
            raise ConfigError(f"optimus.pipeline_parallel.size {size} does not divide the {world} ranks")
        if (world // size) % tensor:
            where = f"the {world // size} ranks of each pipeline stage" if size > 1 else f"the {world} ranks"
            raise ConfigError(f"optimus.tensor_parallel.size {tensor} does not divide {where}")
        if tensor > 1 and not opt.sharded_optimizer.enabled:
            raise ConfigError(
                "optimus.tensor_parallel needs optimus.sharded_optimizer.enabled true (it shards the "
                "optimizer over each TP rank's data-parallel ranks and counts split weights in the norm)"
            )
        sequence = opt.tensor_parallel.sequence_parallel
        if sequence and opt.data.seq_len % tensor:
            raise ConfigError(
                f"optimus.data.seq_len {opt.data.seq_len} does not divide over the {tensor} ranks of a "
                "tensor-parallel group (optimus.tensor_parallel.sequence_parallel)"
            )
        ep = opt.expert_parallel
        return cls(world, size, tensor, ep.size, bool(sequence), ep.node_size)

    @property
    def dp(self) -> int:
        """Ranks of one stage at one TP position."""
        return self.world // (self.pp * self.tp)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts in one stage and TP position."""
        return self.dp // self.ep

    def check_experts(self, num_experts: int) -> None:
        """A one-line error unless the EP size fits the DP ranks and the experts."""
        if num_experts:
            check_layout(self.dp, self.ep, num_experts, self.node_size, stages=self.pp)
        elif self.ep > 1:
            raise ConfigError(
                "optimus.expert_parallel.size > 1 needs an MoE model (num_experts > 0); this one is "
                "dense: set optimus.expert_parallel.size=1"
            )

    def position(self, rank: int) -> RankPosition:
        """Where global `rank` sits (no process groups made)."""
        per_stage = self.world // self.pp
        dp_rank = (rank % per_stage) // self.tp
        return RankPosition(rank // per_stage, rank % self.tp, dp_rank, dp_rank % self.ep)

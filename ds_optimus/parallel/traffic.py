"""Exchange traffic: expected rows per token (uniform routing, the planner's model) and bytes counted at the
collective.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from functools import lru_cache
from math import comb
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner imports this module's formulas without PyTorch
    import torch


def group_hit_probability(num_experts: int, top_k: int, experts_per_group: int) -> float:
    """Chance that a token's `top_k` experts hit a group of `experts_per_group` (uniform routing)."""
    if experts_per_group >= num_experts:
        return 1.0
    return 1.0 - comb(num_experts - experts_per_group, top_k) / comb(num_experts, top_k)


@lru_cache(maxsize=4096)  # the planner asks for the same few (experts, top-k, groups) for every layout
def expected_groups_hit(num_experts: int, top_k: int, groups: int) -> float:
    """Rows per token a deduplicated exchange sends to `groups` ranks."""
    return groups * group_hit_probability(num_experts, top_k, num_experts // groups)


def metadata_bytes(top_k: int, weight_bytes: int) -> int:
    """Bytes of slot ids (int16) and weights per deduplicated row."""
    return top_k * (2 + weight_bytes)


def dedup_sends_fewer_bytes(
    num_experts: int, top_k: int, destinations: int, row_bytes: int, weight_bytes: int = 4
) -> bool:
    """Whether deduplication should send fewer bytes to `destinations` groups."""
    dedup = expected_groups_hit(num_experts, top_k, destinations) * (row_bytes + metadata_bytes(top_k, weight_bytes))
    return dedup < top_k * row_bytes


def exchange_bytes_per_token(dispatch: str, ep_size: int, top_k: int, row_bytes: float) -> float:
    """Hidden-row bytes moved per token held, in one forward pass (uniform routing)."""
    if dispatch == "allgather":
        return 2 * (ep_size - 1) * row_bytes
    return 2 * top_k * (ep_size - 1) / ep_size * row_bytes


def allgather_sends_fewer_bytes(top_k: int, ep_size: int) -> bool:
    """Whether the all-gather exchange sends fewer bytes than the per-slot all-to-all."""
    return 1 < ep_size < top_k


class ExchangeTraffic(contextlib.AbstractContextManager):
    """Counts bytes this rank's `all_to_all_single` calls send to other ranks while active."""

    def __init__(self) -> None:
        self.by_peer: dict[int, int] = defaultdict(int)
        self.records: list[tuple[int, dict[int, int]]] = []  # (bytes per row, rows per other rank) per call
        self.calls = 0
        self._original = None

    def __enter__(self) -> ExchangeTraffic:
        import torch.distributed as dist

        self._original = original = dist.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            self._count(input, input_split_sizes, group)
            return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._original

    def _count(self, tensor: torch.Tensor, splits, group) -> None:
        import torch.distributed as dist

        self.calls += 1
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        rows = tensor.shape[0] if tensor.dim() else 1
        splits = list(splits) if splits else [rows // len(ranks)] * len(ranks)
        row_bytes = tensor.numel() // max(rows, 1) * tensor.element_size() if rows else 0
        me = dist.get_rank()
        rows_to = {peer: n for peer, n in zip(ranks, splits, strict=True) if peer != me}
        for peer, n in rows_to.items():
            self.by_peer[peer] += n * row_bytes
        self.records.append((row_bytes, rows_to))

    @property
    def sent(self) -> int:
        """Bytes sent to other ranks."""
        return sum(self.by_peer.values())

    def rows(self, row_bytes: int, node_size: int | None = None) -> int:
        """Rows of `row_bytes` bytes sent to other ranks (or nodes, with `node_size`)."""
        import torch.distributed as dist

        me = dist.get_rank() // node_size if node_size else None
        return sum(
            n
            for size, rows_to in self.records
            if size == row_bytes
            for peer, n in rows_to.items()
            if node_size is None or peer // node_size != me
        )

    def inter_node(self, node_size: int) -> int:
        """Bytes sent to other nodes of `node_size` ranks."""
        import torch.distributed as dist

        me = dist.get_rank() // node_size
        return sum(n for peer, n in self.by_peer.items() if peer // node_size != me)

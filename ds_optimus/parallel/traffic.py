"""What an expert-parallel exchange sends: expected rows per token (the model the planner and the
`dedup: "auto"` choice use) and exact bytes counted at the collective (`ExchangeTraffic`, for
benchmarks and tests).

With uniform routing a token's `top_k` distinct experts are a uniform draw without replacement from
the `num_experts`; a group of `g` experts (one rank's, or one node's) is hit unless all `top_k`
miss it, which happens with probability C(E - g, k) / C(E, k). The per-slot exchange sends `top_k`
rows per token; the deduplicated one sends one row per group hit.
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
    """Probability that a token's `top_k` distinct experts include at least one of a group of
    `experts_per_group` (uniform routing)."""
    if experts_per_group >= num_experts:
        return 1.0
    return 1.0 - comb(num_experts - experts_per_group, top_k) / comb(num_experts, top_k)


@lru_cache(maxsize=4096)  # the planner asks for the same few (experts, top-k, groups) for every layout
def expected_groups_hit(num_experts: int, top_k: int, groups: int) -> float:
    """Expected number of distinct groups (of `num_experts / groups` experts each) a token's
    `top_k` experts fall in: the rows per token a deduplicated exchange sends to `groups` ranks."""
    return groups * group_hit_probability(num_experts, top_k, num_experts // groups)


def metadata_bytes(top_k: int, weight_bytes: int) -> int:
    """Bytes travelling with each deduplicated row: the slots' expert ids (int16) and weights."""
    return top_k * (2 + weight_bytes)


def dedup_sends_fewer_bytes(
    num_experts: int, top_k: int, destinations: int, row_bytes: int, weight_bytes: int = 4
) -> bool:
    """Whether the deduplicated exchange is expected to send fewer bytes than the per-slot one to
    `destinations` equal groups of experts (ranks; nodes for the hierarchical exchange's inter-node hop)."""
    dedup = expected_groups_hit(num_experts, top_k, destinations) * (row_bytes + metadata_bytes(top_k, weight_bytes))
    return dedup < top_k * row_bytes


def exchange_bytes_per_token(dispatch: str, ep_size: int, top_k: int, row_bytes: float) -> float:
    """Bytes of hidden rows a rank moves to and from other ranks per token it holds, in one forward
    pass (the backward pass moves as many): "allgather" gathers every token to the other ep_size - 1
    ranks and reduce-scatters as many partial rows back, whatever `top_k`; the per-slot "alltoall"
    sends `top_k` rows, (ep_size - 1) / ep_size of them to other ranks with uniform routing, and
    gets them back. Routing metadata (ids, weights, counts) is not counted."""
    if dispatch == "allgather":
        return 2 * (ep_size - 1) * row_bytes
    return 2 * top_k * (ep_size - 1) / ep_size * row_bytes


def allgather_sends_fewer_bytes(top_k: int, ep_size: int) -> bool:
    """Whether the all-gather exchange sends fewer bytes than the per-slot all-to-all: (P-1) rows
    against k (P-1)/P per token, i.e. exactly when the EP size P is below top-k."""
    return 1 < ep_size < top_k


class ExchangeTraffic(contextlib.AbstractContextManager):
    """Counts, exactly, the bytes this rank's all-to-alls send to other ranks while active.

    Wraps `torch.distributed.all_to_all_single` (which ds_optimus' dispatchers and DeepSpeed's MoE
    layer both call), so every implementation is counted at the same place. `by_peer` maps global
    ranks to bytes; `inter_node(node_size)` sums what went to ranks of other nodes of that size.
    Rows a rank sends to itself are not counted: they do not leave it."""

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
        """Rows of `row_bytes` bytes (e.g. hidden states) sent to other ranks, or, with `node_size`,
        to ranks of other nodes."""
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
        """Bytes sent to ranks of other nodes, nodes being consecutive runs of `node_size` ranks."""
        import torch.distributed as dist

        me = dist.get_rank() // node_size
        return sum(n for peer, n in self.by_peer.items() if peer // node_size != me)

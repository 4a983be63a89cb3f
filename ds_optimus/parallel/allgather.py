"""The all-gather expert-parallel exchange (`dispatch: "allgather"`, EP inside one node): all-gather tokens and
routing, run the local experts, reduce-scatter the partial outputs. No variable-size all-to-all (reported to fail on
Intel's collective library); fewer bytes than the per-slot all-to-all exactly when EP size < top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import collective as _collective
from .dedup import _at_least, _Collect, _id_dtype, _Plan, _Spread, at_experts, pack, unpack
from .dispatch import wire
from .groups import ExpertParallelGroups


def reduce_dtype(x: torch.Tensor, group) -> torch.dtype:
    """What a reduce-scatter of `x` adds in: float32 for half types on gloo, else `x.dtype`."""
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return torch.float32
    return x.dtype


def all_gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Every rank's rows `x` (equal counts), in rank order."""
    x = x.contiguous()
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    _collective("all_gather")(wire(out, group), wire(x, group), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group, size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's rows of `x` summed over the group, as `dtype`."""
    src = x.to(reduce_dtype(x, group)).contiguous()
    out = src.new_empty(x.shape[0] // size, *x.shape[1:])
    _collective("reduce_scatter")(out, src, group=group)
    return out.to(dtype or x.dtype)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int):
        ctx.group, ctx.size = group, size
        return all_gather_rows(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_rows(grad, ctx.group, ctx.size), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, dtype: torch.dtype):
        ctx.group, ctx.size, ctx.dtype = group, size, x.dtype
        return reduce_scatter_rows(x, group, size, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_rows(grad, ctx.group, ctx.size).to(ctx.dtype), None, None, None


class _GatherRouting(torch.autograd.Function):
    """Every rank's routing weights and ids, in one message."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, ids: torch.Tensor, group, size: int):
        ctx.group, ctx.size = group, size
        gathered, gathered_ids = unpack(all_gather_rows(pack(weights, ids), group, size), weights.dtype, ids.dtype)
        ctx.mark_non_differentiable(gathered_ids)
        return gathered, gathered_ids

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _):
        return reduce_scatter_rows(grad, ctx.group, ctx.size), None, None, None


class AllGatherDispatcher:
    """Runs a layer's experts over a flat EP group by all-gather and reduce-scatter."""

    # Takes whole tokens with their routing, as `DedupDispatcher` does (the experts implementation's
    # token interface), not per-slot rows sorted by expert.
    deduplicated = True

    def __init__(self, groups: ExpertParallelGroups, num_local_experts: int) -> None:
        if groups.hierarchical:
            raise ValueError(
                "the all-gather exchange runs inside one node: it has no hierarchical form "
                f"(node_size {groups.node_size} of EP size {groups.ep_size})"
            )
        self.groups, self.num_local_experts = groups, num_local_experts

    @torch.compiler.disable  # sizes are read on the host: a traced exchange would recompile per batch
    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: Callable[..., torch.Tensor],
        params: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H]; ids -1 are dropped slots."""
        g, el = self.groups, self.num_local_experts
        tokens = x.shape[0]
        plan, most = self._plan(ids)
        if most == 0:  # no rank has tokens: nothing to gather
            return x.new_zeros(x.shape)
        pad = most - tokens
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), -1)])
            weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
        x_all = _AllGather.apply(x, g.ep_group, g.ep_size)
        w_all, ids_all = _GatherRouting.apply(weights, ids.to(_id_dtype(g.ep_size * el)), g.ep_group, g.ep_size)
        first = g.ep_rank * el
        local = torch.where((ids_all >= first) & (ids_all < first + el), ids_all - first, -1)
        m, index = at_experts(local, plan, el)
        y = experts(_Spread.apply(x_all, m), plan.counts, *params)
        y = y.to(reduce_dtype(y, g.ep_group))  # float32 partial sums where the reduction is in float32
        partial = _Collect.apply(y, w_all.reshape(-1).index_select(0, index), m)
        return _ReduceScatter.apply(partial, g.ep_group, g.ep_size, x.dtype)[:tokens]

    def _plan(self, ids: torch.Tensor) -> tuple[_Plan, int]:
        """Every rank's token and slot counts in one all-gather: this rank's `_Plan`, the largest token count."""
        g, el = self.groups, self.num_local_experts
        ep, me = g.ep_size, g.ep_rank
        tokens, k = ids.shape
        depth = min(k, el)
        rank_of = torch.where(ids >= 0, torch.div(ids, el, rounding_mode="floor"), ep)
        slots = torch.zeros(tokens, ep + 1, dtype=torch.long, device=ids.device)
        slots = slots.scatter_add_(1, rank_of, torch.ones_like(rank_of))[:, :ep]  # [T, ranks]
        per_expert = torch.zeros(ep * el + 1, dtype=torch.long, device=ids.device).scatter_add_(
            0, torch.where(ids >= 0, ids, ep * el).reshape(-1), torch.ones_like(ids).reshape(-1)
        )[:-1]
        mine = torch.cat(
            [
                torch.full((1,), tokens, dtype=torch.long, device=ids.device),
                _at_least(slots, depth).t().reshape(-1),
                per_expert,
            ]
        )
        every = all_gather_rows(mine, g.ep_group, ep).view(ep, -1)  # [source, 1 + ep * depth + ep * el]
        at_least = every[:, 1 : 1 + ep * depth].view(ep, ep, depth)[:, me].sum(0)
        counts = every[:, 1 + ep * depth :].view(ep, ep, el)[:, me].sum(0)  # rows per local expert
        sizes = torch.cat([every[:, 0], at_least, counts.sum().view(1)]).tolist()  # the one host synchronisation
        plan = _Plan(
            send=[], recv=[], at_least=[], dest_at_least=sizes[ep : ep + depth], dest_total=sizes[-1], counts=counts
        )
        return plan, max(sizes[:ep])

"""The all-gather expert-parallel exchange (`optimus.expert_parallel.dispatch: "allgather"`): the
method of Optimus, the library of the Mula runs on Aurora (EP inside one 12-tile node).

Every rank all-gathers its EP group's tokens (hidden states [T, H]) and their routing (top-k expert
ids and weights, one packed message), runs its local experts on the gathered rows routed to them
(from every rank of the group), adds each token's weighted outputs there into a partial output for
every gathered token (zero for tokens whose experts all live elsewhere), and reduce-scatters the
partial outputs, so each rank gets back the sum over the group for its own tokens. Backward: the
all-gather's backward is a reduce-scatter of the gradients, the reduce-scatter's an all-gather.
Ranks with different token counts (evaluation, a last batch) pad to the group's largest count;
padding rows carry no routing (ids -1). The counts travel in one small all-gather per layer together
with what each rank's experts will receive (rows per local expert, rows per number of local slots),
read with one host synchronisation, as the all-to-all exchanges read their split sizes. The experts
see their rows in the all-to-all's order (by expert, then source rank, then token); the sums are
gathers over rows ordered by member count, as in `dedup.py` (no atomics: the same result every run).

No variable-size all-to-all is needed (reported to fail on Intel's collective library), only the
two collectives every library tunes best. Bytes per rank with T tokens per rank, hidden size H,
EP size P and top-k k (forward; backward the same reversed): the all-gather receives (P-1)·T·H
elements (plus (P-1)·T·k ids and weights) and the reduce-scatter sends (P-1)·T·H, whatever k is.
The per-slot all-to-all sends k·T·H·(P-1)/P each way with uniform routing. The ratio is P/k: the
all-gather sends fewer bytes exactly when P < k (top-8: 4x fewer at EP 2, 2x at EP 4, equal at EP 8,
1.5x more at Optimus' EP 12). The deduplicated all-to-all never sends more than the all-gather (it
is the all-gather with every rank reached), so this exchange pays where the collectives, not the
bytes, decide: inside one fast node, with a small EP group and a large top-k; never between nodes.
Each rank holds the group's P·T gathered rows while its experts run.

Dtypes. The all-gathers are bitwise (`dispatch.wire`: bf16 over gloo travels as bytes). A reduction
cannot be bitwise, so the reduce-scatter adds in float32 where half types go through gloo (CPU): the
partial outputs are then kept in float32 (the local weighted sum accumulates in float32 anyway), so
the output is rounded once, as the per-slot all-to-all's combine rounds it, at twice the return bytes
on the one backend where they are memory copies. (An all-to-all of bf16 partial outputs and a local
sum would keep the bytes but round every partial sum once more, as the deduplicated exchange does.)
Backends that reduce half types natively (NCCL, xccl) reduce in the model's dtype, as Optimus does.
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
    """The dtype a reduce-scatter of `x` adds in: float32 for half types going through gloo (which
    cannot add them, or adds them in their own precision at every step), else `x`'s."""
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return torch.float32
    return x.dtype


def all_gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Every rank's rows `x` (the same count on each), concatenated in rank order."""
    x = x.contiguous()
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    _collective("all_gather")(wire(out, group), wire(x, group), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group, size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows `x` [size * N, ...] summed over the group's ranks; this rank's N rows, as `dtype`."""
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
    """The sum over the group, this rank's rows, cast to `dtype`; the gradient comes back by
    all-gather in that dtype (the cast of the sum loses nothing the gradient carries)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, dtype: torch.dtype):
        ctx.group, ctx.size, ctx.dtype = group, size, x.dtype
        return reduce_scatter_rows(x, group, size, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_rows(grad, ctx.group, ctx.size).to(ctx.dtype), None, None, None


class _GatherRouting(torch.autograd.Function):
    """Every rank's routing weights and expert ids in one message; the weights' gradients are
    reduce-scattered back."""

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
    """Runs a layer's experts on tokens routed across the EP group by all-gather and reduce-scatter.
    Installed by `apply_expert_parallel` (`dispatch="allgather"`); flat EP groups only."""

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
        """Experts on `x [T, H]` for expert ids `ids [T, k]` (in the EP group; -1: a dropped slot)
        with routing `weights [T, k]`: sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H].
        `experts(rows, counts, *params)` runs this rank's experts with the weights `params`."""
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
        """One small all-gather of, per rank: its token count and, for each rank of the group, how many
        of its tokens have more than j slots there (j < min(k, local experts)) and its slots per expert
        there. Returns what this rank's experts receive, and the group's largest token count."""
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

"""The deduplicated expert-parallel exchange: a token crosses once to each rank (or node, then rank) it reaches.

Sums go in member-count order (gathers only, no atomics: deterministic); one host synchronisation per
layer. Chunked and overlapped: `overlap.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..moe.permute import _rowwise_dot, kernels_on
from .dispatch import all_to_all, all_to_all_autograd, wire
from .groups import ExpertParallelGroups


class _Pending:
    """Asynchronous all-to-alls of several tensors with the same row splits."""

    def __init__(self, tensors: list[torch.Tensor], send: list[int], recv: list[int], group) -> None:
        self.inputs = [t.contiguous() for t in tensors]  # kept alive until the exchange is done
        self.outputs = [t.new_empty(sum(recv), *t.shape[1:]) for t in self.inputs]
        self.works = [
            dist.all_to_all_single(wire(o, group), wire(i, group), recv, send, group=group, async_op=True)
            for o, i in zip(self.outputs, self.inputs, strict=True)
        ]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.inputs = None
        return self.outputs


def pack(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slot weights and ids [N, k] as one [N, bytes] buffer, one message."""
    return torch.cat([weights.contiguous().view(torch.uint8), ids.contiguous().view(torch.uint8)], 1)


def unpack(buffer: torch.Tensor, weight_dtype: torch.dtype, id_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack` undone: (weights, ids as int64)."""
    k = buffer.shape[1] // (weight_dtype.itemsize + id_dtype.itemsize)
    cut = k * weight_dtype.itemsize

    def part(columns: slice, dtype: torch.dtype) -> torch.Tensor:
        # a fresh copy: a slice of one or no rows counts as contiguous with its parent's strides and
        # offset, which a view as a wider dtype refuses
        return buffer[:, columns].clone(memory_format=torch.contiguous_format).view(dtype)

    return part(slice(None, cut), weight_dtype), part(slice(cut, None), id_dtype).long()


class _SendMeta(torch.autograd.Function):
    """The slots' weights and ids in one message; the weights' gradients come back."""

    @staticmethod
    def forward(ctx, weights, ids, send, recv, group):
        ctx.splits, ctx.group = (send, recv), group
        (buffer,) = _Pending([pack(weights, ids)], send, recv, group).wait()
        received, received_ids = unpack(buffer, weights.dtype, ids.dtype)
        ctx.mark_non_differentiable(received_ids)
        return received, received_ids

    @staticmethod
    def backward(ctx, grad, _):
        send, recv = ctx.splits
        return _Pending([grad], recv, send, ctx.group).wait()[0], None, None, None, None


@dataclass
class _Members:
    """The members of N rows in a mask [N, C], numbered column by column."""

    row_of: torch.Tensor
    column_of: torch.Tensor
    inverse: torch.Tensor  # each row's place among the rows sorted by member count, most first
    nth: list[torch.Tensor]  # nth[j]: the j-th members of those sorted rows
    rows: int
    table: torch.Tensor  # [N, depth]: each row's members, -1 padded (for `ds_optimus.ops.routing`)


def _nonzero(flat: torch.Tensor, size: int) -> torch.Tensor:
    if flat.device.type == "cpu":
        return flat.nonzero().squeeze(1)
    return torch.nonzero_static(flat, size=size).squeeze(1)  # no host synchronisation


def _members(mask: torch.Tensor, total: int, at_least: list[int]) -> _Members:
    """`at_least[j]`: rows with more than j members, known on the host."""
    n, c = mask.shape
    flat = _nonzero(mask.t().reshape(-1), total)
    column_of, row_of = flat // n, flat % n
    order = torch.argsort(mask.sum(1), descending=True, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=mask.device)
    ordinal = (mask.cumsum(1) - 1).reshape(-1).index_select(0, row_of * c + column_of)
    depth = max(len(at_least), 1)
    table = torch.full((n * depth,), -1, dtype=torch.long, device=mask.device)
    table[row_of * depth + ordinal] = torch.arange(total, device=mask.device)  # every index once
    table = table.view(n, depth)
    nth = [table[order[:m], j] for j, m in enumerate(at_least) if m]
    return _Members(row_of, column_of, inverse, nth, n, table)


def _sum_members(src: torch.Tensor, m: _Members, weight: torch.Tensor | None) -> torch.Tensor:
    """out[r] = sum over the members p of row r of weight[p] * src[p]."""
    if kernels_on(src.device):  # one pass; the same sums in the same order
        return torch.ops.ds_optimus.combine_rows(src.contiguous(), weight, m.table, m.row_of)
    dtype = torch.float32 if src.element_size() < 4 else src.dtype
    acc = torch.zeros(m.rows, src.shape[-1], dtype=dtype, device=src.device)
    for positions in m.nth:
        part = src.index_select(0, positions)
        if weight is None:
            acc[: len(positions)] += part
        else:
            acc[: len(positions)].addcmul_(part, weight.index_select(0, positions).to(dtype).unsqueeze(1))
    return acc.index_select(0, m.inverse).to(src.dtype)


class _Spread(torch.autograd.Function):
    """Row r copied to each of its members ([N, H] -> [S, H])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, m: _Members):
        ctx.m = m
        if kernels_on(x.device):
            return torch.ops.ds_optimus.gather_rows(x.contiguous(), m.row_of, m.table)
        return x.index_select(0, m.row_of)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_members(grad.contiguous(), ctx.m, None), None


class _Collect(torch.autograd.Function):
    """Each row's members summed, weighted or not ([S, H] -> [N, H])."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, weight: torch.Tensor | None, m: _Members):
        ctx.m = m
        ctx.save_for_backward(*((src, weight) if weight is not None else ()))  # src only for d weight
        return _sum_members(src, m, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no more)
        if kernels_on(grad.device):  # the gathered rows, weighted, and the weights' gradient in one pass
            src, weight = saved or (grad.new_empty(0, grad.shape[1]), None)
            need = bool(saved) and ctx.needs_input_grad[1]
            rows, grad_w = torch.ops.ds_optimus.combine_rows_backward(
                grad.contiguous(), src.contiguous(), ctx.m.row_of, weight, need
            )
            return rows, (grad_w.to(weight.dtype) if need else None), None
        rows = grad.contiguous().index_select(0, ctx.m.row_of)
        if not saved:
            return rows, None, None
        src, weight = saved
        grad_w = _rowwise_dot(src, rows).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return rows.mul_(weight.to(rows.dtype).unsqueeze(1)), grad_w, None


def _slot_members(ids: torch.Tensor, units: int, dests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each slot's destination, `dests` for none; [N, dests] mask of destinations reached)."""
    dest = torch.where(ids >= 0, torch.div(ids, units, rounding_mode="floor"), dests)
    mask = torch.zeros(ids.shape[0], dests + 1, dtype=torch.bool, device=ids.device).scatter_(1, dest, True)
    return dest, mask[:, :dests]


def _at_least(counts: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth, *counts.shape[1:]]: how many rows have more than j members, for j < depth."""
    thresholds = torch.arange(1, depth + 1, device=counts.device).view(-1, *([1] * counts.dim()))
    return (counts.unsqueeze(0) >= thresholds).sum(1)


@dataclass
class _Hop:
    group: object
    dests: int  # ranks of the group
    units: int  # expert ids per destination at this hop


@dataclass
class _Plan:
    """One chunk's sizes per hop and at the experts, on the host (`counts` on the device)."""

    send: list[list[int]]
    recv: list[list[int]]
    at_least: list[list[int]]
    dest_at_least: list[int]
    dest_total: int
    counts: torch.Tensor


def _split_list(values: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(values[start : start + n])
        start += n
    return out


def plan_chunks(dispatcher: DedupDispatcher, chunk_ids: list[torch.Tensor]) -> list[_Plan]:
    """Every chunk's split sizes and member counts: one count exchange per hop, one host synchronisation."""
    # Sent per chunk to rank r: [rows with > j slots on r | slots per local expert]; hierarchically, to node b's
    # rail rank: [rows reaching > j ranks of b | each rank's vector], summed there and forwarded. j = 0: split size.
    el, hops, ep = dispatcher.num_local_experts, dispatcher.hops, dispatcher.groups.ep_size
    k, chunks = chunk_ids[0].shape[1], len(chunk_ids)
    depth_e, src_depth = min(k, el), min(k, hops[0].dests)
    inner_depth = min(k, hops[-1].dests)
    local, vectors = [], []
    for ids in chunk_ids:
        rank = torch.where(ids >= 0, torch.div(ids, el, rounding_mode="floor"), ep)
        slots = torch.zeros(ids.shape[0], ep + 1, dtype=torch.long, device=ids.device)
        slots = slots.scatter_add_(1, rank, torch.ones_like(rank))[:, :-1]  # [T, ranks]: integer adds, exact
        per_expert = torch.zeros(ep * el + 1, dtype=torch.long, device=ids.device).scatter_add_(
            0, torch.where(ids >= 0, ids, ep * el).reshape(-1), torch.ones_like(ids).reshape(-1)
        )[:-1]
        per_rank = torch.cat([_at_least(slots, depth_e), per_expert.view(ep, el).t()]).t()  # [ranks, V]
        reached = (slots > 0).view(ids.shape[0], hops[0].dests, ep // hops[0].dests)  # [T, dests, ranks in each]
        local.append(torch.cat([reached.any(2).sum(0), _at_least(reached.any(2).sum(1), src_depth)]))
        if len(hops) == 2:
            inner = _at_least(reached.sum(2), inner_depth).t()  # [nodes, depth]: ranks reached per node
            per_rank = torch.cat([inner, per_rank.reshape(hops[0].dests, -1)], 1)
        vectors.append(per_rank.reshape(hops[0].dests, -1))
    width = vectors[0].shape[1]
    splits = [chunks * width] * hops[0].dests
    recv = all_to_all(torch.stack(vectors, 1).reshape(-1), splits, splits, hops[0].group)
    synced = [torch.stack(local).reshape(-1), recv]
    final, final_width = recv.view(hops[0].dests, chunks, width), width
    if len(hops) == 2:
        n, final_width = hops[1].dests, depth_e + el
        to_ranks = final[:, :, inner_depth:].sum(0).view(chunks, n, final_width).transpose(0, 1)
        splits = [chunks * final_width] * n
        final = all_to_all(to_ranks.reshape(-1), splits, splits, hops[1].group).view(n, chunks, final_width)
        synced.append(final.reshape(-1))
    values = torch.cat(synced).tolist()  # the one host synchronisation
    parts = _split_list(
        values,
        [hops[0].dests + src_depth] * chunks
        + [width] * (chunks * hops[0].dests)
        + ([final_width] * (chunks * n) if len(hops) == 2 else []),
    )
    mine, first = parts[:chunks], parts[chunks : chunks * (1 + hops[0].dests)]
    second = parts[chunks * (1 + hops[0].dests) :]
    plans = []
    for c in range(chunks):
        by_source = [first[s * chunks + c] for s in range(hops[0].dests)]
        plan = _Plan(
            send=[mine[c][: hops[0].dests]],
            recv=[[v[0] for v in by_source]],
            at_least=[mine[c][hops[0].dests :]],
            dest_at_least=[],
            dest_total=0,
            counts=final[:, c, depth_e:].sum(0),
        )
        at_dest = by_source
        if len(hops) == 2:
            plan.at_least.append([sum(v[j] for v in by_source) for j in range(inner_depth)])
            plan.send.append([sum(v[inner_depth + m * final_width] for v in by_source) for m in range(n)])
            at_dest = [second[q * chunks + c] for q in range(n)]
            plan.recv.append([v[0] for v in at_dest])
        plan.dest_at_least = [sum(v[j] for v in at_dest) for j in range(depth_e)]
        plan.dest_total = sum(sum(v[depth_e:]) for v in at_dest)
        plans.append(plan)
    return plans


def depart(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, plan: _Plan, level: int, hop: _Hop, spread=None):
    """Each row once per destination it reaches: (members, slot positions [S, k], rows, weights, local ids)."""
    dest, mask = _slot_members(ids, hop.units, hop.dests)
    m = _members(mask, sum(plan.send[level]), plan.at_least[level])
    here = dest.index_select(0, m.row_of) == m.column_of.unsqueeze(1)
    local = torch.where(here, ids.index_select(0, m.row_of) - m.column_of.unsqueeze(1) * hop.units, -1)
    rows = spread(x, m) if spread is not None else x.index_select(0, m.row_of)
    return m, here, rows, w.index_select(0, m.row_of) * here, local.to(_id_dtype(hop.units * hop.dests))


def _id_dtype(ids: int) -> torch.dtype:
    return torch.int16 if ids < 2**15 else torch.int32


def at_experts(ids: torch.Tensor, plan: _Plan, num_local_experts: int) -> tuple[_Members, torch.Tensor]:
    """The slots at this rank's experts, and each slot's index in the flat [N, k] weights."""
    el, k = num_local_experts, ids.shape[1]
    _, mask = _slot_members(ids, 1, el)
    m = _members(mask, plan.dest_total, plan.dest_at_least)
    slot = torch.zeros(ids.shape[0], el + 1, dtype=torch.long, device=ids.device).scatter_(
        1, torch.where(ids >= 0, ids, el), torch.arange(k, device=ids.device).expand_as(ids).contiguous()
    )
    return m, m.row_of * k + slot[:, :el].reshape(-1).index_select(0, m.row_of * el + m.column_of)


class DedupDispatcher:
    """Runs a layer's experts across the EP group, deduplicated."""

    deduplicated = True

    def __init__(self, groups: ExpertParallelGroups, num_local_experts: int, chunks: int = 1) -> None:
        self.groups, self.num_local_experts, self.chunks = groups, num_local_experts, chunks
        el, g = num_local_experts, groups
        if g.hierarchical:
            n = g.node_size
            self.hops = [_Hop(g.inter_node_group, g.ep_size // n, n * el), _Hop(g.intra_node_group, n, el)]
        else:
            self.hops = [_Hop(g.ep_group, g.ep_size, el)]

    @torch.compiler.disable  # split sizes are read on the host: a traced exchange would recompile per routing
    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: Callable[..., torch.Tensor],
        params: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H] (ids -1: dropped); `experts(rows,
        counts, *params)` runs this rank's experts."""
        if self.chunks > 1:  # the chunked, overlapped exchange is its subclass's (`overlap.py`)
            raise ValueError("a DedupDispatcher of several chunks is made by overlap.dedup_dispatcher")
        (plan,) = plan_chunks(self, [ids])
        x_l, w_l, ids_l, members = x, weights, ids, []
        for level, hop in enumerate(self.hops):  # out: once per destination
            m, _, rows, w, local = depart(x_l, w_l, ids_l, plan, level, hop, _Spread.apply)
            members.append(m)
            x_l = all_to_all_autograd(rows, plan.recv[level], plan.send[level], hop.group)
            w_l, ids_l = _SendMeta.apply(w, local, plan.send[level], plan.recv[level], hop.group)
        m, index = at_experts(ids_l, plan, self.num_local_experts)
        y = experts(_Spread.apply(x_l, m), plan.counts, *params)
        out = _Collect.apply(y, w_l.reshape(-1).index_select(0, index), m)
        for level in reversed(range(len(self.hops))):  # back: one partial sum per (row, destination)
            back = all_to_all_autograd(out, plan.send[level], plan.recv[level], self.hops[level].group)
            out = _Collect.apply(back, None, members[level])
        return out

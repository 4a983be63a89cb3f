"""All-to-all token exchange for expert parallelism: flat, or hierarchical (`node_size`: inside each node,
then one aggregated message per node pair, as BaGuaLu and Tutel do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .groups import ExpertParallelGroups


def wire(x: torch.Tensor, group) -> torch.Tensor:
    """`x` as the all-to-all can send it: int16, and bf16/fp16 on gloo, as bytes."""
    if x.dtype == torch.int16 or (
        x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and "gloo" in str(dist.get_backend(group))
    ):
        return x.view(torch.uint8)
    return x


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows `x`, split by `in_splits`, to the group's ranks in order; returns the rows received."""
    x = x.contiguous()
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(wire(out, group), wire(x, group), out_splits, in_splits, group=group)
    return out


def all_to_all_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """`all_to_all` whose backward sends the gradients back the same way."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def transpose_chunks(x: torch.Tensor, sizes: list[list[int]]) -> torch.Tensor:
    """Rows in chunks ordered (a, b) with sizes[a][b], reordered to (b, a)."""
    rows, cols = len(sizes), len(sizes[0])
    chunks = x.split([n for row in sizes for n in row])
    return torch.cat([chunks[a * cols + b] for b in range(cols) for a in range(rows)])


def _t(sizes: list[list[int]]) -> list[list[int]]:
    return [list(col) for col in zip(*sizes, strict=True)]


class ExpertParallelDispatcher:
    """Sends expert-sorted rows to their experts' ranks and back, one row per slot each way."""

    deduplicated = False

    def __init__(self, groups: ExpertParallelGroups, num_local_experts: int) -> None:
        self.groups = groups
        self.num_local_experts = num_local_experts

    # Never traced by torch.compile: the split sizes are read on the host every call, so a compiled
    # exchange would guard on them and recompile for every new routing.
    @torch.compiler.disable
    def __call__(
        self,
        x_sorted: torch.Tensor,
        counts: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        g, el = self.groups, self.num_local_experts
        send = counts.reshape(g.ep_size, el)  # [destination rank, its local expert]
        if g.hierarchical:
            return self._hierarchical(x_sorted, send, experts)
        recv = all_to_all(send.reshape(-1), [el] * g.ep_size, [el] * g.ep_size, g.ep_group).view(g.ep_size, el)
        send_l, recv_l = torch.stack([send, recv]).tolist()  # one host sync for every split size
        in_splits, out_splits = [sum(r) for r in send_l], [sum(r) for r in recv_l]
        rows = all_to_all_autograd(x_sorted, out_splits, in_splits, g.ep_group)
        y = self._local(rows, recv_l, experts)
        return all_to_all_autograd(y, in_splits, out_splits, g.ep_group)

    def _local(self, rows: torch.Tensor, recv: list[list[int]], experts) -> torch.Tensor:
        """Run the experts on received rows in (expert, source) order."""
        by_expert = transpose_chunks(rows, recv)
        per_expert = torch.tensor([sum(col) for col in zip(*recv, strict=True)], device=rows.device)
        return transpose_chunks(experts(by_expert, per_expert), _t(recv))

    def _hierarchical(self, x_sorted: torch.Tensor, send: torch.Tensor, experts) -> torch.Tensor:
        g, el = self.groups, self.num_local_experts
        n = g.node_size
        nodes = g.ep_size // n
        # Counts, step 1 (inside the node): to local rank m, the counts for (node b, local rank m).
        c1_in = send.view(nodes, n, el).transpose(0, 1).contiguous()  # [m, b, e]
        c1 = all_to_all(c1_in.reshape(-1), [nodes * el] * n, [nodes * el] * n, g.intra_node_group).view(n, nodes, el)
        # Counts, step 2 (between nodes): to node b, what this node's ranks send to (b, my local rank).
        c2_in = c1.transpose(0, 1).contiguous()  # [b, l, e]
        c2 = all_to_all(c2_in.reshape(-1), [n * el] * nodes, [n * el] * nodes, g.inter_node_group).view(nodes * n, el)
        sizes = torch.cat([send.reshape(-1), c1.sum(-1).reshape(-1), c2.reshape(-1)]).tolist()  # one host sync
        send_l = [sizes[r * el : (r + 1) * el] for r in range(g.ep_size)]
        sizes = sizes[g.ep_size * el :]
        c1_l = [sizes[m * nodes : (m + 1) * nodes] for m in range(n)]
        sizes = sizes[n * nodes :]
        recv_l = [sizes[r * el : (r + 1) * el] for r in range(g.ep_size)]

        s = [[sum(send_l[b * n + m]) for m in range(n)] for b in range(nodes)]  # rows to (b, m)
        in1 = [sum(s[b][m] for b in range(nodes)) for m in range(n)]
        out1 = [sum(row) for row in c1_l]  # from each local rank of this node
        in2 = [sum(row[b] for row in c1_l) for b in range(nodes)]
        out2 = [sum(sum(row) for row in recv_l[a * n : (a + 1) * n]) for a in range(nodes)]

        rows = transpose_chunks(x_sorted, s)  # (b, m) -> (m, b)
        rows = all_to_all_autograd(rows, out1, in1, g.intra_node_group)
        rows = transpose_chunks(rows, c1_l)  # (l, b) -> (b, l)
        rows = all_to_all_autograd(rows, out2, in2, g.inter_node_group)
        y = self._local(rows, recv_l, experts)
        y = all_to_all_autograd(y, in2, out2, g.inter_node_group)
        y = transpose_chunks(y, _t(c1_l))  # (b, l) -> (l, b)
        y = all_to_all_autograd(y, in1, out1, g.intra_node_group)
        return transpose_chunks(y, _t(s))  # (m, b) -> (b, m)

"""Token permutation for dropless MoE: sort (token, slot) pairs by expert (stably) and back.

Forward and backward are gathers (no atomics), so deterministic. The compiled kernels (`ops.routing`) run unless
`routing_kernel` says "reference"; then the PyTorch code below, which the kernels are measured against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import routing


@dataclass
class RoutingPlan:
    """Where each of the S = T*k slots goes (tensors on the routing device)."""

    order: torch.Tensor  # [S] int64: the slot at sorted position p
    inverse: torch.Tensor  # [S] int64: the sorted position of slot s
    token_of_sorted: torch.Tensor  # [S] int64: the token whose row sits at sorted position p
    counts: torch.Tensor  # [E] int64: how many slots expert e received
    inverse_by_slot: torch.Tensor  # [k, T] int64: row j holds the sorted positions of every token's j-th slot
    num_tokens: int
    top_k: int

    @property
    def num_slots(self) -> int:
        return self.num_tokens * self.top_k


def kernels_on(device: torch.device) -> bool:
    """Whether routing, gather and combine run the compiled kernels on `device`."""
    return routing.routing_kernel(device) != "reference"


def plan_routing(top_k_index: torch.Tensor, num_experts: int) -> RoutingPlan:
    """Sort the slots of `top_k_index [T, k]` by expert id."""
    num_tokens, top_k = top_k_index.shape
    if kernels_on(top_k_index.device):
        order, inverse, counts = routing.route_slots(top_k_index, num_experts)
        by_slot = inverse.view(num_tokens, top_k).t()  # a view: the kernels take the [T, k] table itself
        return RoutingPlan(order, inverse, order // top_k, counts, by_slot, num_tokens, top_k)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # Counts from the sorted ids: `bincount` sizes its output from the largest id, which on an
    # accelerator makes the host wait for the device in every MoE layer.
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    counts = torch.searchsorted(flat.index_select(0, order), bounds).diff()
    by_slot = inverse.view(num_tokens, top_k).t().contiguous()
    return RoutingPlan(order, inverse, order // top_k, counts, by_slot, num_tokens, top_k)


def _accumulator(like: torch.Tensor, rows: int) -> torch.Tensor:
    # Sums over the k slots are accumulated in float32 when the data is bf16/fp16.
    dtype = torch.float32 if like.element_size() < 4 else like.dtype
    return torch.zeros(rows, like.shape[-1], dtype=dtype, device=like.device)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor, chunk_rows: int = 2048) -> torch.Tensor:
    # float32 rows go through a batched GEMM (no [S, H] temporary; 2.5x faster than multiply-and-sum
    # on CPU). bf16/fp16 batched GEMMs of 1xH by Hx1 are slow there and vecdot multiplies into an
    # [S, H] temporary, so it runs over blocks of rows whose temporary stays in cache (4x faster).
    if a.dtype == torch.float32:
        return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)
    if a.device.type != "cpu":
        return torch.linalg.vecdot(a, b)
    out = a.new_empty(a.shape[0])
    for start in range(0, a.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        torch.linalg.vecdot(a[rows], b[rows], out=out[rows])
    return out


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_sorted: torch.Tensor, inverse_by_slot: torch.Tensor):
        ctx.save_for_backward(inverse_by_slot)
        return x.index_select(0, token_of_sorted)

    @staticmethod
    def backward(ctx, grad_sorted: torch.Tensor):
        (inverse_by_slot,) = ctx.saved_tensors
        # grad_x[t] = sum_j grad_sorted[inverse(t, j)]: one [T, H] gather per slot index, summed in
        # place, instead of materialising the [T*k, H] gather.
        grad_x = _accumulator(grad_sorted, inverse_by_slot.shape[1])
        for positions in inverse_by_slot:
            grad_x += grad_sorted.index_select(0, positions)
        return grad_x.to(grad_sorted.dtype), None, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        y_sorted: torch.Tensor,
        weights: torch.Tensor,
        inverse_by_slot: torch.Tensor,
        order: torch.Tensor,
        token_of_sorted: torch.Tensor,
    ):
        out = _accumulator(y_sorted, weights.shape[0])
        w = weights.to(y_sorted.dtype)
        for j, positions in enumerate(inverse_by_slot):  # out[t] += w[t, j] * y[slot (t, j)]
            out.addcmul_(y_sorted.index_select(0, positions), w[:, j : j + 1])
        ctx.save_for_backward(y_sorted, weights, order, token_of_sorted)
        return out.to(y_sorted.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y_sorted, weights, order, token_of_sorted = ctx.saved_tensors
        # Sorted position p holds slot order[p] of token token_of_sorted[p]: gather that token's
        # gradient row once; it gives the routing-weight gradient (its dot product with y) and,
        # scaled in place by the slot's weight, the gradient of y.
        grad_rows = grad_out.contiguous().index_select(0, token_of_sorted)
        grad_w = None
        if ctx.needs_input_grad[1]:
            per_sorted = _rowwise_dot(y_sorted, grad_rows)
            grad_w = torch.empty_like(per_sorted).index_copy_(0, order, per_sorted)
            grad_w = grad_w.view(weights.shape).to(weights.dtype)
        w_sorted = weights.reshape(-1).index_select(0, order).to(grad_rows.dtype)
        return grad_rows.mul_(w_sorted.unsqueeze(-1)), grad_w, None, None, None


def permute_tokens(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Rows of `x [T, H]` in sorted-slot order `[S, H]` (a token once per chosen expert)."""
    if kernels_on(x.device):
        return routing.gather_rows(x, plan.token_of_sorted, plan.inverse.view(plan.num_tokens, plan.top_k))
    return _PermuteTokens.apply(x, plan.token_of_sorted, plan.inverse_by_slot)


def unpermute_combine(y_sorted: torch.Tensor, weights: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """`out[t] = sum_j weights[t, j] * y[slot (t, j)]` from expert outputs in sorted order `[S, H]`."""
    if kernels_on(y_sorted.device):
        w_sorted = weights.reshape(-1).index_select(0, plan.order)  # [S]: each sorted position's weight
        table = plan.inverse.view(plan.num_tokens, plan.top_k)
        return routing.combine_rows(y_sorted, w_sorted, table, plan.token_of_sorted)
    return _UnpermuteCombine.apply(y_sorted, weights, plan.inverse_by_slot, plan.order, plan.token_of_sorted)

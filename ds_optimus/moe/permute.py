"""Token permutation for dropless MoE: sort (token, slot) pairs by expert and back.

A routing decision `top_k_index [T, k]` has S = T*k slots. `plan_routing` sorts the slots by expert
(stably, so tokens keep their order inside an expert), which gives contiguous per-expert rows and
their counts. `permute_tokens` gathers the token rows into that order; `unpermute_combine` brings the
expert outputs back to slot order and sums each token's k outputs weighted by its routing weights.
Both are gathers in forward and backward (no scatter-add, no atomics), so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingPlan:
    """Where each slot goes. `order[p]` is the slot at sorted position p, `inverse[s]` the sorted
    position of slot s, `counts[e]` how many slots expert e received (on the routing device)."""

    order: torch.Tensor  # [S] int64
    inverse: torch.Tensor  # [S] int64
    token_of_sorted: torch.Tensor  # [S] int64: the token whose row sits at sorted position p
    counts: torch.Tensor  # [E] int64
    num_tokens: int
    top_k: int

    @property
    def num_slots(self) -> int:
        return self.num_tokens * self.top_k


def plan_routing(top_k_index: torch.Tensor, num_experts: int) -> RoutingPlan:
    """Sort the slots of `top_k_index [T, k]` by expert id (ids in [0, num_experts))."""
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return RoutingPlan(order, inverse, order // top_k, counts, num_tokens, top_k)


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_sorted: torch.Tensor, inverse: torch.Tensor, top_k: int):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, token_of_sorted)

    @staticmethod
    def backward(ctx, grad_sorted: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        per_slot = grad_sorted.index_select(0, inverse)  # slot order: token-major, k slots each
        grad_x = per_slot.view(-1, ctx.top_k, per_slot.shape[-1]).sum(1, dtype=torch.float32)
        return grad_x.to(grad_sorted.dtype), None, None, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, order: torch.Tensor):
        num_tokens, top_k = weights.shape
        y_slots = y_sorted.index_select(0, inverse).view(num_tokens, top_k, -1)
        w = weights.to(y_sorted.dtype).unsqueeze(1)  # [T, 1, k]
        out = torch.bmm(w, y_slots).squeeze(1)  # weighted sum over k, accumulated in fp32 by the GEMM
        ctx.save_for_backward(y_slots, weights, order)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y_slots, weights, order = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_w = torch.bmm(y_slots, grad_out.unsqueeze(-1)).squeeze(-1) if ctx.needs_input_grad[1] else None
        grad_y = None
        if ctx.needs_input_grad[0]:
            grad_slots = weights.to(grad_out.dtype).unsqueeze(-1) * grad_out.unsqueeze(1)  # [T, k, H]
            grad_y = grad_slots.view(order.numel(), -1).index_select(0, order)
        if grad_w is not None:
            grad_w = grad_w.to(weights.dtype)
        return grad_y, grad_w, None, None


def permute_tokens(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Rows of `x [T, H]` in sorted-slot order `[S, H]` (each token repeated once per chosen expert)."""
    return _PermuteTokens.apply(x, plan.token_of_sorted, plan.inverse, plan.top_k)


def unpermute_combine(y_sorted: torch.Tensor, weights: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """`out[t] = sum_j weights[t, j] * y[slot (t, j)]` from expert outputs in sorted order `[S, H]`."""
    return _UnpermuteCombine.apply(y_sorted, weights, plan.inverse, plan.order)

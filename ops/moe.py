"""The SwiGLU experts as custom ops (`torch.ops.ds_optimus.*`) with autograd and fake implementations, for
`torch.compile`: `moe_swiglu` (the whole dropless MoE feed-forward; deterministic, no atomics) and `swiglu_experts`
(rows sorted by expert).

Triton kernels run where they can, else the reference; `DS_OPTIMUS_KERNELS=reference` forces the reference,
`DS_OPTIMUS_KERNELS=triton` makes a missing Triton an error.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import Tensor

ENV_VAR = "DS_OPTIMUS_KERNELS"
_CHOICES = ("auto", "triton", "reference")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """Whether the optional Triton is installed."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_choice() -> str:
    """$DS_OPTIMUS_KERNELS: "auto" (default), "triton" or "reference"."""
    choice = os.environ.get(ENV_VAR, "auto") or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(_CHOICES)}, got {choice!r}")
    return choice


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether Triton is installed and runs on `device` (a GPU, or the CPU when interpreting)."""
    device = torch.device(device)
    if not triton_available():
        return False
    return device.type in ("cuda", "xpu") or (device.type == "cpu" and interpreting())


def kernel_for(device: torch.device | str) -> str:
    """ "triton" or "reference": what the ops run on `device` now."""
    choice = kernels_choice()
    if choice == "reference":
        return "reference"
    if triton_runs_on(device):
        return "triton"
    if choice == "triton":
        why = "Triton is not installed" if not triton_available() else f"Triton does not run on {device}"
        raise RuntimeError(f"{ENV_VAR}=triton but {why} (without TRITON_INTERPRET=1 on the CPU)")
    return "reference"


def _triton():
    from . import _triton_moe

    return _triton_moe


# -- reference ------------------------------------------------------------------------------------


def _reference_forward(x, gate_up, down, counts, src, dst, weights, top_k):
    """Plain PyTorch per expert: the oracle and the path without Triton."""
    rows = x.index_select(0, src) if src is not None else x
    inter = down.shape[-1]
    gus, ys = [], []
    for e, part in enumerate(rows.split(counts.tolist())):
        gu = F.linear(part, gate_up[e])
        gus.append(gu)
        ys.append(F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down[e]))
    gu = torch.cat(gus) if gus else x.new_zeros(0, 2 * inter)
    y = torch.cat(ys) if ys else x.new_zeros(0, down.shape[1])
    if dst is None:
        return y, gu
    if weights is not None:
        y = y * weights.index_select(0, dst).to(y.dtype).unsqueeze(1)
    slots = y.new_zeros(y.shape).index_copy(0, dst, y)
    return _sum_slots(slots, top_k), gu


def _reference_backward(grad, x, gate_up, down, counts, src, dst, weights, top_k):
    """`_reference_forward`'s gradients per expert (autograd does not run inside an op)."""
    rows = x.index_select(0, src) if src is not None else x
    grad_rows = grad.index_select(0, src) if dst is not None else grad  # each slot's output gradient
    w = weights.index_select(0, dst).unsqueeze(1) if weights is not None else None
    inter = down.shape[-1]
    d_gate_up, d_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    d_rows, grad_w_sorted = torch.zeros_like(rows), rows.new_zeros(rows.shape[0], dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts.tolist()):
        part, end = rows[start : start + n], start + n
        gu = F.linear(part, gate_up[e])
        gate, up = gu[:, :inter].float(), gu[:, inter:].float()
        act = F.silu(gate)
        h = (act * up).to(x.dtype)
        g = grad_rows[start:end]
        if w is not None:
            grad_w_sorted[start:end] = (g.float() * F.linear(h, down[e]).float()).sum(1)
            g = (g.float() * w[start:end].float()).to(g.dtype)
        d_h = (g @ down[e]).float()
        sig = torch.sigmoid(gate)
        d_gu = torch.cat([d_h * up * sig * (1 + gate * (1 - sig)), d_h * act], 1).to(x.dtype)
        d_down[e] = g.t() @ h
        d_gate_up[e] = d_gu.t() @ part
        d_rows[start:end] = d_gu @ gate_up[e]
        start = end
    dx = torch.zeros_like(x).index_add_(0, src, d_rows) if src is not None else d_rows
    grad_w = x.new_empty(0)
    if weights is not None:
        grad_w = torch.zeros(weights.shape, dtype=torch.float32, device=x.device)
        grad_w = grad_w.index_copy_(0, dst, grad_w_sorted).to(weights.dtype)
    return dx, d_gate_up, d_down, grad_w


def _sum_slots(slots: Tensor, top_k: int) -> Tensor:
    # Each token's k slot rows are adjacent (slot t*k + j): sum them in float32 (deterministic).
    if top_k == 1:
        return slots
    return slots.view(-1, top_k, slots.shape[-1]).sum(1, dtype=torch.float32).to(slots.dtype)


# -- the ops --------------------------------------------------------------------------------------


@torch.library.custom_op("ds_optimus::swiglu_experts_fwd", mutates_args=())
def _fwd(
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    counts: Tensor,
    src: Tensor | None,
    dst: Tensor | None,
    weights: Tensor | None,
    top_k: int,
) -> tuple[Tensor, Tensor]:
    """(out, gate/up pre-activation [S, 2I])."""
    if kernel_for(x.device) == "reference":
        return _reference_forward(x, gate_up, down, counts, src, dst, weights, top_k)
    num_sorted = src.numel() if src is not None else x.shape[0]
    y, gu = _triton().forward(x, gate_up, down, counts, src, dst, weights, num_sorted)
    return (_sum_slots(y, top_k) if dst is not None else y), gu


@_fwd.register_fake
def _fwd_fake(x, gate_up, down, counts, src, dst, weights, top_k):
    num_sorted = src.shape[0] if src is not None else x.shape[0]
    out_rows = num_sorted // top_k if dst is not None else num_sorted
    return x.new_empty(out_rows, down.shape[1]), x.new_empty(num_sorted, 2 * down.shape[-1])


@torch.library.custom_op("ds_optimus::swiglu_experts_bwd", mutates_args=())
def _bwd(
    grad: Tensor,
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    counts: Tensor,
    src: Tensor | None,
    dst: Tensor | None,
    weights: Tensor | None,
    gu: Tensor,
    top_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d gate_up, d down, d weights or empty)."""
    if kernel_for(x.device) == "reference":
        return _reference_backward(grad, x, gate_up, down, counts, src, dst, weights, top_k)
    fused = dst is not None
    # In the fused layout, sorted position p's output gradient is the gradient of its token, src[p].
    dx, d_gate_up, d_down, gw = _triton().backward(
        grad,
        src if fused else None,
        x,
        gate_up,
        down,
        counts,
        src,
        dst,
        weights,
        gu,
        dx_rows=gu.shape[0],
    )
    if fused:
        dx = _sum_slots(dx, top_k)
    grad_w = x.new_empty(0)
    if weights is not None:
        grad_w = torch.zeros(weights.shape, device=weights.device, dtype=torch.float32)
        grad_w = grad_w.index_copy_(0, dst, gw).to(weights.dtype)
    return dx, d_gate_up, d_down, grad_w


@_bwd.register_fake
def _bwd_fake(grad, x, gate_up, down, counts, src, dst, weights, gu, top_k):
    grad_w = torch.empty_like(weights) if weights is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(gate_up), torch.empty_like(down), grad_w


def _setup_context(ctx, inputs, output):
    x, gate_up, down, counts, src, dst, weights, top_k = inputs
    ctx.save_for_backward(x, gate_up, down, counts, src, dst, weights, output[1])
    ctx.top_k = top_k


def _backward(ctx, grad_out, grad_gu):
    x, gate_up, down, counts, src, dst, weights, gu = ctx.saved_tensors
    dx, d_gate_up, d_down, grad_w = torch.ops.ds_optimus.swiglu_experts_bwd(
        grad_out.contiguous(), x, gate_up, down, counts, src, dst, weights, gu, ctx.top_k
    )
    return dx, d_gate_up, d_down, None, None, None, (grad_w if weights is not None else None), None


_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- public entry points --------------------------------------------------------------------------


def _check(x: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor) -> None:
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"expected x [rows, H], gate_up [E, 2I, H], down [E, H, I]; got "
            f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    experts, two_inter, hidden = gate_up.shape
    if down.shape != (experts, hidden, two_inter // 2) or two_inter % 2 or x.shape[1] != hidden:
        raise ValueError(
            f"shapes do not match: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}"
        )
    if not (x.dtype == gate_up.dtype == down.dtype) or x.dtype not in _FLOATS:
        raise ValueError(
            f"x, gate_up and down must share one of float32/bfloat16/float16; got "
            f"{x.dtype}, {gate_up.dtype}, {down.dtype}"
        )
    if counts.shape != (experts,) or counts.dtype.is_floating_point:
        raise ValueError(
            f"counts must be an integer tensor of shape ({experts},), got {counts.dtype} {tuple(counts.shape)}"
        )


def swiglu_experts(x_sorted: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor) -> Tensor:
    """`y = down_e(silu(gate_e(x)) * up_e(x))` for rows sorted by expert, `counts [E]` rows each."""
    _check(x_sorted, gate_up, down, counts)
    if counts.device.type == "cpu" and int(counts.sum()) != x_sorted.shape[0]:  # free to check here
        raise ValueError(f"counts sum to {int(counts.sum())} but there are {x_sorted.shape[0]} rows")
    return torch.ops.ds_optimus.swiglu_experts_fwd(x_sorted, gate_up, down, counts, None, None, None, 1)[0]


def moe_swiglu(
    x: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor, token_of_sorted: Tensor, order: Tensor, weights: Tensor
) -> Tensor:
    """`out[t] = sum_j weights[t, j] * experts_{e(t, j)}(x[t])`; `order`, `token_of_sorted` and `counts` come from
    `ds_optimus.moe.plan_routing`."""
    _check(x, gate_up, down, counts)
    tokens, top_k = weights.shape
    if tokens != x.shape[0] or order.shape != (tokens * top_k,) or token_of_sorted.shape != order.shape:
        raise ValueError(
            f"routing does not match {tokens} tokens x top-{top_k}: order {tuple(order.shape)}, "
            f"token_of_sorted {tuple(token_of_sorted.shape)}, x {tuple(x.shape)}"
        )
    return torch.ops.ds_optimus.swiglu_experts_fwd(
        x, gate_up, down, counts, token_of_sorted, order, weights.reshape(-1), top_k
    )[0]

"""The MoE layer's routing, gather and combine as custom ops (`torch.ops.ds_optimus.*`), summing in a
fixed order: compiled C++ on the CPU (`ops/csrc/moe_routing.cpp`), Triton on GPUs, or the reference below.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from .moe import ENV_VAR, interpreting, kernels_choice, triton_available

OP_NAME = "moe_routing"  # the op's name in DeepSpeed's op builder and `ds_report`

_cpu_module = None
_cpu_failed: str | None = None


# -- which implementation -------------------------------------------------------------------------


def cpu_module():
    """The compiled CPU op, prebuilt or built once per environment; None if it cannot be built."""
    global _cpu_module, _cpu_failed
    if _cpu_module is None and _cpu_failed is None:
        try:
            import deepspeed  # noqa: F401  (first: importing it registers the op with DeepSpeed, ds_optimus.integrations)

            from .op_builder import MoERoutingBuilder, prebuilt_available

            builder = MoERoutingBuilder()
            if not prebuilt_available() and not builder.is_compatible():
                raise RuntimeError(f"no C++ compiler ({builder.compiler()}) to build it")
            _cpu_module = builder.load(verbose=False)
        except Exception as error:  # no DeepSpeed, no compiler, no ninja: the reference serves
            _cpu_failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            print(
                f"ds_optimus: the compiled {OP_NAME} CPU op is unavailable ({_cpu_failed}); "
                f"routing, gather and combine run in plain PyTorch",
                file=sys.stderr,
                flush=True,
            )
    return _cpu_module


def cpu_build_error() -> str | None:
    """Why the compiled CPU op could not be loaded, or None."""
    return _cpu_failed


def routing_kernel(device: torch.device | str) -> str:
    """ "triton", "cpu" (the compiled op) or "reference": what the routing ops run on `device` now."""
    device = torch.device(device)
    choice = kernels_choice()
    if choice == "reference":
        return "reference"
    if device.type in ("cuda", "xpu") and triton_available():
        return "triton"
    if device.type == "cpu":
        if choice == "triton":
            if interpreting() and triton_available():
                return "triton"
            raise RuntimeError(
                f"{ENV_VAR}=triton runs the routing kernels on the CPU only under TRITON_INTERPRET=1 "
                "with Triton installed"
            )
        return "cpu" if cpu_module() is not None else "reference"
    if choice == "triton":
        raise RuntimeError(f"{ENV_VAR}=triton but Triton does not run on {device}")
    return "reference"


def _triton():
    from . import _triton_routing

    return _triton_routing


def _impl(device: torch.device, dtype: torch.dtype | None = None):
    kind = routing_kernel(device)
    if kind == "triton" and dtype != torch.float64:  # the Triton kernels add in float32: float64 stays exact here
        return _triton()
    if kind == "triton":
        return sys.modules[__name__]
    if kind == "cpu":
        return cpu_module()
    return sys.modules[__name__]  # the reference functions below


# -- reference (plain PyTorch) --------------------------------------------------------------------


def route(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Reference of `route_slots`."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    counts = torch.searchsorted(flat.index_select(0, order), bounds).diff()
    return order, inverse, counts


def _acc(t: Tensor) -> torch.dtype:
    # Sums and products are taken in float32 (float64 for float64 data).
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def gather(x: Tensor, index: Tensor, weight: Tensor | None) -> Tensor:
    """Reference: rows `x[index[p]]`, times `weight[p]` (in float32, rounded once) when given."""
    rows = x.index_select(0, index)
    if weight is None:
        return rows
    return (rows.to(_acc(x)) * weight.to(_acc(x)).unsqueeze(1)).to(x.dtype)


def combine(src: Tensor, table: Tensor, weight: Tensor | None) -> Tensor:
    """Reference: row r = sum_j `weight[table[r, j]] * src[table[r, j]]` (-1 skipped), in float32, j order."""
    acc = torch.zeros(table.shape[0], src.shape[1], dtype=_acc(src), device=src.device)
    for j in range(table.shape[1]):
        index = table[:, j]
        valid = index >= 0
        part = src.index_select(0, index.clamp(min=0)).to(acc.dtype)
        if weight is not None:
            part = part * weight.index_select(0, index.clamp(min=0)).to(acc.dtype).unsqueeze(1)
        acc += torch.where(valid.unsqueeze(1), part, 0.0)
    return acc.to(src.dtype)


def combine_backward(
    grad: Tensor, src: Tensor, row_of: Tensor, weight: Tensor | None, need_weight_grad: bool
) -> tuple[Tensor, Tensor]:
    """Reference: (`weight[p] * grad[row_of[p]]`, `dot(src[p], grad[row_of[p]])` in float32 or an empty
    tensor)."""
    rows = grad.index_select(0, row_of)
    grad_w = src.new_empty(0, dtype=_acc(grad))
    if need_weight_grad:
        grad_w = (src.to(_acc(grad)) * rows.to(_acc(grad))).sum(1)
    if weight is not None:
        rows = (rows.to(_acc(grad)) * weight.to(_acc(grad)).unsqueeze(1)).to(grad.dtype)
    return rows, grad_w


# -- the custom ops -------------------------------------------------------------------------------


@torch.library.custom_op("ds_optimus::route", mutates_args=())
def _route(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    if ids.numel() == 0:
        empty = torch.empty(0, dtype=torch.long, device=ids.device)
        return empty, empty.clone(), torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    return tuple(_impl(ids.device).route(ids.contiguous(), num_experts))


def _index(t: Tensor) -> Tensor:
    return t.contiguous().long()  # the compiled kernels take contiguous int64 indices


@_route.register_fake
def _(ids, num_experts):
    n = ids.numel()
    long = torch.long
    return ids.new_empty(n, dtype=long), ids.new_empty(n, dtype=long), ids.new_empty(num_experts, dtype=long)


@torch.library.custom_op("ds_optimus::gather_rows", mutates_args=())
def _gather_rows(x: Tensor, row_of: Tensor, table: Tensor) -> Tensor:
    if row_of.numel() == 0:
        return x.new_empty(0, x.shape[1])
    return _impl(x.device, x.dtype).gather(x.contiguous(), _index(row_of), None)


@_gather_rows.register_fake
def _(x, row_of, table):
    return x.new_empty(row_of.shape[0], x.shape[1])


@torch.library.custom_op("ds_optimus::combine_rows", mutates_args=())
def _combine_rows(src: Tensor, weight: Tensor | None, table: Tensor, row_of: Tensor) -> Tensor:
    if table.numel() == 0 or src.shape[0] == 0:
        return src.new_zeros(table.shape[0], src.shape[1])
    weight = weight.contiguous() if weight is not None else None
    return _impl(src.device, src.dtype).combine(src.contiguous(), _index(table), weight)


@_combine_rows.register_fake
def _(src, weight, table, row_of):
    return src.new_empty(table.shape[0], src.shape[1])


@torch.library.custom_op("ds_optimus::combine_rows_backward", mutates_args=())
def _combine_rows_backward(
    grad: Tensor, src: Tensor, row_of: Tensor, weight: Tensor | None, need_weight_grad: bool
) -> tuple[Tensor, Tensor]:
    if row_of.numel() == 0:
        return grad.new_empty(0, grad.shape[1]), grad.new_empty(0, dtype=_acc(grad))
    weight = weight.contiguous() if weight is not None else None
    return tuple(
        _impl(grad.device, grad.dtype).combine_backward(
            grad.contiguous(), src.contiguous(), _index(row_of), weight, need_weight_grad
        )
    )


@_combine_rows_backward.register_fake
def _(grad, src, row_of, weight, need_weight_grad):
    return grad.new_empty(row_of.shape[0], grad.shape[1]), grad.new_empty(
        row_of.shape[0] if need_weight_grad else 0, dtype=_acc(grad)
    )


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[1])


def _gather_backward(ctx, grad):
    table, row_of = ctx.saved_tensors
    return torch.ops.ds_optimus.combine_rows(grad.contiguous(), None, table, row_of), None, None


_gather_rows.register_autograd(_gather_backward, setup_context=_gather_setup)


def _combine_setup(ctx, inputs, output):
    src, weight, table, row_of = inputs
    ctx.weighted = weight is not None
    ctx.need_weight_grad = weight is not None and weight.requires_grad
    ctx.save_for_backward(src if ctx.need_weight_grad else None, weight, row_of)
    ctx.weight_dtype = weight.dtype if weight is not None else None


def _combine_backward(ctx, grad):
    src, weight, row_of = ctx.saved_tensors
    if src is None:
        src = grad.new_empty(0, grad.shape[1])
    grad_src, grad_w = torch.ops.ds_optimus.combine_rows_backward(
        grad.contiguous(), src, row_of, weight, ctx.need_weight_grad
    )
    return grad_src, (grad_w.to(ctx.weight_dtype) if ctx.need_weight_grad else None), None, None


_combine_rows.register_autograd(_combine_backward, setup_context=_combine_setup)


# -- public entry points --------------------------------------------------------------------------


def route_slots(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """`(order, inverse, counts [E])`: the slots t*k + j of `ids [T, k]` stably sorted by expert, and each count."""
    return torch.ops.ds_optimus.route(ids, num_experts)


def gather_rows(x: Tensor, row_of: Tensor, table: Tensor) -> Tensor:
    """Rows `x[row_of[p]]` ([S, H]); `table [N, D]` lists where each row of `x` went (-1: nowhere)."""
    return torch.ops.ds_optimus.gather_rows(x, row_of, table)


def combine_rows(src: Tensor, weight: Tensor | None, table: Tensor, row_of: Tensor) -> Tensor:
    """Row r = sum_j `weight[table[r, j]] * src[table[r, j]]` in float32; `row_of [S]` is for the backward."""
    return torch.ops.ds_optimus.combine_rows(src, weight, table, row_of)

"""Grouped SwiGLU experts over stacked weights, through a backend chosen per device and dtype.

Each computes `y = down_e(act(gate_e(x)) * up_e(x))` for expert-sorted rows `x [S, H]` (`counts [E]`),
`gate_up [E, 2I, H]` (gate rows first) and `down [E, H, I]`: ``reference`` (the test oracle),
``grouped_mm``, ``looped``, ``triton`` (with a fused form) or any `register_backend` adds.
`DS_OPTIMUS_EXPERTS_BACKEND=<name>` overrides every other choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..schema import Section, need

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]


# fused(x [T, H], gate_up, down, plan, top_k_weights [T, k], act) -> [T, H], or None where it
# cannot take the call (the layer then runs permute, `fn`, combine).
FusedFn = Callable[..., "torch.Tensor | None"]


@dataclass
class Backend:
    name: str
    fn: ExpertsFn
    supports: Callable[[torch.device, torch.dtype], bool]
    priority: int  # the highest-priority backend that supports the device and dtype is chosen
    automatic: Callable[[torch.device], bool] = lambda device: True  # may "auto" pick it here?
    fused: FusedFn | None = None


_BACKENDS: dict[str, Backend] = {}
ENV_VAR = "DS_OPTIMUS_EXPERTS_BACKEND"


def register_backend(
    name: str,
    fn: ExpertsFn,
    supports: Callable[[torch.device, torch.dtype], bool],
    priority: int = 0,
    *,
    automatic: Callable[[torch.device], bool] | None = None,
    fused: FusedFn | None = None,
) -> None:
    """Register `fn(x, gate_up, down, counts, act)` as backend `name`; `automatic(device)`: may "auto"
    pick it there; `fused`: its optional fused form."""
    _BACKENDS[name] = Backend(name, fn, supports, priority, automatic or (lambda device: True), fused)


def get_backend(name: str) -> Backend:
    """The registered backend `name`."""
    return _BACKENDS[name]


def registered_backends() -> list[str]:
    """Names of every registered backend, whatever the device."""
    return list(_BACKENDS)


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Names of the backends that run on `device` with `dtype`, best first."""
    device = torch.device(device)
    usable = [b for b in _BACKENDS.values() if b.supports(device, dtype)]
    return [b.name for b in sorted(usable, key=lambda b: -b.priority)]


def select_backend(device: torch.device | str, dtype: torch.dtype, requested: str | None = None) -> str:
    """$DS_OPTIMUS_EXPERTS_BACKEND if set, else `requested`, else the best available backend."""
    requested = os.environ.get(ENV_VAR) or requested or None
    if requested is not None and requested != "auto":
        if requested not in _BACKENDS:
            raise ValueError(f"unknown experts backend {requested!r}; registered: {', '.join(_BACKENDS)}")
        if not _BACKENDS[requested].supports(torch.device(device), dtype):
            why = " (Triton is not installed)" if requested == "triton" and not _triton_installed() else ""
            raise ValueError(f"experts backend {requested!r} does not support {dtype} on {torch.device(device)}{why}")
        return requested
    device = torch.device(device)
    return next(name for name in available_backends(device, dtype) if _BACKENDS[name].automatic(device))


def grouped_swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    act: str = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """SwiGLU experts on expert-sorted rows `x [S, H]` (`counts [E]` rows per expert); returns [S, H]."""
    name = select_backend(x.device, x.dtype, backend)
    return _BACKENDS[name].fn(x, gate_up, down, counts, act)


# -- activation ---------------------------------------------------------------------------------


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return F.silu if name == "silu" else ACT2FN[name]


def _swiglu(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate).mul_(up)  # one [S, I] temporary: these tensors are the big ones
    return _activation(act)(gate) * up  # an activation may return its input: never write in place


def _swiglu_backward(gate_up: torch.Tensor, grad_h: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate_up, h) for h = act(gate) * up, recomputing h from the pre-activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        # Written into the halves of one buffer by fused kernels (silu_backward computes in float32
        # internally), so the backward allocates one [S, I] temporary instead of a dozen.
        grad_gate_up = torch.empty_like(gate_up)
        d_gate, d_up = grad_gate_up.chunk(2, dim=-1)
        h = F.silu(gate)
        torch.mul(grad_h, h, out=d_up)
        torch.mul(grad_h, up, out=d_gate)
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)  # elementwise, in place
        return grad_gate_up, h.mul_(up)
    with torch.enable_grad():
        g = gate.detach().requires_grad_()
        u = up.detach().requires_grad_()
        h = _activation(act)(g) * u
        d_gate, d_up = torch.autograd.grad(h, (g, u), grad_h)
    return torch.cat([d_gate, d_up], dim=-1), h.detach()


# -- grouped GEMM primitives ----------------------------------------------------------------------

_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _gmm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: `a [S, K]` x `b [E, K, N]` -> [S, N], or `a [M, S]` x `b [S, N]` -> [E, M, N] (ragged K)."""
    return torch.ops.ds_optimus.grouped_mm(a, b, offsets)


# A custom op, so that torch.compile treats the grouped GEMM as one opaque call with the shapes
# below: PyTorch's own meta function for it accepts bf16 only, while the CPU kernel, which the
# float32 runs use, also takes float32.
@torch.library.custom_op("ds_optimus::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _GMM(a, b, offs=offsets)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])


class _LoopedSwiGLU(torch.autograd.Function):
    """SwiGLU experts as one dense matmul per expert into preallocated outputs; h recomputed in backward."""

    @staticmethod
    def forward(ctx, x, gate_up, down, sizes, act):
        inter = down.shape[-1]
        # Two [S, I] buffers, not halves of one [S, 2I]: strided elementwise kernels run ~2x slower on CPU bf16.
        gate, up = x.new_empty(x.shape[0], inter), x.new_empty(x.shape[0], inter)
        y = x.new_empty(x.shape[0], down.shape[1])
        for e, rows in _expert_rows(sizes):
            torch.mm(x[rows], gate_up[e, :inter].t(), out=gate[rows])
            torch.mm(x[rows], gate_up[e, inter:].t(), out=up[rows])
        h = _glu(gate, up, act)
        for e, rows in _expert_rows(sizes):
            torch.mm(h[rows], down[e].t(), out=y[rows])
        ctx.save_for_backward(x, gate_up, down, gate, up)  # h is recomputed in backward
        ctx.sizes, ctx.act = sizes, act
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, gate_up, down, gate, up = ctx.saved_tensors
        sizes, inter = ctx.sizes, down.shape[-1]
        grad_y = grad_y.contiguous()
        grad_h = grad_y.new_empty(grad_y.shape[0], inter)
        for e, rows in _expert_rows(sizes):
            torch.mm(grad_y[rows], down[e], out=grad_h[rows])
        d_gate, d_up, h = _glu_backward(gate, up, grad_h, ctx.act)
        grad_x = grad_gate_up = grad_down = None
        if ctx.needs_input_grad[2]:
            grad_down = _weight_grad_buffer(down, sizes)
            for e, rows in _expert_rows(sizes):
                torch.mm(grad_y[rows].t(), h[rows], out=grad_down[e])
        if ctx.needs_input_grad[1]:
            grad_gate_up = _weight_grad_buffer(gate_up, sizes)
            for e, rows in _expert_rows(sizes):
                torch.mm(d_gate[rows].t(), x[rows], out=grad_gate_up[e, :inter])
                torch.mm(d_up[rows].t(), x[rows], out=grad_gate_up[e, inter:])
        if ctx.needs_input_grad[0]:
            grad_x = x.new_empty(x.shape)
            for e, rows in _expert_rows(sizes):
                torch.mm(d_gate[rows], gate_up[e, :inter], out=grad_x[rows]).addmm_(d_up[rows], gate_up[e, inter:])
        return grad_x, grad_gate_up, grad_down, None, None


def _expert_rows(sizes: list[int]):
    """(expert, row slice) for every expert that has rows."""
    start = 0
    for e, n in enumerate(sizes):
        if n:
            yield e, slice(start, start + n)
            start += n


def _weight_grad_buffer(weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """An uninitialised stacked-weight gradient, zeroed only for experts without rows (a full fill costs a GEMM)."""
    grad = torch.empty_like(weight)
    for e, n in enumerate(sizes):
        if not n:
            grad[e].zero_()
    return grad


def _glu(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(gate).mul_(up)
    return _activation(act)(gate) * up  # an activation may return its input: never write in place


def _glu_backward(
    gate: torch.Tensor, up: torch.Tensor, grad_h: torch.Tensor, act: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate, d up, h) for h = act(gate) * up; d gate overwrites `grad_h`."""
    if act == "silu":
        s = F.silu(gate)
        d_up = grad_h * s
        d_gate = torch.mul(grad_h, up, out=grad_h)
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return d_gate, d_up, s.mul_(up)
    with torch.enable_grad():
        g = gate.detach().requires_grad_()
        u = up.detach().requires_grad_()
        h = _activation(act)(g) * u
        d_gate, d_up = torch.autograd.grad(h, (g, u), grad_h)
    return d_gate, d_up, h.detach()


class _GroupedSwiGLU(torch.autograd.Function):
    """Forward and backward of the SwiGLU experts written out over grouped GEMMs."""

    @staticmethod
    def forward(ctx, x, gate_up, down, offsets, act):
        gu = _gmm(x, gate_up.transpose(-2, -1), offsets)  # [S, 2I]
        y = _gmm(_swiglu(gu, act), down.transpose(-2, -1), offsets)  # [S, H]
        ctx.save_for_backward(x, gate_up, down, gu, offsets)  # h is recomputed from gu in backward
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, gate_up, down, gu, offsets = ctx.saved_tensors
        if x.shape[0] == 0:  # no rows (e.g. an EP rank that received none): zero gradients
            return torch.zeros_like(x), torch.zeros_like(gate_up), torch.zeros_like(down), None, None
        grad_y = grad_y.contiguous()
        grad_h = _gmm(grad_y, down, offsets)  # [S, I]
        grad_gu, h = _swiglu_backward(gu, grad_h, ctx.act)
        grad_down = _gmm(grad_y.t(), h, offsets) if ctx.needs_input_grad[2] else None  # [E, H, I]
        grad_gate_up = _gmm(grad_gu.t(), x, offsets) if ctx.needs_input_grad[1] else None  # [E, 2I, H]
        grad_x = _gmm(grad_gu, gate_up, offsets) if ctx.needs_input_grad[0] else None  # [S, H]
        return grad_x, grad_gate_up, grad_down, None, None


def _grouped_mm_backend(x, gate_up, down, counts, act):
    if not _gmm_aligned(x, gate_up, down):
        return _looped_backend(x, gate_up, down, counts, act)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return _GroupedSwiGLU.apply(x, gate_up, down, offsets, act)


def _looped_backend(x, gate_up, down, counts, act):
    sizes = counts.tolist()
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"experts got {x.shape[0]} rows but counts sum to {sum(sizes)}")
    return _LoopedSwiGLU.apply(x, gate_up, down, counts.tolist(), act)


def _reference_backend(x, gate_up, down, counts, act):
    fn = _activation(act)
    outputs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outputs.append(F.linear(fn(gate) * up, down[e]))
    return torch.cat(outputs) if outputs else x.new_zeros(0, down.shape[1])


def _gmm_aligned(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    # The grouped GEMM kernels need 16-byte aligned row strides and base pointers. A traced graph
    # cannot read pointers; there the inputs are fresh buffers and parameters, which are aligned.
    size = x.element_size()
    dims_ok = all((d * size) % 16 == 0 for d in (gate_up.shape[-1], down.shape[-1]))
    if torch.compiler.is_compiling():
        return dims_ok
    return dims_ok and all(t.data_ptr() % 16 == 0 for t in (x, gate_up, down))


_TORCH_2_9 = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if _GMM is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if device.type == "cpu":
        return _TORCH_2_9  # PyTorch 2.8's grouped GEMM has no CPU kernel
    if device.type == "cuda":
        # CUDA's grouped GEMM takes bf16 only: sm80 and newer from PyTorch 2.9, Hopper only before.
        capability = torch.cuda.get_device_capability(device)
        return dtype == torch.bfloat16 and (capability >= (8, 0) if _TORCH_2_9 else capability[0] == 9)
    return False


def _triton_installed() -> bool:
    from ..ops import moe  # ds_optimus.ops: needs neither Triton nor DeepSpeed to import

    return moe.triton_available()


def _triton_supported(device: torch.device, dtype: torch.dtype) -> bool:
    from ..ops import moe

    return dtype in (torch.float32, torch.bfloat16, torch.float16) and moe.triton_runs_on(device)


def _triton_backend(x, gate_up, down, counts, act):
    if act != "silu":  # the kernels fuse SiLU; other gated activations take the grouped GEMM path
        return _grouped_mm_or_looped(x, gate_up, down, counts, act)
    from ..ops import swiglu_experts

    return swiglu_experts(x, gate_up, down, counts)


def _triton_fused(x, gate_up, down, plan, weights, act):
    if act != "silu":
        return None
    from ..ops import moe_swiglu

    return moe_swiglu(x, gate_up, down, plan.counts, plan.token_of_sorted, plan.order, weights)


def _grouped_mm_or_looped(x, gate_up, down, counts, act):
    if _grouped_mm_supported(x.device, x.dtype):
        return _grouped_mm_backend(x, gate_up, down, counts, act)
    return _looped_backend(x, gate_up, down, counts, act)


register_backend("reference", _reference_backend, lambda device, dtype: True, priority=0)
register_backend("looped", _looped_backend, lambda device, dtype: dtype.is_floating_point, priority=10)
register_backend("grouped_mm", _grouped_mm_backend, _grouped_mm_supported, priority=20)
# On the CPU the kernels only run in Triton's interpreter (for tests): never picked automatically.
register_backend(
    "triton",
    _triton_backend,
    _triton_supported,
    priority=30,
    automatic=lambda device: device.type != "cpu",
    fused=_triton_fused,
)


@dataclass(frozen=True)
class MoEConfig(Section):
    """`optimus.moe`: which grouped-GEMM backend the MoE layers use ("auto": the best one for the
    device and dtype), and uniform routing, a benchmark mode."""

    experts_backend: str = "auto"  # the experts backend of every MoE layer; "auto": the best for the device and dtype
    # Benchmark mode: every token goes to fixed experts that load all experts equally, so the expert
    # kernels and the expert-parallel exchange are measured without routing noise; the router still runs
    # and learns. ds_optimus.train takes it only in a run that keeps nothing (train.export and
    # checkpoint.enabled false).
    force_uniform_routing: bool = False

    def check(self, where: str) -> None:
        known = ["auto", *registered_backends()]
        need(
            self.experts_backend in known,
            f"{where}.experts_backend must be one of {', '.join(known)}, got {self.experts_backend!r}",
        )

"""Triton kernels of the MoE routing ops (`ds_optimus.ops.routing`): `route`, `gather`, `combine` and
`combine_backward`, with the reference functions' names, signatures and results.

Portable Triton only (no atomics, no CUDA-specific intrinsics): NVIDIA, AMD and Intel GPUs, and the CPU under
`TRITON_INTERPRET=1`. Nothing waits for the host: every grid comes from shapes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Default tiles. route: BLOCK slots against EXPERT_TILE experts at a time. Its scan goes through shared
# memory in proportion to BLOCK x EXPERT_TILE (16 KiB with these, on sm_90), well within every GPU's;
# larger blocks would shrink the (E x blocks) histogram the prefix sum reads, at the price of more
# shared memory. Row kernels: 32 rows x 128 columns, 4096 elements a program.
ROUTE_BLOCK = 512
ROUTE_EXPERT_TILE = 16
ROUTE_WARPS = 8
ROW_BLOCK = 32
COL_BLOCK = 128
ROW_WARPS = 4


def _launch_options(num_warps: int, **options) -> dict:
    # The interpreter has no warps or compiler options; keep launch options off its path.
    return {} if INTERPRET else dict(num_warps=num_warps, **options)


# The sums of combine and combine_backward: products rounded before they are added, as in the reference,
# rather than fused into FMAs, so compiled kernels add the very terms the reference adds.
_NO_FMA = dict(enable_fp_fusion=False)


# Triton's interpreter converts bfloat16 with bit tricks of its own: float32 -> bfloat16 truncates (its
# explicit round-to-nearest does not break ties to even), and bfloat16 subnormals -> float32 lose their
# value. Under the interpreter (EXACT_BF16) both conversions are done here on the bits, as GPUs and torch
# do them; compiled kernels never see that branch and use the hardware's conversions.


@triton.jit
def _f32(x, EXACT_BF16: tl.constexpr):
    """`x` widened to float32, exactly."""
    if EXACT_BF16:
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def _round(x, dtype: tl.constexpr, EXACT_BF16: tl.constexpr):
    """float32 `x` rounded to nearest (ties to even) in `dtype`, as torch rounds."""
    if EXACT_BF16:
        if dtype == tl.bfloat16:
            # Add just under half a bfloat16 ulp, plus one when the kept bits are odd, and drop the low
            # half. NaN would carry into the exponent: it becomes torch's quiet NaN 0x7FC0 instead.
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(x != x, 0x7FC0, rounded)
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


# -- route ----------------------------------------------------------------------------------------


@triton.jit
def _route_histogram_kernel(ids_ptr, hist_ptr, S, E, num_blocks, BLOCK: tl.constexpr, EXPERT_TILE: tl.constexpr):
    """hist[e, b] = how many of block b's slots chose expert e."""
    b = tl.program_id(0)
    slots = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # Slots past the end read -1, which matches no expert.
    ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1)
    for e0 in range(0, E, EXPERT_TILE):
        experts = e0 + tl.arange(0, EXPERT_TILE)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        tl.store(hist_ptr + experts.to(tl.int64) * num_blocks + b, tl.sum(hits, axis=0), mask=experts < E)


@triton.jit
def _route_scatter_kernel(
    ids_ptr, starts_ptr, order_ptr, inverse_ptr, S, E, num_blocks, BLOCK: tl.constexpr, EXPERT_TILE: tl.constexpr
):
    """inverse[s] = starts[e, b] + (rank of slot s among block b's slots of expert e); order = its inverse."""
    b = tl.program_id(0)
    slots = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = slots < S
    ids = tl.load(ids_ptr + slots, mask=in_range, other=-1)
    position = tl.zeros([BLOCK], dtype=tl.int64)
    for e0 in range(0, E, EXPERT_TILE):
        experts = e0 + tl.arange(0, EXPERT_TILE)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        # Exclusive running count down the slots: earlier slots of the same expert come first (stable).
        rank = tl.cumsum(hits, axis=0) - hits
        start = tl.load(starts_ptr + experts.to(tl.int64) * num_blocks + b, mask=experts < E, other=0)
        # Each slot hits one column of one tile; the others add zero.
        position += tl.sum(hits.to(tl.int64) * (start[None, :] + rank), axis=1)
    tl.store(inverse_ptr + slots, position, mask=in_range)
    tl.store(order_ptr + position, slots, mask=in_range)


def route(
    ids: Tensor, num_experts: int, *, block: int = ROUTE_BLOCK, expert_tile: int = ROUTE_EXPERT_TILE
) -> tuple[Tensor, Tensor, Tensor]:
    """(order [S], inverse [S], counts [E]), all int64: the slots of `ids [T, k]` sorted by expert, stably."""
    # A two-pass counting sort: per-block histograms, a prefix sum over them, then each slot's rank in its block.
    flat = ids.reshape(-1).contiguous()
    num_slots = flat.numel()
    num_blocks = triton.cdiv(num_slots, block)
    tile = min(expert_tile, triton.next_power_of_2(num_experts))
    hist = torch.empty(num_experts, num_blocks, dtype=torch.int32, device=flat.device)
    options = _launch_options(ROUTE_WARPS)
    _route_histogram_kernel[(num_blocks,)](
        flat, hist, num_slots, num_experts, num_blocks, BLOCK=block, EXPERT_TILE=tile, **options
    )
    # Expert-major, so (expert, block) order is the flat order: run e of block b starts after every
    # earlier expert's slots and expert e's slots in earlier blocks.
    runs = hist.view(-1)
    starts = torch.cumsum(runs, 0) - runs  # int64
    order = torch.empty(num_slots, dtype=torch.int64, device=flat.device)
    inverse = torch.empty_like(order)
    _route_scatter_kernel[(num_blocks,)](
        flat, starts, order, inverse, num_slots, num_experts, num_blocks, BLOCK=block, EXPERT_TILE=tile, **options
    )
    counts = hist.sum(1, dtype=torch.int64)
    return order, inverse, counts


# -- gather ---------------------------------------------------------------------------------------


@triton.jit
def _gather_kernel(
    x_ptr,
    index_ptr,
    weight_ptr,
    out_ptr,
    S,
    H,
    stride_x,
    stride_out,
    HAS_WEIGHT: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[p] = x[index[p]] (times weight[p] in float32, rounded once)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < S
    mask = row_mask[:, None] & (cols < H)[None, :]
    source = tl.load(index_ptr + rows, mask=row_mask, other=0)
    values = tl.load(x_ptr + source[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_WEIGHT:
        weight = _f32(tl.load(weight_ptr + rows, mask=row_mask, other=0.0), EXACT_BF16)
        values = _round(_f32(values, EXACT_BF16) * weight[:, None], out_ptr.dtype.element_ty, EXACT_BF16)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], values, mask=mask)


def gather(
    x: Tensor, index: Tensor, weight: Tensor | None, *, block_rows: int = ROW_BLOCK, block_cols: int = COL_BLOCK
) -> Tensor:
    """Rows `x[index[p]]` ([S, H], x's dtype), times `weight[p]` (in float32, rounded once) when given."""
    x = x.contiguous()
    index = index.contiguous()
    num_rows, hidden = index.numel(), x.shape[1]
    out = x.new_empty(num_rows, hidden)
    weight = weight.contiguous() if weight is not None else None
    # Rows on the first grid axis: it is the one allowed more than 65535 programs.
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden, block_cols))
    _gather_kernel[grid](
        x,
        index,
        weight if weight is not None else x,
        out,
        num_rows,
        hidden,
        x.stride(0),
        out.stride(0),
        HAS_WEIGHT=weight is not None,
        EXACT_BF16=INTERPRET,
        BLOCK_R=block_rows,
        BLOCK_H=block_cols,
        **_launch_options(ROW_WARPS),
    )
    return out


# -- combine --------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    src_ptr,
    table_ptr,
    weight_ptr,
    out_ptr,
    N,
    H,
    D,
    stride_src,
    stride_out,
    HAS_WEIGHT: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[r] = sum over j of weight[table[r, j]] * src[table[r, j]] (table -1: skipped), float32, j order."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < N
    col_mask = cols < H
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for j in range(0, D):
        entry = tl.load(table_ptr + rows * D + j, mask=row_mask, other=-1)
        valid = entry >= 0
        # A missing entry loads 0.0, so adding it leaves the sum as the reference's masked add does.
        part = _f32(
            tl.load(
                src_ptr + entry[:, None] * stride_src + cols[None, :],
                mask=valid[:, None] & col_mask[None, :],
                other=0.0,
            ),
            EXACT_BF16,
        )
        if HAS_WEIGHT:
            weight = _f32(tl.load(weight_ptr + entry, mask=valid, other=0.0), EXACT_BF16)
            part = part * weight[:, None]
        acc += part
    out = _round(acc, out_ptr.dtype.element_ty, EXACT_BF16)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def combine(
    src: Tensor, table: Tensor, weight: Tensor | None, *, block_rows: int = ROW_BLOCK, block_cols: int = COL_BLOCK
) -> Tensor:
    """Row r = sum_j `weight[table[r, j]] * src[table[r, j]]` ([N, H], src's dtype; float32 sums)."""
    src = src.contiguous()
    table = table.contiguous()
    num_rows, depth = table.shape
    hidden = src.shape[1]
    out = src.new_empty(num_rows, hidden)
    weight = weight.contiguous() if weight is not None else None
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden, block_cols))
    _combine_kernel[grid](
        src,
        table,
        weight if weight is not None else src,
        out,
        num_rows,
        hidden,
        depth,
        src.stride(0),
        out.stride(0),
        HAS_WEIGHT=weight is not None,
        EXACT_BF16=INTERPRET,
        BLOCK_R=block_rows,
        BLOCK_H=block_cols,
        **_launch_options(ROW_WARPS, **_NO_FMA),
    )
    return out


# -- combine backward -----------------------------------------------------------------------------


@triton.jit
def _combine_backward_kernel(
    grad_ptr,
    src_ptr,
    row_of_ptr,
    weight_ptr,
    grad_src_ptr,
    grad_w_ptr,
    S,
    H,
    stride_grad,
    stride_src,
    stride_grad_src,
    HAS_WEIGHT: tl.constexpr,
    NEED_WEIGHT_GRAD: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """grad_src[p] = weight[p] * grad[row_of[p]]; grad_w[p] = dot(src[p], grad[row_of[p]]) in float32."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < S
    target = tl.load(row_of_ptr + rows, mask=row_mask, other=0)
    if HAS_WEIGHT:
        weight = _f32(tl.load(weight_ptr + rows, mask=row_mask, other=0.0), EXACT_BF16)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    # The whole row in one program: the dot product needs no cross-program reduction.
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        g = tl.load(grad_ptr + target[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0)
        if NEED_WEIGHT_GRAD:
            s = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
            dot += tl.sum(_f32(s, EXACT_BF16) * _f32(g, EXACT_BF16), axis=1)
        if HAS_WEIGHT:
            g = _round(_f32(g, EXACT_BF16) * weight[:, None], grad_src_ptr.dtype.element_ty, EXACT_BF16)
        tl.store(grad_src_ptr + rows[:, None] * stride_grad_src + cols[None, :], g, mask=mask)
    if NEED_WEIGHT_GRAD:
        tl.store(grad_w_ptr + rows, dot, mask=row_mask)


def combine_backward(
    grad: Tensor,
    src: Tensor,
    row_of: Tensor,
    weight: Tensor | None,
    need_weight_grad: bool,
    *,
    block_rows: int = ROW_BLOCK,
    block_cols: int = COL_BLOCK,
) -> tuple[Tensor, Tensor]:
    """(`weight[p] * grad[row_of[p]]` [S, H] of grad's dtype, `dot(src[p], grad[row_of[p]])` float32 [S],
    or an empty float32 tensor without `need_weight_grad`)."""
    grad = grad.contiguous()
    row_of = row_of.contiguous()
    num_rows, hidden = row_of.numel(), grad.shape[1]
    grad_src = grad.new_empty(num_rows, hidden)
    grad_w = torch.empty(num_rows if need_weight_grad else 0, dtype=torch.float32, device=grad.device)
    # Without the weight's gradient `src` may be an empty placeholder; the kernel then never reads it.
    src = src.contiguous() if need_weight_grad else grad
    weight = weight.contiguous() if weight is not None else None
    _combine_backward_kernel[(triton.cdiv(num_rows, block_rows),)](
        grad,
        src,
        row_of,
        weight if weight is not None else grad,
        grad_src,
        grad_w if need_weight_grad else grad,
        num_rows,
        hidden,
        grad.stride(0),
        src.stride(0),
        grad_src.stride(0),
        HAS_WEIGHT=weight is not None,
        NEED_WEIGHT_GRAD=need_weight_grad,
        EXACT_BF16=INTERPRET,
        BLOCK_R=block_rows,
        BLOCK_H=block_cols,
        **_launch_options(ROW_WARPS, **_NO_FMA),
    )
    return grad_src, grad_w

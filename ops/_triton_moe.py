"""Triton kernels of the SwiGLU experts: grouped GEMMs over expert-sorted rows, with the token
gather, the SwiGLU, the routing weights and the scatter to slot order fused in. Portable Triton only
(no CUDA intrinsics): it runs on NVIDIA, AMD and Intel GPUs, and on the CPU under `TRITON_INTERPRET=1`.

Expert e owns sorted positions `[starts[e], ends[e])`; position p reads input row `src[p]` and writes
output row `dst[p]` (its slot t*k + j; each the identity when absent), scaled by `weights[dst[p]]`.
Weights are `gate_up [E, 2I, H]` (gate rows first) and `down [E, H, I]`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# -- device helpers -------------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Triton's interpreter multiplies bfloat16 tiles as raw integers (numpy has no bfloat16), so it
    # gets them as float32: the products of 16-bit floats are exact in float32, so the result is
    # the one the GPU's 16-bit MMA with float32 accumulation gives.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _row_tile(tile_expert_ptr, starts_ptr, ends_ptr, first_tile_ptr, pid, BLOCK_M: tl.constexpr):
    """(expert, sorted positions of this tile, their mask); expert is -1 for a spare tile."""
    e = tl.load(tile_expert_ptr + pid)
    e_safe = tl.maximum(e, 0)
    start = tl.load(starts_ptr + e_safe)
    end = tl.load(ends_ptr + e_safe)
    first = tl.load(first_tile_ptr + e_safe)
    rows = start + (pid - first) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, rows, rows < end


@triton.jit
def _rows_times_weight(
    a_rows,
    row_mask,
    w_base,
    stride_wk,
    stride_wn,
    cols,
    col_mask,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc[m, n] = sum_k a_rows[m][k] * w_base[k * stride_wk + cols[n] * stride_wn] in float32;
    `a_rows`: one pointer per row."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(
            w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = _mma(a, b, acc, UPCAST, PRECISION)
    return acc


# -- forward --------------------------------------------------------------------------------------


@triton.jit
def _gate_up_fwd_kernel(
    x_ptr,
    src_ptr,
    w_ptr,
    gu_ptr,
    h_ptr,
    tile_expert_ptr,
    starts_ptr,
    ends_ptr,
    first_tile_ptr,
    H,
    INTER,
    stride_x,
    stride_w0,
    stride_w1,
    stride_w2,
    stride_gu,
    stride_h,
    HAS_SRC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """gu[p] = x[src[p]] @ gate_up[e].T (pre-activation) and h[p] = silu(gate) * up."""
    e, rows, row_mask = _row_tile(tile_expert_ptr, starts_ptr, ends_ptr, first_tile_ptr, tl.program_id(1), BLOCK_M)
    if e < 0:
        return
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    if HAS_SRC:
        src = tl.load(src_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    w_base = w_ptr + e.to(tl.int64) * stride_w0
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        a = tl.load(x_ptr + src[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        b_gate = tl.load(w_base + cols[None, :] * stride_w1 + ks[:, None] * stride_w2, mask=b_mask, other=0.0)
        b_up = tl.load(w_base + (cols[None, :] + INTER) * stride_w1 + ks[:, None] * stride_w2, mask=b_mask, other=0.0)
        acc_gate = _mma(a, b_gate, acc_gate, UPCAST, PRECISION)
        acc_up = _mma(a, b_up, acc_up, UPCAST, PRECISION)
    out_dtype = gu_ptr.dtype.element_ty
    gate = acc_gate.to(out_dtype)
    up = acc_up.to(out_dtype)
    mask = row_mask[:, None] & col_mask[None, :]
    gu_rows = gu_ptr + rows.to(tl.int64)[:, None] * stride_gu
    tl.store(gu_rows + cols[None, :], gate, mask=mask)
    tl.store(gu_rows + INTER + cols[None, :], up, mask=mask)
    # h from the rounded pre-activation, as the backward recomputes it.
    g32 = gate.to(tl.float32)
    h = g32 * tl.sigmoid(g32) * up.to(tl.float32)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], h.to(out_dtype), mask=mask)


@triton.jit
def _rows_gemm_scatter_kernel(
    a_ptr,
    w_ptr,
    y_ptr,
    dst_ptr,
    rw_ptr,
    tile_expert_ptr,
    starts_ptr,
    ends_ptr,
    first_tile_ptr,
    N,
    K,
    stride_a,
    stride_w0,
    stride_wk,
    stride_wn,
    stride_y,
    HAS_DST: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[dst[p], n] = weights[dst[p]] * sum_k a[p, k] * w[e, k, n] (strides as given): the down
    projection (a = h, w = down[e].T, weighted) and the input gradient (a = dgu, w = gate_up[e])."""
    e, rows, row_mask = _row_tile(tile_expert_ptr, starts_ptr, ends_ptr, first_tile_ptr, tl.program_id(1), BLOCK_M)
    if e < 0:
        return
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = w_ptr + e.to(tl.int64) * stride_w0
    acc = _rows_times_weight(
        a_ptr + rows.to(tl.int64) * stride_a,
        row_mask,
        w_base,
        stride_wk,
        stride_wn,
        cols,
        col_mask,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        UPCAST,
        PRECISION,
    )
    if HAS_DST:
        dst = tl.load(dst_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        dst = rows.to(tl.int64)
    if HAS_WEIGHTS:
        acc = acc * tl.load(rw_ptr + dst, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + dst[:, None] * stride_y + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# -- backward -------------------------------------------------------------------------------------


@triton.jit
def _down_bwd_kernel(
    g_ptr,
    gsrc_ptr,
    w_ptr,
    gu_ptr,
    dst_ptr,
    rw_ptr,
    dgu_ptr,
    hw_ptr,
    gw_ptr,
    tile_expert_ptr,
    starts_ptr,
    ends_ptr,
    first_tile_ptr,
    H,
    INTER,
    stride_g,
    stride_w0,
    stride_w1,
    stride_w2,
    stride_gu,
    stride_dgu,
    stride_hw,
    stride_gw,
    HAS_GSRC: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Backward through down and the SwiGLU from the saved pre-activation: a = g[gsrc[p]] @ down[e];
    d gate and d up into dgu, w * h into hw, this column block's part of sum(a * h) into gw[p, block]."""
    e, rows, row_mask = _row_tile(tile_expert_ptr, starts_ptr, ends_ptr, first_tile_ptr, tl.program_id(1), BLOCK_M)
    if e < 0:
        return
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    if HAS_GSRC:
        gsrc = tl.load(gsrc_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        gsrc = rows.to(tl.int64)
    w_base = w_ptr + e.to(tl.int64) * stride_w0
    acc = _rows_times_weight(
        g_ptr + gsrc * stride_g,
        row_mask,
        w_base,
        stride_w1,
        stride_w2,
        cols,
        col_mask,
        H,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        UPCAST,
        PRECISION,
    )
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    gu_rows = gu_ptr + rows64[:, None] * stride_gu
    gate = tl.load(gu_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_rows + INTER + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    act = gate * sig
    h = act * up
    if HAS_WEIGHTS:
        if HAS_DST:
            dst = tl.load(dst_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            dst = rows64
        w = tl.load(rw_ptr + dst, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(gw_ptr + rows64 * stride_gw + pid_n, tl.sum(acc * h, axis=1), mask=row_mask)
        acc = acc * w[:, None]
        h = h * w[:, None]
    d_up = acc * act
    d_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
    out_dtype = dgu_ptr.dtype.element_ty
    dgu_rows = dgu_ptr + rows64[:, None] * stride_dgu
    tl.store(dgu_rows + cols[None, :], d_gate.to(out_dtype), mask=mask)
    tl.store(dgu_rows + INTER + cols[None, :], d_up.to(out_dtype), mask=mask)
    tl.store(hw_ptr + rows64[:, None] * stride_hw + cols[None, :], h.to(out_dtype), mask=mask)


@triton.jit
def _weight_grad_kernel(
    a_ptr,
    asrc_ptr,
    b_ptr,
    bsrc_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    M,
    N,
    stride_a,
    stride_b,
    stride_o0,
    stride_o1,
    HAS_ASRC: tl.constexpr,
    HAS_BSRC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[e] = a[asrc[rows of e]].T @ b[bsrc[rows of e]] (ragged K); zeros for an expert without rows."""
    e = tl.program_id(2)
    start = tl.load(starts_ptr + e)
    end = tl.load(ends_ptr + e)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = ms < M
    n_mask = ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < end
        if HAS_ASRC:
            ra = tl.load(asrc_ptr + ks, mask=k_mask, other=0).to(tl.int64)
        else:
            ra = ks.to(tl.int64)
        if HAS_BSRC:
            rb = tl.load(bsrc_ptr + ks, mask=k_mask, other=0).to(tl.int64)
        else:
            rb = ks.to(tl.int64)
        a = tl.load(a_ptr + ra[None, :] * stride_a + ms[:, None], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * stride_b + ns[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _mma(a, b, acc, UPCAST, PRECISION)
    out = out_ptr + e.to(tl.int64) * stride_o0 + ms[:, None] * stride_o1 + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# -- launchers ------------------------------------------------------------------------------------

# Tile sizes: a starting point for 16-bit data on current GPUs. `benchmarks/tune_moe_kernels.py
# --write` measures better ones per GPU into tuned_blocks.json (looked up by device name); tests pass
# small blocks to exercise ragged tiles.
DEFAULT_BLOCKS = {
    "gate_up": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    "down": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "down_bwd": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    "dx": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "weight_grad": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
}
_TUNED_FILE = Path(__file__).with_name("tuned_blocks.json")
_tuned: dict | None = None


def _device_name(device: torch.device) -> str | None:
    module = getattr(torch, device.type, None)  # torch.cuda (NVIDIA and AMD), torch.xpu
    try:
        return module.get_device_name(device) if module is not None else None
    except (AssertionError, RuntimeError, AttributeError):
        return None


def shared_memory_bytes(name: str, cfg: dict, element_size: int) -> int:
    """The shared memory kernel `name` asks for with `cfg`: a row tile and the weight tiles per stage."""
    weight_tiles = 2 if name == "gate_up" else 1
    tile = cfg["BLOCK_M"] * cfg["BLOCK_K"] + weight_tiles * cfg["BLOCK_K"] * cfg["BLOCK_N"]
    return cfg.get("num_stages", 1) * tile * element_size


def fit_shared_memory(name: str, cfg: dict, element_size: int, limit: int | None) -> dict:
    """`cfg` with fewer stages, then narrower K and N tiles, until kernel `name` fits `limit` bytes."""
    # tiles are tuned on 16-bit data; float32 doubles every tile
    cfg = dict(cfg)
    while limit and shared_memory_bytes(name, cfg, element_size) > limit:
        if cfg.get("num_stages", 1) > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        elif cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        else:
            break
    return cfg


def _shared_memory_limit(device: torch.device) -> int | None:
    module = getattr(torch, device.type, None)
    try:
        return getattr(module.get_device_properties(device), "shared_memory_per_block_optin", None)
    except (AssertionError, RuntimeError, AttributeError):
        return None


def resolve_blocks(name: str, device: torch.device | str, blocks: dict | None = None, element_size: int = 2) -> dict:
    """Tile sizes and launch options of kernel `name` on `device`: defaults, then this GPU's tuned
    entry (fitted to its shared memory), then `blocks[name]`."""
    global _tuned
    if _tuned is None:
        _tuned = json.loads(_TUNED_FILE.read_text()) if _TUNED_FILE.exists() else {}
    cfg = dict(DEFAULT_BLOCKS[name])
    device = torch.device(device)
    if device.type != "cpu":
        cfg.update(_tuned.get(_device_name(device) or "", {}).get(name, {}))
        cfg = fit_shared_memory(name, cfg, element_size, _shared_memory_limit(device))
    if blocks and name in blocks:
        cfg.update(blocks[name])
    if INTERPRET:  # launch options mean nothing to the interpreter
        cfg.pop("num_warps", None)
        cfg.pop("num_stages", None)
    return cfg


def _numerics(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        tf32 = torch.backends.cuda.matmul.allow_tf32 and not INTERPRET
        return dict(UPCAST=False, PRECISION="tf32" if tf32 else "ieee")
    return dict(UPCAST=INTERPRET, PRECISION="ieee" if INTERPRET else "tf32")


class _Schedule:
    """Where each expert's rows are, and the row-tile table of one tile height."""

    def __init__(self, counts: torch.Tensor, num_rows: int):
        counts = counts.to(torch.int64)
        self.num_experts = counts.numel()
        self.ends = torch.cumsum(counts, 0)
        self.starts = self.ends - counts
        self.counts = counts
        self.num_rows = num_rows
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(expert of each row tile or -1, first tile of each expert, number of tiles to launch)."""
        if block_m not in self._tiles:
            per_expert = (self.counts + block_m - 1) // block_m
            cum = torch.cumsum(per_expert, 0)
            # built on the device so nothing waits for the host: the most any routing needs; spares exit
            grid = triton.cdiv(self.num_rows, block_m) + self.num_experts
            ids = torch.arange(grid, device=self.counts.device)
            expert = torch.searchsorted(cum, ids, right=True)
            expert = torch.where(expert < self.num_experts, expert, -1).to(torch.int32)
            self._tiles[block_m] = (expert, cum - per_expert, grid)
        return self._tiles[block_m]

    def row_grid(self, cfg: dict, columns: int) -> tuple[tuple[int, int], tuple]:
        """(grid, row-tile table arguments) of a row-tile kernel over `columns` output columns."""
        expert, first, tiles = self.tiles(cfg["BLOCK_M"])
        # columns on the fastest axis: programs running at once share row tiles and weights in L2
        return (triton.cdiv(columns, cfg["BLOCK_N"]), tiles), (expert, self.starts, self.ends, first)


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    # An absent optional tensor: the kernel never reads it (its HAS_* flag is off).
    return t if t is not None else placeholder


def launch_gate_up(x, src, gate_up, gu, h, sched: _Schedule, cfg: dict, num: dict) -> None:
    """gu = x[src] @ gate_up[e].T per expert, h = silu(gate) * up."""
    inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    grid, table = sched.row_grid(cfg, inter)
    _gate_up_fwd_kernel[grid](
        x,
        _or(src, x),
        gate_up,
        gu,
        h,
        *table,
        hidden,
        inter,
        x.stride(0),
        *gate_up.stride(),
        gu.stride(0),
        h.stride(0),
        HAS_SRC=src is not None,
        **cfg,
        **num,
    )


def launch_down(h, down, y, dst, weights, sched: _Schedule, cfg: dict, num: dict) -> None:
    """y[dst] = weights[dst] * (h @ down[e].T) per expert."""
    hidden, inter = down.shape[1], down.shape[2]
    grid, table = sched.row_grid(cfg, hidden)
    _rows_gemm_scatter_kernel[grid](
        h,
        down,
        y,
        _or(dst, h),
        _or(weights, h),
        *table,
        hidden,
        inter,
        h.stride(0),
        down.stride(0),
        down.stride(2),
        down.stride(1),
        y.stride(0),
        HAS_DST=dst is not None,
        HAS_WEIGHTS=weights is not None,
        **cfg,
        **num,
    )


def launch_down_bwd(
    grad, grad_src, down, gu, dst, weights, dgu, hw, gw_parts, sched: _Schedule, cfg: dict, num: dict
) -> None:
    """dgu, hw = w * h and the routing-weight gradient parts from the output gradient grad[grad_src]."""
    hidden, inter = down.shape[1], down.shape[2]
    grid, table = sched.row_grid(cfg, inter)
    gw_parts = _or(gw_parts, hw)
    _down_bwd_kernel[grid](
        grad,
        _or(grad_src, grad),
        down,
        gu,
        _or(dst, gu),
        _or(weights, gu),
        dgu,
        hw,
        gw_parts,
        *table,
        hidden,
        inter,
        grad.stride(0),
        *down.stride(),
        gu.stride(0),
        dgu.stride(0),
        hw.stride(0),
        gw_parts.stride(0),
        HAS_GSRC=grad_src is not None,
        HAS_DST=dst is not None,
        HAS_WEIGHTS=weights is not None,
        **cfg,
        **num,
    )


def launch_weight_grad(a, asrc, b, bsrc, out, sched: _Schedule, cfg: dict, num: dict) -> None:
    """out[e] = a[asrc[rows of e]].T @ b[bsrc[rows of e]] for every expert (out [E, M, N] contiguous)."""
    m, n = out.shape[1], out.shape[2]
    # the expert on the slowest axis: programs running at once read the same expert's rows
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), sched.num_experts)
    _weight_grad_kernel[grid](
        a,
        _or(asrc, a),
        b,
        _or(bsrc, b),
        out,
        sched.starts,
        sched.ends,
        m,
        n,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_ASRC=asrc is not None,
        HAS_BSRC=bsrc is not None,
        **cfg,
        **num,
    )


def launch_dx(dgu, gate_up, dx, dst, sched: _Schedule, cfg: dict, num: dict) -> None:
    """dx[dst] = dgu @ gate_up[e] per expert."""
    hidden = gate_up.shape[2]
    grid, table = sched.row_grid(cfg, hidden)
    _rows_gemm_scatter_kernel[grid](
        dgu,
        gate_up,
        dx,
        _or(dst, dgu),
        dgu,
        *table,
        hidden,
        gate_up.shape[1],
        dgu.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up.stride(2),
        dx.stride(0),
        HAS_DST=dst is not None,
        HAS_WEIGHTS=False,
        **cfg,
        **num,
    )


def forward(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    src: torch.Tensor | None,
    dst: torch.Tensor | None,
    weights: torch.Tensor | None,
    out_rows: int,
    blocks: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [out_rows, H] written at rows dst, pre-activation gu [S, 2I]) for the sorted rows."""
    num_sorted = src.numel() if src is not None else x.shape[0]
    inter, hidden = down.shape[-1], down.shape[1]
    x = x.contiguous()
    gu = x.new_empty(num_sorted, 2 * inter)
    y = x.new_empty(out_rows, hidden)
    if num_sorted == 0:
        return y.zero_(), gu
    sched = _Schedule(counts, num_sorted)
    num = _numerics(x.dtype)
    h = x.new_empty(num_sorted, inter)
    launch_gate_up(x, src, gate_up, gu, h, sched, resolve_blocks("gate_up", x.device, blocks, x.element_size()), num)
    launch_down(h, down, y, dst, weights, sched, resolve_blocks("down", x.device, blocks, x.element_size()), num)
    return y, gu


def backward(
    grad: torch.Tensor,
    grad_src: torch.Tensor | None,
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    src: torch.Tensor | None,
    dst: torch.Tensor | None,
    weights: torch.Tensor | None,
    gu: torch.Tensor,
    dx_rows: int,
    blocks: dict | None = None,
):
    """Gradients of `forward`, position p's output gradient at row grad_src[p] of `grad` (None: sorted):
    (dx [dx_rows, H] at rows dst, d gate_up, d down, routing-weight gradient per position or None)."""
    num_sorted = gu.shape[0]
    inter, hidden = down.shape[-1], down.shape[1]
    grad = grad.contiguous()
    x = x.contiguous()
    d_gate_up = gate_up.new_empty(gate_up.shape)  # contiguous, whatever the weights' strides
    d_down = down.new_empty(down.shape)
    dx = x.new_empty(dx_rows, hidden)
    if num_sorted == 0:
        gw = grad.new_zeros(0, dtype=torch.float32) if weights is not None else None
        return dx.zero_(), d_gate_up.zero_(), d_down.zero_(), gw
    sched = _Schedule(counts, num_sorted)
    num = _numerics(x.dtype)
    dgu = torch.empty_like(gu)
    hw = gu.new_empty(num_sorted, inter)
    cfg = resolve_blocks("down_bwd", x.device, blocks, x.element_size())
    gw_parts = None
    if weights is not None:  # one partial sum per column tile: summed below, no atomics
        gw_parts = torch.empty(num_sorted, triton.cdiv(inter, cfg["BLOCK_N"]), device=gu.device, dtype=torch.float32)
    launch_down_bwd(grad, grad_src, down, gu, dst, weights, dgu, hw, gw_parts, sched, cfg, num)
    cfg = resolve_blocks("weight_grad", x.device, blocks, x.element_size())
    launch_weight_grad(grad, grad_src, hw, None, d_down, sched, cfg, num)  # g[grad_src].T @ (w * h)
    launch_weight_grad(dgu, None, x, src, d_gate_up, sched, cfg, num)  # dgu.T @ x[src]
    launch_dx(dgu, gate_up, dx, dst, sched, resolve_blocks("dx", x.device, blocks, x.element_size()), num)
    return dx, d_gate_up, d_down, (gw_parts.sum(1) if gw_parts is not None else None)

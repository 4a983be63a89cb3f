"""The Triton routing kernels (`ds_optimus.ops._triton_routing`) against the reference functions of
`ds_optimus.ops.routing`.

Without a GPU they run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1). Small tiles make
every case span several programs, with ragged last blocks of slots, rows and columns. `route` and
`gather` must agree bitwise, as must `combine_backward`'s gathered rows (one product rounded once);
the float32 sums of `combine` and the weight gradient agree within the bounds derived at `_sum_bound`.
"""

from __future__ import annotations

import needs
import pytest
import torch

needs.module("triton", "pip install triton")

import ds_optimus.ops._triton_routing as tr  # noqa: E402
import ds_optimus.ops.routing as routing  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUTE_TILES = dict(block=16, expert_tile=8)
ROW_TILES = dict(block_rows=8, block_cols=16)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps  # 2**-23: two float32 roundings of u = 2**-24 each


def _ids(tokens: int, k: int, experts: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":  # distinct experts per token, as top-k gives
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if kind == "hot":  # expert 3 takes every token's first slot
        rest = torch.stack([torch.randperm(experts - 1, generator=gen)[: k - 1] + 4 for _ in range(tokens)])
        return torch.cat([torch.full((tokens, 1), 3), rest % experts], 1)
    if kind == "few":  # only experts 1 and 2 are chosen: the others get no slot
        return torch.randint(1, 3, (tokens, k), generator=gen)
    return torch.randint(0, experts, (tokens, k), generator=gen)  # "repeats": a token may pick one twice


@pytest.mark.parametrize(
    "tokens,k,experts,kind",
    [
        (1, 1, 1, "random"),
        (37, 1, 1, "random"),
        (50, 2, 5, "random"),
        (33, 3, 7, "repeats"),
        (40, 4, 300, "random"),
        (45, 2, 300, "hot"),
        (30, 4, 64, "hot"),
        (29, 3, 40, "few"),
        (64, 2, 8, "random"),
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_route_matches_reference(tokens, k, experts, kind, index_dtype):
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    ids = _ids(tokens, k, experts, kind, gen).to(DEVICE, index_dtype)
    expected = routing.route(ids, experts)
    for tiles in (ROUTE_TILES, {}):  # small tiles, and the defaults (one block, one or more expert tiles)
        got = tr.route(ids, experts, **tiles)
        for name, a, b in zip(("order", "inverse", "counts"), got, expected, strict=True):
            assert a.dtype == torch.int64 and a.shape == b.shape, name
            assert torch.equal(a, b), (name, tiles)


def _row_data(rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)


def _weights(count: int, dtype: torch.dtype | None, gen: torch.Generator) -> torch.Tensor | None:
    return None if dtype is None else torch.rand(count, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_gather_bitwise(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(1)
    x = _row_data(13, 37, dtype, gen)
    index = torch.randint(0, 13, (45,), generator=gen).to(DEVICE)
    weight = _weights(45, weight_dtype, gen)
    got = tr.gather(x, index, weight, **ROW_TILES)
    assert got.dtype == dtype and torch.equal(got, routing.gather(x, index, weight))


def test_gather_rounds_to_nearest_even_and_keeps_subnormals():
    # Ties, neighbours of ties and subnormals: float32 -> bfloat16 must round as torch does (the
    # interpreter's own conversion truncates), and bfloat16 subnormals must widen exactly.
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=torch.int32)
    high = torch.tensor([0x3F80, 0x3F81, 0x4049, 0xBF80, 0xC2F7], dtype=torch.int32)
    weight = ((high[:, None] << 16) | low[None, :]).reshape(-1).view(torch.float32).to(DEVICE)
    x = torch.tensor([[1.0, -1.0, 1e-40, -3e-39, 5.0, 2.0**-126, 0.0, -0.0, 2.0e36]]).to(DEVICE, torch.bfloat16)
    index = torch.zeros(weight.numel(), dtype=torch.long, device=DEVICE)
    got = tr.gather(x, index, weight, **ROW_TILES)
    expected = routing.gather(x, index, weight)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def _sum_bound(magnitude: torch.Tensor, terms: int, got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How far `got` may be from `expected`, elementwise.

    Both sides add the same float32 terms (each product rounded once, identically). Any order or
    grouping of `terms` float32 additions is within (terms - 1) * 2**-24 * sum|terms| of the exact sum,
    so two of them differ by at most terms * EPS32 * sum|terms| (`magnitude` = sum|terms|). The same
    order, as combine uses, gives zero difference; the bound is what a compiler's reassociation or FMA
    could cost. Rounding the two float32 sums to the output dtype then adds at most one ulp of the
    output, at most its eps times the larger magnitude (plus its smallest subnormal near zero).
    """
    finfo = torch.finfo(got.dtype)
    ulp_out = finfo.eps * torch.maximum(got.double().abs(), expected.double().abs()) + finfo.smallest_normal * finfo.eps
    return terms * EPS32 * magnitude.double() + ulp_out


def _assert_combine_within(got, expected, src, table, weight):
    magnitude = routing.combine(src.double().abs(), table, None if weight is None else weight.double().abs())
    assert ((got.double() - expected.double()).abs() <= _sum_bound(magnitude, table.shape[1], got, expected)).all()


def _assert_dot_within(grad_w, expected_w, src, grad, row_of):
    magnitude = (src.double() * grad.double().index_select(0, row_of)).abs().sum(1)
    bound = _sum_bound(magnitude, src.shape[1], grad_w, expected_w)
    assert ((grad_w.double() - expected_w.double()).abs() <= bound).all()


def _tables(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    """Name -> (table [N, D], S): a dense permutation from route, a padded one, and D = 1."""
    tokens, k = 19, 3
    _, inverse, _ = routing.route(_ids(tokens, k, 5, "random", gen), 5)
    num_slots, rows, depth = 30, 40, 4  # N > S: many rows gather nothing
    padded = torch.full((rows * depth,), -1, dtype=torch.long)
    padded[torch.randperm(rows * depth, generator=gen)[:num_slots]] = torch.arange(num_slots)
    padded = padded.view(rows, depth)
    padded[5] = -1  # a row with no entries at all, whatever the draw
    single = torch.randperm(25, generator=gen)[:21].view(21, 1)
    single[3, 0] = -1
    return {"dense": (inverse.view(tokens, k), tokens * k), "padded": (padded, num_slots), "single": (single, 25)}


def _row_of(table: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The row each position goes to (positions in no row: row 0, the kernels read it all the same)."""
    row_of = torch.zeros(num_slots, dtype=torch.long)
    rows = torch.arange(table.shape[0]).unsqueeze(1).expand_as(table)
    valid = table >= 0
    row_of[table[valid]] = rows[valid]
    return row_of


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_combine_matches_reference(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(2)
    for name, (table, num_slots) in _tables(gen).items():
        table = table.to(DEVICE)
        src = _row_data(num_slots, 37, dtype, gen)
        weight = _weights(num_slots, weight_dtype, gen)
        got = tr.combine(src, table, weight, **ROW_TILES)
        expected = routing.combine(src, table, weight)
        assert got.dtype == dtype and got.shape == expected.shape, name
        _assert_combine_within(got, expected, src, table, weight)
        empty = (table < 0).all(1)
        assert empty.any() == (name != "dense") and (got[empty] == 0).all(), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_combine_backward_matches_reference(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(3)
    hidden = 37
    for name, (table, num_slots) in _tables(gen).items():
        row_of = _row_of(table, num_slots).to(DEVICE)
        grad = _row_data(table.shape[0], hidden, dtype, gen)
        src = _row_data(num_slots, hidden, dtype, gen)
        weight = _weights(num_slots, weight_dtype, gen)
        grad_src, grad_w = tr.combine_backward(grad, src, row_of, weight, True, **ROW_TILES)
        expected_src, expected_w = routing.combine_backward(grad, src, row_of, weight, True)
        assert grad_src.dtype == dtype and torch.equal(grad_src, expected_src), name
        assert grad_w.dtype == torch.float32 and grad_w.shape == (num_slots,), name
        _assert_dot_within(grad_w, expected_w, src, grad, row_of)
        # Without the weight's gradient the caller passes an empty `src`, which must not be read.
        grad_src, grad_w = tr.combine_backward(grad, src[:0], row_of, weight, False, **ROW_TILES)
        assert torch.equal(grad_src, expected_src) and grad_w.dtype == torch.float32 and grad_w.numel() == 0


def test_default_tiles_span_several_column_blocks():
    # The default tiles (128 columns): a hidden size of several column blocks and a ragged last one.
    gen = torch.Generator().manual_seed(4)
    table, num_slots = _tables(gen)["padded"]
    src = _row_data(num_slots, 300, torch.bfloat16, gen)
    weight = _weights(num_slots, torch.float32, gen)
    got = tr.combine(src, table.to(DEVICE), weight)
    expected = routing.combine(src, table.to(DEVICE), weight)
    _assert_combine_within(got, expected, src, table.to(DEVICE), weight)
    row_of = _row_of(table, num_slots).to(DEVICE)
    grad = _row_data(table.shape[0], 300, torch.bfloat16, gen)
    grad_src, grad_w = tr.combine_backward(grad, src, row_of, weight, True)
    expected_src, expected_w = routing.combine_backward(grad, src, row_of, weight, True)
    assert torch.equal(grad_src, expected_src)
    _assert_dot_within(grad_w, expected_w, src, grad, row_of)
    index = torch.randint(0, num_slots, (70,), generator=gen).to(DEVICE)
    assert torch.equal(tr.gather(src, index, None), routing.gather(src, index, None))

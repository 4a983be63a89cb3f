"""The sharded optimizer's saved state: a rank's shard as named pieces, loadable on any layout."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .spaces import ShardedOptimizerError, Space

STATE_FORMAT = "ds_optimus.sharded/1"
MOMENTS = ("master", "exp_avg", "exp_avg_sq")


def shard_state(spaces: list[Space]) -> list[dict[str, Any]]:
    """Per space, this rank's pieces and CPU tensors; each element is saved by one rank."""
    saved = []
    for space in spaces:
        if space.replica_rank > 0 or not getattr(space, "counted", True):
            saved.append({"key": space.key, "pieces": [], **{key: torch.zeros(0) for key in MOMENTS}})
            continue
        pieces = [
            (space.names[i], start, seg, pos) if count == 1 else (space.names[i], start, seg, pos, count, stride)
            for i, start, seg, pos, count, stride in space.pieces()
        ]
        saved.append({"key": space.key, "pieces": pieces, **{key: getattr(space, key).cpu() for key in MOMENTS}})
    return saved


def held_ranges(state: dict[str, Any]) -> list[list]:
    """A saved `state_dict()`'s runs [name, first element, length, ...], for the manifest."""
    return [[piece[0], *piece[1:3], *piece[4:]] for saved in state["spaces"] for piece in saved["pieces"]]


def files_holding(held: dict[str, list | None], spaces: list[Space]) -> list[str]:
    """The files of `held` with part of this rank's shard (all if any runs are None)."""
    if any(runs is None for runs in held.values()):
        return list(held)
    wanted = _wanted(spaces)
    return [
        file
        for file, runs in held.items()
        if any(_overlap(_shape(run[1:]), mine) for run in runs for mine, _, _ in wanted.get(run[0], ()))
    ]


Piece = tuple[int, int, int, int]  # first element in the full parameter, segment length, segments, stride


def _shape(fields) -> Piece:
    """(start, length) or (start, length, segments, stride) as a Piece."""
    start, length, *rest = fields
    return (start, length, *rest) if rest else (start, length, 1, length)


def _wanted(spaces: list[Space]) -> dict[str, list[tuple[Piece, Space, int]]]:
    # this rank's pieces by parameter: (piece, space, position in the shard)
    wanted: dict[str, list[tuple[Piece, Space, int]]] = {}
    for space in spaces:
        for i, start, seg, pos, count, stride in space.pieces():
            wanted.setdefault(space.names[i], []).append(((start, seg, count, stride), space, pos))
    return wanted


def _boxes(piece: Piece, width: int) -> list[tuple[int, int, int, int, int]]:
    """A piece as row-major boxes (first row, rows, first column, columns, offset) of a `width`-column grid."""
    start, seg, count, _ = piece
    if count > 1:
        row, col = divmod(start, width)
        return [(row, count, col, seg, 0)]
    boxes, pos = [], 0
    while seg:
        row, col = divmod(start, width)
        rows = seg // width if col == 0 else 0
        box = (row, rows, 0, width, pos) if rows else (row, 1, col, min(width - col, seg), pos)
        boxes.append(box)
        used = box[1] * box[3]
        start, seg, pos = start + used, seg - used, pos + used
    return boxes


def _width(a: Piece, b: Piece) -> int | None:
    """The row length to compare two pieces on; None if both are contiguous."""
    return a[3] if a[2] > 1 else b[3] if b[2] > 1 else None


def _overlap(a: Piece, b: Piece) -> int:
    if a[0] >= b[0] + (b[2] - 1) * b[3] + b[1] or b[0] >= a[0] + (a[2] - 1) * a[3] + a[1]:
        return 0
    width = _width(a, b)
    if width is None:
        return min(a[0] + a[1], b[0] + b[1]) - max(a[0], b[0])
    return sum(
        max(0, min(ar + an, br + bn) - max(ar, br)) * max(0, min(ac + am, bc + bm) - max(ac, bc))
        for ar, an, ac, am, _ in _boxes(a, width)
        for br, bn, bc, bm, _ in _boxes(b, width)
    )


def _copy(saved: dict[str, Any], spos: int, a: Piece, space: Space, pos: int, b: Piece) -> int:
    """Copy what saved piece `a` shares with this rank's piece `b`; returns the count."""
    width = _width(a, b)
    if width is None:
        lo, hi = max(a[0], b[0]), min(a[0] + a[1], b[0] + b[1])
        if lo >= hi:
            return 0
        for key in MOMENTS:
            getattr(space, key)[pos + lo - b[0] : pos + hi - b[0]].copy_(
                saved[key][spos + lo - a[0] : spos + hi - a[0]]
            )
        return hi - lo
    copied = 0
    for ar, an, ac, am, ap in _boxes(a, width):
        for br, bn, bc, bm, bp in _boxes(b, width):
            r0, r1, c0, c1 = max(ar, br), min(ar + an, br + bn), max(ac, bc), min(ac + am, bc + bm)
            if r0 >= r1 or c0 >= c1:
                continue
            for key in MOMENTS:
                src = saved[key][spos + ap : spos + ap + an * am].view(an, am)[r0 - ar : r1 - ar, c0 - ac : c1 - ac]
                dst = getattr(space, key)[pos + bp : pos + bp + bn * bm].view(bn, bm)
                dst[r0 - br : r1 - br, c0 - bc : c1 - bc].copy_(src)
            copied += (r1 - r0) * (c1 - c0)
    return copied


@torch.no_grad()
def load_spaces(spaces: list[Space], sources: Iterable[dict[str, Any]]) -> None:
    """Fill this rank's shard from saved states of any layout; a one-line error if some is missing."""
    wanted = _wanted(spaces)
    covered = dict.fromkeys(wanted, 0)
    for source in sources:
        if source.get("format") != STATE_FORMAT:
            raise ShardedOptimizerError(f"not a sharded-optimizer state (format {source.get('format')!r})")
        for saved in source["spaces"]:
            for name, gstart, length, spos, *rest in saved["pieces"]:
                piece = _shape((gstart, length, *rest))
                for mine, space, pos in wanted.get(name, ()):
                    covered[name] += _copy(saved, spos, piece, space, pos, mine)
    missing = [n for n, runs in wanted.items() if covered[n] != sum(p[1] * p[2] for p, _, _ in runs)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ShardedOptimizerError(
            f"the checkpoint has no optimizer state for {missing[0]}{more}; was the model changed?"
        )


def restore_hyperparameters(param_groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """Restore param-group hyper-parameters by name, else position; a group the checkpoint lacks gets its first
    group's LR."""
    by_name = {g.get("name"): g for g in saved_groups if g.get("name") is not None}
    for i, group in enumerate(param_groups):
        saved = by_name.get(group.get("name"))
        if saved is None and len(saved_groups) == len(param_groups) and not by_name:
            saved = saved_groups[i]
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            group.update({k: saved_groups[0][k] for k in ("lr", "initial_lr") if k in saved_groups[0]})

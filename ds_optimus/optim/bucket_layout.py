"""Bucket layouts of the sharded optimizer, one equal shard per rank: flat (end to end, least padding) or
chunked (each parameter split per rank: each expert of an [L, ...] stack, L divisible by the group
size, stays on one rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """A contiguous run of one parameter's flattened elements inside a bucket."""

    param: int  # index of the parameter in its space
    start: int  # first element of the run within the (local, flattened) parameter
    length: int
    offset: int  # position of the run in the bucket buffer
    owner: int  # rank (within the space's group) whose shard holds the run


def flat_runs(numels: list[int], group_size: int, first: int = 0) -> tuple[list[Run], int]:
    """Parameters `first, ...` end to end in `group_size` equal shards: (runs, bucket size)."""
    total = sum(numels)
    shard = max(1, math.ceil(total / group_size))
    runs, pos = [], 0
    for i, n in enumerate(numels):
        s = 0
        while s < n:
            owner = (pos + s) // shard
            end = min(n, (owner + 1) * shard - pos)
            runs.append(Run(first + i, s, end - s, pos + s, owner))
            s = end
        pos += n
    return runs, shard * group_size


def chunked_runs(numels: list[int], group_size: int, first: int = 0) -> tuple[list[Run], int]:
    """Each parameter in `group_size` chunks, rank by rank: (runs, bucket size)."""
    chunks = [math.ceil(n / group_size) for n in numels]
    shard = max(1, sum(chunks))
    runs = []
    for d in range(group_size):
        offset = d * shard
        for i, (n, c) in enumerate(zip(numels, chunks, strict=True)):
            length = min(c, n - d * c)
            if length > 0:
                runs.append(Run(first + i, d * c, length, offset, d))
            offset += c
    return runs, shard * group_size


def merge_copies(runs: list[Run]) -> dict[int, list[tuple[int, int, int]]]:
    """Per parameter, (start, offset, length) bucket copies, contiguous runs merged."""
    copies: dict[int, list[tuple[int, int, int]]] = {}
    for run in sorted(runs, key=lambda r: (r.param, r.start)):
        mine = copies.setdefault(run.param, [])
        if mine and mine[-1][0] + mine[-1][2] == run.start and mine[-1][1] + mine[-1][2] == run.offset:
            start, offset, length = mine[-1]
            mine[-1] = (start, offset, length + run.length)
        else:
            mine.append((run.start, run.offset, run.length))
    return copies


def padding(runs: list[Run], size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bucket elements no run covers."""
    gaps, pos = [], 0
    for run in sorted(runs, key=lambda r: r.offset):
        if run.offset > pos:
            gaps.append((pos, run.offset - pos))
        pos = max(pos, run.offset + run.length)
    if pos < size:
        gaps.append((pos, size - pos))
    return gaps


def split_buckets(numels: list[int], bucket_size: int) -> list[list[int]]:
    """Consecutive parameter indices, grouped to at least `bucket_size` elements (bar the last)."""
    buckets, current, filled = [], [], 0
    for i, n in enumerate(numels):
        current.append(i)
        filled += n
        if filled >= bucket_size:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets

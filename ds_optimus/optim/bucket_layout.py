"""How the sharded optimizer lays parameters out in communication buckets and shards.

A *space* is a set of parameters reduced over one process group: the dense parameters over the
data-parallel group, each EP layout's expert parameters over its expert-data-parallel group. A
space's parameters are cut into *buckets* of about `bucket_size` elements (in the order the
backward pass produces their gradients), and every bucket into one equal *shard* per rank of the
group, so that a bucket is reduced with one reduce-scatter and gathered with one all-gather.

Two layouts of a bucket:

- flat: the parameters one after another, the bucket cut into equal contiguous ranges (ZeRO's
  layout; the least padding);
- chunked: every parameter cut into one chunk per rank along its flattened elements, the bucket
  arranged rank by rank. For stacked expert weights [L, ...] whose local expert count L divides
  by the group size, every chunk is a whole number of experts: each expert's optimizer state lives
  on exactly one rank.

Both are described by `Run`s: a contiguous run of one parameter's elements at a bucket offset.
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
    """Runs of parameters `first, first+1, ...` laid end to end and cut into `group_size` equal
    shards; returns (runs, bucket size)."""
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
    """Runs of parameters each cut into `group_size` chunks of ceil(numel / group_size) elements,
    the bucket ordered rank by rank; returns (runs, bucket size)."""
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
    """Per parameter, (start, offset, length) copies between the parameter and the bucket, with
    runs that continue each other in both merged into one."""
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
    """Consecutive parameter indices grouped so that each group reaches `bucket_size` elements
    (the last may be smaller); a parameter is never split between buckets."""
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

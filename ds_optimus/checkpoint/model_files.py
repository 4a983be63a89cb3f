"""A checkpoint's model files written by many replicas at once (`optimus.checkpoint.stagger_writes`).

Every weight file of a checkpoint (a pipeline stage's dense weights, a TP position's split weights, an
EP rank's experts) is the same on all the ranks that replicate it: the stage's ranks, the TP position's
data-parallel ranks, the EP rank's expert-data-parallel ranks. Written by the first of them, one rank
per file writes it all (at 220B x 12,288 ranks: 4.4 GB by each of 96 ranks, while the other 12,192
write only their optimizer shard). Staggered, the file is cut into byte-balanced parts, at most one
per replica and none smaller than `min_part_bytes` (a part boundary may cut a tensor between rows),
and part j is written by the replica j x R / n (plus an offset hashed from the file's name) of the R
replicas: spread over their nodes, as the seed spread its shards over its data-parallel replicas, but
every replica writing a share instead of one replica writing a whole shard.

A part is `<name>_partJJJJ.pt` holding {"part": [j, n], "rows": {weight: [first row, rows, all rows]}
(the weights it holds only some rows of), "weights": {...}} and the whole file's other keys; a file
written in one part keeps its plain name and format. `read_weights` joins the parts back into whole
tensors, and reads the unstaggered formats (a plain state dict, or one with "weights") alike. The
manifest lists each part's weights, so a rank resuming reads only the parts of the weights it holds.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .files import CheckpointError, load

PART = re.compile(r"^(?P<base>.+)_part(?P<j>\d{4})\.pt$")


def part_count(total_bytes: int, replicas: int, min_part_bytes: int) -> int:
    """Parts of a file of `total_bytes` held by `replicas` ranks: one per replica, at most, and no part
    under `min_part_bytes` (so a small file stays whole and a large one is not cut into slivers)."""
    return max(1, min(replicas, total_bytes // max(1, min_part_bytes)))


def writer_of(part: int, parts: int, replicas: int, offset: int = 0) -> int:
    """The index among `replicas` ranks of the one writing `part` of `parts`: spread evenly over them,
    starting at `offset` (each file its own, `first_writer`: a rank seldom writes parts of two files)."""
    return (part * replicas // parts + offset) % replicas


def first_writer(name: str, replicas: int) -> int:
    """Where the writers of model file `name` start among its replicas: a hash of the name, the same on
    every rank, so that the first parts of a stage's dense file and of its experts fall to other ranks."""
    return zlib.crc32(name.encode()) % replicas


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as `torch.save` should write it: itself when it owns its storage, else a copy of its own
    elements on the CPU (a slice, or a parameter that is a view into an optimizer's flat buffer: saved
    as is, the whole buffer would go into the file)."""
    if tensor.untyped_storage().nbytes() <= _nbytes(tensor):
        return tensor
    return tensor.detach().to("cpu", copy=True)


def cut(weights: dict[str, torch.Tensor], parts: int) -> list[tuple[dict[str, torch.Tensor], dict[str, list]]]:
    """`weights` as `parts` pieces of about equal bytes, in order: each (weights, rows) where `rows` names the
    tensors it holds only rows [first, first + count) of, as [first, count, all rows]. A tensor is cut only
    between rows (dimension 0); a 0-d, 1-row or empty tensor goes whole into the part its start falls in.
    The pieces are views (`compact` copies what is written)."""
    total = sum(_nbytes(t) for t in weights.values())
    out: list[tuple[dict, dict]] = [({}, {}) for _ in range(parts)]
    done = 0  # bytes placed so far
    for name, tensor in weights.items():
        rows = tensor.shape[0] if tensor.dim() > 0 else 1
        if rows <= 1 or tensor.numel() == 0:  # nothing to cut
            out[min(parts - 1, done * parts // max(1, total))][0][name] = tensor
            done += _nbytes(tensor)
            continue
        row_bytes = _nbytes(tensor) // rows
        first = 0
        while first < rows:
            j = min(parts - 1, done * parts // max(1, total))
            end_of_part = -(-(j + 1) * total // parts)  # this part's last byte, rounded up
            count = (
                rows - first
                if j == parts - 1
                else max(1, min(rows - first, -(-(end_of_part - done) // max(1, row_bytes))))
            )
            out[j][0][name] = tensor if count == rows else tensor[first : first + count]
            if count != rows:
                out[j][1][name] = [first, count, rows]
            first += count
            done += count * row_bytes
    return out


def this_ranks_parts(
    name: str,
    weights: dict[str, torch.Tensor],
    extra: dict[str, Any] | None,
    replicas: list[int],
    rank: int,
    min_part_bytes: int | None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The files of model file `name` (without ".pt") that `rank` writes, one of `replicas` holding it:
    the whole file from the first replica (`min_part_bytes` None: no staggering), or this rank's parts;
    and what the manifest says of each part (the weights it holds, so that a reader opens only the parts
    of the weights it wants). `extra`: the file's keys besides its weights (None: the file is the plain
    state dict `weights`)."""
    if rank not in replicas:
        return {}, {}
    total = sum(_nbytes(t) for t in weights.values())
    parts = 1 if min_part_bytes is None else part_count(total, len(replicas), min_part_bytes)
    index = replicas.index(rank)
    if parts == 1:
        if index != 0:
            return {}, {}
        weights = {k: compact(v) for k, v in weights.items()}
        return {f"{name}.pt": weights if extra is None else {**extra, "weights": weights}}, {}
    offset = first_writer(name, len(replicas))
    mine = [j for j in range(parts) if writer_of(j, parts, len(replicas), offset) == index]
    pieces = cut(weights, parts) if mine else []
    files = {
        f"{name}_part{j:04d}.pt": {
            **(extra or {}),
            "part": [j, parts],
            "rows": pieces[j][1],
            "weights": {k: compact(v) for k, v in pieces[j][0].items()},
        }
        for j in mine
    }
    return files, {file: {"names": sorted(obj["weights"])} for file, obj in files.items()}


def base_name(file: str) -> str:
    """The model file a part belongs to (itself for a whole file), without ".pt"."""
    match = PART.match(file)
    return match.group("base") if match else file[:-3] if file.endswith(".pt") else file


def files_with(records: dict[str, Any], files: list[str], wanted: Callable[[str], bool] | None) -> list[str]:
    """Of `files`, those holding a weight `wanted` accepts, by the manifest's `records` of them (a part
    lists its weights); a whole file, or one the manifest says nothing of, is always among them."""
    if wanted is None:
        return files
    keep = []
    for file in files:
        names = (records.get(file) or {}).get("names") if isinstance(records, dict) else None
        if names is None or any(wanted(n) for n in names):
            keep.append(file)
    return keep


def read_weights(
    path: Path, files: list[str], wanted: Callable[[str], bool] | None = None, records: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights of model files `files` of checkpoint folder `path` (whole files and parts, in any order)
    with every part's rows joined into whole tensors, and the first file's other keys; memory-mapped, so
    a whole file's tensors are read only where used. `wanted` (a name filter) and the manifest's `records`:
    only the parts holding wanted weights are opened and only those weights joined (a resuming rank reads
    its stage's and EP rank's parts, not every part). A CheckpointError names a part left out."""
    weights: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    totals: dict[str, int] = {}
    extra: dict[str, Any] = {}
    for file in sorted(files_with(records or {}, files, wanted)):
        saved = load(path / file, mmap=True)
        if "weights" not in saved:  # a plain state dict
            weights.update(saved)
            continue
        extra = extra or {k: v for k, v in saved.items() if k not in ("weights", "rows", "part")}
        if "part" in saved and wanted is None:
            _check_parts(path, base_name(file), saved["part"][1], files)
        for name, tensor in saved["weights"].items():
            rows = saved.get("rows", {}).get(name)
            if rows is None:
                weights[name] = tensor
            elif wanted is None or wanted(name):
                pieces.setdefault(name, []).append((rows[0], tensor))
                totals[name] = rows[2]
    for name, found in pieces.items():
        found.sort(key=lambda piece: piece[0])
        if sum(len(t) for _, t in found) != totals[name] or any(
            a + len(t) != b for (a, t), (b, _) in zip(found, found[1:], strict=False)
        ):
            raise CheckpointError(f"{path}: the parts of {name} do not cover its {totals[name]} rows (a part missing?)")
        weights[name] = torch.cat([t for _, t in found])
    return weights, extra


def _check_parts(path: Path, base: str, parts: int, files: list[str]) -> None:
    missing = [j for j in range(parts) if f"{base}_part{j:04d}.pt" not in files]
    if missing:
        raise CheckpointError(
            f"{path}: {base} is written in {parts} parts but part {missing[0]} is not among the files read"
        )


def grouped(files: list[str], prefix: str) -> dict[str, list[str]]:
    """The model files starting with `prefix`, by the file they are parts of (whole files alone)."""
    out: dict[str, list[str]] = {}
    for file in sorted(f for f in files if f.startswith(prefix)):
        out.setdefault(base_name(file), []).append(file)
    return out

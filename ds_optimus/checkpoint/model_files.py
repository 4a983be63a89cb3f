"""Model files cut into `<name>_partJJJJ.pt` parts, each written by one of the file's replicas
(`optimus.checkpoint.stagger_writes`); `read_weights` joins them back."""

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
    """Parts of a file: at most one per replica, none under `min_part_bytes`."""
    return max(1, min(replicas, total_bytes // max(1, min_part_bytes)))


def writer_of(part: int, parts: int, replicas: int, offset: int = 0) -> int:
    """Index among `replicas` of the rank writing `part`."""
    return (part * replicas // parts + offset) % replicas


def first_writer(name: str, replicas: int) -> int:
    """Writers' start among the replicas of file `name`: a hash of the name."""
    return zlib.crc32(name.encode()) % replicas


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a CPU copy when it views a larger storage (which torch.save would write whole)."""
    if tensor.untyped_storage().nbytes() <= _nbytes(tensor):
        return tensor
    return tensor.detach().to("cpu", copy=True)


def cut(weights: dict[str, torch.Tensor], parts: int) -> list[tuple[dict[str, torch.Tensor], dict[str, list]]]:
    """`weights` as `parts` (weights, rows) views of about equal bytes; `rows`: name -> [first, count, all]."""
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
    """The files of `name` that `rank` writes, and each part's manifest record; `extra`: other keys."""
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
    """The model file a part belongs to, without ".pt"."""
    match = PART.match(file)
    return match.group("base") if match else file[:-3] if file.endswith(".pt") else file


def files_with(records: dict[str, Any], files: list[str], wanted: Callable[[str], bool] | None) -> list[str]:
    """The `files` that may hold a weight `wanted` accepts, by the manifest's `records`."""
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
    """The weights of `files` in `path`, parts joined, and the first file's other keys; `wanted` filters."""
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
    """The files starting with `prefix`, grouped by model file."""
    out: dict[str, list[str]] = {}
    for file in sorted(f for f in files if f.startswith(prefix)):
        out.setdefault(base_name(file), []).append(file)
    return out

"""Each source's content identity, shard folder (keyed by a hash of it and the settings, so a changed
input never reuses a stale shard) and preparation work units."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .documents import embedded_documents, file_documents, iter_documents, load_saved, saved_documents
from .errors import DataError
from .sources import DistinctFiles, Source, is_saved_dataset, reads_files, resolve_files, resolve_token_files
from .token_files import TokenFile, token_files
from .tokenizer import tokenizer_fingerprint

FORMAT_VERSION = 3  # of the shard files and their markers (tokenize_workers.py writes them)
DISK_ROWS_PER_UNIT = 100_000  # rows of a save_to_disk folder per preparation work unit


@dataclass(frozen=True)
class Unit:
    """What one worker tokenizes: a file, a row range, or a whole source."""

    label: str
    size: int  # bytes or rows: what balances the work between workers
    part: Any = None  # a Path, a (start, stop) row range, or None for the whole source


def source_units(source: Source, files: list[Path] | None = None) -> list[Unit]:
    """The source's work units in stream order (one with `max_documents`, embedded or streamed)."""
    if source.kind in ("files", "hf") and is_saved_dataset(source.target) and source.max_documents is None:
        rows = len(load_saved(source))
        return [
            Unit(
                f"rows {lo}-{min(lo + DISK_ROWS_PER_UNIT, rows)}",
                min(DISK_ROWS_PER_UNIT, rows - lo),
                (lo, min(lo + DISK_ROWS_PER_UNIT, rows)),
            )
            for lo in range(0, max(rows, 1), DISK_ROWS_PER_UNIT)
        ]
    if source.kind == "files" and source.max_documents is None:
        return [Unit(str(p), p.stat().st_size, p) for p in (resolve_files(source) if files is None else files)]
    return [Unit(str(source), 0, None)]


def unit_documents(source: Source, unit: Unit) -> Iterator[str]:
    """The non-empty documents of one unit of `source`, in order."""
    if unit.part is None:
        yield from iter_documents(source)
    elif isinstance(unit.part, tuple):
        yield from (t for t in saved_documents(source, unit.part) if t)
    else:
        yield from (t for t in file_documents(unit.part, source.text_field) if t)


def describe(source: Source, files: list[Path] | None = None) -> dict[str, Any]:
    """What identifies a source's content for cache keys, without reading its bytes."""
    info: dict[str, Any] = {"kind": source.kind, "text_field": source.text_field, "max_documents": source.max_documents}
    if source.kind == "embedded":
        digest = hashlib.sha256("\x00".join(embedded_documents()).encode()).hexdigest()
        info.update(python=sys.version.split()[0], sha256=digest)
    elif source.kind == "tokens":
        files = resolve_token_files(source.target) if files is None else files
        info.update(
            dtype=source.dtype, files=_stats(files), val=_stats(resolve_token_files(source.val)) if source.val else None
        )
    elif source.kind == "files" and not is_saved_dataset(source.target):
        info["files"] = _stats(resolve_files(source) if files is None else files)
    else:
        info.update(target=source.target, name=source.config_name, split=source.split, data_files=source.data_files)
        if os.path.exists(os.path.expanduser(source.target)):  # a local dataset folder: its files identify it
            root = Path(os.path.expanduser(source.target))
            info["files"] = [
                (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                for p in sorted(root.rglob("*"))
                if p.is_file()
            ]
    return info


def _stats(files: list[Path]) -> list[tuple[str, int, int]]:
    """Resolved names, sizes and modification times of `files`."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def source_key(source: Source, tokenizer, val_fraction: float, files: list[Path] | None = None) -> str:
    """A hash of the source's identity, the tokenizer and the packing settings."""
    payload = {
        "format": FORMAT_VERSION,
        "source": describe(source, files),
        "val_fraction": val_fraction,
        "tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def source_folder(source: Source, tokenizer, cache_dir: str | Path, val_fraction: float) -> Path:
    return Path(cache_dir) / f"{source.label}-{source_key(source, tokenizer, val_fraction)[:16]}"


@dataclass
class SourcePlan:
    """What preparing and opening a source needs, found on the filesystem."""

    source: Source
    identity: str
    folder: Path | None = None  # a text source's shard folder
    units: list[Unit] | None = None  # a text source's work, when not prepared yet
    train_files: list[TokenFile] | None = None  # a token source's files
    val_files: list[TokenFile] | None = None


def plan_sources(sources: list[Source], tokenizer, cache_dir: str | Path, val_fraction: float) -> list[SourcePlan]:
    """Each source's identity, folder and pending units, or token files, from one pass of filesystem
    reads (rank 0's at launch); a file two sources train on is a `DataError`."""
    if not sources:
        raise DataError("optimus.data.sources is empty")
    if not 0.0 <= val_fraction < 0.5:
        raise DataError(f"optimus.data.val_fraction must be in [0, 0.5), got {val_fraction}")
    plans = []
    distinct = DistinctFiles()
    for i, source in enumerate(sources):
        if source.kind == "tokens":
            try:
                files = resolve_token_files(source.target)
            except DataError as err:
                raise DataError(f"source {source.label!r}: {err}") from None
            distinct.add(i, source, files)
            try:
                identity = hashlib.sha256(json.dumps(describe(source, files), default=str).encode()).hexdigest()
                plans.append(
                    SourcePlan(
                        source,
                        identity,
                        train_files=token_files(source.target, source.dtype, files),
                        val_files=token_files(source.val, source.dtype) if source.val else None,
                    )
                )
            except DataError as err:
                raise DataError(f"source {source.label!r}: {err}") from None
            continue
        files = resolve_files(source) if reads_files(source) else None
        if files is not None:
            distinct.add(i, source, files)
        key = source_key(source, tokenizer, val_fraction, files)
        folder = Path(cache_dir) / f"{source.label}-{key[:16]}"
        units = None if (folder / "meta.json").exists() else source_units(source, files)
        plans.append(SourcePlan(source, key[:16], folder, units))
    return plans

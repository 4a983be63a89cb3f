"""Pretraining sources: the embedded default corpus, local files (plain or compressed), `datasets`
folders and names, and pre-tokenized token files.

A source is given in the config's `optimus.data.sources` list as a string or an object:

    "embedded"                                  the Python reference manual every CPython ships
                                                (`pydoc_data.topics`, ~465 KB, one document per topic)
    "path/to/file.jsonl" | "dir/" | "*.json.zst" local files: .txt/.md (a file is a document),
                                                .jsonl/.json (one record per line), each also
                                                .gz- or .zst-compressed, .parquet; or a folder
                                                written by `datasets`' `save_to_disk`
    {"path": "...", "text_field": "content"}    the same, with options
    {"hf": "allenai/OLMoE-mix-0924", "config": null, "split": "train", "data_files": null,
     "text_field": "text", "max_documents": 100000}
                                                a `datasets` name on the Hub or a local dataset
                                                folder, streamed (nothing is downloaded up front)
    {"tokens": "tok/*.npy", "dtype": null, "val": null}
                                                pre-tokenized flat token files (.npy, or raw .bin
                                                with a "dtype"), read in place; "val": held-out ones

Every object also takes `"name"` (the source's name in logs and metrics; by default from its path)
and `"weight"` (its share of the sampled sequences; give every source one, or none: then each
source is drawn in proportion to its size).

`describe()` gives what identifies a source's content (file sizes and times, dataset revision) for
the fingerprint of a tokenized cache; `source_units()` splits a source into the pieces that
preparation hands to its workers (a file each, or row ranges of a `save_to_disk` folder).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .compressed import decode_errors, open_text
from .errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".zst")
DISK_ROWS_PER_UNIT = 100_000  # rows of a save_to_disk folder per preparation work unit


@dataclass(frozen=True)
class Source:
    kind: str  # "embedded" | "files" | "hf" | "tokens"
    target: str = ""  # the path/glob, or the dataset name or folder
    text_field: str = "text"
    name: str = ""  # the source's name in logs and metrics (`source_name` when empty)
    split: str = "train"
    data_files: Any = None
    max_documents: int | None = None
    weight: float | None = None  # share of the sampled sequences (None: by size)
    config_name: str | None = None  # a dataset's configuration name ("name" of an "hf" source)
    dtype: str | None = None  # a "tokens" source's .bin dtype
    val: str | None = None  # a "tokens" source's held-out files

    def __str__(self) -> str:
        return self.kind if self.kind == "embedded" else f"{self.kind}:{self.target}"

    @property
    def label(self) -> str:
        return self.name or source_name(self)


_COMMON = {"name", "weight"}
_OPTIONS = _COMMON | {"text_field", "max_documents", "split"}  # split: of a saved DatasetDict
_HF_OPTIONS = _OPTIONS | {"data_files", "config"}
_TOKEN_OPTIONS = _COMMON | {"dtype", "val"}


def parse_source(spec: str | dict[str, Any]) -> Source:
    """A `Source` from its config form (see the module docstring)."""
    if isinstance(spec, str):
        return Source("embedded") if spec == "embedded" else Source("files", spec)
    if not isinstance(spec, dict):
        raise DataError(f"a data source must be a string or an object, got {type(spec).__name__}")
    keys = [k for k in ("hf", "path", "tokens", "embedded") if k in spec]
    if len(keys) != 1:
        raise DataError(f"a data source object needs exactly one of 'path', 'hf', 'tokens', got {sorted(spec)}")
    kind = {"hf": "hf", "path": "files", "tokens": "tokens", "embedded": "embedded"}[keys[0]]
    allowed = {"hf": _HF_OPTIONS, "files": _OPTIONS, "tokens": _TOKEN_OPTIONS, "embedded": _OPTIONS}[kind]
    target = spec[keys[0]]
    if kind == "embedded":
        target = ""
    elif not isinstance(target, str) or not target:
        raise DataError(f"data source {keys[0]!r} must be a non-empty string, got {target!r}")
    unknown = sorted(set(spec) - allowed - {keys[0]})
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(allowed), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(allowed))})"
        raise DataError(f"data source {target or 'embedded'!r}: unknown key {unknown[0]!r}{hint}")
    options = {k: v for k, v in spec.items() if k != keys[0]}
    where = f"data source {target or 'embedded'!r}"
    max_docs = options.get("max_documents")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise DataError(f"{where}: max_documents must be a positive integer, got {max_docs!r}")
    weight = options.get("weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                               or not math.isfinite(weight) or weight <= 0):
        raise DataError(f"{where}: weight must be a number > 0, got {weight!r}")
    name = options.get("name")
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name)):
        raise DataError(f"{where}: name must be letters, digits, '_', '.' or '-', got {name!r}")
    if options.get("dtype") is not None:
        from .tokens import check_token_dtype

        try:
            check_token_dtype(options["dtype"])
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
    if "config" in options:  # a dataset's configuration name ("name" in datasets' words)
        options["config_name"] = options.pop("config")
    return Source(kind, str(target), **options)


def parse_sources(specs: list) -> list[Source]:
    """Every source of `optimus.data.sources`, with unique names and weights on all or none."""
    sources = [parse_source(spec) for spec in specs]
    seen: dict[str, int] = {}
    read: dict[tuple, int] = {}
    for i, source in enumerate(sources):
        same = (source.kind, os.path.normpath(os.path.expanduser(source.target)) if source.target else "",
                source.text_field, source.split, source.config_name, str(source.data_files))
        if same in read:
            raise DataError(f"sources {read[same]} and {i} read the same data ({source}): list it once, with the "
                            "\"weight\" it should have")
        read[same] = i
        if source.label in seen:
            raise DataError(f"sources {seen[source.label]} and {i} are both named {source.label!r}: give one a "
                            "\"name\" (to weight a source up, give it a \"weight\" rather than listing it twice)")
        seen[source.label] = i
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        missing = sources[weighted.index(False)].label
        raise DataError(f"source {missing!r} has no \"weight\" while others have one: give every source a weight, "
                        "or none (then sources are drawn in proportion to their sizes)")
    return sources


def source_name(source: Source) -> str:
    """A source's default name: "embedded", the last plain part of its path, or its dataset's name."""
    if source.kind == "embedded":
        return "embedded"
    parts = [p for p in re.split(r"[\\/]", source.target) if p and not any(ch in p for ch in "*?[")]
    base = parts[-1] if parts else source.kind
    if source.kind != "hf":
        while "." in base.strip(".") and base.rsplit(".", 1)[-1].lower() in (
                "gz", "zst", "jsonl", "json", "txt", "md", "text", "parquet", "npy", "bin"):
            base = base.rsplit(".", 1)[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base) or source.kind


def resolve_files(source: Source) -> list[Path]:
    """The files a "files" source names, sorted; a one-line `DataError` if there are none."""
    return matching_files(source.target, _supported, "data",
                          ".txt, .md, .jsonl, .json (each also .gz or .zst) or .parquet")


def matching_files(target: str, supported, what: str, kinds: str) -> list[Path]:
    """The files a path, folder or glob names, sorted (a folder's: those `supported` accepts), with
    one-line errors naming `what` files ("data", "token") and the `kinds` that are read."""
    expanded = os.path.expanduser(target)
    if os.path.isdir(expanded):
        files = [p for p in sorted(Path(expanded).rglob("*")) if p.is_file() and supported(p)]
    elif any(ch in expanded for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if os.path.isfile(p)]
    elif os.path.isfile(expanded):
        files = [Path(expanded)]
    else:
        raise DataError(f"{what} path {target!r} does not exist")
    if not files:
        raise DataError(f"{what} path {target!r} {'holds' if os.path.isdir(expanded) else 'matches'} no {kinds} "
                        "files")
    for path in files:
        if not supported(path):
            raise DataError(f"{what} file {str(path)!r} has an unsupported type (use {kinds})")
    return files


def _inner_suffix(path: Path) -> str:
    """The format suffix under any compression: "wiki-0000.json.gz" -> ".json"."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _supported(path: Path) -> bool:
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return True
    return _inner_suffix(path) in TEXT_SUFFIXES + JSON_SUFFIXES


def is_saved_dataset(target: str) -> bool:
    """Whether `target` is a folder written by `datasets`' `save_to_disk` (a Dataset or DatasetDict)."""
    root = Path(os.path.expanduser(target))
    return root.is_dir() and ((root / "state.json").is_file() or (root / "dataset_dict.json").is_file())


def iter_documents(source: Source) -> Iterator[str]:
    """The documents (strings) of a source, in a fixed order."""
    limit = source.max_documents
    count = 0
    for text in _documents(source):
        if limit is not None and count >= limit:
            return
        if text:
            count += 1
            yield text


def _documents(source: Source) -> Iterator[str]:
    if source.kind == "embedded":
        yield from embedded_documents()
    elif source.kind in ("files", "hf") and is_saved_dataset(source.target):
        yield from _saved_documents(source, None)
    elif source.kind == "files":
        for path in resolve_files(source):
            yield from _file_documents(path, source.text_field)
    elif source.kind == "hf":
        yield from _hf_documents(source)
    else:
        raise DataError(f"a {source.kind!r} source holds no text documents")


@dataclass(frozen=True)
class Unit:
    """A piece of a source that one preparation worker tokenizes: a file, a row range, or all of it."""

    label: str
    size: int  # bytes or rows: what balances the work between workers
    part: Any = None  # a Path, a (start, stop) row range, or None for the whole source


def source_units(source: Source) -> list[Unit]:
    """The source's work units, in order (their tokens, concatenated, are the source's stream). A
    source with `max_documents`, the embedded corpus and a streamed dataset are one unit each."""
    if source.kind in ("files", "hf") and is_saved_dataset(source.target) and source.max_documents is None:
        rows = len(_load_saved(source))
        return [Unit(f"rows {lo}-{min(lo + DISK_ROWS_PER_UNIT, rows)}", min(DISK_ROWS_PER_UNIT, rows - lo),
                     (lo, min(lo + DISK_ROWS_PER_UNIT, rows))) for lo in range(0, max(rows, 1), DISK_ROWS_PER_UNIT)]
    if source.kind == "files" and source.max_documents is None:
        return [Unit(str(p), p.stat().st_size, p) for p in resolve_files(source)]
    return [Unit(str(source), 0, None)]


def unit_documents(source: Source, unit: Unit) -> Iterator[str]:
    """The documents of one unit of `source` (empty ones left out), in order."""
    if unit.part is None:
        yield from iter_documents(source)
    elif isinstance(unit.part, tuple):
        yield from (t for t in _saved_documents(source, unit.part) if t)
    else:
        yield from (t for t in _file_documents(unit.part, source.text_field) if t)


def embedded_documents() -> list[str]:
    """The Python reference manual shipped with CPython, one document per topic."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _file_documents(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix.lower() in PARQUET_SUFFIXES:
        yield from _parquet_documents(path, text_field)
        return
    compressed = path.suffix.lower() in COMPRESSED_SUFFIXES
    try:
        with open_text(path) as f:
            if _inner_suffix(path) in TEXT_SUFFIXES:
                yield f.read()
                return
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: not a JSON record ({err.msg} at column {err.colno})") from None
                if not isinstance(record, dict) or text_field not in record:
                    fields = f" (its fields: {', '.join(record)[:200]}; set the source's \"text_field\")" \
                        if isinstance(record, dict) else ""
                    raise DataError(f"{path}:{lineno}: record has no {text_field!r} field{fields}")
                yield from _text(record[text_field], f"{path}:{lineno}")
    except decode_errors() as err:
        kind = f"{path.suffix.lower()[1:]}-compressed " if compressed else ""
        raise DataError(f"{path}: not a readable {kind}file ({type(err).__name__}: {err})") from None


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    if text_field not in parquet.schema_arrow.names:
        raise DataError(f"{path}: no {text_field!r} column (columns: {', '.join(parquet.schema_arrow.names)})")
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield from _text(text, str(path))


def _text(value, where: str) -> Iterator[str]:
    """A record's text: nothing for a null, a one-line error for anything but a string."""
    if value is None:
        return
    if not isinstance(value, str):
        raise DataError(f"{where}: the text field holds a {type(value).__name__}, not a string")
    yield value


def _load_saved(source: Source):
    """A `save_to_disk` folder's dataset (memory-mapped Arrow), the source's split of a DatasetDict."""
    import datasets

    try:
        loaded = datasets.load_from_disk(os.path.expanduser(source.target))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(f"dataset folder {source.target!r}: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DataError(f"dataset folder {source.target!r} has no split {source.split!r} "
                            f"(splits: {', '.join(loaded)}; set the source's \"split\")")
        loaded = loaded[source.split]
    if source.text_field not in loaded.column_names:
        raise DataError(f"dataset folder {source.target!r}: no {source.text_field!r} column "
                        f"(columns: {', '.join(loaded.column_names)}; set the source's \"text_field\")")
    return loaded


def _saved_documents(source: Source, rows: tuple[int, int] | None) -> Iterator[str]:
    dataset = _load_saved(source).select_columns([source.text_field])
    lo, hi = rows if rows is not None else (0, len(dataset))
    for start in range(lo, hi, 1024):
        for text in dataset[start:min(start + 1024, hi)][source.text_field]:
            yield from _text(text, f"dataset folder {source.target!r}")


def _hf_documents(source: Source) -> Iterator[str]:
    import datasets

    try:
        stream = datasets.load_dataset(source.target, source.config_name, split=source.split,
                                       data_files=source.data_files, streaming=True)
    except FileNotFoundError as err:
        raise DataError(f"dataset {source.target!r} not found: {err}") from None
    except ValueError as err:
        raise DataError(f"dataset {source.target!r}: {err}") from None
    for record in stream:
        if source.text_field not in record:
            raise DataError(f"dataset {source.target!r}: records have no {source.text_field!r} field "
                            f"(fields: {', '.join(record)})")
        yield from _text(record[source.text_field], f"dataset {source.target!r}")


def describe(source: Source) -> dict[str, Any]:
    """What identifies the content of a source, for cache fingerprints: never its bytes (names,
    sizes and modification times of its files)."""
    info: dict[str, Any] = {"kind": source.kind, "text_field": source.text_field,
                            "max_documents": source.max_documents}
    if source.kind == "embedded":
        digest = hashlib.sha256("\x00".join(embedded_documents()).encode()).hexdigest()
        info.update(python=sys.version.split()[0], sha256=digest)
    elif source.kind == "tokens":
        from .tokens import describe_token_files

        info.update(dtype=source.dtype, files=describe_token_files(source.target),
                    val=describe_token_files(source.val) if source.val else None)
    elif source.kind == "files" and not is_saved_dataset(source.target):
        info["files"] = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in resolve_files(source)]
    else:
        info.update(target=source.target, name=source.config_name, split=source.split, data_files=source.data_files)
        if os.path.exists(os.path.expanduser(source.target)):  # a local dataset folder: its files identify it
            root = Path(os.path.expanduser(source.target))
            info["files"] = [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                             for p in sorted(root.rglob("*")) if p.is_file()]
    return info

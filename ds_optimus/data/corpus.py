"""Text sources for pretraining: the embedded default corpus, local files, and Hugging Face datasets.

A source is given in the config's `optimus.data.sources` list as a string or an object:

    "embedded"                                  the Python reference manual every CPython ships
                                                (`pydoc_data.topics`, ~465 KB, one document per topic)
    "path/to/file.jsonl" | "dir/" | "*.txt"     local files: .txt/.md (a file is a document),
                                                .jsonl/.json (one record per line), .parquet
    {"path": "...", "text_field": "content"}    the same, with options
    {"hf": "allenai/OLMoE-mix-0924", "name": null, "split": "train", "data_files": null,
     "text_field": "text", "max_documents": 100000}
                                                a `datasets` name on the Hub or a local dataset
                                                folder, streamed (nothing is downloaded up front)

`describe()` gives what identifies a source's content (file sizes and times, dataset revision) for
the fingerprint of a tokenized cache.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class DataError(ValueError):
    """A data source that cannot be used; the message names it."""


@dataclass(frozen=True)
class Source:
    kind: str  # "embedded" | "files" | "hf"
    target: str = ""  # the path/glob, or the dataset name or folder
    text_field: str = "text"
    name: str | None = None  # dataset configuration name
    split: str = "train"
    data_files: Any = None
    max_documents: int | None = None

    def __str__(self) -> str:
        return self.kind if self.kind == "embedded" else f"{self.kind}:{self.target}"


_OPTIONS = {"text_field", "max_documents"}
_HF_OPTIONS = _OPTIONS | {"name", "split", "data_files"}


def parse_source(spec: str | dict[str, Any]) -> Source:
    """A `Source` from its config form (see the module docstring)."""
    if isinstance(spec, str):
        return Source("embedded") if spec == "embedded" else Source("files", spec)
    if not isinstance(spec, dict):
        raise DataError(f"a data source must be a string or an object, got {type(spec).__name__}")
    if "hf" in spec:
        unknown = sorted(set(spec) - _HF_OPTIONS - {"hf"})
        kind, target = "hf", spec["hf"]
    elif "path" in spec:
        unknown = sorted(set(spec) - _OPTIONS - {"path"})
        kind, target = "files", spec["path"]
    else:
        raise DataError(f"a data source object needs a 'path' or an 'hf' key, got {sorted(spec)}")
    if unknown:
        raise DataError(f"data source {target!r}: unknown key {unknown[0]!r}")
    options = {k: v for k, v in spec.items() if k not in ("hf", "path")}
    max_docs = options.get("max_documents")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise DataError(f"data source {target!r}: max_documents must be a positive integer, got {max_docs!r}")
    return Source(kind, str(target), **options)


def resolve_files(source: Source) -> list[Path]:
    """The files a "files" source names, sorted; a one-line `DataError` if there are none."""
    target = os.path.expanduser(source.target)
    if os.path.isdir(target):
        files = [p for p in sorted(Path(target).rglob("*")) if p.is_file() and _supported(p)]
    elif any(ch in target for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(target, recursive=True)) if os.path.isfile(p)]
    elif os.path.isfile(target):
        files = [Path(target)]
    else:
        raise DataError(f"data path {source.target!r} does not exist")
    if not files:
        raise DataError(f"data path {source.target!r} holds no .txt, .md, .jsonl, .json or .parquet files")
    for path in files:
        if not _supported(path):
            raise DataError(f"data file {str(path)!r} has an unsupported type (use .txt, .md, .jsonl, .json, .parquet)")
    return files


def _supported(path: Path) -> bool:
    return path.suffix.lower() in TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES


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
    elif source.kind == "files":
        for path in resolve_files(source):
            yield from _file_documents(path, source.text_field)
    elif source.kind == "hf":
        yield from _hf_documents(source)
    else:
        raise DataError(f"unknown data source kind {source.kind!r}")


def embedded_documents() -> list[str]:
    """The Python reference manual shipped with CPython, one document per topic."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _file_documents(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield path.read_text(encoding="utf-8", errors="replace")
    elif suffix in JSON_SUFFIXES:
        with path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: not a JSON record ({err.msg})") from None
                if not isinstance(record, dict) or text_field not in record:
                    raise DataError(f"{path}:{lineno}: record has no {text_field!r} field")
                yield from _text(record[text_field], f"{path}:{lineno}")
    else:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
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


def _hf_documents(source: Source) -> Iterator[str]:
    import datasets

    try:
        stream = datasets.load_dataset(source.target, source.name, split=source.split,
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
    """What identifies the content of a source, for cache fingerprints."""
    info: dict[str, Any] = {"kind": source.kind, "text_field": source.text_field,
                            "max_documents": source.max_documents}
    if source.kind == "embedded":
        digest = hashlib.sha256("\x00".join(embedded_documents()).encode()).hexdigest()
        info.update(python=sys.version.split()[0], sha256=digest)
    elif source.kind == "files":
        info["files"] = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in resolve_files(source)]
    else:
        info.update(target=source.target, name=source.name, split=source.split, data_files=source.data_files)
        if os.path.exists(source.target):  # a local dataset folder: its files identify it
            root = Path(source.target)
            info["files"] = [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                             for p in sorted(root.rglob("*")) if p.is_file()]
    return info

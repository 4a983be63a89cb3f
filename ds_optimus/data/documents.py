"""The text documents of a source, in a fixed order: the embedded corpus, local files (.txt/.md a
document each, .jsonl/.json a record per line, each also .gz or .zst, .parquet), folders written by
`datasets`' `save_to_disk` (memory-mapped, by row ranges), and `datasets` names streamed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from .compressed import decode_errors, open_text
from .errors import DataError
from .sources import (
    COMPRESSED_SUFFIXES,
    PARQUET_SUFFIXES,
    TEXT_SUFFIXES,
    Source,
    inner_suffix,
    is_saved_dataset,
    resolve_files,
)


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
        yield from saved_documents(source, None)
    elif source.kind == "files":
        for path in resolve_files(source):
            yield from file_documents(path, source.text_field)
    elif source.kind == "hf":
        yield from _hf_documents(source)
    else:
        raise DataError(f"a {source.kind!r} source holds no text documents")


def embedded_documents() -> list[str]:
    """The Python reference manual shipped with CPython, one document per topic."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def file_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one local file (a text file is one; JSON lines and parquet one per record)."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        yield from _parquet_documents(path, text_field)
        return
    compressed = path.suffix.lower() in COMPRESSED_SUFFIXES
    try:
        with open_text(path) as f:
            if inner_suffix(path) in TEXT_SUFFIXES:
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
                    fields = (
                        f' (its fields: {", ".join(record)[:200]}; set the source\'s "text_field")'
                        if isinstance(record, dict)
                        else ""
                    )
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


def load_saved(source: Source):
    """A `save_to_disk` folder's dataset (memory-mapped Arrow), the source's split of a DatasetDict."""
    import datasets

    try:
        loaded = datasets.load_from_disk(os.path.expanduser(source.target))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(f"dataset folder {source.target!r}: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DataError(
                f"dataset folder {source.target!r} has no split {source.split!r} "
                f'(splits: {", ".join(loaded)}; set the source\'s "split")'
            )
        loaded = loaded[source.split]
    if source.text_field not in loaded.column_names:
        raise DataError(
            f"dataset folder {source.target!r}: no {source.text_field!r} column "
            f'(columns: {", ".join(loaded.column_names)}; set the source\'s "text_field")'
        )
    return loaded


def saved_documents(source: Source, rows: tuple[int, int] | None) -> Iterator[str]:
    """The documents of a `save_to_disk` folder, of rows [start, stop) (all of them for None)."""
    dataset = load_saved(source).select_columns([source.text_field])
    lo, hi = rows if rows is not None else (0, len(dataset))
    for start in range(lo, hi, 1024):
        for text in dataset[start : min(start + 1024, hi)][source.text_field]:
            yield from _text(text, f"dataset folder {source.target!r}")


def _hf_documents(source: Source) -> Iterator[str]:
    import datasets

    try:
        stream = datasets.load_dataset(
            source.target, source.config_name, split=source.split, data_files=source.data_files, streaming=True
        )
    except FileNotFoundError as err:
        raise DataError(f"dataset {source.target!r} not found: {err}") from None
    except ValueError as err:
        raise DataError(f"dataset {source.target!r}: {err}") from None
    for record in stream:
        if source.text_field not in record:
            raise DataError(
                f"dataset {source.target!r}: records have no {source.text_field!r} field (fields: {', '.join(record)})"
            )
        yield from _text(record[source.text_field], f"dataset {source.target!r}")

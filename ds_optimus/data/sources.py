"""The `optimus.data` section, its sources (their forms: docs/data.md; "embedded" is the Python reference manual every
CPython ships, `pydoc_data.topics`) and the files each names.

The data pipeline's first stage (sources -> work units -> tokenizing workers -> stored shards -> mixture and loader):
it imports nothing of the later ones.
"""

from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..schema import ConfigError, Section, need, number, positive_int
from .errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".zst")
TOKEN_SUFFIXES = (".npy", ".bin")


@dataclass(frozen=True)
class DataConfig(Section):
    """`optimus.data`: the corpora, tokenizer, sequence length, held-out share, token cache and tokenizing workers."""

    sources: list = field(default_factory=lambda: ["embedded"])  # the corpora, each with an optional weight and name
    tokenizer: str | None = None  # an HF tokenizer name or folder; null: the embedded default
    seq_len: int = 256  # tokens per training sequence (at most the model's max_position_embeddings)
    val_fraction: float = 0.02  # share of each text source's documents held out for evaluation
    cache_dir: str = "data_cache"  # where token shards are kept (a filesystem every rank sees)
    workers: int = 1  # tokenizing processes per rank when the data must be prepared at the start
    allow_change: bool = False  # resume on sources that differ from the checkpoint's (logged)

    def check(self, where: str) -> None:
        need(isinstance(self.sources, list) and len(self.sources) > 0, f"{where}.sources must be a non-empty list")
        for i, spec in enumerate(self.sources):
            try:
                parse_sources([spec])
            except DataError as err:
                raise ConfigError(f"{where}.sources[{i}]: {err}") from None
        try:
            parse_sources(self.sources)
        except DataError as err:
            raise ConfigError(f"{where}.sources: {err}") from None
        need(positive_int(self.seq_len) and self.seq_len >= 8, f"{where}.seq_len must be an integer >= 8")
        need(
            number(self.val_fraction) and 0 <= self.val_fraction < 0.5,
            f"{where}.val_fraction must be in [0, 0.5), got {self.val_fraction!r}",
        )
        need(positive_int(self.workers), f"{where}.workers must be a positive integer, got {self.workers!r}")


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
    """A `Source` from its config form (docs/data.md)."""
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
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0
    ):
        raise DataError(f"{where}: weight must be a number > 0, got {weight!r}")
    name = options.get("name")
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name)):
        raise DataError(f"{where}: name must be letters, digits, '_', '.' or '-', got {name!r}")
    if options.get("dtype") is not None:
        try:
            check_token_dtype(options["dtype"])
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
    if "config" in options:  # a dataset's configuration name ("name" in datasets' words)
        options["config_name"] = options.pop("config")
    return Source(kind, str(target), **options)


def parse_sources(specs: list) -> list[Source]:
    """Every source of `optimus.data.sources`, with unique names and weights on all or none (the same files spelled
    otherwise: `DistinctFiles`)."""
    sources = [parse_source(spec) for spec in specs]
    seen: dict[str, int] = {}
    read: dict[tuple, int] = {}
    for i, source in enumerate(sources):
        same = (
            source.kind,
            os.path.normpath(os.path.expanduser(source.target)) if source.target else "",
            source.text_field,
            source.split,
            source.config_name,
            str(source.data_files),
        )
        if same in read:
            raise DataError(
                f"sources {read[same]} and {i} read the same data ({source}): list it once, with the "
                '"weight" it should have'
            )
        read[same] = i
        if source.label in seen:
            raise DataError(
                f"sources {seen[source.label]} and {i} are both named {source.label!r}: give one a "
                '"name" (to weight a source up, give it a "weight" rather than listing it twice)'
            )
        seen[source.label] = i
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        missing = sources[weighted.index(False)].label
        raise DataError(
            f'source {missing!r} has no "weight" while others have one: give every source a weight, '
            "or none (then sources are drawn in proportion to their sizes)"
        )
    return sources


def source_name(source: Source) -> str:
    """A source's default name: "embedded", the last plain part of its path, or its dataset's name."""
    if source.kind == "embedded":
        return "embedded"
    parts = [p for p in re.split(r"[\\/]", source.target) if p and not any(ch in p for ch in "*?[")]
    base = parts[-1] if parts else source.kind
    if source.kind != "hf":
        while "." in base.strip(".") and base.rsplit(".", 1)[-1].lower() in (
            "gz",
            "zst",
            "jsonl",
            "json",
            "txt",
            "md",
            "text",
            "parquet",
            "npy",
            "bin",
        ):
            base = base.rsplit(".", 1)[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base) or source.kind


def check_token_dtype(dtype) -> None:
    try:
        ok = np.issubdtype(np.dtype(dtype), np.integer)
    except TypeError:
        ok = False
    if not ok:
        raise DataError(f'dtype {dtype!r} is not an integer type (use e.g. "uint16", "uint32", "int32")')


def resolve_files(source: Source) -> list[Path]:
    """The files a "files" source names, sorted; a `DataError` if there are none."""
    return matching_files(
        source.target, supported_file, "data", ".txt, .md, .jsonl, .json (each also .gz or .zst) or .parquet"
    )


def resolve_token_files(target: str) -> list[Path]:
    """The `.npy`/`.bin` files a path, folder or glob names, sorted."""
    return matching_files(target, lambda p: p.suffix in TOKEN_SUFFIXES, "token", ".npy or .bin")


def matching_files(target: str, supported, what: str, kinds: str) -> list[Path]:
    """The files a path, folder or glob names, sorted (a folder's: those `supported` accepts)."""
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
        raise DataError(f"{what} path {target!r} {'holds' if os.path.isdir(expanded) else 'matches'} no {kinds} files")
    for path in files:
        if not supported(path):
            raise DataError(f"{what} file {str(path)!r} has an unsupported type (use {kinds})")
    return files


def inner_suffix(path: Path) -> str:
    """The format suffix under any compression: "wiki-0000.json.gz" -> ".json"."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def supported_file(path: Path) -> bool:
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return True
    return inner_suffix(path) in TEXT_SUFFIXES + JSON_SUFFIXES


def is_saved_dataset(target: str) -> bool:
    """Whether `target` is a folder written by `datasets`' `save_to_disk` (a Dataset or DatasetDict)."""
    root = Path(os.path.expanduser(target))
    return root.is_dir() and ((root / "state.json").is_file() or (root / "dataset_dict.json").is_file())


def reads_files(source: Source) -> bool:
    """Whether the source trains on local data or token files it names (not a `save_to_disk` folder or dataset)."""
    return source.kind == "tokens" or (source.kind == "files" and not is_saved_dataset(source.target))


class DistinctFiles:
    """Refuses a file that two sources train on under any spellings (a folder and a glob, links), known by its
    (st_dev, st_ino) or, without inode numbers, its resolved path."""

    def __init__(self) -> None:
        self._owners: dict[tuple, tuple[int, Source, Path]] = {}

    def add(self, index: int, source: Source, files: list[Path]) -> None:
        """Note the files source `index` trains on; a `DataError` if an earlier source trains on one."""
        # text sources that take other fields of the same files are not the same data
        family = ("tokens",) if source.kind == "tokens" else ("text", source.text_field)
        for path in files:
            key = (*family, *_file_identity(path))
            owner = self._owners.setdefault(key, (index, source, path))
            if owner[0] != index:
                other, first, spelled = owner
                as_ = "" if str(spelled) == str(path) else f" (as {path})"
                raise DataError(
                    f"sources {other} ({first.label!r}) and {index} ({source.label!r}) both read "
                    f"{spelled}{as_}: list each file in one source"
                )


def _file_identity(path: Path) -> tuple:
    stat = os.stat(path)  # follows symbolic links: a link and its target are one file
    if stat.st_ino:
        return ("inode", stat.st_dev, stat.st_ino)
    return ("path", os.path.realpath(path))

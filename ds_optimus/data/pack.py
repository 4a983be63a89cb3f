"""Tokenize text sources into flat token shards, in parallel and resumably; open every source as a
memory-mapped token stream.

Each text source is prepared into its own folder, `<cache_dir>/<name>-<key>/`, the key a hash of
what identifies the source's content (file names, sizes, times), the tokenizer, the held-out
fraction and this format: a changed input never reuses a stale shard, and changing the mixture
re-tokenizes nothing. A source is split into work units (`corpus.source_units`: a file each, or row
ranges of a `save_to_disk` folder). Unit i becomes `unit-i.train.bin` and `unit-i.val.bin` (uint16
when the vocabulary fits, else uint32; every document followed by the end-of-text id; a document
goes to the held-out split by a hash of its unit and position, a `val_fraction` of them), written
under temporary names and renamed, then its completion marker `unit-i.json`, written last. A
killed preparation resumes at the first unit without a marker; a unit without one is never read.

The units of all pending sources are dealt to the `world` processes of a launch (largest first,
each to the least loaded; every process computes the same deal) and each process tokenizes its
share with `workers` local processes. A process that finishes waits for the others' markers on the
shared filesystem, not in a collective (tokenizing a corpus takes longer than any collective's
time-out); an error is written beside the markers, so every process stops with the same line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..schema import ConfigError, Section, need, number, positive_int
from .corpus import DataError, Source, Unit, describe, parse_sources, source_units
from .tokenizer import tokenizer_fingerprint
from .tokens import TokenFile, TokenStream, token_files

FORMAT_VERSION = 3


@dataclass(frozen=True)
class DataConfig(Section):
    """`optimus.data`: the corpora (with mixture weights), the tokenizer (null: the embedded
    default), the sequence length, the held-out fraction, the token cache folder (on a filesystem
    every rank sees), the tokenizing processes per rank, and whether a resumed run may continue on
    changed data."""

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
        need(number(self.val_fraction) and 0 <= self.val_fraction < 0.5,
             f"{where}.val_fraction must be in [0, 0.5), got {self.val_fraction!r}")
        need(positive_int(self.workers), f"{where}.workers must be a positive integer, got {self.workers!r}")
        need(isinstance(self.allow_change, bool), f"{where}.allow_change must be true or false")


@dataclass
class PreparedSource:
    """One source, ready: its token streams and what identifies it."""

    source: Source
    identity: str  # a hash of the source's content identity (and, for text, the tokenizer's)
    train: TokenStream
    val: TokenStream | None
    documents: int | None  # None for a pre-tokenized source (never scanned)
    folder: Path | None = None

    @property
    def name(self) -> str:
        return self.source.label

    @property
    def weight(self) -> float | None:
        return self.source.weight


@dataclass
class PreparedData:
    """Every source of a run, ready to read."""

    sources: list[PreparedSource]
    eos_id: int
    root: Path  # the cache folder

    @property
    def train_tokens(self) -> int:
        return sum(s.train.total for s in self.sources)

    @property
    def val_tokens(self) -> int:
        return sum(s.val.total for s in self.sources if s.val is not None)

    @property
    def documents(self) -> int:
        return sum(s.documents or 0 for s in self.sources)

    @property
    def fingerprint(self) -> str:
        """A hash of every source's identity and weight."""
        parts = [(s.name, s.identity, s.weight) for s in self.sources]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def tokens(self, split: str) -> TokenStream:
        """All sources' tokens of `split` ("train" or "val"), one after another."""
        streams = [s.train if split == "train" else s.val for s in self.sources]
        return TokenStream.concat([s for s in streams if s is not None])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def source_key(source: Source, tokenizer, val_fraction: float) -> str:
    """A hash of the source's content identity, the tokenizer and the packing settings."""
    payload = {"format": FORMAT_VERSION, "source": describe(source), "val_fraction": val_fraction,
               "tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def source_folder(source: Source, tokenizer, cache_dir: str | Path, val_fraction: float) -> Path:
    return Path(cache_dir) / f"{source.label}-{source_key(source, tokenizer, val_fraction)[:16]}"


def _is_val(unit: int, index: int, fraction: float) -> bool:
    """Whether document `index` of unit `unit` is held out: a hash of the two below `fraction`, and
    the second document of the first unit always (a source of one document keeps it for training)."""
    if fraction == 0:
        return False
    mixed = ((unit * 0xD1B54A32D192ED03 + index) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)
    return (unit, index) == (0, 1) or (mixed >> 11) < fraction * 2**53


@dataclass
class SourcePlan:
    """What preparing and opening a source needs, found on the filesystem (by one rank, at scale)."""

    source: Source
    identity: str
    folder: Path | None = None  # a text source's shard folder
    units: list[Unit] | None = None  # a text source's work, when not prepared yet
    train_files: list[TokenFile] | None = None  # a token source's files
    val_files: list[TokenFile] | None = None


def plan_sources(sources: list[Source], tokenizer, cache_dir: str | Path, val_fraction: float) -> list[SourcePlan]:
    """Each source's identity, folder and pending units, or token files: every stat, glob and header
    read the data needs, done once (a training launch does it on rank 0 and sends it to the others)."""
    if not sources:
        raise DataError("optimus.data.sources is empty")
    if not 0.0 <= val_fraction < 0.5:
        raise DataError(f"optimus.data.val_fraction must be in [0, 0.5), got {val_fraction}")
    plans = []
    for source in sources:
        if source.kind == "tokens":
            try:
                identity = hashlib.sha256(json.dumps(describe(source), default=str).encode()).hexdigest()
                plans.append(SourcePlan(source, identity, train_files=token_files(source.target, source.dtype),
                                        val_files=token_files(source.val, source.dtype) if source.val else None))
            except DataError as err:
                raise DataError(f"source {source.label!r}: {err}") from None
            continue
        key = source_key(source, tokenizer, val_fraction)
        folder = Path(cache_dir) / f"{source.label}-{key[:16]}"
        units = None if (folder / "meta.json").exists() else source_units(source)
        plans.append(SourcePlan(source, key[:16], folder, units))
    return plans


def prepare_data(sources: list[Source], tokenizer, cache_dir: str | Path, val_fraction: float = 0.01, *,
                 workers: int = 1, rank: int = 0, world: int = 1, progress: bool = True,
                 threads: int | None = None, poll_seconds: float = 1.0,
                 plan: list[SourcePlan] | None = None) -> PreparedData:
    """Tokenize what is not prepared yet (this process's share of it), wait for the rest, and open
    every source. Every process of a launch calls it alike, with its `rank` of `world` (and the
    `plan_sources` of rank 0, where there is a process group to send it)."""
    plan = plan if plan is not None else plan_sources(sources, tokenizer, cache_dir, val_fraction)
    pending = [(p.source, p.folder, p.units) for p in plan if p.units is not None]
    if pending:
        from .workers import run_units

        run_units(pending, tokenizer, val_fraction, Path(cache_dir), workers=workers, rank=rank, world=world,
                  progress=progress, threads=threads, poll_seconds=poll_seconds)
    return PreparedData([_open(p) for p in plan], tokenizer.eos_token_id, Path(cache_dir))


def _open(plan: SourcePlan) -> PreparedSource:
    if plan.source.kind == "tokens":
        val = TokenStream(plan.val_files) if plan.val_files else None
        return PreparedSource(plan.source, plan.identity, TokenStream(plan.train_files), val, None)
    meta = json.loads((plan.folder / "meta.json").read_text())
    if meta["documents"] == 0:
        raise DataError(f"source {plan.source.label!r} holds no documents ({plan.source})")
    val = folder_stream(plan.folder, "val", meta)
    return PreparedSource(plan.source, meta["key"], folder_stream(plan.folder, "train", meta),
                          val if val.total else None, meta["documents"], plan.folder)


def folder_stream(folder: str | Path, split: str = "train", meta: dict | None = None) -> TokenStream:
    """A prepared source folder's tokens of `split`, each shard mapped when first read."""
    folder = Path(folder)
    meta = meta if meta is not None else json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"]).str
    return TokenStream([TokenFile(str(folder / f"unit-{i:06d}.{split}.bin"), count, dtype)
                        for i, count in enumerate(meta[f"{split}_units"]) if count])

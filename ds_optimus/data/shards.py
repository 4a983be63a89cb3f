"""Stored token shards opened for reading: memory-mapped `TokenStream`s per source and the run's
`PreparedData`; opening reads headers only.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .sources import Source
from .token_files import TokenFile, token_files
from .tokenize_workers import shard_file
from .units import SourcePlan

MAX_MAPPED = 128  # token files one stream keeps mapped at once (a rank's open files stay well under its limit)


class TokenStream:
    """Token arrays, or `TokenFile`s mapped on first read, as one stream (documents end-of-text separated)."""

    def __init__(self, parts, names=()) -> None:
        parts = list(parts)
        names = list(names) or [p.path if isinstance(p, TokenFile) else "" for p in parts]
        kept = [(p, n) for p, n in zip(parts, names, strict=True) if (p.length if isinstance(p, TokenFile) else len(p))]
        # Files are mapped only when read: at 12,288 ranks, each maps just the files its batches come from.
        self.files = [p if isinstance(p, TokenFile) else None for p, _ in kept]
        self.arrays = [None if isinstance(p, TokenFile) else p for p, _ in kept]
        self.names = [n for _, n in kept]
        self.ends = np.cumsum([p.length if isinstance(p, TokenFile) else len(p) for p, _ in kept], dtype=np.int64)
        self._mapped: OrderedDict[int, None] = OrderedDict()  # the files mapped now, least recently read first
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def __len__(self) -> int:
        return self.total

    def array(self, i: int) -> np.ndarray:
        """The i-th file's ids, mapped if need be; beyond `MAX_MAPPED` maps, the least recently read goes."""
        if self.files[i] is None:
            return self.arrays[i]
        if self.arrays[i] is None:
            self.arrays[i] = self.files[i].open()
            while len(self._mapped) >= MAX_MAPPED:
                self.arrays[self._mapped.popitem(last=False)[0]] = None
        self._mapped[i] = None
        self._mapped.move_to_end(i)
        return self.arrays[i]

    def num_sequences(self, seq_len: int) -> int:
        return self.total // seq_len

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) as int64 (across file boundaries)."""
        if start < 0 or start + count > self.total:
            raise IndexError(f"tokens [{start}, {start + count}) outside a stream of {self.total}")
        out = np.empty(count, dtype=np.int64)
        done = 0
        i = int(np.searchsorted(self.ends, start, side="right"))
        while done < count:
            first = int(self.ends[i - 1]) if i else 0
            lo = start + done - first
            take = min(count - done, int(self.ends[i]) - first - lo)
            out[done : done + take] = self.array(i)[lo : lo + take]
            done += take
            i += 1
        return out

    def head(self, count: int) -> np.ndarray:
        return self.read(0, min(count, self.total))

    @staticmethod
    def concat(streams) -> TokenStream:
        """The streams one after another (nothing is opened)."""
        parts = [f if f is not None else a for s in streams for f, a in zip(s.files, s.arrays, strict=True)]
        return TokenStream(parts, [n for s in streams for n in s.names])


def open_token_files(target: str, dtype: str | None = None) -> TokenStream:
    return TokenStream(token_files(target, dtype))


def folder_stream(folder: str | Path, split: str = "train", meta: dict | None = None) -> TokenStream:
    """A prepared source folder's tokens of `split`, each shard mapped when first read."""
    folder = Path(folder)
    meta = meta if meta is not None else json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"]).str
    return TokenStream(
        [
            TokenFile(str(shard_file(folder, i, split)), count, dtype)
            for i, count in enumerate(meta[f"{split}_units"])
            if count
        ]
    )


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


def open_prepared(plan: list[SourcePlan], eos_id: int, cache_dir: str | Path) -> PreparedData:
    """Every planned source opened (text sources' prepared shards, token sources' files)."""
    return PreparedData([_open(p) for p in plan], eos_id, Path(cache_dir))


def _open(plan: SourcePlan) -> PreparedSource:
    if plan.source.kind == "tokens":
        val = TokenStream(plan.val_files) if plan.val_files else None
        return PreparedSource(plan.source, plan.identity, TokenStream(plan.train_files), val, None)
    meta = json.loads((plan.folder / "meta.json").read_text())
    if meta["documents"] == 0:
        raise DataError(f"source {plan.source.label!r} holds no documents ({plan.source})")
    val = folder_stream(plan.folder, "val", meta)
    return PreparedSource(
        plan.source,
        meta["key"],
        folder_stream(plan.folder, "train", meta),
        val if val.total else None,
        meta["documents"],
        plan.folder,
    )

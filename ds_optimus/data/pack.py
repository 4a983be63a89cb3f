"""Tokenize documents and pack them into flat token files, cached under a content fingerprint.

Every document is tokenized (the Rust tokenizer encodes batches on all cores), followed by the
end-of-text token, and appended to `train.bin` or `val.bin` (numpy `uint16` when the vocabulary
fits, else `uint32`). Every `1/val_fraction`-th document (by a hash of its position, at least one)
goes to the held-out split. The folder is named by a fingerprint of the sources, the tokenizer and
these settings, so a changed input never reuses a stale cache; it is written under a temporary name
and renamed when complete, so an interrupted run leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..schema import ConfigError, Section, need, number, positive_int
from .corpus import DataError, Source, describe, iter_documents, parse_source
from .tokenizer import tokenizer_fingerprint

FORMAT_VERSION = 1
BATCH_DOCUMENTS = 256


@dataclass(frozen=True)
class DataConfig(Section):
    """`optimus.data`: the corpora, the tokenizer (null: the embedded default), the sequence length,
    the held-out fraction and the token cache folder."""

    sources: list = field(default_factory=lambda: ["embedded"])
    tokenizer: str | None = None  # an HF tokenizer name or folder; null: the embedded default
    seq_len: int = 256
    val_fraction: float = 0.02
    cache_dir: str = "data_cache"

    def check(self, where: str) -> None:
        need(isinstance(self.sources, list) and len(self.sources) > 0, f"{where}.sources must be a non-empty list")
        for i, spec in enumerate(self.sources):
            try:
                parse_source(spec)
            except DataError as err:
                raise ConfigError(f"{where}.sources[{i}]: {err}") from None
        need(positive_int(self.seq_len) and self.seq_len >= 8, f"{where}.seq_len must be an integer >= 8")
        need(number(self.val_fraction) and 0 <= self.val_fraction < 0.5,
             f"{where}.val_fraction must be in [0, 0.5), got {self.val_fraction!r}")


@dataclass(frozen=True)
class PackedData:
    """A finished cache folder: token files and what they hold."""

    root: Path
    dtype: np.dtype
    train_tokens: int
    val_tokens: int
    documents: int
    eos_id: int

    def tokens(self, split: str) -> np.memmap | np.ndarray:
        path = self.root / f"{split}.bin"
        count = self.train_tokens if split == "train" else self.val_tokens
        if count == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(count,))

    @classmethod
    def open(cls, root: str | Path) -> PackedData:
        root = Path(root)
        meta = json.loads((root / "meta.json").read_text())
        return cls(root, np.dtype(meta["dtype"]), meta["train_tokens"], meta["val_tokens"], meta["documents"],
                   meta["eos_id"])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def fingerprint(sources: Iterable[Source], tokenizer, val_fraction: float) -> str:
    """A hash of the sources' content identity, the tokenizer and the packing settings."""
    payload = {"format": FORMAT_VERSION, "sources": [describe(s) for s in sources],
               "tokenizer": tokenizer_fingerprint(tokenizer), "val_fraction": val_fraction}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _is_val(index: int, every: int | None) -> bool:
    if every is None:
        return False
    mixed = (index * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)
    return index == 0 or (mixed >> 32) % every == 0


def prepare(sources: list[Source], tokenizer, cache_dir: str | Path, val_fraction: float = 0.01,
            progress: bool = True) -> PackedData:
    """Tokenize and pack `sources` into `cache_dir/<fingerprint>/`, or reuse a finished one there."""
    if not sources:
        raise DataError("optimus.data.sources is empty")
    if not 0.0 <= val_fraction < 0.5:
        raise DataError(f"optimus.data.val_fraction must be in [0, 0.5), got {val_fraction}")
    key = fingerprint(sources, tokenizer, val_fraction)
    root = Path(cache_dir) / key[:20]
    if (root / "meta.json").exists():
        return PackedData.open(root)

    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = token_dtype(len(tokenizer))
    eos = tokenizer.eos_token_id
    every = None if val_fraction == 0 else max(2, round(1 / val_fraction))
    backend = tokenizer.backend_tokenizer
    counts = {"train": 0, "val": 0}
    started = time.time()
    bar = None
    if progress:
        from ..progress import progress

        bar = progress(desc="tokenizing", unit="doc")
    try:
        documents = _tokenize_into(tmp, sources, backend, eos, dtype, every, counts, bar)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    finally:
        if bar is not None:
            bar.close()
    if documents == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"the data sources hold no documents: {', '.join(map(str, sources))}")
    meta = {"format": FORMAT_VERSION, "fingerprint": key, "dtype": dtype.name, "eos_id": eos,
            "vocab_size": len(tokenizer), "documents": documents, "train_tokens": counts["train"],
            "val_tokens": counts["val"], "sources": [str(s) for s in sources],
            "seconds": round(time.time() - started, 2)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        os.replace(tmp, root)
    except OSError:  # another process finished the same cache first
        shutil.rmtree(tmp, ignore_errors=True)
    return PackedData.open(root)


def _tokenize_into(tmp: Path, sources, backend, eos, dtype, every, counts, bar) -> int:
    documents = 0
    with open(tmp / "train.bin", "wb") as train_f, open(tmp / "val.bin", "wb") as val_f:
        for source in sources:
            batch: list[str] = []
            for text in iter_documents(source):
                batch.append(text)
                if len(batch) == BATCH_DOCUMENTS:
                    documents = _write_batch(batch, backend, eos, dtype, documents, every, train_f, val_f, counts)
                    batch = []
                    if bar is not None:
                        bar.update(BATCH_DOCUMENTS)
                        bar.set_postfix(tokens=f"{counts['train'] + counts['val']:,}")
            if batch:
                documents = _write_batch(batch, backend, eos, dtype, documents, every, train_f, val_f, counts)
                if bar is not None:
                    bar.update(len(batch))
    if bar is not None:
        bar.set_postfix(tokens=f"{counts['train'] + counts['val']:,}")
    return documents


def _write_batch(texts, backend, eos, dtype, first_index, every, train_f, val_f, counts) -> int:
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    limit = np.iinfo(dtype).max
    for offset, encoding in enumerate(encodings):
        ids = np.asarray(encoding.ids + [eos], dtype=np.int64)
        if ids.size and ids.max() > limit:
            raise DataError(f"token id {ids.max()} does not fit {dtype.name}")
        split = "val" if _is_val(first_index + offset, every) else "train"
        ids.astype(dtype).tofile(val_f if split == "val" else train_f)
        counts[split] += ids.size
    return first_index + len(texts)

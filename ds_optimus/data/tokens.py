"""Flat token files, memory-mapped: the shards `prepare` writes and pre-tokenized sources.

A `TokenStream` is the concatenation of one or more 1-D integer arrays (memory maps), cut into
sequences of `seq_len` tokens across file boundaries. Opening one maps the files and reads their
headers: nothing is copied, hashed or scanned, so a 4-trillion-token source opens in milliseconds
with memory that does not grow with its size. Documents inside are separated by the end-of-text id.

Token files: `.npy` (the dtype and length from the header) or raw `.bin` (the dtype must be given).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from .corpus import DataError

TOKEN_SUFFIXES = (".npy", ".bin")


class TokenStream:
    """Token arrays read as one stream."""

    def __init__(self, arrays, names=()) -> None:
        pairs = [(a, n) for a, n in zip(arrays, list(names) or [""] * len(arrays), strict=True) if len(a)]
        self.arrays = [a for a, _ in pairs]
        self.names = [n for _, n in pairs]
        self.ends = np.cumsum([len(a) for a in self.arrays], dtype=np.int64)
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def __len__(self) -> int:
        return self.total

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
            take = min(count - done, len(self.arrays[i]) - lo)
            out[done:done + take] = self.arrays[i][lo:lo + take]
            done += take
            i += 1
        return out

    def head(self, count: int) -> np.ndarray:
        return self.read(0, min(count, self.total))

    def sequences(self, indices, seq_len: int) -> np.ndarray:
        """Rows `[len(indices), seq_len]` (int64): the `i`-th sequence of `seq_len` tokens for each i."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), seq_len), dtype=np.int64)
        for row, index in enumerate(indices.tolist()):
            out[row] = self.read(index * seq_len, seq_len)
        return out


def resolve_token_files(target: str) -> list[Path]:
    """The `.npy`/`.bin` files a path, folder or glob names, sorted; one-line errors."""
    expanded = os.path.expanduser(target)
    if os.path.isdir(expanded):
        files = sorted(p for p in Path(expanded).rglob("*") if p.is_file() and p.suffix in TOKEN_SUFFIXES)
    elif any(ch in expanded for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if os.path.isfile(p)]
    elif os.path.isfile(expanded):
        files = [Path(expanded)]
    else:
        raise DataError(f"token path {target!r} does not exist")
    if not files:
        raise DataError(f"token path {target!r} holds no .npy or .bin files")
    for path in files:
        if path.suffix not in TOKEN_SUFFIXES:
            raise DataError(f"token file {str(path)!r} is neither .npy nor .bin")
    return files


def open_token_file(path: Path, dtype: str | None = None) -> np.ndarray:
    """One token file, memory-mapped read-only."""
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise DataError(f"{path}: not a readable .npy file ({err})") from None
        if array.ndim != 1:
            raise DataError(f"{path}: a token file must be flat (1-D), this one has shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"{path}: holds {array.dtype} values, not integer token ids")
        if dtype is not None and np.dtype(dtype) != array.dtype:
            raise DataError(f"{path}: holds {array.dtype}, but the source says dtype {dtype!r}")
        return array
    if dtype is None:
        raise DataError(f"{path}: raw .bin token files need the source's \"dtype\" (e.g. \"uint16\" or \"uint32\")")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(size // itemsize,))


def open_token_files(target: str, dtype: str | None = None) -> TokenStream:
    files = resolve_token_files(target)
    return TokenStream([open_token_file(p, dtype) for p in files], [str(p) for p in files])


def describe_token_files(target: str) -> list[tuple[str, int, int]]:
    """What identifies token files without reading them: names, sizes and modification times."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in resolve_token_files(target)]


def check_token_dtype(dtype) -> None:
    try:
        ok = np.issubdtype(np.dtype(dtype), np.integer)
    except TypeError:
        ok = False
    if not ok:
        raise DataError(f"dtype {dtype!r} is not an integer type (use e.g. \"uint16\", \"uint32\", \"int32\")")

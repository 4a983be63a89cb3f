"""Flat token files, memory-mapped: the shards `prepare` writes and pre-tokenized sources.

A `TokenStream` is the concatenation of one or more 1-D integer arrays (memory maps), cut into
sequences of `seq_len` tokens across file boundaries. Opening one maps the files and reads their
headers: nothing is copied, hashed or scanned, so a 4-trillion-token source opens in milliseconds
with memory that does not grow with its size. Documents inside are separated by the end-of-text id.

Token files: `.npy` (the dtype and length from the header) or raw `.bin` (the dtype must be given).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpus import DataError, matching_files

TOKEN_SUFFIXES = (".npy", ".bin")
MAX_MAPPED = 128  # token files one stream keeps mapped at once (a rank's open files stay well under its limit)


@dataclass(frozen=True)
class TokenFile:
    """Where one token file's ids lie: its path, count, dtype and the byte offset of the first."""

    path: str
    length: int
    dtype: str
    offset: int = 0

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.length,))


class TokenStream:
    """Token arrays, or token files mapped on first read, read as one stream. Built from `TokenFile`
    records it opens nothing until a read needs a file: at 12,288 ranks and thousands of files, a
    rank maps only the files its batches come from."""

    def __init__(self, parts, names=()) -> None:
        parts = list(parts)
        names = list(names) or [p.path if isinstance(p, TokenFile) else "" for p in parts]
        kept = [(p, n) for p, n in zip(parts, names, strict=True) if (p.length if isinstance(p, TokenFile) else len(p))]
        self.files = [p if isinstance(p, TokenFile) else None for p, _ in kept]
        self.arrays = [None if isinstance(p, TokenFile) else p for p, _ in kept]
        self.names = [n for _, n in kept]
        self.ends = np.cumsum([p.length if isinstance(p, TokenFile) else len(p) for p, _ in kept], dtype=np.int64)
        self._mapped: OrderedDict[int, None] = OrderedDict()  # the files mapped now, least recently read first
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def __len__(self) -> int:
        return self.total

    def array(self, i: int) -> np.ndarray:
        """The i-th file's ids, mapped now if not yet. At most `MAX_MAPPED` files stay mapped (each
        map holds a file descriptor): the least recently read is let go first."""
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
            out[done:done + take] = self.array(i)[lo:lo + take]
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


def resolve_token_files(target: str) -> list[Path]:
    """The `.npy`/`.bin` files a path, folder or glob names, sorted; one-line errors."""
    return matching_files(target, lambda p: p.suffix in TOKEN_SUFFIXES, "token", ".npy or .bin")


def token_file(path: Path, dtype: str | None = None) -> TokenFile:
    """Where a token file's ids lie, from its header (`.npy`) or its size (`.bin`); one-line errors."""
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise DataError(f"{path}: not a readable .npy file ({type(err).__name__}: {err})") from None
        if array.ndim != 1:
            raise DataError(f"{path}: a token file must be flat (1-D), this one has shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"{path}: holds {array.dtype} values, not integer token ids")
        if dtype is not None and np.dtype(dtype) != array.dtype:
            raise DataError(f"{path}: holds {array.dtype}, but the source says dtype {dtype!r}")
        return TokenFile(str(path), len(array), array.dtype.str, int(getattr(array, "offset", 0)))
    if dtype is None:
        raise DataError(f"{path}: raw .bin token files need the source's \"dtype\" (e.g. \"uint16\" or \"uint32\")")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    return TokenFile(str(path), size // itemsize, np.dtype(dtype).str)


def token_files(target: str, dtype: str | None = None) -> list[TokenFile]:
    return [token_file(p, dtype) for p in resolve_token_files(target)]


def open_token_files(target: str, dtype: str | None = None) -> TokenStream:
    return TokenStream(token_files(target, dtype))


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

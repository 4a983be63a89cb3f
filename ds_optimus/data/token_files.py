"""Pre-tokenized token files (`.npy`, or raw `.bin` of a given dtype), located from headers alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .sources import resolve_token_files


@dataclass(frozen=True)
class TokenFile:
    """A token file's path, id count, dtype and first id's byte offset."""

    path: str
    length: int
    dtype: str
    offset: int = 0

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.length,))


def token_file(path: Path, dtype: str | None = None) -> TokenFile:
    """A token file, from its header (`.npy`) or its size (`.bin`)."""
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
        raise DataError(f'{path}: raw .bin token files need the source\'s "dtype" (e.g. "uint16" or "uint32")')
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    return TokenFile(str(path), size // itemsize, np.dtype(dtype).str)


def token_files(target: str, dtype: str | None = None, files: list[Path] | None = None) -> list[TokenFile]:
    """The token files `target` names (`files`: those already listed)."""
    return [token_file(p, dtype) for p in (files if files is not None else resolve_token_files(target))]

"""Readers of gzip and zstd (one or many frames) text files; a file cut inside a frame is an error, not a half line."""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path

from .errors import DataError


def open_text(path: Path):
    """A text reader of `path`, decompressing .gz and .zst."""
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if suffix == ".zst":
        return io.TextIOWrapper(io.BufferedReader(_ZstdReader(path)), encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


class _ZstdReader(io.RawIOBase):
    """Decompressed bytes of a .zst file of one or more frames."""

    def __init__(self, path: Path) -> None:
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") from None
        self._context = zstandard.ZstdDecompressor()
        self._error = zstandard.ZstdError
        self._file = path.open("rb")
        self._frame, self._fed, self._pending = self._context.decompressobj(), False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._fed and not self._frame.eof:
                    raise self._error("the file ends inside a zstd frame (a cut download?)")
                return 0
            out = []
            while chunk:
                if self._frame.eof:
                    self._frame, self._fed = self._context.decompressobj(), False
                out.append(self._frame.decompress(chunk))
                self._fed = True
                chunk = self._frame.unused_data if self._frame.eof else b""
            self._pending = b"".join(out)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def decode_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors

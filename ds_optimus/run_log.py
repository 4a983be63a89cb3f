"""A run's `log.txt`, appended by several processes (a leaf: imports nothing of ds_optimus)."""

from __future__ import annotations

import os
import time
from pathlib import Path

LOG_FILE = "log.txt"


def append_log(folder: str | Path, text: str) -> None:
    """Append `text`, timestamped, to `<folder>/log.txt` in one O_APPEND `write` (lines never interleave)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    line = "".join(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {part}\n" for part in text.splitlines() or [""])
    fd = os.open(folder / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    finally:
        os.close(fd)

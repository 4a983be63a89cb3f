"""Checkpoint file I/O under both checkpoint formats (it imports nothing of ds_optimus): atomic writes,
`CheckpointWriter`, `verify`, and `load`, whose `weights_only=True` refuses a planted pickle.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LATEST = "latest"  # the file naming the newest checkpoint folder, replaced atomically after it is complete


class CheckpointError(RuntimeError):
    """A checkpoint this run cannot use; the one-line message says why."""


# -- files ----------------------------------------------------------------------------------------


class _HashingWriter:
    """A file wrapper that counts and hashes what `torch.save` writes through it."""

    def __init__(self, f) -> None:
        self.f, self.size, self.crc = f, 0, 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        # Unbuffered, so a full disk fails here with its errno (torch's zip writer would otherwise
        # report only a position mismatch when a buffered flush fails later).
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):
                done += self.f.write(view[done:])
        except OSError as err:
            self.error = err
            raise
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.f.flush()


def atomic_save(obj: Any, path: Path) -> dict[str, Any]:
    """`torch.save` through a temporary name, fsync and rename; returns the manifest record (size, CRC-32)."""
    tmp = path.with_name(path.name + ".partial")
    writer = None
    try:
        with open(tmp, "wb", buffering=0) as f:
            writer = _HashingWriter(f)
            _save_without_zip_crc(obj, writer)
            os.fsync(f.fileno())
    except BaseException as err:
        tmp.unlink(missing_ok=True)  # a half-written file would only take space (the disk may be full)
        if writer is not None and writer.error is not None and not isinstance(err, OSError):
            raise writer.error from None  # the OS's reason, not the serializer's echo of it
        raise
    os.replace(tmp, path)
    return {"bytes": writer.size, "crc32": f"{writer.crc:08x}"}


def _save_without_zip_crc(obj: Any, f) -> None:
    # torch.save also computes a CRC-32 per zip record; the manifest's covers the whole file, so that
    # second pass over every byte is skipped (torch.load does not need it).
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if setter is None:
        torch.save(obj, f)
        return
    previous = torch.serialization.get_crc32_options()
    setter(False)
    try:
        torch.save(obj, f)
    finally:
        setter(previous)


def file_record(path: Path, chunk: int = 1 << 24) -> dict[str, Any]:
    """Size and CRC-32 of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def write_text_atomic(path: Path, text: str, fsync: bool = True) -> None:
    """Replace `path` with `text` through a temporary file: readers see the old or the new text."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    # A rename is durable once its directory is synced (POSIX); not every file system allows it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def copy_to_cpu(obj: Any, copy: bool = True) -> Any:
    """`obj` with every tensor on the CPU; `copy` copies CPU tensors too (a snapshot for a background save)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_to_cpu(v, copy) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_to_cpu(v, copy) for v in obj)
    return obj


def load(path: Path, allow: Iterable[Any] = (), mmap: bool = False) -> Any:
    """`torch.load` onto the CPU of only tensors, plain containers and `allow`'s types; else a CheckpointError."""
    allowed = list(allow)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, OSError, RuntimeError, EOFError, ValueError) as err:
        unsafe = [] if isinstance(err, OSError) else _unsafe_globals(path, allowed, str(err))
        if unsafe:
            raise CheckpointError(
                f"{path} holds objects that are not plain tensors or containers "
                f"({', '.join(unsafe)}); refusing to unpickle it"
            ) from None
        raise CheckpointError(f"{path} cannot be read ({_describe(err)})") from None


def _unsafe_globals(path: Path, allowed: list[Any], message: str) -> list[str]:
    # Named from a static read of the pickle (nothing in it runs), else from torch's message.
    try:
        with torch.serialization.safe_globals(allowed):
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip archive (legacy format), or unreadable: the message still names one
        found = []
    return sorted(found) or re.findall(r"Unsupported global: GLOBAL ([\w.]+)", message)[:1]


def _first_line(err: BaseException) -> str:
    text = str(err)
    # torch wraps the unpickler's own reason in paragraphs of advice; the reason is what matters here
    text = text.split("WeightsUnpickler error:", 1)[-1]
    reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def _describe(err: BaseException) -> str:
    # An OSError says what happened itself ("[Errno 28] No space left on device: ..."); others get their type.
    return str(err) if isinstance(err, (OSError, CheckpointError)) else _first_line(err)


# -- checkpoint folders ---------------------------------------------------------------------------


def verify(path: Path, rank: int = 0, world: int = 1, required: tuple[str, ...] = (), only=None) -> str | None:
    """One line on what is wrong with folder `path` against its manifest, None if intact (collective)."""
    files, problem = manifest_files(path, required)
    for name in sorted(n for n in files if only is None or only(n))[rank::world]:
        record, target = files[name], path / name
        if not target.is_file():
            problem = f"{name} is missing"
        elif record is not None:  # checkpoints from before manifests list names only
            if target.stat().st_size != record["bytes"]:
                problem = f"{name} has {target.stat().st_size} bytes, the manifest says {record['bytes']}"
            elif file_record(target)["crc32"] != record["crc32"]:
                problem = f"{name} fails its CRC-32 checksum"
        if problem:
            break
    return next((p for p in gather(world, problem) if p), None)


def manifest_files(path: Path, required: tuple[str, ...] = ()) -> tuple[dict[str, dict | None], str | None]:
    """({name: {"bytes", "crc32"}, or None before checksums}, what is wrong with the manifest or None)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        return {}, f"its manifest meta.json is unreadable ({type(err).__name__})"
    if not isinstance(meta, dict):
        return {}, "its manifest meta.json is not a JSON object"
    files, missing = meta.get("files"), [k for k in required if type(meta.get(k)) is not int]
    if missing:
        return {}, f"its manifest meta.json has no {missing[0]}"
    if isinstance(files, list) and all(isinstance(name, str) for name in files):
        return dict.fromkeys(files), None
    if not isinstance(files, dict) or not files:
        return {}, "its manifest meta.json lists no files"
    for name, record in files.items():
        kinds = (type(record.get("bytes")), type(record.get("crc32"))) if isinstance(record, dict) else ()
        if kinds != (int, str):
            return {}, f"its manifest meta.json gives no size and CRC-32 for {name}"
    return files, None


def manifest_text(meta: dict[str, Any], records: dict[str, dict[str, Any]]) -> str:
    """`meta.json`'s text: `meta` indented, then one line per file record (12,288 ranks' stay a few MB)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in sorted(records.items())]
    rest = {k: v for k, v in meta.items() if k != "files"}
    head = json.dumps(rest, indent=1)[:-2] + ",\n" if rest else "{\n"
    return head + ' "files": {' + ("\n" + ",\n".join(lines) + "\n " if lines else "") + "}\n}\n"


def gather(world: int, value: Any) -> list[Any]:
    """`value` of every rank (collective when `world` > 1 and torch.distributed is initialized)."""
    # An all-gather: a gather to one rank would open NCCL connections from every rank to it (12,288 for Mula).
    if world == 1 or not dist.is_initialized():
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    """`dist.barrier()` when torch.distributed is initialized, else nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointWriter:
    """Writes checkpoints: each rank its files into `<root>/<name>.tmp/`, then rank 0 the manifest, the
    rename, `latest` and pruning. A failure on any rank is raised on every rank."""

    def __init__(self, rank: int, world: int, timeout_s: float = 3600.0) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        # called with (path, step) after each of this rank's files, in the save's thread; one that raises fails it
        self.file_hooks: list[Callable[[Path, int | None], None]] = []
        self._thread: threading.Thread | None = None
        self._pruner: threading.Thread | None = None
        self._error: str | None = None
        self.last_seconds: float | None = None  # how long the last save took to write

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def prepare(self, root: Path, name: str) -> Path:
        """Create `<root>/<name>.tmp/` (rank 0, after removing what a crashed save left); collective."""
        tmp = root / f"{name}.tmp"
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None
        if self.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        return tmp

    def write(
        self,
        root: Path,
        name: str,
        files: dict[str, Any],
        meta: dict[str, Any] | None,
        *,
        background: bool = False,
        save_latest: bool = True,
        keep: Callable[[Path], None] | None = None,
        about: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Write this rank's `files` of checkpoint `name` (collective, after `prepare`); `meta` and `about` go
        into the manifest, `keep(root)` runs on rank 0 once it is in place."""
        tmp = root / f"{name}.tmp"
        files = {k: (v, (about or {}).get(k, {})) for k, v in files.items()}
        args = (root, name, tmp, files, meta, save_latest, keep)
        if background:
            self._thread = threading.Thread(
                target=self._background, args=args, name="ds_optimus-checkpoint", daemon=True
            )
            self._thread.start()
            return
        began = time.perf_counter()
        error = None
        try:
            records = self._write_files(tmp, files, (meta or {}).get("step"))
        except Exception as err:  # whatever it is, every rank must hear of it (none may wait forever)
            error, records = f"rank {self.rank}: {_describe(err)}", {}
        gathered = gather(self.world, (error, records))
        errors = [e for e, _ in gathered if e]
        if not errors and self.rank == 0:
            try:
                self._finish(
                    root, name, tmp, {k: v for _, r in gathered for k, v in r.items()}, meta or {}, save_latest, keep
                )
            except Exception as err:
                errors.append(f"rank 0: {_describe(err)}")
        errors = [e for e in gather(self.world, errors[0] if errors else None) if e]
        if errors:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"saving checkpoint {name} failed ({errors[0]}); the previous checkpoints are untouched"
            )
        self.last_seconds = time.perf_counter() - began

    def wait(self) -> None:
        """Join the save in flight, if any; raise its failure on every rank (collective)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None
        error, self._error = self._error, None
        errors = [e for e in gather(self.world, error) if e]
        if errors:
            raise CheckpointError(
                f"an asynchronous checkpoint save failed ({errors[0]}); the previous checkpoints are untouched"
            )

    def _write_files(self, folder: Path, files: dict[str, Any], step: int | None) -> dict[str, Any]:
        records = {}
        for name, (obj, facts) in files.items():
            records[name] = {**atomic_save(obj, folder / name), **facts}
            for hook in self.file_hooks:
                hook(folder / name, step)
        return records

    def _background(self, root, name, tmp, files, meta, save_latest, keep) -> None:
        # No collectives here: each rank leaves a `done_rankN.json` marker that rank 0 waits for.
        began = time.perf_counter()
        try:
            records = self._write_files(tmp, files, (meta or {}).get("step"))
            write_text_atomic(tmp / f"done_rank{self.rank:05d}.json", json.dumps(records))
        except Exception as err:
            self._error = f"rank {self.rank}: {_describe(err)}"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # the other ranks' writes fail too and say so
                return
            try:
                (tmp / f"failed_rank{self.rank:05d}").touch()
            except OSError:
                pass  # rank 0 gives up at its time-out instead
            return
        if self.rank != 0:
            self.last_seconds = time.perf_counter() - began
            return
        try:
            merged = self._collect_markers(tmp)
            self._finish(root, name, tmp, merged, meta or {}, save_latest, keep)
        except Exception as err:
            self._error = f"rank 0: {_describe(err)}"
            shutil.rmtree(tmp, ignore_errors=True)
            return
        self.last_seconds = time.perf_counter() - began

    def _collect_markers(self, tmp: Path) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        markers = [tmp / f"done_rank{r:05d}.json" for r in range(self.world)]
        done, polls = 0, 0  # each marker is looked for until it is there, in rank order: ~one stat a rank
        while done < self.world:
            if markers[done].exists():
                done += 1
                continue
            if polls % 20 == 0 and any(tmp.glob("failed_rank*")):  # a listing of the folder once a second
                raise CheckpointError("another rank failed to write its files")
            if time.monotonic() > deadline:
                missing = [r for r, m in enumerate(markers) if not m.exists()]
                raise CheckpointError(f"ranks {missing} did not finish writing within {self.timeout_s:.0f} s")
            polls += 1
            time.sleep(0.05)
        merged: dict[str, Any] = {}
        for marker in markers:
            merged.update(json.loads(marker.read_text()))
            marker.unlink()
        return merged

    def _finish(self, root, name, tmp, records, meta, save_latest, keep) -> None:
        write_text_atomic(tmp / "meta.json", manifest_text({**meta, "time": time.time()}, records))
        _fsync_dir(tmp)
        final, old = root / name, root / f"{name}.old"
        if final.exists():  # the same name saved again: set the old one aside until the new is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(root)
        if save_latest:
            write_text_atomic(root / LATEST, name)
            _fsync_dir(root)
        if keep is not None:  # deleting old checkpoints need not hold up training
            self._pruner = threading.Thread(target=keep, args=(root,), name="ds_optimus-prune", daemon=True)
            self._pruner.start()

"""Checkpoints of a DeepSpeed training run that survive crashes, full disks and damaged files.

A checkpoint is a folder `step_00000100/` in the checkpoint directory (on a file system every rank
sees). With the EP-aware sharded optimizer (`optimus.sharded_optimizer`, every shipped config) it
holds the engine's own files (`ds_optimus.optim.checkpointing`: weights and optimizer state named
by parameter and element range, not by rank), with the RNG states and the caller's extra state (the
data loader's position) as client state, and resumes on any world size and EP size. With
DeepSpeed's own optimizers it holds per-rank files and resumes on the same layout:

    model.pt              dense weights and buffers (written by rank 0)
    experts_ep000.pt ...  each EP rank's expert shard (written by the first replica of that shard)
    rank00000.pt ...      each rank's optimizer partition, LR scheduler, engine counters, RNG
                          states and the caller's extra state

Both kinds end with `meta.json`, the manifest: layout, step, and every file's size and CRC-32.
Every file is written under a temporary name, fsynced and renamed; the folder is assembled as
`step_N.tmp` and renamed by rank 0 once every rank's files are in; the `latest` file then names it
(replaced atomically). A crash at any point leaves the previous checkpoints and at most a `.tmp`
folder that the next save removes. On resume, `latest_good` checks the files against the manifest
and falls back to the previous checkpoint when one is damaged (renamed `.corrupt`, reported).
Saves can run in a background thread (`background=True`) while training goes on.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..schema import Section, check_flags, need, non_negative_int, positive_int
from . import faults

STEP_PREFIX = "step_"
LATEST = "latest"  # the file naming the newest checkpoint folder, replaced atomically after it is complete


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run; the message says why, in one line."""


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from, on this rank."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    accelerator = _accelerator()
    if accelerator is not None:
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    accelerator = _accelerator()
    if accelerator is not None and "accelerator" in state:
        accelerator.set_rng_state(state["accelerator"])


def _accelerator():
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator


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
    """`torch.save` to a temporary name, fsync, then rename: `path` is complete or absent. Returns
    its manifest record: size and CRC-32, computed while writing."""
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


def _write_files(folder: Path, files: dict[str, Any], step: int | None) -> dict[str, Any]:
    records = {}
    for i, (name, obj) in enumerate(files.items()):
        records[name] = atomic_save(obj, folder / name)
        if i == 0:
            faults.in_save(step)  # fault injection for the tests; nothing unless DS_OPTIMUS_FAULTS says so
    return records


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
    """`obj` with every tensor moved to the CPU (containers rebuilt). With `copy`, CPU tensors are
    copied too: a snapshot that training can run on from while a background thread writes it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_to_cpu(v, copy) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_to_cpu(v, copy) for v in obj)
    return obj


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Check checkpoint folder `path` against its manifest (`meta.json`: every file's size and
    CRC-32); None if it is intact, else what is wrong, in one line. Collective when `world` > 1:
    the files are hashed by the ranks in turn, each read once."""
    problem = None
    try:
        meta = json.loads((path / "meta.json").read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        problem = f"its manifest meta.json is unreadable ({type(err).__name__})"
        files = {}
    names = sorted(files)
    for name in names[rank::world] if problem is None else []:
        record = files[name] if isinstance(files, dict) else None
        target = path / name
        if not target.is_file():
            problem = f"{name} is missing"
        elif record is not None:  # checkpoints from before manifests list names only
            if target.stat().st_size != record["bytes"]:
                problem = f"{name} has {target.stat().st_size} bytes, the manifest says {record['bytes']}"
            elif file_record(target)["crc32"] != record["crc32"]:
                problem = f"{name} fails its CRC-32 checksum"
        if problem:
            break
    if world > 1 and dist.is_initialized():
        found = [None] * world
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    return problem


class CheckpointWriter:
    """Writes checkpoints: every rank its own files into `<root>/<name>.tmp/`, then rank 0 the
    manifest (`meta.json`, with every file's size and CRC-32), the rename to `<root>/<name>`, the
    `latest` pointer and the pruning of old checkpoints.

    Synchronous saves agree on success through a collective, so a failure on one rank (a full disk)
    is raised on every rank with the same message. Asynchronous saves run in a background thread
    that uses no collectives: each rank leaves a `done_rankN.json` marker with its records, and rank
    0's thread waits for all of them before it finishes the checkpoint. One save is in flight at a
    time; `wait()` (collective) joins it and raises its error on every rank."""

    def __init__(self, rank: int, world: int, timeout_s: float = 3600.0) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
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
        _barrier()
        return tmp

    def write(self, root: Path, name: str, files: dict[str, Any], meta: dict[str, Any] | None, *,
              background: bool = False, save_latest: bool = True, keep: Callable[[Path], None] | None = None) -> None:
        """Write this rank's `files` ({file name: object}) of checkpoint `name` (collective; call
        `prepare` first). `meta` (rank 0) goes into the manifest; `keep(root)` runs on rank 0 after
        the checkpoint is in place (pruning)."""
        tmp = root / f"{name}.tmp"
        args = (root, name, tmp, files, meta, save_latest, keep)
        if background:
            self._thread = threading.Thread(target=self._background, args=args, name="ds_optimus-checkpoint",
                                            daemon=True)
            self._thread.start()
            return
        began = time.perf_counter()
        error = None
        try:
            records = _write_files(tmp, files, (meta or {}).get("step"))
        except Exception as err:  # whatever it is, every rank must hear of it (none may wait forever)
            error, records = f"rank {self.rank}: {_describe(err)}", {}
        gathered = _all_gather(self.world, (error, records))
        errors = [e for e, _ in gathered if e]
        if not errors and self.rank == 0:
            try:
                self._finish(root, name, tmp, {k: v for _, r in gathered for k, v in r.items()}, meta or {},
                             save_latest, keep)
            except Exception as err:
                errors.append(f"rank 0: {_describe(err)}")
        errors = [e for e in _all_gather(self.world, errors[0] if errors else None) if e]
        if errors:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {name} failed ({errors[0]}); the previous checkpoints are "
                                  "untouched")
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
        errors = [e for e in _all_gather(self.world, error) if e]
        if errors:
            raise CheckpointError(f"an asynchronous checkpoint save failed ({errors[0]}); the previous "
                                  "checkpoints are untouched")

    def _background(self, root, name, tmp, files, meta, save_latest, keep) -> None:
        began = time.perf_counter()
        try:
            records = _write_files(tmp, files, (meta or {}).get("step"))
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
        while not all(m.exists() for m in markers):
            if any(tmp.glob("failed_rank*")):
                raise CheckpointError("another rank failed to write its files")
            if time.monotonic() > deadline:
                missing = [r for r, m in enumerate(markers) if not m.exists()]
                raise CheckpointError(f"ranks {missing} did not finish writing within {self.timeout_s:.0f} s")
            time.sleep(0.05)
        merged: dict[str, Any] = {}
        for marker in markers:
            merged.update(json.loads(marker.read_text()))
            marker.unlink()
        return merged

    def _finish(self, root, name, tmp, records, meta, save_latest, keep) -> None:
        meta = {**meta, "time": time.time(), "files": dict(sorted(records.items()))}
        write_text_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
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


def _describe(err: Exception) -> str:
    # An OSError says what happened itself ("[Errno 28] No space left on device: ..."); others get their type.
    return str(err) if isinstance(err, (OSError, CheckpointError)) else f"{type(err).__name__}: {err}"


def _all_gather(world: int, value: Any) -> list[Any]:
    if world == 1 or not dist.is_initialized():
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sharded(engine) -> bool:
    from ..optim.sharded import ShardedOptimizer

    return isinstance(engine.optimizer, ShardedOptimizer)


class CheckpointManager:
    """Save and find checkpoints of `engine` (whose module may be expert-parallel) in `directory`."""

    def __init__(self, directory: str | Path, keep_last: int = 2, groups=None) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.groups = groups  # ExpertParallelGroups, or None without expert parallelism
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.ep_size = groups.ep_size if groups is not None else 1
        self.writer = CheckpointWriter(self.rank, self.world_size)

    # -- finding ----------------------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()
                 and (p / "meta.json").exists()]
        return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))

    def has_checkpoints(self) -> bool:
        """Whether rank 0 sees a complete checkpoint here, on every rank (collective)."""
        found = [bool(self.complete()) if self.rank == 0 else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def candidates(self) -> list[Path]:
        """Complete checkpoints to resume from, best first: the one `latest` names, then the others
        newest first."""
        done = self.complete()[::-1]
        try:
            named = self.directory / (self.directory / LATEST).read_text().strip()
        except OSError:
            return done
        return [named, *(p for p in done if p != named)] if named in done else done

    def latest_good(self, report: Callable[[str], None] = print) -> Path | None:
        """The newest checkpoint whose files match their manifest, the same on every rank (rank 0's
        view of the directory; collective). A damaged one is reported through `report`, renamed to
        `<name>.corrupt` (kept for inspection, never loaded again) and the previous one tried.
        None without checkpoints; a CheckpointError when there are some and none is intact."""
        listed = [[str(p) for p in self.candidates()] if self.rank == 0 else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(listed, src=0)
        candidates = [Path(p) for p in listed[0]]
        problems = []
        for path in candidates:
            problem = verify(path, self.rank, self.world_size)
            if problem is None:
                return path
            problems.append(f"{path.name}: {problem}")
            report(f"checkpoint {path.name} is damaged: {problem}; falling back to the previous one")
            _barrier()  # every rank is done reading it
            if self.rank == 0:
                shutil.rmtree(path.with_name(path.name + ".corrupt"), ignore_errors=True)
                os.replace(path, path.with_name(path.name + ".corrupt"))
        if candidates:
            raise CheckpointError(f"none of the {len(candidates)} checkpoints in {self.directory} is intact "
                                  f"({'; '.join(problems)}); move them away to start over")
        return None

    # -- saving -----------------------------------------------------------------------------------

    def _expert_names(self, model: torch.nn.Module) -> set[str]:
        from ..parallel.expert_parallel import is_expert_param

        if self.groups is None:
            return set()
        return {name for name, p in model.named_parameters() if is_expert_param(p)}

    def save(self, step: int, engine, extra: dict[str, Any] | None = None, background: bool = False) -> Path:
        """Write checkpoint `step` (collective: every rank calls it) and prune old ones. With
        `background`, the state is copied and written by a thread while training goes on (one save
        in flight: this waits for the previous one first)."""
        self.writer.wait()
        name = f"{STEP_PREFIX}{step:08d}"
        self.writer.prepare(self.directory, name)
        client = {"rng": rng_state(), "extra": extra or {}}
        if _sharded(engine):
            from ..optim import checkpointing

            files, meta = checkpointing.checkpoint_files(engine, client, copy=background)
            meta["tag"] = name
        else:
            files, meta = self._per_rank_files(engine, client, copy=background)
        meta["step"] = step
        self.writer.write(self.directory, name, files, meta, background=background, keep=self._prune)
        return self.directory / name

    def wait(self) -> None:
        """Finish the save in flight (collective); raises its failure on every rank."""
        self.writer.wait()

    def _per_rank_files(self, engine, client: dict, copy: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        from ..optim.deepspeed_compat import engine_state

        model = engine.module
        state = model.state_dict()
        experts = self._expert_names(model)
        files: dict[str, Any] = {}
        if self.rank == 0:
            files["model.pt"] = {k: v for k, v in state.items() if k not in experts}
        if experts and self.rank == self.groups.edp_ranks[0]:
            files[f"experts_ep{self.groups.ep_rank:03d}.pt"] = {k: v for k, v in state.items() if k in experts}
        files[f"rank{self.rank:05d}.pt"] = {"engine": engine_state(engine), **client}
        if copy:
            files = copy_to_cpu(files)
        return files, {"world_size": self.world_size, "ep_size": self.ep_size}

    def _prune(self, root: Path) -> None:
        for old in self.complete()[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------------

    def load(self, path: str | Path, engine) -> tuple[int, dict[str, Any]]:
        """Restore model, optimizer, scheduler, counters and RNG from `path` on every rank; returns
        (step, the extra state saved with it)."""
        from ..optim.deepspeed_compat import load_engine_state

        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path} is not a complete checkpoint ({err})") from None
        engine_format = meta.get("format", "").startswith("ds_optimus.checkpoint/")
        if engine_format != _sharded(engine):
            raise CheckpointError(f"{path} was saved {'with' if engine_format else 'without'} the sharded optimizer; "
                                  f"set optimus.sharded_optimizer.enabled to {str(engine_format).lower()} to resume it")
        if engine_format:
            from ..optim import checkpointing

            try:
                _, client = checkpointing.load_checkpoint(engine, self.directory, tag=path.name)
            except checkpointing.CheckpointLoadError as err:
                raise CheckpointError(str(err)) from None
            if meta["world_size"] == self.world_size:  # on another layout the generators stay as seeded
                set_rng_state(client["rng"])
            return int(path.name[len(STEP_PREFIX):]), client["extra"]
        if (meta["world_size"], meta["ep_size"]) != (self.world_size, self.ep_size):
            raise CheckpointError(
                f"{path} was saved by {meta['world_size']} ranks at EP {meta['ep_size']}; this run has "
                f"{self.world_size} ranks at EP {self.ep_size} (resuming on another layout is not supported)")
        model = engine.module
        state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        if self._expert_names(model):
            state.update(torch.load(path / f"experts_ep{self.groups.ep_rank:03d}.pt", map_location="cpu",
                                    weights_only=True))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0]
            raise CheckpointError(f"{path} does not fit this model ({first}); was the model config changed?") from None
        own = torch.load(path / f"rank{self.rank:05d}.pt", map_location="cpu", weights_only=False)
        load_engine_state(engine, own["engine"])
        set_rng_state(own["rng"])
        return meta["step"], own["extra"]


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """`optimus.checkpoint`: when to save, how many to keep, where, and whether to resume."""

    interval: int = 0  # every N steps, and always at the end; 0: only at the end
    keep_last: int = 2
    dir: str | None = None  # null: <train.output_dir>/checkpoints
    resume: bool = True  # continue from the latest complete checkpoint in dir, if there is one
    async_save: bool = False  # write checkpoints in a background thread while training goes on

    def check(self, where: str) -> None:
        need(non_negative_int(self.interval), f"{where}.interval must be an integer >= 0, got {self.interval!r}")
        need(positive_int(self.keep_last), f"{where}.keep_last must be a positive integer, got {self.keep_last!r}")
        check_flags(self, where, "resume", "async_save")

    def build(self, output_dir: str | Path, groups=None) -> CheckpointManager:
        """The run's checkpoint manager (`dir`, or `<output_dir>/checkpoints`); collective-free."""
        return CheckpointManager(self.dir or Path(output_dir) / "checkpoints", self.keep_last, groups)

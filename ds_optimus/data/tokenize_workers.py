"""Tokenizing workers: pending units dealt to a launch's processes and tokenized by local workers into shards, each
unit's marker `unit-i.json` written last (a unit without one is never read; a killed preparation resumes there).
Processes wait for the markers on the shared filesystem, not in a collective (tokenizing outlasts its time-out); an
error file stops all alike.
"""

from __future__ import annotations

import heapq
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

from ..command_line import said_by_every_rank
from .errors import DataError
from .sources import Source
from .units import FORMAT_VERSION, Unit, unit_documents

BATCH_DOCUMENTS = 256
_TOKENIZERS: dict[int, object] = {}  # a worker process's tokenizer, built once from its JSON


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _is_val(unit: int, index: int, fraction: float) -> bool:
    """Whether document `index` of `unit` is held out: by a hash, and always document 1 of unit 0 (a one-document
    source keeps it for training)."""
    if fraction == 0:
        return False
    mixed = ((unit * 0xD1B54A32D192ED03 + index) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)
    return (unit, index) == (0, 1) or (mixed >> 11) < fraction * 2**53


def shard_file(folder: Path, index: int, split: str) -> Path:
    """Unit `index`'s token shard of `split` ("train" or "val") in a source's folder."""
    return folder / f"unit-{index:06d}.{split}.bin"


def deal(sizes: list[int], world: int) -> list[int]:
    """The process each unit goes to: largest first, to the least loaded (ties: lowest rank)."""
    owner = [0] * len(sizes)
    loads = [(0, r) for r in range(world)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(loads)
        owner[index] = r
        heapq.heappush(loads, (load + max(sizes[index], 1), r))
    return owner


def _marker(folder: Path, index: int) -> Path:
    return folder / f"unit-{index:06d}.json"


def run_units(
    pending: list[tuple[Source, Path, list[Unit]]],
    tokenizer,
    val_fraction: float,
    cache_dir: Path,
    *,
    workers: int,
    rank: int,
    world: int,
    progress: bool,
    threads: int | None,
    poll_seconds: float,
) -> None:
    """Tokenize this process's share and wait for every source (rank 0 writes each `meta.json`); errors go to
    `<cache_dir>/<folder>.error.rank<R>`."""
    jobs = [(source, folder, i, unit) for source, folder, units in pending for i, unit in enumerate(units)]
    owner = deal([unit.size for *_, unit in jobs], world)
    for _, folder, _ in pending:
        folder.mkdir(parents=True, exist_ok=True)
    for name in _error_files(pending, cache_dir):  # this rank's, or a rank this launch has not, from before
        other = int(name.rsplit(".rank", 1)[1])
        if other == rank or other >= world:
            (cache_dir / name).unlink(missing_ok=True)
    backend = tokenizer.backend_tokenizer.to_str()
    dtype = token_dtype(len(tokenizer)).name
    mine = [
        (source, folder, i, unit, backend, tokenizer.eos_token_id, dtype, val_fraction, rank)
        for (source, folder, i, unit), r in zip(jobs, owner, strict=True)
        if r == rank and not _marker(folder, i).exists()
    ]
    _remove_leftovers(jobs, owner, rank)
    bar = None
    if progress:
        from ..progress import progress as make_bar

        done = _markers_done(pending)
        if done:
            print(
                f"tokenizing: going on from an earlier preparation ({done} of {len(jobs)} files done)",
                file=sys.stderr,
                flush=True,
            )
        bar = make_bar(total=len(jobs), initial=done, desc="tokenizing", unit="file")
    try:
        _work(mine, workers, threads, lambda: _tick(bar, pending, cache_dir, count=bar is not None))
        if rank == 0:
            _wait(lambda: _tick(bar, pending, cache_dir) == len(jobs), poll_seconds)
            for source, folder, units in pending:
                _write_meta(source, folder, units, dtype)
            for name in _error_files(pending, cache_dir):  # those of earlier, failed launches
                (cache_dir / name).unlink(missing_ok=True)
        else:  # rank 0 writes the meta files when every marker is there
            _wait(
                lambda: (
                    not _tick(None, pending, cache_dir, count=False)
                    and all((folder / "meta.json").exists() for _, folder, _ in pending)
                ),
                poll_seconds * min(30, 1 + world // 256),
            )
    except DataError as err:
        if not getattr(err, "every_rank", False):  # this process's own: the others must hear of it
            _say_error(pending, cache_dir, rank, str(err))
        raise
    except Exception as err:  # the others must hear of it too
        _say_error(pending, cache_dir, rank, f"preparing the data failed on rank {rank}: {type(err).__name__}: {err}")
        raise
    finally:
        if bar is not None:
            bar.close()


STARTED = time.time()  # this process's start: error files much older are an earlier launch's


def _error_files(pending, cache_dir: Path, since: float | None = None) -> list[str]:
    """Error files of the pending sources (written since `since`, when given)."""
    prefixes = tuple(f"{folder.name}.error.rank" for _, folder, _ in pending)
    names = sorted(name for name in os.listdir(cache_dir) if name.startswith(prefixes) and ".tmp-" not in name)
    if since is None:
        return names
    fresh = []
    for name in names:
        try:
            if (cache_dir / name).stat().st_mtime >= since:
                fresh.append(name)
        except FileNotFoundError:
            pass
    return fresh


def _markers_done(pending) -> int:
    """Units with their marker, one listing per shard folder."""
    return sum(
        sum(1 for name in os.listdir(folder) if name.startswith("unit-") and name.endswith(".json"))
        for _, folder, _ in pending
    )


def _tick(bar, pending, cache_dir: Path, count: bool = True) -> int:
    """Raise an error another process wrote; count the finished units (rank 0) and show them."""
    errors = _error_files(pending, cache_dir, since=STARTED - LAUNCH_SKEW_SECONDS)
    if errors:  # another process's: it prints it itself, and rank 0 does (the launcher may stop it first)
        raise said_by_every_rank(DataError((cache_dir / errors[0]).read_text().strip()))
    if not count:
        return 0
    done = _markers_done(pending)
    if bar is not None:
        bar.update(done - bar.n)
    return done


def _wait(finished, poll_seconds: float) -> None:
    while not finished():
        time.sleep(poll_seconds)


LAUNCH_SKEW_SECONDS = 120  # the processes of one launch start within this of each other
STALE_SECONDS = 600  # a worker appends to its file every batch of documents: older ones are a dead worker's


def _tmp_suffix() -> str:
    """Temporary names say who writes them: `.tmp-<host>-<pid>`."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}"


def _dead_writer(name: str) -> bool:
    """Whether the process that wrote temporary file `name` is known dead (it ran on this host)."""
    host, _, pid = name.rpartition(".tmp-")[2].rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _remove_leftovers(jobs, owner: list[int], rank: int) -> None:
    """Delete this process's units' half-written files of dead or stale writers; live ones (another preparation's)
    stay."""
    mine: dict[Path, set[str]] = {}
    for (_, folder, i, _), r in zip(jobs, owner, strict=True):
        if r == rank:
            mine.setdefault(folder, set()).add(f"unit-{i:06d}")
    live = 0
    for folder, stems in mine.items():
        for name in os.listdir(folder):
            if ".tmp-" in name and name.split(".", 1)[0] in stems:
                path = folder / name
                try:
                    if _dead_writer(name) or time.time() - path.stat().st_mtime > STALE_SECONDS:
                        path.unlink(missing_ok=True)
                    else:
                        live += 1
                except FileNotFoundError:
                    pass
    if live:
        print(
            f"tokenizing: {live} files of this cache are being written right now, by another preparation "
            "(or one killed minutes ago); both go on, and the files both do are done twice",
            file=sys.stderr,
            flush=True,
        )


def _work(mine, workers: int, threads: int | None, tick) -> None:
    if not mine:
        return
    if workers == 1:
        for job in mine:
            tokenize_unit(job)
            tick()
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # no fork of a process with threads (torch, gloo)
    with context.Pool(workers, initializer=_limit_threads, initargs=(threads,)) as pool:
        for _ in pool.imap_unordered(tokenize_unit, mine):
            tick()


def _limit_threads(threads: int | None) -> None:
    """A worker's start: tokenizer held to `threads` threads, Ctrl-C ignored, ended with its parent."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # Linux: SIGTERM to this worker when the parent dies (a killed preparation leaves no orphans)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def tokenize_unit(job) -> dict:
    """Tokenize one unit into its shard files and write its marker (last)."""
    source, folder, index, unit, backend_json, eos, dtype_name, val_fraction, rank = job
    key = hash(backend_json)
    if key not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS.clear()
        _TOKENIZERS[key] = Tokenizer.from_str(backend_json)
    backend, dtype = _TOKENIZERS[key], np.dtype(dtype_name)
    started = time.time()
    tmp = {split: Path(f"{shard_file(folder, index, split)}{_tmp_suffix()}") for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    documents = 0
    try:
        with open(tmp["train"], "wb") as train_f, open(tmp["val"], "wb") as val_f:
            files = {"train": train_f, "val": val_f}
            batch: list[str] = []
            for text in unit_documents(source, unit):
                batch.append(text)
                if len(batch) == BATCH_DOCUMENTS:
                    documents = _write_batch(batch, backend, eos, dtype, index, documents, val_fraction, files, counts)
                    batch = []
            if batch:
                documents = _write_batch(batch, backend, eos, dtype, index, documents, val_fraction, files, counts)
        for split in ("train", "val"):
            os.replace(tmp[split], shard_file(folder, index, split))
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    record = {
        "unit": unit.label,
        "rank": rank,
        "documents": documents,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "seconds": round(time.time() - started, 3),
    }
    _write_atomic(_marker(folder, index), json.dumps(record))
    return record


def _write_batch(texts, backend, eos, dtype, unit, first_index, val_fraction, files, counts) -> int:
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    limit = np.iinfo(dtype).max
    for offset, encoding in enumerate(encodings):
        ids = np.asarray(encoding.ids + [eos], dtype=np.int64)
        if ids.size and ids.max() > limit:
            raise DataError(f"token id {ids.max()} does not fit {dtype.name}")
        split = "val" if _is_val(unit, first_index + offset, val_fraction) else "train"
        ids.astype(dtype).tofile(files[split])
        counts[split] += ids.size
    return first_index + len(texts)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}{_tmp_suffix()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _say_error(pending, cache_dir: Path, rank: int, message: str) -> None:
    for _, folder, _ in pending:
        try:
            _write_atomic(cache_dir / f"{folder.name}.error.rank{rank}", message + "\n")
        except OSError:
            pass


def _write_meta(source: Source, folder: Path, units: list[Unit], dtype: str) -> None:
    records = [json.loads(_marker(folder, i).read_text()) for i in range(len(units))]
    meta = {
        "format": FORMAT_VERSION,
        "key": folder.name.rsplit("-", 1)[-1],
        "source": str(source),
        "name": source.label,
        "dtype": dtype,
        "documents": sum(r["documents"] for r in records),
        "train_tokens": sum(r["train_tokens"] for r in records),
        "val_tokens": sum(r["val_tokens"] for r in records),
        "train_units": [r["train_tokens"] for r in records],
        "val_units": [r["val_tokens"] for r in records],
        "seconds": round(sum(r["seconds"] for r in records), 2),
    }
    _write_atomic(folder / "meta.json", json.dumps(meta, indent=1))

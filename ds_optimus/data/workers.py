"""The preparation's work: units dealt to the processes of a launch, tokenized by local worker
processes into shards with completion markers, and the wait for everyone's markers (`pack.py`
says what the files are)."""

from __future__ import annotations

import heapq
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .corpus import DataError, Source, Unit, unit_documents

BATCH_DOCUMENTS = 256
_TOKENIZERS: dict[int, object] = {}  # a worker process's tokenizer, built once from its JSON


def deal(sizes: list[int], world: int) -> list[int]:
    """The process each unit goes to: largest first, each to the least loaded (ties: lowest rank),
    the same on every process."""
    owner = [0] * len(sizes)
    loads = [(0, r) for r in range(world)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(loads)
        owner[index] = r
        heapq.heappush(loads, (load + max(sizes[index], 1), r))
    return owner


def _marker(folder: Path, index: int) -> Path:
    return folder / f"unit-{index:06d}.json"


def run_units(pending: list[tuple[Source, Path, list[Unit]]], tokenizer, val_fraction: float, *, workers: int,
              rank: int, world: int, progress: bool, threads: int | None, poll_seconds: float) -> None:
    """Tokenize this process's share of the pending sources' units, wait for all of them, and
    write each source's `meta.json`."""
    from .pack import token_dtype

    jobs = [(source, folder, i, unit) for source, folder, units in pending for i, unit in enumerate(units)]
    owner = deal([unit.size for *_, unit in jobs], world)
    for _, folder, _ in pending:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("error.rank*"):  # this process's, or a rank this launch has not, from before
            if stale.name == f"error.rank{rank}" or int(stale.name[len("error.rank"):] or 0) >= world:
                stale.unlink(missing_ok=True)
    backend = tokenizer.backend_tokenizer.to_str()
    dtype = token_dtype(len(tokenizer)).name
    every = None if val_fraction == 0 else max(2, round(1 / val_fraction))
    mine = [(source, folder, i, unit, backend, tokenizer.eos_token_id, dtype, every, rank)
            for (source, folder, i, unit), r in zip(jobs, owner, strict=True)
            if r == rank and not _marker(folder, i).exists()]
    _remove_leftovers(jobs, owner, rank)
    bar = None
    if progress:
        from ..progress import progress as make_bar

        done = sum(_marker(folder, i).exists() for _, folder, i, _ in jobs)
        if done:
            print(f"tokenizing: going on from an earlier preparation ({done} of {len(jobs)} files done)",
                  file=sys.stderr, flush=True)
        bar = make_bar(total=len(jobs), initial=done, desc="tokenizing", unit="file")
    try:
        _work(mine, workers, threads, lambda: _show(bar, jobs))
        _wait(jobs, pending, bar, poll_seconds)
    except DataError as err:
        _say_error(pending, rank, str(err))
        raise
    except Exception as err:  # the others must hear of it too
        _say_error(pending, rank, f"preparing the data failed on rank {rank}: {type(err).__name__}: {err}")
        raise
    finally:
        if bar is not None:
            bar.close()
    for source, folder, units in pending:
        _write_meta(source, folder, units, dtype)


def _remove_leftovers(jobs, owner: list[int], rank: int) -> None:
    """Half-written files of this process's units, left by a killed preparation (one listing per folder)."""
    mine: dict[Path, set[str]] = {}
    for (_, folder, i, _), r in zip(jobs, owner, strict=True):
        if r == rank:
            mine.setdefault(folder, set()).add(f"unit-{i:06d}")
    for folder, stems in mine.items():
        for name in os.listdir(folder):
            if ".tmp-" in name and name.split(".", 1)[0] in stems:
                (folder / name).unlink(missing_ok=True)


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
    """Hold a worker's Rust tokenizer to `threads` threads (before its thread pool starts)."""
    if threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def tokenize_unit(job) -> dict:
    """Tokenize one unit into its shard files and write its marker (last)."""
    source, folder, index, unit, backend_json, eos, dtype_name, every, rank = job
    key = hash(backend_json)
    if key not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS.clear()
        _TOKENIZERS[key] = Tokenizer.from_str(backend_json)
    backend, dtype = _TOKENIZERS[key], np.dtype(dtype_name)
    started = time.time()
    stem = folder / f"unit-{index:06d}"
    tmp = {split: Path(f"{stem}.{split}.bin.tmp-{os.getpid()}") for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    documents = 0
    try:
        with open(tmp["train"], "wb") as train_f, open(tmp["val"], "wb") as val_f:
            files = {"train": train_f, "val": val_f}
            batch: list[str] = []
            for text in unit_documents(source, unit):
                batch.append(text)
                if len(batch) == BATCH_DOCUMENTS:
                    documents = _write_batch(batch, backend, eos, dtype, index, documents, every, files, counts)
                    batch = []
            if batch:
                documents = _write_batch(batch, backend, eos, dtype, index, documents, every, files, counts)
        for split in ("train", "val"):
            os.replace(tmp[split], f"{stem}.{split}.bin")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    record = {"unit": unit.label, "rank": rank, "documents": documents, "train_tokens": counts["train"],
              "val_tokens": counts["val"], "seconds": round(time.time() - started, 3)}
    _write_atomic(_marker(folder, index), json.dumps(record))
    return record


def _write_batch(texts, backend, eos, dtype, unit, first_index, every, files, counts) -> int:
    from .pack import _is_val

    encodings = backend.encode_batch(texts, add_special_tokens=False)
    limit = np.iinfo(dtype).max
    for offset, encoding in enumerate(encodings):
        ids = np.asarray(encoding.ids + [eos], dtype=np.int64)
        if ids.size and ids.max() > limit:
            raise DataError(f"token id {ids.max()} does not fit {dtype.name}")
        split = "val" if _is_val(unit, first_index + offset, every) else "train"
        ids.astype(dtype).tofile(files[split])
        counts[split] += ids.size
    return first_index + len(texts)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _show(bar, jobs) -> None:
    if bar is None:
        return
    done = sum(_marker(folder, i).exists() for _, folder, i, _ in jobs)
    bar.update(done - bar.n)


def _wait(jobs, pending, bar, poll_seconds: float) -> None:
    """Until every unit has its marker; an error another process wrote is raised here."""
    while True:
        missing = [(folder, i) for _, folder, i, _ in jobs if not _marker(folder, i).exists()]
        _show(bar, jobs)
        if not missing:
            return
        for _, folder, _ in pending:
            for error in sorted(folder.glob("error.rank*")):
                raise DataError(error.read_text().strip())
        time.sleep(poll_seconds)


def _say_error(pending, rank: int, message: str) -> None:
    for _, folder, _ in pending:
        try:
            _write_atomic(folder / f"error.rank{rank}", message + "\n")
        except OSError:
            pass


def _write_meta(source: Source, folder: Path, units: list[Unit], dtype: str) -> None:
    from .pack import FORMAT_VERSION

    records = [json.loads(_marker(folder, i).read_text()) for i in range(len(units))]
    meta = {"format": FORMAT_VERSION, "key": folder.name.rsplit("-", 1)[-1], "source": str(source),
            "name": source.label, "dtype": dtype, "documents": sum(r["documents"] for r in records),
            "train_tokens": sum(r["train_tokens"] for r in records),
            "val_tokens": sum(r["val_tokens"] for r in records),
            "train_units": [r["train_tokens"] for r in records], "val_units": [r["val_tokens"] for r in records],
            "seconds": round(sum(r["seconds"] for r in records), 2)}
    _write_atomic(folder / "meta.json", json.dumps(meta, indent=1))

"""Prepare a config's data sources in parallel, across nodes, resumably: `prepare_data` (called as training
starts) or `python -m ds_optimus.data.prepare --config CONFIG --workers N` under any launcher. Each process
tokenizes its share into `optimus.data.cache_dir`, which all must see (a shared filesystem).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..command_line import ArgumentParser, fail, launch_rank
from ..launch.environment import detect

if TYPE_CHECKING:  # the command's --help imports none of them
    from .shards import PreparedData
    from .sources import Source
    from .units import SourcePlan

NAME = "ds_optimus.data.prepare"


def prepare_data(
    sources: list[Source],
    tokenizer,
    cache_dir: str | Path,
    val_fraction: float = 0.01,
    *,
    workers: int = 1,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
    threads: int | None = None,
    poll_seconds: float = 1.0,
    plan: list[SourcePlan] | None = None,
) -> PreparedData:
    """Tokenize this process's share of what is unprepared, wait for the rest, and open every source.
    Every process calls it alike (`plan`: rank 0's `plan_sources`, where a process group can send it)."""
    from .shards import open_prepared
    from .tokenize_workers import run_units
    from .units import plan_sources

    plan = plan if plan is not None else plan_sources(sources, tokenizer, cache_dir, val_fraction)
    pending = [(p.source, p.folder, p.units) for p in plan if p.units is not None]
    if pending:
        run_units(
            pending,
            tokenizer,
            val_fraction,
            Path(cache_dir),
            workers=workers,
            rank=rank,
            world=world,
            progress=progress,
            threads=threads,
            poll_seconds=poll_seconds,
        )
    return open_prepared(plan, tokenizer.eos_token_id, cache_dir)


def launch_world() -> tuple[int, int]:
    """(rank, world) from this process's launcher, (0, 1) without one; ranks meet on the files, not a process group."""
    world = detect()
    return world.rank, world.size


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(NAME, launched=True, description="Tokenize a config's data sources into token shards.")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config with an optimus.data section")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, dotted (repeatable)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenizing processes on this machine per launched process (default: optimus.data.workers)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="T",
        help="threads of each worker's tokenizer (default: the cores over the workers; 1 with "
        "several workers per core)",
    )
    parser.add_argument("--local_rank", type=int, default=None, help=argparse_suppress())  # from the launcher
    args = parser.parse_args(argv)
    for flag in ("workers", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be at least 1, got {value}")

    from ..schema import ConfigError, apply_overrides, load_json_config
    from .errors import DataError
    from .sources import DataConfig, parse_sources
    from .tokenizer import load_tokenizer
    from .units import plan_sources

    rank, world, started = launch_rank(), 1, time.time()
    try:
        rank, world = launch_world()
        config = apply_overrides(load_json_config(args.config), args.overrides)
        data = DataConfig.parse(config.get("optimus", {}).get("data", {}), "optimus.data")
        tokenizer = load_tokenizer(data.tokenizer)
        workers = args.workers or data.workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = args.threads or (max(1, cores // workers) if workers > 1 else None)
        sources = parse_sources(data.sources)
        plan = plan_sources(sources, tokenizer, data.cache_dir, data.val_fraction)
        if rank == 0 and not any(p.units is not None for p in plan):
            print(
                f"nothing to tokenize: every source is prepared in {data.cache_dir} or read in place", file=sys.stderr
            )
        prepared = prepare_data(
            sources,
            tokenizer,
            data.cache_dir,
            data.val_fraction,
            workers=workers,
            rank=rank,
            world=world,
            progress=rank == 0,
            threads=threads,
            plan=plan,
        )
    except KeyboardInterrupt:
        if rank == 0:
            print(f"{NAME}: interrupted; the same command goes on from the files already done", file=sys.stderr)
        return 130
    except (ConfigError, DataError, ValueError, OSError) as err:
        return fail(NAME, err, launched=True)
    if rank == 0:
        seconds = time.time() - started
        for source in prepared.sources:
            where = source.folder or source.source.target
            docs = f"{source.documents:,} documents, " if source.documents is not None else ""
            print(
                f"{source.name}: {docs}{source.train.total:,} train + "
                f"{source.val.total if source.val is not None else 0:,} held-out tokens in {where}"
            )
        count = len(prepared.sources)
        print(
            f"ready: {prepared.train_tokens:,} train tokens in {count} source{'s' if count > 1 else ''} "
            f"({seconds:.1f} s, {world} process{'es' if world > 1 else ''} x {workers} workers)"
        )
    return 0


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())

"""Tokenize a config's data sources before training: in parallel, across nodes, resumably.

    python -m ds_optimus.data.prepare --config ds_configs/NAME.json --workers 16
    mpirun -n 64 python -m ds_optimus.data.prepare --config ds_configs/NAME.json --workers 12
    deepspeed --num_nodes 8 --num_gpus 1 --module ds_optimus.data.prepare --config ds_configs/NAME.json

Every process of a launch (its rank from RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK,
PALS_RANKID or SLURM_PROCID; the count from the matching size variable) tokenizes its share of
the files with `--workers` local processes into `optimus.data.cache_dir`, which every process must
see (a shared filesystem). A killed preparation started again goes on from the files it had not
finished. Training with the same config then finds the shards and starts at once.
"""

from __future__ import annotations

import os
import sys
import time

from ..command_line import ArgumentParser, fail, launch_rank

NAME = "ds_optimus.data.prepare"
SIZE_KEYS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "PALS_SIZE", "SLURM_NTASKS")


def launch_world() -> tuple[int, int]:
    """(rank, world) of this process as its launcher set them; (0, 1) without one."""
    rank = launch_rank()
    if "PALS_RANKID" in os.environ and os.environ["PALS_RANKID"].isdigit() and not rank:
        rank = int(os.environ["PALS_RANKID"])
    world = next((int(os.environ[k]) for k in SIZE_KEYS if os.environ.get(k, "").isdigit() and int(os.environ[k]) > 0),
                 1)
    if rank >= world:
        raise ValueError(f"this process is rank {rank} but the launcher's size variables ({', '.join(SIZE_KEYS)}) "
                         f"say {world} process{'es' if world > 1 else ''}: set the size with the rank")
    return rank, world


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(NAME, launched=True, description="Tokenize a config's data sources into token shards.")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config with an optimus.data section")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, dotted (repeatable)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizing processes on this machine per launched process (default: "
                             "optimus.data.workers)")
    parser.add_argument("--threads", type=int, default=None, metavar="T",
                        help="threads of each worker's tokenizer (default: the cores over the workers; 1 with "
                             "several workers per core)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse_suppress())  # from the launcher
    args = parser.parse_args(argv)
    for flag in ("workers", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} must be at least 1, got {value}")

    from ..schema import ConfigError, apply_overrides, load_json_config
    from .corpus import DataError, parse_sources
    from .pack import DataConfig, plan_sources, prepare_data
    from .tokenizer import load_tokenizer

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
            print(f"nothing to tokenize: every source is prepared in {data.cache_dir} or read in place",
                  file=sys.stderr)
        prepared = prepare_data(sources, tokenizer, data.cache_dir, data.val_fraction, workers=workers, rank=rank,
                                world=world, progress=rank == 0, threads=threads, plan=plan)
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
            print(f"{source.name}: {docs}{source.train.total:,} train + "
                  f"{source.val.total if source.val is not None else 0:,} held-out tokens in {where}")
        count = len(prepared.sources)
        print(f"ready: {prepared.train_tokens:,} train tokens in {count} source{'s' if count > 1 else ''} "
              f"({seconds:.1f} s, {world} process{'es' if world > 1 else ''} x {workers} workers)")
    return 0


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())

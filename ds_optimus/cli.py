"""What every command line of ds_optimus shares (a leaf: imports nothing else of ds_optimus, nor
PyTorch): usage as `python -m NAME`, errors as one line `NAME: error: ...` with exit status 2, and
under a launcher an error every rank raises printed once, by rank 0."""

from __future__ import annotations

import argparse
import os
import sys

EXIT_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the usage line `python -m NAME ...` and usage errors as `NAME: error: ...`,
    the form every error of the command takes."""

    def __init__(self, name: str, **kwargs) -> None:
        kwargs.setdefault("prog", f"python -m {name}")
        super().__init__(**kwargs)
        self.name = name

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.name}: error: {message}\n")


def launch_rank() -> int:
    """This process's global rank as the launcher set it (0 without a launcher)."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def fail(name: str, error: BaseException | str) -> int:
    """Print `error` as one line `NAME: error: ...` and return the exit status 2. Under a launcher
    only rank 0 prints: the library raises its errors (bad config, data, layout, checkpoints) on
    every rank alike, so the other ranks would repeat the line among the launcher's; an error
    marked `rank_specific` (one rank's own failure) is printed by the rank that has it."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    rank = launch_rank()
    if rank == 0:
        print(f"{name}: error: {line}", file=sys.stderr, flush=True)
    elif getattr(error, "rank_specific", False):
        print(f"{name}: error: rank {rank}: {line}", file=sys.stderr, flush=True)
    return EXIT_ERROR

"""What every command shares: `python -m NAME` usage and one-line `NAME: error: ...` errors (exit status 2), printed
once where all ranks raise them alike.
"""

from __future__ import annotations

# A leaf: imports no PyTorch and nothing of ds_optimus but the launch environment (itself a leaf).
import argparse
import atexit
import os
import shutil
import sys
import threading

EXIT_ERROR = 2


def said_by_every_rank(error: BaseException) -> BaseException:
    """Mark `error` as raised alike by every rank; returns it."""
    error.every_rank = True
    return error


class ArgumentParser(argparse.ArgumentParser):
    """argparse with usage `python -m NAME` and `NAME: error: ...` errors (from rank 0 alone with `launched`)."""

    def __init__(self, name: str, launched: bool = False, **kwargs) -> None:
        kwargs.setdefault("prog", f"python -m {name}")
        super().__init__(**kwargs)
        self.name, self.launched = name, launched

    def error(self, message: str):
        if not self.launched or launch_rank() == 0:
            self.print_usage(sys.stderr)
            self.exit(EXIT_ERROR, f"{self.name}: error: {message}\n")
        self.exit(EXIT_ERROR)


def launch_rank() -> int:
    """This process's launcher-set global rank (0 without a launcher, or if unreadable)."""
    from .launch.environment import LaunchError, detect

    try:
        return detect().rank
    except LaunchError:
        return 0


def fail(name: str, error: BaseException | str, launched: bool = False) -> int:
    """Print `error` as `NAME: error: ...` and return 2; with `launched`, rank 0 alone prints `said_by_every_rank`
    errors, and any rank its other errors, naming its rank."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    rank = launch_rank() if launched else 0
    if rank == 0:
        print(f"{name}: error: {line}", file=sys.stderr, flush=True)
    elif not getattr(error, "every_rank", False):
        print(f"{name}: error: rank {rank}: {line}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def deepspeed_launcher() -> str:
    """The `deepspeed` script beside this Python, else on PATH."""
    from pathlib import Path

    beside = Path(sys.executable).with_name("deepspeed")
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if found is None:
        raise FileNotFoundError(f"no `deepspeed` launcher beside {sys.executable} or on PATH")
    return found


def exit_without_teardown(status: int | None) -> None:
    """Exit 0 skipping interpreter teardown (atexit and flushes still run); other statuses or live non-daemon threads
    exit normally."""
    # The teardown costs each rank 1.5-2 s of a core (measured on a tiny run). A failed rank keeps it:
    # stopped by a peer's failure, it must not end before that peer, whose status the launcher reports.
    status = 0 if status is None else status
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if status != 0 or others:
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(status)

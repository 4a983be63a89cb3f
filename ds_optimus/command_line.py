"""What every command line of ds_optimus shares (a leaf: imports nothing of ds_optimus but the
launch environment, itself a leaf, nor PyTorch): usage as `python -m NAME`, errors as one line
`NAME: error: ...` with exit status 2, and, for the commands a launcher starts on many ranks, an
error every rank raises alike printed once.

Which errors every rank raises alike is known where they are raised: the checks of the config before
anything rank-dependent (`said_by_every_rank`), and the errors the library makes collective (rank 0's
data error broadcast, a checkpoint none of the ranks can use). Rank 0 prints those; any other error
is printed by every rank that has it, with its rank, so that a rank failing alone (a file its node
does not see) is never silent."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import threading

EXIT_ERROR = 2


def said_by_every_rank(error: BaseException) -> BaseException:
    """Mark `error` as one every rank raises alike (rank 0 alone prints it); returns it."""
    error.every_rank = True
    return error


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the usage line `python -m NAME ...` and usage errors as `NAME: error: ...`,
    the form every error of the command takes; with `launched`, printed by rank 0 only (every rank
    parses the same command line)."""

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
    """This process's global rank as its launcher set it (0 without a launcher, or where the
    launcher's variables cannot be read: the error saying so is then printed)."""
    from .launch.environment import LaunchError, detect

    try:
        return detect().rank
    except LaunchError:
        return 0


def fail(name: str, error: BaseException | str, launched: bool = False) -> int:
    """Print `error` as one line `NAME: error: ...` and return the exit status 2. With `launched`
    (a command a launcher starts on many ranks), an error marked by `said_by_every_rank` is printed
    by rank 0 alone and any other by each rank that raises it, naming its rank."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    rank = launch_rank() if launched else 0
    if rank == 0:
        print(f"{name}: error: {line}", file=sys.stderr, flush=True)
    elif not getattr(error, "every_rank", False):
        print(f"{name}: error: rank {rank}: {line}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def deepspeed_launcher() -> str:
    """The `deepspeed` launcher script: beside this Python (a venv), else the one on PATH (a
    `pip install --target` puts it in that folder's bin/, which the caller adds to PATH)."""
    from pathlib import Path

    beside = Path(sys.executable).with_name("deepspeed")
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if found is None:
        raise FileNotFoundError(f"no `deepspeed` launcher beside {sys.executable} or on PATH")
    return found


def exit_without_teardown(status: int | None) -> None:
    """Exit 0 without the interpreter's teardown (atexit handlers run, output flushed); any other
    status, or a non-daemon thread still running, exits normally."""
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

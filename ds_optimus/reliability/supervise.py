"""Restart a failed training run from its last good checkpoint.

    python -m ds_optimus.reliability.supervise [--max-restarts 3] [--backoff 30] -- \\
        deepspeed --num_gpus 8 --module ds_optimus.train --config ds_configs/mula-7b-a1b.json

Runs the command; when it fails (a killed rank, a watchdog exit, a crash), waits (`--backoff`
seconds, doubling up to `--max-backoff`) and runs it again: the training entry point resumes from
the newest intact checkpoint. It stops when the run succeeds, when it was preempted (exit status 75:
the checkpoint is written; the scheduler requeues), after `--max-restarts` restarts, or when two
failures in a row happen at the same step (no progress: restarting again would fail again). The
step comes from `<train.output_dir>/progress.json`, found through the command's `--config` (or
`--progress FILE`). Each attempt gets `DS_OPTIMUS_ATTEMPT=<n>` in its environment. SIGTERM/SIGINT
are passed on to the run, whose exit status is then the supervisor's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .signals import EXIT_PREEMPTED

EXIT_GAVE_UP = 3
ATTEMPT_VAR = "DS_OPTIMUS_ATTEMPT"  # the restart count, in every attempt's environment
DEFAULT_OUTPUT_DIR = "runs/mula"  # optimus.train.output_dir when a config does not set it


def _progress_file(command: list[str]) -> Path | None:
    """`<optimus.train.output_dir>/progress.json` of the config the command trains (with its --set)."""
    from ..schema import apply_overrides, load_json_config

    if "--config" not in command or command.index("--config") + 1 >= len(command):
        return None
    config = load_json_config(command[command.index("--config") + 1])
    overrides = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "--set"]
    train = apply_overrides(config, overrides).get("optimus", {}).get("train", {})
    return Path(train.get("output_dir", DEFAULT_OUTPUT_DIR)) / "progress.json"


def _step(progress: Path | None) -> int | None:
    try:
        return int(json.loads(progress.read_text())["step"]) if progress is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def supervise(command: list[str], max_restarts: int = 3, backoff: float = 30.0, max_backoff: float = 600.0,
              progress: Path | None = None, log=print) -> int:
    """Run `command` until it succeeds or the rules above stop it; returns the exit status to use."""
    progress = progress or _progress_file(command)
    child: subprocess.Popen | None = None
    stopping = []

    def forward(signum, frame):
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at: int | None = None
        for attempt in range(max_restarts + 1):
            if attempt:
                wait = min(max_backoff, backoff * 2 ** (attempt - 1))
                log(f"supervise: restart {attempt} of {max_restarts} in {wait:g} s")
                time.sleep(wait)
            child = subprocess.Popen(command, env={**os.environ, ATTEMPT_VAR: str(attempt)})
            status = child.wait()
            if status == 0:
                return 0
            if status == EXIT_PREEMPTED or stopping:
                log(f"supervise: the run exited with status {status} after a signal; not restarting")
                return status
            step = _step(progress)
            where = f"after step {step}" if step is not None else "before its first step"
            log(f"supervise: attempt {attempt} failed with status {status} {where}")
            if step is not None and step == failed_at:
                log(f"supervise: two failures in a row after step {step} without progress; giving up")
                return EXIT_GAVE_UP
            failed_at = step
        log(f"supervise: {max_restarts} restarts used up; giving up")
        return EXIT_GAVE_UP
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    from ..command_line import ArgumentParser

    parser = ArgumentParser("ds_optimus.reliability.supervise",
                            description="Restart a failed training run from its last good checkpoint.",
                            usage="%(prog)s [options] -- COMMAND ...")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--backoff", type=float, default=30.0, help="seconds before the first restart (doubles)")
    parser.add_argument("--max-backoff", type=float, default=600.0)
    parser.add_argument("--progress", type=Path, default=None,
                        help="the run's progress.json (default: found through the command's --config)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (put it after --)")
    if args.max_restarts < 0 or args.backoff < 0:
        parser.error("--max-restarts and --backoff must be >= 0")
    try:
        progress = args.progress or _progress_file(command)
    except ValueError as err:  # a config that does not parse: the run itself will say so
        print(f"supervise: cannot read the command's config ({err}); no progress tracking", file=sys.stderr)
        progress = None

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    return supervise(command, args.max_restarts, args.backoff, args.max_backoff, progress, log)


if __name__ == "__main__":
    sys.exit(main())

"""Nodes simulated on one machine, as an `mpiexec` would start them: `python -m
ds_optimus.launch.simulate --hostfile F --ppn P -- COMMAND...` starts P ranks for each host of F with
MPICH's variables (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), the host's name as
DS_OPTIMUS_HOST (logs, fault records and host lists name it) and the rendezvous on the loopback, since
the names resolve nowhere. The supervisor's host files and left-out nodes work as on a cluster."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from .hosts import HostListError, read_hostfile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        "ds_optimus.launch.simulate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hostfile", required=True, help="the simulated nodes, a name a line (any host-file format)")
    p.add_argument("--ppn", type=int, default=1, help="ranks a node (default 1)")
    p.add_argument(
        "--kill-after",
        type=float,
        default=30.0,
        help="seconds from the SIGTERM to the SIGKILL of ranks still running after a failure (default 30)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise ValueError("no command: give it after --")
        if args.ppn < 1:
            raise ValueError(f"--ppn must be at least 1, got {args.ppn}")
        hosts = read_hostfile(args.hostfile)
    except (HostListError, ValueError) as err:  # one line; ds_optimus.command_line is above this package
        print(f"ds_optimus.launch.simulate: error: {err}", file=sys.stderr)
        return 2
    return run(hosts, args.ppn, command, args.kill_after)


def run(hosts: list[str], ppn: int, command: list[str], kill_after: float = 30.0) -> int:
    """Start `ppn` ranks of `command` for each of `hosts`; the first failure's status, or 0."""
    world = len(hosts) * ppn
    with socket.socket() as s:  # a free port for this launch, as a job's id would give one
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PMI_RANK": str(rank),
            "PMI_SIZE": str(world),
            "MPI_LOCALRANKID": str(rank % ppn),
            "MPI_LOCALNRANKS": str(ppn),
            "DS_OPTIMUS_HOST": hosts[rank // ppn],
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(subprocess.Popen(command, env=env))
    forward = lambda signum, _frame: [p.send_signal(signum) for p in procs if p.poll() is None]  # noqa: E731
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)  # a preemption reaches every rank, as the scheduler's would
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed:
            status = failed[0]
            time.sleep(2)  # the others' own exits first (a watchdog's report)
            _stop(procs, kill_after)
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    return status or next((p.returncode for p in procs if p.returncode), 0)


def _stop(procs: list[subprocess.Popen], kill_after: float) -> None:
    # as mpiexec and srun stop ranks: SIGTERM (each says its last word), then SIGKILL
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + kill_after
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())

"""A stand-in for `mpiexec` over several nodes, on this machine: `python tests/fake_cluster.py
--hostfile F --ppn P -- COMMAND...` starts P ranks for each host of F with the variables MPICH's
Hydra gives (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS) and the host's name as
DS_OPTIMUS_HOST, the rendezvous on the loopback (the hosts' names resolve nowhere). When a rank
exits with a failure the others are stopped and its status is this command's, as mpiexec does."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hostfile", required=True)
    parser.add_argument("--ppn", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    hosts = [line.split()[0] for line in open(args.hostfile) if line.strip()]
    world = len(hosts) * args.ppn
    with socket.socket() as s:  # a port for this launch, as a job id would give
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = {**os.environ, "PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(rank % args.ppn),
               "MPI_LOCALNRANKS": str(args.ppn), "DS_OPTIMUS_HOST": hosts[rank // args.ppn],
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(command, env=env))
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed:
            status = failed[0]
            time.sleep(2)  # the others' last words (a watchdog's report)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    return status or next((p.returncode for p in procs if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())

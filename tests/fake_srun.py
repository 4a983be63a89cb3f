"""A stand-in for Slurm's `srun` on this machine: `python tests/fake_srun.py --nodes N
--ntasks-per-node P --nodelist a,b [--cpu-bind=...] COMMAND...` starts P tasks for each of the
first N hosts of the node list with the variables srun gives its tasks (SLURM_PROCID,
SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST,
SLURM_JOB_ID, SLURM_STEP_ID) and the host's name as DS_OPTIMUS_HOST. A failing task stops the
others; its status is this command's."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main() -> int:
    args, i = sys.argv[1:], 0
    options = {}
    while i < len(args) and args[i].startswith("--"):
        key, _, value = args[i][2:].partition("=")
        if not value:
            value, i = args[i + 1], i + 1
        options[key] = value
        i += 1
    command = args[i:]
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    if "ntasks" in options and int(options["ntasks"]) != nodes * per_node:
        print(
            f"srun: --ntasks {options['ntasks']} is not --nodes {nodes} x --ntasks-per-node {per_node}", file=sys.stderr
        )
        return 1
    hosts = options["nodelist"].split(",")[:nodes]
    procs = []
    for rank in range(nodes * per_node):
        node = rank // per_node
        env = {
            **os.environ,
            "SLURM_PROCID": str(rank),
            "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(node),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_STEP_NODELIST": ",".join(hosts),
            "SLURM_JOB_ID": os.environ.get("SLURM_JOB_ID", "1"),
            "SLURM_STEP_ID": "0",
            "DS_OPTIMUS_HOST": hosts[node],
        }
        procs.append(subprocess.Popen(command, env=env))
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    return next((p.returncode for p in procs if p.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())

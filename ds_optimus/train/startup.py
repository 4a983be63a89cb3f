"""Process start-up of a training rank: the process group, the launch summary, threads per rank, seeds."""

from __future__ import annotations

import os
import random
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist

from ..command_line import said_by_every_rank
from ..schema import ConfigError


def init_distributed() -> str:
    """torch.distributed through DeepSpeed from whichever launcher started this process (or none); returns a log
    line."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ..integrations.deepspeed_ops import prepare_op_builds
    from ..launch.environment import LaunchError, adopt, open_files_for

    if dist.is_initialized():
        return launch_summary()
    try:
        world = adopt()
        if world.rank == 0:
            open_files_for(world.size)  # rank 0's store holds a connection per rank
    except LaunchError as err:
        raise said_by_every_rank(ConfigError(f"launch: {err}")) from None
    note = world_size_note(world.rank, world.size, os.environ)
    if note:
        print(note, file=sys.stderr, flush=True)
    prepare_op_builds()
    if world.launcher == "none":  # plain `python -m ds_optimus.train`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    accelerator = get_accelerator()
    backend = accelerator.communication_backend_name()
    if accelerator.device_name() == "cpu" and backend == "ccl":
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            backend = "gloo"
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    except dist.DistNetworkError as err:  # rank 0 could not open the rendezvous port
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
            raise
        raise ConfigError(
            f"port {os.environ.get('MASTER_PORT')} on {os.environ.get('MASTER_ADDR')} is in use (another "
            "job on this machine?): set MASTER_PORT to a free port (the deepspeed launcher: "
            "--master_port N)"
        ) from None
    if "LOCAL_RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:  # the launcher did not say
        local_rank, local_size = _local_place()
        os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size))
    from ..launch.environment import bind_cpus

    bound = bind_cpus(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    if accelerator.device_name() == "cpu":
        if bound:
            torch.set_num_threads(len(bound))  # its own cores: no further split
        else:
            cpu_threads_per_rank()
    return launch_summary()


def world_size_note(rank: int, size: int, env) -> str | None:
    """Rank 0's warning when the world size is Slurm's task count without an srun step."""
    from ..launch.environment import SIZE_FROM_VARIABLE

    if rank != 0 or not env.get(SIZE_FROM_VARIABLE) or env.get("SLURM_STEP_ID"):
        return None
    return (
        f"launch: waiting for {size} ranks ({env[SIZE_FROM_VARIABLE]}, no srun step): inside a batch script, "
        "start the ranks with srun"
    )


def launch_summary() -> str:
    """One line: world, launcher, rendezvous and this rank's CPU cores."""
    from ..launch.environment import LAUNCHER_VARIABLE, LAUNCHERS, SIZE_FROM_VARIABLE

    launcher = os.environ.get(LAUNCHER_VARIABLE, "none")
    names = {
        "none": "no launcher",
        "openmpi": "Open MPI's mpiexec",
        "pals": "Cray PALS mpiexec",
        "mpich": "MPICH/Intel MPI mpiexec",
    }  # else the launcher table's own words
    started_by = names.get(launcher) or next((x.what for x in LAUNCHERS if x.name == launcher), launcher)
    how = os.environ.get("DS_OPTIMUS_RENDEZVOUS")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    size_from = os.environ.get(SIZE_FROM_VARIABLE)
    size_from = f" (the size from {size_from}: no srun step variables)" if size_from else ""
    world = dist.get_world_size()
    return (
        f"world: {world} rank{'s' if world != 1 else ''}{size_from}, "
        f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} on this host, started by {started_by}; rendezvous "
        f"{os.environ.get('MASTER_ADDR')}:"
        f"{os.environ.get('MASTER_PORT')}"
        + (f" ({how})" if how else "")
        + (f"; rank {dist.get_rank()} on CPU cores {_ranges(cores)}" if cores else "")
    )


def _ranges(cores: list[int]) -> str:
    out, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            out.append(f"{start}" if start == core else f"{start}-{core}")
            start = None
    return ",".join(out)


def cpu_threads_per_rank() -> int:
    """On CPU, give each local rank its share of the cores (unless OMP_NUM_THREADS is set); returns the count."""
    # The deepspeed launcher leaves every rank at all cores: N ranks would run N x cores threads.
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or _local_world_size())
    threads = max(1, cores // max(1, local))
    torch.set_num_threads(threads)
    return threads


def _local_world_size() -> int:
    return _local_place()[1]


def _local_place() -> tuple[int, int]:
    """(local rank, ranks on this host), by an all-gather of host names."""
    from ..launch.environment import this_host

    me = this_host()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, me)
    return names[: dist.get_rank()].count(me), names.count(me)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

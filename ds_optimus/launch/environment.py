"""Which launcher started this process, and its world (a leaf: the standard library and `hosts` only).

`adopt()` reads the variables of whichever launcher in `LAUNCHERS` is there and writes torch's `env://` ones.
Rank 0's host: `MASTER_ADDR`, else 127.0.0.1 on one host, else the job's first host; the port: `MASTER_PORT`,
else derived from the job id, else from the launcher's pid on one host.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace

from .hosts import HostListError, expand_slurm_hostlist, read_hostfile, short_host


class LaunchError(ValueError):
    """An environment the world cannot be formed from; the message names the variables, in one line."""


@dataclass(frozen=True)
class Launcher:
    name: str  # short name, said in the log
    what: str
    rank: tuple[str, ...]  # the variables holding each value, first found wins
    size: tuple[str, ...]
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]
    job: tuple[str, ...] = ()  # variables naming the job (the port is derived from them)
    mpi: bool = True  # an MPI process manager (their variables must agree where several are set)


# The first whose rank variable is set wins (torchrun under srun: torchrun's; srun's then describe the allocation).
LAUNCHERS = (
    Launcher(
        "torch",
        "the deepspeed launcher or torchrun",
        ("RANK",),
        ("WORLD_SIZE",),
        ("LOCAL_RANK",),
        ("LOCAL_WORLD_SIZE",),
        ("TORCHELASTIC_RUN_ID",),
        mpi=False,
    ),
    Launcher(
        "openmpi",
        "Open MPI",
        ("OMPI_COMM_WORLD_RANK",),
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"),
    ),
    Launcher(
        "pals",
        "Cray PALS",
        ("PALS_RANKID",),
        ("PALS_SIZE", "PMI_SIZE"),
        ("PALS_LOCAL_RANKID",),
        ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"),
        ("PALS_APID", "PBS_JOBID"),
    ),
    Launcher(
        "mpich",
        "MPICH or Intel MPI",
        ("PMI_RANK",),
        ("PMI_SIZE",),
        ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
        ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
        ("PBS_JOBID", "SLURM_JOB_ID"),
    ),
    # srun before PMIx: `srun --mpi=pmix` sets PMIX_RANK but no size variable. The step's size first; a
    # launch wrapper (Lightning's and others') forwards the job's task count
    Launcher(
        "slurm",
        "srun",
        ("SLURM_PROCID",),
        ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        ("SLURM_LOCALID",),
        (),
        ("SLURM_JOB_ID", "SLURM_STEP_ID"),
        mpi=False,
    ),
    Launcher(
        "pmix",
        "a PMIx launcher",
        ("PMIX_RANK",),
        ("PMIX_SIZE", "PMI_SIZE"),
        ("PMIX_LOCAL_RANK",),
        ("PMIX_LOCAL_SIZE",),
        ("PMIX_NAMESPACE",),
    ),
)
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
HOSTFILE_VARIABLE = "DS_OPTIMUS_HOSTFILE"
LAUNCHER_VARIABLE = "DS_OPTIMUS_LAUNCHER"  # set by adopt(): the launcher's short name, for the log
SIZE_FROM_VARIABLE = "DS_OPTIMUS_SIZE_FROM"  # set by adopt() where the size is not the launcher's own variable
PORT_BASE, PORT_SPAN = 20000, 12000  # derived ports stay below Linux's ephemeral range (32768-60999)


@dataclass(frozen=True)
class World:
    """This process's place in the world, as its launcher described it."""

    launcher: str  # a `Launcher.name`, or "none" (a world of one, no launcher)
    rank: int
    size: int
    local_rank: int | None  # None: the launcher does not say (worked out after the world forms)
    local_size: int | None
    job: str | None  # the job's id, where the launcher names it
    seen: tuple[str, ...]  # the variables read, NAME=value

    @property
    def single_host(self) -> bool:
        return self.local_size is not None and self.local_size == self.size


def _value(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "") != "":
            return name, env[name]
    return None


def _integer(env: Mapping[str, str], names: tuple[str, ...], seen: list[str]) -> int | None:
    found = _value(env, names)
    if found is None:
        return None
    name, value = found
    seen.append(f"{name}={value}")
    if not value.strip().isdigit():
        raise LaunchError(f"{name}={value!r} is not a non-negative integer")
    return int(value)


def _slurm_local_size(env: Mapping[str, str], seen: list[str]) -> int | None:
    """This node's task count from `SLURM_STEP_TASKS_PER_NODE` ("2(x3),1") and `SLURM_NODEID`."""
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if not spec or not (node or "").isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            return None
        counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
    seen.append(f"SLURM_STEP_TASKS_PER_NODE={spec}")
    return counts[int(node)] if int(node) < len(counts) else None


def detect(env: Mapping[str, str] | None = None) -> World:
    """The world this process's launcher describes; a world of one without a launcher."""
    env = os.environ if env is None else env
    present = [launcher for launcher in LAUNCHERS if _value(env, launcher.rank) is not None]
    if not present:
        return World("none", 0, 1, 0, 1, None, ())
    launcher, seen = present[0], []
    rank = _integer(env, launcher.rank, seen)
    size = _integer(env, launcher.size, seen)
    if size is None:
        raise LaunchError(
            f"{seen[0]} is set ({launcher.what}) but no world size is: none of {', '.join(launcher.size)}"
        )
    if size < 1 or rank >= size:
        raise LaunchError(f"rank {rank} is not inside a world of {size} ({', '.join(seen)})")
    local_rank = _integer(env, launcher.local_rank, seen)
    local_size = _integer(env, launcher.local_size, seen) if launcher.local_size else _slurm_local_size(env, seen)
    if local_rank is not None and local_size is not None and not local_rank < local_size <= size:
        raise LaunchError(
            f"local rank {local_rank} of {local_size} on this host does not fit a world of {size} ({', '.join(seen)})"
        )
    _check_agreement(env, launcher, present, rank, size, seen)
    job = _value(env, launcher.job)
    if launcher.name == "slurm" and job is not None:
        job = (job[0], f"{job[1]}.{env.get('SLURM_STEP_ID', '')}")
    return World(launcher.name, rank, size, local_rank, local_size, job[1] if job else None, tuple(seen))


def _check_agreement(env, chosen: Launcher, present: list[Launcher], rank: int, size: int, seen: list[str]) -> None:
    """Where several MPI process managers' variables are set (PALS sets PMI_RANK too), they must agree."""
    if not chosen.mpi:
        return
    for other in present[1:]:
        if not other.mpi:
            continue
        other_seen: list[str] = []
        other_rank = _integer(env, other.rank, other_seen)
        other_size = _integer(env, other.size, other_seen)
        if other_rank != rank or (other_size is not None and other_size != size):
            raise LaunchError(
                f"the launchers' variables disagree: {', '.join(seen[:2])} ({chosen.what}) but "
                f"{', '.join(other_seen)} ({other.what})"
            )


def job_hosts(env: Mapping[str, str] | None = None) -> tuple[list[str], str] | None:
    """The launch's hosts in order and where they came from, or None where the job gives none."""
    env = os.environ if env is None else env
    try:
        # the launch step's own nodes first (srun's; the supervisor's host file of the attempt), then
        # the allocation's
        for name in ("SLURM_STEP_NODELIST", HOSTFILE_VARIABLE, "SLURM_JOB_NODELIST", "SLURM_NODELIST", "PBS_NODEFILE"):
            if env.get(name):
                read = read_hostfile if name in (HOSTFILE_VARIABLE, "PBS_NODEFILE") else expand_slurm_hostlist
                return read(env[name]), f"{name}={env[name]}"
    except HostListError as err:
        raise LaunchError(str(err)) from None
    return None


def derived_port(key: str) -> int:
    """A port every rank of a job derives alike from the job's id."""
    return PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN


HOST_VARIABLE = "DS_OPTIMUS_HOST"  # this host's name where it is not the system's (nodes simulated on one machine)


def this_host(env: Mapping[str, str] | None = None) -> str:
    """The name this process's host goes by in logs, fault records and host lists."""
    env = os.environ if env is None else env
    return env.get(HOST_VARIABLE) or socket.gethostname()


def rendezvous(world: World, env: Mapping[str, str] | None = None) -> tuple[str, int, str]:
    """(rank 0's address, the port, how it was found) for `world`."""
    env = os.environ if env is None else env
    if env.get("MASTER_ADDR"):
        address, how = env["MASTER_ADDR"], "MASTER_ADDR"
    elif world.single_host:
        address, how = "127.0.0.1", "every rank on this host"
    else:
        found = job_hosts(env)
        if found is None:
            where = (
                "how many ranks run here is not said"
                if world.local_size is None
                else f"{world.local_size} of {world.size} ranks on this host"
            )
            raise LaunchError(
                f"cannot find rank 0's host ({where}; no MASTER_ADDR, SLURM_JOB_NODELIST, "
                f"PBS_NODEFILE or {HOSTFILE_VARIABLE}; seen: {', '.join(world.seen)}): "
                "set MASTER_ADDR to rank 0's host"
            )
        hosts, source = found
        address, how = hosts[0], f"the first host of {source.split('=')[0]}"
        if world.rank == 0 and short_host(address) != short_host(this_host(env)):
            raise LaunchError(
                f"rank 0 runs on {this_host(env)} but {how} is {address} (ranks not placed "
                "in host order?): set MASTER_ADDR to rank 0's host"
            )
    if env.get("MASTER_PORT"):
        port_text, port_how = env["MASTER_PORT"], "MASTER_PORT"
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise LaunchError(f"MASTER_PORT={port_text!r} is not a port number")
        return address, int(port_text), f"{how}, port from MASTER_PORT"
    if world.job:
        return address, derived_port(world.job), f"{how}, port from the job id {world.job}"
    if world.single_host or world.launcher == "none":
        # the launcher's process on this host is every rank's parent: the same key for all of them
        return address, derived_port(f"{this_host(env)}:{os.getppid()}"), f"{how}, port from the launcher's pid"
    port_how = "the default port 29500 (no job id)"
    return address, 29500, f"{how}, {port_how}"


def adopt(env: MutableMapping[str, str] | None = None) -> World:
    """Write torch's variables from whichever launcher started this process and return its world.
    Idempotent; without a launcher nothing is written."""
    env = os.environ if env is None else env
    world = detect(env)
    if world.launcher == "none":
        return world
    formed = world.launcher == "torch" and bool(env.get("MASTER_ADDR")) and bool(env.get("MASTER_PORT"))
    if world.launcher == "torch" and env.get(LAUNCHER_VARIABLE):  # adopted before (this process or its parent)
        world = replace(world, launcher=env[LAUNCHER_VARIABLE])
    values = {"RANK": world.rank, "WORLD_SIZE": world.size}
    if world.local_rank is not None:
        values["LOCAL_RANK"] = world.local_rank
    if world.local_size is not None:
        values["LOCAL_WORLD_SIZE"] = world.local_size
    if not formed:
        address, port, how = rendezvous(world, env)
        if world.rank != 0 and how.startswith("the first host of"):
            _check_resolves(address, how.split(", port")[0], env)
        values.update(MASTER_ADDR=address, MASTER_PORT=port)
        env["DS_OPTIMUS_RENDEZVOUS"] = how
    for key, value in values.items():
        env[key] = str(value)
    env[LAUNCHER_VARIABLE] = world.launcher
    fallback = [x for x in world.seen if x.startswith(("SLURM_NTASKS=", "SLURM_NPROCS="))]
    if world.launcher == "slurm" and fallback:
        env[SIZE_FROM_VARIABLE] = fallback[0]  # the launch line says where the size came from
    return world


def _check_resolves(address: str, how: str, env: Mapping[str, str]) -> None:
    """Fail in one line, before the process group's retries, if rank 0's host does not resolve here."""
    try:
        socket.getaddrinfo(address, None)
    except OSError as err:
        raise LaunchError(
            f"rank 0's host {address} ({how}) does not resolve on {this_host(env)} "
            f"({err.strerror or err}): a host file of this job's nodes, or MASTER_ADDR"
        ) from None


def open_files_for(world_size: int) -> None:
    """Raise the open-file limit to cover rank 0's TCP store (a connection per rank), or fail if the hard one is low."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    needed = world_size + 512  # a connection per rank, and this process's own files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise LaunchError(
                f"rank 0 needs {needed} open files for {world_size} ranks' connections but its hard "
                f"limit is {hard}: raise it (ulimit -Hn) in the job script"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


BIND_VARIABLE = "DS_OPTIMUS_CPU_BIND"  # "1": each local rank bound to its share of this process's cores


def core_share(cores: list[int], local_rank: int, local_size: int) -> list[int]:
    """`local_rank`'s contiguous, even share of `cores` (the first ranks take one more where they do not divide)."""
    cores = sorted(cores)
    base, extra = divmod(len(cores), max(1, local_size))
    if base == 0:
        return [cores[local_rank % len(cores)]]
    start = local_rank * base + min(local_rank, extra)
    return cores[start : start + base + (local_rank < extra)]


def bind_cpus(local_rank: int, local_size: int, env: Mapping[str, str] | None = None) -> list[int] | None:
    """With DS_OPTIMUS_CPU_BIND=1 (for launchers that do not bind), bind to this rank's share of cores; returns it."""
    env = os.environ if env is None else env
    if env.get(BIND_VARIABLE, "") not in ("1", "true", "auto") or not hasattr(os, "sched_setaffinity"):
        return None
    share = core_share(sorted(os.sched_getaffinity(0)), local_rank, local_size)
    os.sched_setaffinity(0, share)
    return share

"""Job scripts for the schedulers clusters run: PBS with `mpiexec` (Aurora: Cray PALS, the CPU
binding and oneCCL environment of the Mula runs) and Slurm with `srun` (NVIDIA and AMD clusters),
each wrapping the supervisor, so a failing node is left out and the run goes on inside the same
allocation (`ds_optimus.reliability.supervise`). `python -m ds_optimus.plan ... --write C.json
--job pbs|slurm` writes one beside the config it writes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


class JobError(ValueError):
    """A job option that cannot work; the message names it, in one line."""


@dataclass(frozen=True)
class NodeShape:
    """What binding a node's ranks needs: its cores, how they split into sockets, and the cores
    each socket keeps for the system."""

    sockets: int
    cores_per_socket: int
    reserved_per_socket: int = 1  # the first core of each socket: the operating system's


# Aurora: 2 x 52-core Xeon Max 9470 per node (ALCF's system overview), 12 GPU tiles.
# Frontier: 64-core EPYC 7A53, 8 cores of which (one per L3 region) the low-noise mode keeps for
# the system: 7 usable cores per GCD (OLCF's user guide), 8 GCDs.
NODE_SHAPES = {
    "aurora": NodeShape(sockets=2, cores_per_socket=52),
    "frontier": NodeShape(sockets=1, cores_per_socket=64),
}

# oneCCL and libfabric settings of the Mula runs on Aurora (Optimus' setenv_aurora_essential.sh), each
# with the failure it avoids there.
AURORA_ENVIRONMENT = (
    ("CCL_KVS_USE_MPI_RANKS", "1", "oneCCL's start-up through MPI's ranks: slow otherwise at thousands of ranks"),
    ("CCL_KVS_GET_TIMEOUT", "600", "oneCCL's key-value store time-out at start-up"),
    ("CCL_ATL_TRANSPORT", "mpi", "oneCCL over MPI ('pmrt_kvs_get' errors otherwise)"),
    ("CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD", "32768", "'mem handle cache limit is reached' otherwise"),
    ("CCL_ZE_CACHE_GET_IPC_HANDLES_THRESHOLD", "32768", ""),
    ("CCL_SYCL_SCALEOUT_HOST_BUF_SIZE", str(2 * 1024**3), "room for the largest gradient bucket across nodes"),
    ("CCL_CHECK_INPLACE_ALIASING", "0", "no in-place check on all-gathers"),
    ("ForceExtendedUSMBufferSize", "256", "segmentation faults otherwise"),
    ("FI_LOG_LEVEL", "warn", ""),
    ("TMPDIR", "/tmp", "AF_UNIX socket paths short enough"),
)
FRONTIER_ENVIRONMENT = (
    ("NCCL_SOCKET_IFNAME", "hsn0", "RCCL's bootstrap over the Slingshot interface"),
    ("NCCL_NET_GDR_LEVEL", "3", "GPU-direct RDMA between nodes"),
    ("FI_CXI_ATS", "0", "the CXI provider's address translation off, as OLCF advises for RCCL"),
    (
        "MIOPEN_USER_DB_PATH",
        "/tmp/miopen-${USER:-$(id -un)}",
        "MIOpen's database per node, not on the shared file system",
    ),
)
NVIDIA_ENVIRONMENT = (
    ("NCCL_ASYNC_ERROR_HANDLING", "1", "a failed collective ends the rank (the supervisor relaunches)"),
)


@dataclass(frozen=True)
class JobSpec:
    scheduler: str  # "pbs" | "slurm"
    cluster: str  # a planner cluster name (aurora, frontier, h100, local, ...)
    config: str  # the DeepSpeed JSON config the job trains
    nodes: int  # the nodes the run trains on
    ranks_per_node: int
    output_dir: str  # the config's optimus.train.output_dir
    name: str = "mula"
    spares: int = 0  # nodes more in the allocation, held back for failing ones
    walltime: str = "06:00:00"
    account: str | None = None
    queue: str | None = None
    python: str = "python"
    made_by: str = ""  # the command that wrote the script

    def check(self) -> None:
        if self.scheduler not in ("pbs", "slurm"):
            raise JobError(f"--job must be pbs or slurm, got {self.scheduler!r}")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise JobError(
                f"a job needs at least one node and one rank a node, got {self.nodes} x {self.ranks_per_node}"
            )
        if self.spares < 0:
            raise JobError(f"--spares must be >= 0, got {self.spares}")
        parts = self.walltime.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise JobError(f"--walltime must be HH:MM:SS, got {self.walltime!r}")


def cpu_bind_list(shape: NodeShape, ranks: int) -> tuple[str, str]:
    """(mpiexec's `--cpu-bind list:...`, oneCCL's worker cores): each rank a run of cores of one
    socket, ranks spread evenly over the sockets, the last core of each run for its oneCCL worker."""
    if ranks % shape.sockets:
        raise JobError(f"{ranks} ranks a node do not spread evenly over {shape.sockets} sockets")
    per_socket = ranks // shape.sockets
    usable = shape.cores_per_socket - shape.reserved_per_socket
    width = usable // per_socket
    if width < 2:
        raise JobError(f"{ranks} ranks a node leave under 2 cores a rank on {shape.cores_per_socket}-core sockets")
    runs, workers = [], []
    for socket in range(shape.sockets):
        first = socket * shape.cores_per_socket + shape.reserved_per_socket
        for i in range(per_socket):
            start = first + i * width
            runs.append(f"{start}-{start + width - 2}")
            workers.append(str(start + width - 1))
    return "list:" + ":".join(runs), ",".join(workers)


def cpu_masks(bind_list: str) -> str:
    """srun's `--cpu-bind=mask_cpu:` form of a `cpu_bind_list` (one hexadecimal mask a local rank)."""
    masks = []
    for run in bind_list.removeprefix("list:").split(":"):
        first, last = (int(x) for x in run.split("-"))
        masks.append(hex(sum(1 << core for core in range(first, last + 1))))
    return "mask_cpu:" + ",".join(masks)


def job_script(spec: JobSpec) -> str:
    """The job script's text."""
    spec.check()
    return _pbs(spec) if spec.scheduler == "pbs" else _slurm(spec)


def write_job(spec: JobSpec, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_script(spec))
    path.chmod(0o755)
    return path


def _environment(cluster: str, extra: tuple = ()) -> list[str]:
    table = {"aurora": AURORA_ENVIRONMENT, "frontier": FRONTIER_ENVIRONMENT}.get(
        cluster, NVIDIA_ENVIRONMENT if cluster.startswith("h") else ()
    )
    lines = []
    for key, value, why in (*table, *extra):
        lines.append(f'export {key}="{value}"' + (f"  # {why}" if why else ""))
    return lines


def _header_comment(spec: JobSpec) -> list[str]:
    return [
        f"# {spec.nodes} node{'s' if spec.nodes != 1 else ''} x {spec.ranks_per_node} ranks"
        + (f", {spec.spares} spare node{'s' if spec.spares != 1 else ''}" if spec.spares else "")
        + f" on {spec.cluster}; written by: {spec.made_by or 'ds_optimus.launch.jobs'}",
        f"# outputs, checkpoints and faults.jsonl: {spec.output_dir} (relative paths start at the folder the job",
        "# is submitted from: keep them on the shared file system)",
    ]


def _setup_lines() -> list[str]:
    # the job runs in the environment it is submitted from (qsub -V, sbatch's default); a script
    # named by SETUP (module loads, a venv's activate) is sourced first where a site needs more
    return ['if [ -n "${SETUP:-}" ]; then source "$SETUP"; fi  # SETUP=env.sh qsub/sbatch ...: module loads, a venv']


def _supervise(spec: JobSpec, hosts: str, probe: str, launch: str) -> list[str]:
    return [
        'PYTHON="${PYTHON:-python}"',
        f'exec "$PYTHON" -m ds_optimus.reliability.supervise --hosts {hosts} --ranks-per-node '
        f"{spec.ranks_per_node} --spares {spec.spares} \\",
        f'    --probe "{probe}" -- \\',
        f"    {launch} \\",
        f'    "$PYTHON" -m ds_optimus.train --config {shlex.quote(spec.config)}',
    ]


def _devices(spec: JobSpec) -> str:
    return f" --devices {spec.ranks_per_node}" if spec.cluster != "local" else ""


def _pbs(spec: JobSpec) -> str:
    lines = [
        "#!/bin/bash",
        f"#PBS -N {spec.name}",
        f"#PBS -l select={spec.nodes + spec.spares}",
        "#PBS -l place=scatter",  # a chunk a node: the ranks per node are mpiexec's --ppn
        f"#PBS -l walltime={spec.walltime}",
        "#PBS -j oe",
        "#PBS -V",
    ]  # the submitting shell's environment (its venv, modules) travels with the job
    if spec.cluster == "aurora":
        lines.append("#PBS -l filesystems=flare:home")
    if spec.account:
        lines.append(f"#PBS -A {spec.account}")
    if spec.queue:
        lines.append(f"#PBS -q {spec.queue}")
    lines += _header_comment(spec)
    lines += ["set -euo pipefail", 'cd "${PBS_O_WORKDIR:-.}"', *_setup_lines()]
    bind, extra = "", ()
    if spec.cluster in NODE_SHAPES:
        cores, workers = cpu_bind_list(NODE_SHAPES[spec.cluster], spec.ranks_per_node)
        bind = f"--cpu-bind {cores}"
        lines.append("# each rank on cores of one socket, its oneCCL worker on the core after them")
        if spec.cluster == "aurora":
            extra = (("CCL_WORKER_COUNT", "1", ""), ("CCL_WORKER_AFFINITY", workers, ""))
    lines.append(f'CPU_BIND="${{CPU_BIND-{bind}}}"  # CPU_BIND= runs the ranks unbound')
    lines.append('MPIEXEC="${MPIEXEC:-mpiexec}"')
    lines += _environment(spec.cluster, extra)
    probe = (
        f"$MPIEXEC -n {{nodes}} --ppn 1 --hostfile {{hostfile}} $PYTHON -m ds_optimus.reliability.probe{_devices(spec)}"
    )
    launch = f'"$MPIEXEC" -n {{ranks}} --ppn {spec.ranks_per_node} --hostfile {{hostfile}} $CPU_BIND'
    lines += _supervise(spec, "pbs", probe, launch)
    return "\n".join(lines) + "\n"


def _slurm(spec: JobSpec) -> str:
    cores = {"frontier": 7}.get(spec.cluster)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.name}",
        f"#SBATCH --nodes={spec.nodes + spec.spares}",
        f"#SBATCH --ntasks-per-node={spec.ranks_per_node}",
        f"#SBATCH --time={spec.walltime}",
        "#SBATCH --output=slurm-%j.out",  # in the folder the job is submitted from, which exists
        "#SBATCH --no-kill",
    ]  # a failed node leaves the allocation standing: the supervisor goes on without it
    if spec.cluster != "local":
        lines.append(f"#SBATCH --gpus-per-node={spec.ranks_per_node}")
    if cores:
        lines.append(f"#SBATCH --cpus-per-task={cores}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    if spec.queue:
        lines.append(f"#SBATCH --partition={spec.queue}")
    lines += _header_comment(spec)
    lines += [
        "set -euo pipefail",
        'cd "${SLURM_SUBMIT_DIR:-.}"',
        *_setup_lines(),
        f"mkdir -p {shlex.quote(spec.output_dir)}",
        'SRUN="${SRUN:-srun}"',
    ]
    extra, bind = (), f" --cpus-per-task {cores} --cpu-bind=cores" if cores else ""
    if spec.cluster in NODE_SHAPES and not cores:
        listed, workers = cpu_bind_list(NODE_SHAPES[spec.cluster], spec.ranks_per_node)
        lines.append("# each rank on cores of one socket, its oneCCL worker on the core after them")
        lines.append(f'CPU_BIND="${{CPU_BIND---cpu-bind={cpu_masks(listed)}}}"  # CPU_BIND= runs the ranks unbound')
        bind = " $CPU_BIND"
        if spec.cluster == "aurora":
            extra = (("CCL_WORKER_COUNT", "1", ""), ("CCL_WORKER_AFFINITY", workers, ""))
    lines += _environment(spec.cluster, extra)
    # srun's task count given each time: inside the batch job it would take the allocation's (spares too)
    probe = (
        f"$SRUN --nodes {{nodes}} --ntasks {{nodes}} --ntasks-per-node 1 --nodelist {{hosts}} "
        f"$PYTHON -m ds_optimus.reliability.probe{_devices(spec)}"
    )
    launch = (
        f'"$SRUN" --nodes {{nodes}} --ntasks {{ranks}} --ntasks-per-node {spec.ranks_per_node} '
        f"--nodelist {{hosts}}{bind} --kill-on-bad-exit=1"
    )
    lines += _supervise(spec, "slurm", probe, launch)
    return "\n".join(lines) + "\n"

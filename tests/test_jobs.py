"""Job scripts (ds_optimus.launch.jobs, `python -m ds_optimus.plan ... --write C.json --job pbs|slurm`):
valid bash for every cluster, the binding arithmetic, and each script's launch line run here (PBS's
with MPICH's mpiexec, Slurm's with a stand-in srun, tests/fake_srun.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ds_optimus.launch.jobs import JobError, JobSpec, NodeShape, cpu_bind_list, cpu_masks, job_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("scheduler", ["pbs", "slurm"])
@pytest.mark.parametrize("cluster, per_node", [("aurora", 12), ("frontier", 8), ("h100", 8), ("local", 2)])
def test_every_job_script_is_valid_bash(tmp_path, scheduler, cluster, per_node):
    script = tmp_path / "job.sh"
    script.write_text(
        job_script(
            JobSpec(
                scheduler, cluster, "ds_configs/x y.json", 4, per_node, "runs/x", spares=1, account="P1", queue="prod"
            )
        )
    )
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = script.read_text()
    assert ("#PBS -l select=5" if scheduler == "pbs" else "#SBATCH --nodes=5") in text  # 4 nodes and a spare
    assert "ds_optimus.reliability.supervise --hosts " + scheduler in text and "--spares 1" in text
    assert "--config 'ds_configs/x y.json'" in text  # quoted for the shell


def test_aurora_binds_each_tile_rank_to_its_own_cores_and_ccl_worker():
    cores, workers = cpu_bind_list(NodeShape(sockets=2, cores_per_socket=52), 12)
    assert cores == "list:1-7:9-15:17-23:25-31:33-39:41-47:53-59:61-67:69-75:77-83:85-91:93-99"
    assert workers == "8,16,24,32,40,48,60,68,76,84,92,100"
    runs = [set(range(int(a), int(b) + 1)) for a, b in (run.split("-") for run in cores[5:].split(":"))]
    used = set().union(*runs) | {int(w) for w in workers.split(",")}
    assert sum(map(len, runs)) + 12 == len(used)  # no core shared
    assert not used & {0, 52}  # each socket's first core left to the system
    text = job_script(JobSpec("pbs", "aurora", "c.json", 2, 12, "runs/x"))
    assert f'CPU_BIND="${{CPU_BIND---cpu-bind {cores}}}"' in text and f'CCL_WORKER_AFFINITY="{workers}"' in text
    assert 'CCL_KVS_USE_MPI_RANKS="1"' in text and "#PBS -l filesystems=flare:home" in text


def test_slurm_on_aurora_binds_like_pbs_and_frontiers_needs_no_user(tmp_path):
    listed, workers = cpu_bind_list(NodeShape(sockets=2, cores_per_socket=52), 12)
    masks = cpu_masks(listed)
    assert masks.startswith("mask_cpu:0xfe,0xfe00,") and masks.count(",") == 11  # cores 1-7, then 9-15
    text = job_script(JobSpec("slurm", "aurora", "c.json", 2, 12, "runs/x"))
    assert f'CPU_BIND="${{CPU_BIND---cpu-bind={masks}}}"' in text and f'CCL_WORKER_AFFINITY="{workers}"' in text
    assert "--kill-on-bad-exit=1" in text and " $CPU_BIND " in text
    # the environment block as a batch job without USER (a cron or container launch) runs it under set -u
    text = job_script(JobSpec("slurm", "frontier", "c.json", 2, 8, "runs/x"))
    exports = "\n".join(line for line in text.splitlines() if line.startswith("export "))
    env = {k: v for k, v in os.environ.items() if k != "USER"}
    out = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + exports + '\necho "$MIOPEN_USER_DB_PATH"'],
        env=env,
        capture_output=True,
        text=True,
    )
    assert (
        out.returncode == 0 and out.stdout.strip().startswith("/tmp/miopen-") and out.stdout.strip() != "/tmp/miopen-"
    ), out.stderr


def test_pbs_scripts_take_the_submitting_environment_one_node_a_chunk():
    text = job_script(JobSpec("pbs", "aurora", "c.json", 2, 12, "runs/x"))
    assert "#PBS -V" in text and "#PBS -l place=scatter" in text
    for scheduler in ("pbs", "slurm"):
        assert 'if [ -n "${SETUP:-}" ]; then source "$SETUP"; fi' in job_script(
            JobSpec(scheduler, "h100", "c.json", 1, 8, "r")
        )


@pytest.mark.parametrize(
    "spec, message",
    [
        (JobSpec("lsf", "h100", "c.json", 1, 8, "r"), "--job must be pbs or slurm, got 'lsf'"),
        (JobSpec("pbs", "h100", "c.json", 1, 8, "r", walltime="6h"), "--walltime must be HH:MM:SS, got '6h'"),
        (JobSpec("pbs", "aurora", "c.json", 1, 5, "r"), "5 ranks a node do not spread evenly over 2 sockets"),
        (JobSpec("pbs", "h100", "c.json", 0, 8, "r"), "a job needs at least one node"),
    ],
)
def test_bad_job_options_are_one_line(spec, message):
    with pytest.raises(JobError) as err:
        job_script(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_planner_writes_the_job_beside_the_config(tmp_path):
    config = tmp_path / "mula-7b.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_optimus.plan",
            "--model",
            "mula-7b-a1b",
            "--cluster",
            "frontier",
            "--devices",
            "64",
            "--write",
            str(config),
            "--job",
            "slurm",
            "--spares",
            "1",
            "--top",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    job = config.with_suffix(".sbatch")
    assert f"and {job}: submit it with sbatch {job}" in out.stdout
    text = job.read_text()
    assert "#SBATCH --nodes=9" in text and "#SBATCH --ntasks-per-node=8" in text and "--cpus-per-task=7" in text
    assert "written by: python -m ds_optimus.plan --model mula-7b-a1b" in text
    bad = subprocess.run(
        [sys.executable, "-m", "ds_optimus.plan", "--model", "mula-7b-a1b", "--job", "pbs"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "ds_optimus.plan: error: --job goes with --write PATH (the config the job runs; the script is written "
        "beside it)"
    )


def test_a_config_can_be_written_as_it_is_for_its_job(tmp_path, capsys):
    """--keep-layout: the job of a config's own layout (with --set), not of the search's best; without
    it, the replacement is said."""
    from train_workers import tiny_config

    from ds_optimus.plan.__main__ import main

    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        expert_parallel={"size": 2, "dispatch": "allgather"},
        sharded_optimizer={"enabled": True, "reduce_dtype": "bf16"},
    )
    config["train_batch_size"] = 8
    given = tmp_path / "given.json"
    given.write_text(json.dumps(config))
    common = ["--config", str(given), "--cluster", "local", "--devices", "2", "--top", "1", "--job", "slurm"]
    assert (
        main(
            [*common, "--set", "optimus.train.warmup_steps=3", "--write", str(tmp_path / "kept.json"), "--keep-layout"]
        )
        == 0
    )
    config["optimus"]["train"]["warmup_steps"] = 3
    assert json.loads((tmp_path / "kept.json").read_text()) == config
    assert "--config kept.json" in (tmp_path / "kept.sbatch").read_text().replace(str(tmp_path) + "/", "")
    assert main([*common, "--write", str(tmp_path / "best.json")]) == 0
    out = capsys.readouterr().out
    best = json.loads((tmp_path / "best.json").read_text())
    if best["optimus"]["expert_parallel"] != config["optimus"]["expert_parallel"]:
        assert "the search's best layout in place of" in out and "(--keep-layout writes that one)" in out
    else:
        assert "in place of" not in out
    assert main(["--model", "mula-tiny-moe", "--write", str(tmp_path / "x.json"), "--keep-layout"]) == 2
    assert "--keep-layout goes with --config PATH and --write PATH" in capsys.readouterr().err


def test_the_docs_job_scripts_are_the_planners(tmp_path):
    """The cluster page's two job commands, run as written: the scripts it shows are what they write."""
    from doc_blocks import doc_block, doc_commands, ran

    for command in [c for c in doc_commands() if "--job" in c.text]:
        argv = command.argv()
        ran(command.text)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        config = argv[argv.index("--write") + 1]
        script = Path(config).with_suffix(".pbs" if "pbs" in argv else ".sbatch")
        shown = doc_block(f"writes `{script}`", "text")
        assert (tmp_path / script).read_text() == shown, f"{script}: the page is stale"
        assert subprocess.run(["bash", "-n", str(tmp_path / script)]).returncode == 0


def _tiny_job(tmp_path: Path, scheduler: str) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from train_workers import tiny_config

    config = tiny_config(
        tmp_path,
        tmp_path / "cache",
        expert_parallel={"size": 2},
        train={"steps": 2, "eval_interval": 0, "export": False},
        checkpoint={"enabled": False},
    )
    config["train_batch_size"] = 8
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_optimus.plan",
            "--config",
            str(path),
            "--cluster",
            "local",
            "--devices",
            "2",
            "--write",
            str(tmp_path / "job.json"),
            "--job",
            scheduler,
            "--top",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return tmp_path / "job.json", tmp_path / ("job.pbs" if scheduler == "pbs" else "job.sbatch")


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["pbs", "slurm"])
def test_each_job_script_runs_its_launch_line_here(tmp_path, scheduler):
    """The script as the scheduler would run it on a one-node allocation of this machine: PBS's with
    MPICH's mpiexec (the dev extra's), Slurm's with the stand-in srun."""
    from train_workers import child_pythonpath

    config, job = _tiny_job(tmp_path, scheduler)
    setup = tmp_path / "env.sh"
    setup.write_text(f"touch {tmp_path / 'set-up'}\n")  # a site's module loads and venv, sourced first
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
        "WANDB_MODE": "disabled",
        "SETUP": str(setup),
    }
    if scheduler == "pbs":
        nodefile = tmp_path / "nodefile"
        nodefile.write_text(f"{socket.gethostname()}\n")
        env.update(
            PBS_O_WORKDIR=str(tmp_path),
            PBS_NODEFILE=str(nodefile),
            PBS_JOBID="77.test",
            MPIEXEC=str(Path(sys.executable).with_name("mpiexec")),
        )
    else:
        srun = tmp_path / "srun"
        srun.write_text(f'#!/bin/bash\nexec {sys.executable} {ROOT / "tests" / "fake_srun.py"} "$@"\n')
        srun.chmod(0o755)
        env.update(
            SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NODELIST=socket.gethostname(), SLURM_JOB_ID="78", SRUN=str(srun)
        )
    proc = subprocess.run(["bash", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    launcher = "MPICH/Intel MPI mpiexec" if scheduler == "pbs" else "srun"
    assert f"world: 2 ranks, 2 on this host, started by {launcher}" in output, output[-4000:]
    run = Path(json.loads(config.read_text())["optimus"]["train"]["output_dir"])
    assert sorted(json.loads((run / "summary.json").read_text())["losses"]) == ["1", "2"]
    assert (run / "hosts" / "attempt-0.txt").read_text() == f"{socket.gethostname()}\n"
    assert (tmp_path / "set-up").exists()

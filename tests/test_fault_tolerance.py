"""Fault injection: killed ranks, kills during a checkpoint write, damaged checkpoint files, NaN
gradients on one rank, a hung rank, preemption signals and a full disk, each run for real (the
`deepspeed` launcher with 2 processes where it matters), and the pieces they rely on."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from distributed import LONG_TEST_TIMEOUT_S, run_distributed
from train_workers import HANG_TIMEOUT_S, child_pythonpath, deepspeed_launcher, pretrain_worker, tiny_config

from ds_optimus.checkpoint import CheckpointError, CheckpointManager, verify
from ds_optimus.checkpoint.files import CheckpointWriter, atomic_save
from ds_optimus.reliability.guards import StepGuard
from ds_optimus.reliability.signals import EXIT_PREEMPTED
from ds_optimus.reliability.supervise import supervise
from ds_optimus.reliability.watchdog import EXIT_HUNG

LAUNCHER = deepspeed_launcher()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def fault_config(tmp_path: Path, cache: Path, **optimus) -> dict:
    """8 steps, checkpoints every 2, EP 2 on 2 processes, one evaluation at the end (the tiny MoE preset)."""
    sections = {
        "train": {"eval_interval": 0, "eval_batches": 1},
        "checkpoint": {"interval": 2, "keep_last": 2},
        "expert_parallel": {"size": 2},
    }
    for name, values in optimus.items():
        sections[name] = {**sections.get(name, {}), **values}
    return tiny_config(tmp_path, cache, **sections)


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def env_with(faults: list[dict] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    env.pop("DS_OPTIMUS_FAULTS", None)
    if faults:
        env["DS_OPTIMUS_FAULTS"] = json.dumps(faults)
    return env


def launch_command(config_path: Path, procs: int = 2) -> list[str]:
    with socket.socket() as s:  # a port of its own: other launches may run beside (29500 is the default)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        str(LAUNCHER),
        "--num_gpus",
        str(procs),
        "--master_port",
        str(port),
        "--module",
        "ds_optimus.train",
        "--config",
        str(config_path),
    ]


def launch(config_path: Path, faults=None, procs: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_command(config_path, procs),
        cwd=config_path.parent,
        env=env_with(faults),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def step_losses(run: Path) -> dict[int, float]:
    """Each step's loss from metrics.jsonl; a step logged again (after a restart) keeps its last value."""
    losses = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """Per-step losses of the uninterrupted 2-process run every recovered run must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    config = fault_config(tmp, cache)
    proc = launch(write_config(tmp, config))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = step_losses(Path(config["optimus"]["train"]["output_dir"]))
    assert sorted(losses) == list(range(1, 9))
    return losses


# -- the pieces ---------------------------------------------------------------------------------------


def test_manifest_checks_size_checksum_and_presence(tmp_path):
    writer = CheckpointWriter(0, 1)
    writer.prepare(tmp_path, "step_00000001")
    writer.write(tmp_path, "step_00000001", {"a.pt": {"w": torch.arange(1000.0)}, "b.pt": [1, 2]}, {"step": 1})
    folder = tmp_path / "step_00000001"
    assert verify(folder) is None and (tmp_path / "latest").read_text() == "step_00000001"
    data = bytearray((folder / "a.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "a.pt").write_bytes(bytes(data))
    assert verify(folder) == "a.pt fails its CRC-32 checksum"
    (folder / "a.pt").write_bytes(bytes(data[:-10]))
    assert verify(folder) == f"a.pt has {len(data) - 10} bytes, the manifest says {len(data)}"
    (folder / "a.pt").unlink()
    assert verify(folder) == "a.pt is missing"
    (folder / "meta.json").write_text("{")
    assert verify(folder) == "its manifest meta.json is unreadable (JSONDecodeError)"


def test_atomic_save_records_what_it_wrote_and_leaves_nothing_on_failure(tmp_path):
    record = atomic_save({"x": torch.ones(10)}, tmp_path / "f.pt")
    data = (tmp_path / "f.pt").read_bytes()
    assert record == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}

    class Unpicklable:
        def __reduce__(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_save({"x": Unpicklable()}, tmp_path / "g.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pt"]


def test_a_failed_save_is_one_error_and_leaves_no_folder(tmp_path):
    class Broken:
        def __reduce__(self):
            raise ValueError("cannot pickle this")

    writer = CheckpointWriter(0, 1)
    writer.prepare(tmp_path, "step_00000003")
    with pytest.raises(
        CheckpointError,
        match=r"^saving checkpoint step_00000003 failed \(rank 0: ValueError: "
        r"cannot pickle this\); the previous checkpoints are untouched$",
    ):
        writer.write(tmp_path, "step_00000003", {"a.pt": {"x": Broken()}}, {"step": 3})
    assert list(tmp_path.iterdir()) == []
    writer.prepare(tmp_path, "step_00000004")
    writer.write(tmp_path, "step_00000004", {"a.pt": {"x": Broken()}}, {"step": 4}, background=True)
    with pytest.raises(CheckpointError, match=r"^an asynchronous checkpoint save failed \(rank 0: ValueError"):
        writer.wait()
    assert list(tmp_path.iterdir()) == []


def test_latest_good_falls_back_and_says_when_nothing_is_intact(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (2, 4):
        manager.writer.prepare(tmp_path, f"step_{step:08d}")
        manager.writer.write(
            tmp_path,
            f"step_{step:08d}",
            {"rank00000.pt": {"step": step}},
            {"step": step, "world_size": 1, "ep_size": 1},
            keep=manager._prune,
        )
    (tmp_path / "step_00000004" / "rank00000.pt").write_bytes(b"garbage")
    size = (tmp_path / "step_00000002" / "rank00000.pt").stat().st_size  # the same object, the same size
    notes = []
    assert manager.latest_good(notes.append) == tmp_path / "step_00000002"
    assert notes == [
        f"checkpoint step_00000004 is damaged: rank00000.pt has 7 bytes, the manifest says {size}; "
        "falling back to the previous one"
    ]
    assert (tmp_path / "step_00000004.corrupt").is_dir()
    (tmp_path / "step_00000002" / "meta.json").unlink()  # no longer a complete checkpoint
    with pytest.raises(
        CheckpointError,
        match=r"^no intact checkpoint is left in .*; move the folder away to start "
        r"over$",
    ):  # a restart must not quietly begin again at step 0
        manager.latest_good(notes.append)
    shutil.rmtree(tmp_path / "step_00000004.corrupt")
    shutil.rmtree(tmp_path / "step_00000002")
    (tmp_path / "latest").unlink()
    assert manager.latest_good(notes.append) is None  # nothing was ever here: a fresh start
    manager.writer.prepare(tmp_path, "step_00000006")
    manager.writer.write(tmp_path, "step_00000006", {"rank00000.pt": {}}, {"step": 6, "world_size": 1, "ep_size": 1})
    (tmp_path / "step_00000006" / "rank00000.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"^none of the 1 checkpoints in .* is intact \(step_00000006: "
        r"rank00000.pt is missing\); move them away to start over$",
    ):
        manager.latest_good(notes.append)


def test_guard_skips_non_finite_and_spiking_steps_and_asks_for_rollback():
    guard = StepGuard(window=50, min_window=10, sigmas=4.0, rollback_after=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        guard.observe_loss(3.0 + 0.01 * torch.randn((), generator=gen).item())
        assert not guard.decide(1.0 + 0.05 * torch.rand((), generator=gen).item()).skip
    guard.observe_loss(float("nan"))
    assert guard.decide(1.0).reason == "loss is nan" and not guard.wants_rollback
    guard.observe_loss(3.0)
    assert "gradient norm 50 is" in guard.decide(50.0).reason and guard.wants_rollback
    guard.reset_after_rollback()
    guard.observe_loss(9.0)
    assert "loss 9 is" in guard.decide(1.0).reason
    guard.observe_loss(2.5)  # a drop is no spike
    assert not guard.decide(1.02).skip and guard.bad_in_a_row == 0 and guard.skipped == 3


def test_preemption_handler_records_the_signal_and_restores_handlers():
    from ds_optimus.reliability.signals import PreemptionHandler

    before = signal.getsignal(signal.SIGUSR1)
    handler = PreemptionHandler()
    assert not handler.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.received == "SIGUSR1" and handler.requested()
    handler.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_supervisor_stops_without_progress_and_passes_preemption_on(tmp_path):
    progress = tmp_path / "progress.json"
    progress.write_text(json.dumps({"step": 7}))
    log = []
    failing = [sys.executable, "-c", "import sys; sys.exit(1)"]
    assert supervise(failing, max_restarts=5, backoff=0, progress=progress, log=log.append) == 3
    assert log[-1] == "supervise: two failures in a row after step 7 without progress; giving up"
    assert sum("failed with status 1" in line for line in log) == 2
    counting = [
        sys.executable,
        "-c",
        f"import json, os, sys; p = {str(progress)!r}; "
        "s = json.load(open(p))['step'] + 1; json.dump({'step': s}, open(p, 'w')); "
        "sys.exit(0 if os.environ['DS_OPTIMUS_ATTEMPT'] == '2' else 1)",
    ]
    log.clear()
    assert supervise(counting, max_restarts=5, backoff=0, progress=progress, log=log.append) == 0
    assert [line for line in log if "restart" in line] == [
        "supervise: restart 1 of 5 in 0 s",
        "supervise: restart 2 of 5 in 0 s",
    ]
    preempted = [sys.executable, "-c", f"import sys; sys.exit({EXIT_PREEMPTED})"]
    assert supervise(preempted, max_restarts=5, backoff=0, progress=progress, log=log.append) == EXIT_PREEMPTED


# -- the fault-injection runs -------------------------------------------------------------------------


@pytest.mark.slow
def test_killed_rank_is_restarted_by_the_supervisor_with_identical_losses(tmp_path, cache, reference):
    config = fault_config(tmp_path, cache)
    path = write_config(tmp_path, config)
    env = env_with([{"kind": "kill", "step": 5, "rank": 1}])  # SIGKILL on the first attempt only
    command = [sys.executable, "-m", "ds_optimus.reliability.supervise", "--backoff", "0", "--", *launch_command(path)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The launcher passes on the exit status of the first failed rank its poll finds (it polls a set,
    # once a second): the killed rank's -9 as sys.exit(-9), status 247, or, when the other rank has
    # already failed on the broken connection, that rank's 1.
    failed = re.search(r"supervise: attempt 0 failed with status (\d+) after step 4", proc.stderr)
    assert failed and failed.group(1) in ("247", "1"), proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_00000004 at step 4" in proc.stderr
    assert step_losses(Path(config["optimus"]["train"]["output_dir"])) == reference


@pytest.mark.slow
def test_kill_during_a_checkpoint_write_resumes_from_the_previous_checkpoint(tmp_path, cache):
    config = fault_config(tmp_path, cache, expert_parallel={"size": 1})
    path = write_config(tmp_path, config)
    command = [sys.executable, "-m", "ds_optimus.train", "--config", str(path)]
    killed = subprocess.run(
        command,
        cwd=tmp_path,
        env=env_with([{"kind": "kill_in_save", "step": 4}]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL
    checkpoints = Path(config["optimus"]["train"]["output_dir"]) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002", "step_00000004.tmp"]
    resumed = subprocess.run(command, cwd=tmp_path, env=env_with(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000002 at step 2" in resumed.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000006", "step_00000008"]


@pytest.mark.slow
def test_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, cache):
    config = fault_config(tmp_path, cache, expert_parallel={"size": 1}, train={"steps": 4})
    first = run_distributed(pretrain_worker, 1, config)[0]
    checkpoints = Path(config["optimus"]["train"]["output_dir"]) / "checkpoints"
    target = checkpoints / "step_00000004" / "optim_rank00000.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 8] = b"\x00" * 8  # bytes flipped on disk
    target.write_bytes(bytes(data))
    config["optimus"]["train"]["steps"] = 6
    second = run_distributed(pretrain_worker, 1, config)[0]
    assert second["start_step"] == 2 and second["resumed_from"].endswith("step_00000002")
    assert (checkpoints / "step_00000004.corrupt").is_dir()
    assert [second["losses"][s] for s in (3, 4)] == [first["losses"][s] for s in (3, 4)]  # exact resume
    log = (Path(config["optimus"]["train"]["output_dir"]) / "log.txt").read_text()
    assert "checkpoint step_00000004 is damaged: optim_rank00000.pt fails its CRC-32 checksum; falling back" in log


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_everywhere_and_repeated_ones_roll_back(tmp_path, cache, monkeypatch):
    faults = [
        {"kind": "nan_loss", "step": 3, "rank": 1},
        {"kind": "nan_loss", "step": 5, "rank": 0},
        {"kind": "nan_loss", "step": 6, "rank": 1},
    ]
    monkeypatch.setenv("DS_OPTIMUS_FAULTS", json.dumps(faults))
    config = fault_config(tmp_path, cache, guards={"rollback_after": 2})
    summaries = run_distributed(pretrain_worker, 2, config)
    run = Path(config["optimus"]["train"]["output_dir"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    by_step = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r)
    assert math.isnan(by_step[3][0]["loss"]) and by_step[3][0]["skipped_steps"] == 1
    assert by_step[2][0]["skipped_steps"] == 0 and by_step[4][0]["skipped_steps"] == 1
    # steps 5 and 6 went bad, the run went back to the checkpoint of step 4 and ran 5-8 again
    assert [len(by_step[s]) for s in range(1, 9)] == [1, 1, 1, 1, 2, 2, 1, 1]
    assert all(math.isfinite(r["loss"]) for s in (5, 6, 7, 8) for r in by_step[s][-1:])
    assert summaries[0]["rollbacks"] == summaries[1]["rollbacks"] == 1
    assert summaries[0]["weights_fingerprint"] == summaries[1]["weights_fingerprint"]  # no rank diverged
    log = (run / "log.txt").read_text()
    assert "step 3: update skipped on every rank (loss is nan)" in log
    assert "step 6: 2 bad steps in a row (loss is nan); rolled back to step_00000004" in log
    # the rank that computed the NaN is named, with its host, in the log and in faults.jsonl
    host = socket.gethostname()
    assert f"step 3: non-finite loss computed on rank 1 (host {host}); recorded in {run}/faults.jsonl" in log
    faults = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert [(f["step"], f["kind"], f["ranks"], f["hosts"]) for f in faults] == [
        (3, "nonfinite", [1], [host]),
        (5, "nonfinite", [0], [host]),
        (6, "nonfinite", [1], [host]),
    ]


@pytest.mark.slow
def test_a_rank_late_to_the_steps_reduction_is_named_a_straggler(tmp_path, cache, monkeypatch):
    # rank 1 comes to step 4's reduction late by 20 times what its step took until then: named at any
    # machine speed or load (a straggler is late by more than (factor - 1) = 1 step of the others' work)
    monkeypatch.setenv("DS_OPTIMUS_FAULTS", json.dumps([{"kind": "late", "step": 4, "rank": 1, "times": 20}]))
    config = fault_config(
        tmp_path, cache, watchdog={"straggler_interval": 4, "straggler_factor": 2}, train={"steps": 4, "plots": True}
    )
    run_distributed(pretrain_worker, 2, config)
    run = Path(config["optimus"]["train"]["output_dir"])
    faults = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert [(f["step"], f["kind"], f["ranks"], f["hosts"]) for f in faults] == [
        (4, "straggler", [1], [socket.gethostname()])
    ], faults
    log = (run / "log.txt").read_text()
    assert f"step 4: stragglers: rank 1 (host {socket.gethostname()}) came to the step's reduction late" in log
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    late = {r["step"]: r["straggler_seconds"] for r in records if "straggler_seconds" in r}
    assert sorted(late) == [4] and late[4] > 0  # measured every straggler_interval steps only
    assert (run / "plots" / "stragglers.png").stat().st_size > 0  # the run's report draws them


def test_the_straggler_rule_names_the_ranks_past_factor_minus_one_of_the_others_work(tmp_path, monkeypatch):
    """`FaultRecordCallback`'s rule on arrivals the test gives: a rank is named when its lateness exceeds
    (factor - 1) x the step less the last rank's lateness (the others' own work)."""
    from types import SimpleNamespace

    from ds_optimus.train.callbacks import fault_record

    said = []
    trainer = SimpleNamespace(rank=0, world=3, output_dir=tmp_path, message=said.append, metrics={})
    callback = fault_record.FaultRecordCallback(straggler_interval=2, straggler_factor=1.5)
    callback.trainer, callback.hosts = trainer, ["a", "b", "c"]
    # a 1-s step whose last rank came 0.3 s after the first: 0.7 s of work, named past 0.35 s late
    for arrivals, named in (([10.0, 10.3, 10.1], []), ([10.0, 10.4, 10.1], [1]), ([10.0, 10.0, 10.0], [])):
        monkeypatch.setattr(fault_record, "_gather", lambda value, world, got=arrivals: list(got))
        trainer.reduce_arrival, trainer.step_seconds = arrivals[0], 1.0 if max(arrivals) > 10 else 0.7
        said.clear()
        callback._stragglers(2)
        assert trainer.metrics["straggler_seconds"] == pytest.approx(max(arrivals) - 10.0)
        assert [line.split(" came")[0] for line in said] == (
            [f"step 2: stragglers: rank {named[0]} (host {'abc'[named[0]]})"] if named else []
        )
    # two ranks late together, both past the bound
    monkeypatch.setattr(fault_record, "_gather", lambda value, world: [10.0, 13.0, 12.9])
    trainer.step_seconds = 4.0
    said.clear()
    callback._stragglers(4)
    assert said[0].startswith("step 4: stragglers: ranks 1, 2 (hosts b, c)"), said
    faults = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["step"], f["ranks"], f["hosts"]) for f in faults] == [(2, [1], ["b"]), (4, [1, 2], ["b", "c"])]


@pytest.mark.slow
def test_watchdog_stops_a_hung_run_with_stack_dumps(tmp_path, cache):
    config = fault_config(tmp_path, cache, watchdog={"step_timeout_s": HANG_TIMEOUT_S, "first_step_timeout_s": 600})
    # rank 1 sleeps in step 3 for ever; the watchdog's exit status and the hung rank's stacks say it stopped the run
    proc = launch(write_config(tmp_path, config), faults=[{"kind": "sleep", "step": 3, "rank": 1, "seconds": 3600}])
    assert proc.returncode == EXIT_HUNG, proc.stdout[-2000:] + proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert f"[ds_optimus watchdog] rank 1: step 3 exceeded its {HANG_TIMEOUT_S} s time-out" in output, output[-6000:]
    hung = "\n".join(line for line in output.splitlines() if line.startswith("[rank 1] "))
    assert "in sleep_inside_step" in hung and '"MainThread"' in hung, output[-6000:]  # the hung rank's stacks
    # rank 0, waiting in the step's collective, names rank 1 (its watchdog fired outside any collective)
    run = Path(config["optimus"]["train"]["output_dir"])
    assert (
        f"[rank 0] [ds_optimus watchdog] step 3: rank 1 (host {socket.gethostname()}) did not reach the "
        "collective the others wait in (rank 1: busy outside any collective)"
    ) in output, output[-6000:]
    faults = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert [(f["step"], f["kind"], f["ranks"]) for f in faults] == [(3, "hang", [1])]


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_exits_75_and_resumes_exactly(tmp_path, cache, reference):
    config = fault_config(tmp_path, cache)
    path = write_config(tmp_path, config)
    stopped = launch(path, faults=[{"kind": "signal", "step": 5, "rank": 1, "signal": "SIGTERM"}])
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    run = Path(config["optimus"]["train"]["output_dir"])
    assert (run / "checkpoints" / "latest").read_text() == "step_00000005"
    # rank 0 writes the messages; the signal reached rank 1 only
    assert "step 5: a signal on another rank: checkpoint written, exiting with status 75" in stopped.stderr
    resumed = launch(path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step_00000005 at step 5" in resumed.stderr
    assert step_losses(run) == reference


@pytest.mark.slow
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, cache):
    checkpoints = tmp_path / "small_disk"
    checkpoints.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(checkpoints)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        # room for one checkpoint of the tiny model (about 45 MB), not for two
        config = fault_config(tmp_path, cache, expert_parallel={"size": 1}, checkpoint={"dir": str(checkpoints)})
        path = write_config(tmp_path, config)
        command = [sys.executable, "-m", "ds_optimus.train", "--config", str(path)]
        proc = subprocess.run(command, cwd=tmp_path, env=env_with(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2, proc.stderr[-3000:]
        error = proc.stderr.strip().splitlines()[-1]
        assert error.startswith(
            "ds_optimus.train: error: saving checkpoint step_00000004 failed (rank 0: [Errno 28] "
            "No space left on device"
        )
        assert error.endswith("the previous checkpoints are untouched")
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]  # no .tmp left
        assert verify(checkpoints / "step_00000002") is None  # the previous checkpoint is intact
    finally:
        if mounted:
            subprocess.run(["umount", str(checkpoints)], check=False)


@pytest.mark.slow
def test_asynchronous_saves_resume_exactly(tmp_path, cache):
    """Checkpoints written by background threads (2 ranks: rank 0's thread waits for rank 1's marker)
    are complete, verified, and resume to the same losses as saving synchronously."""
    sync = fault_config(tmp_path / "sync", cache)
    straight = run_distributed(pretrain_worker, 2, sync)[0]
    config = fault_config(tmp_path / "async", cache, checkpoint={"async_save": True}, train={"stop_after_steps": 5})
    first = run_distributed(pretrain_worker, 2, config)[0]
    checkpoints = Path(config["optimus"]["train"]["output_dir"]) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert all(verify(checkpoints / name) is None for name in ("step_00000004", "step_00000005"))
    assert not list(checkpoints.glob("*/done_rank*"))  # the markers are folded into the manifest, with
    files = json.loads((checkpoints / "step_00000005" / "meta.json").read_text())["files"]  # the ranges each
    assert [sorted(r) for n, r in files.items() if n.startswith("optim_")] == [["bytes", "crc32", "holds"]] * 2
    second = run_distributed(pretrain_worker, 2, config)[0]
    assert second["start_step"] == 5
    assert {**first["losses"], **second["losses"]} == straight["losses"]


# -- failing nodes left out ---------------------------------------------------------------------

SIMULATE = ["-m", "ds_optimus.launch.simulate"]  # nodes on this machine, by name


@pytest.mark.slow
@pytest.mark.timeout(LONG_TEST_TIMEOUT_S)
def test_the_supervisor_leaves_failing_nodes_out_on_spares_then_at_a_smaller_dp(tmp_path, cache):
    """Three "nodes" of 2 ranks (ds_optimus.launch.simulate gives each its host name), the run on two of
    them (EP 2, data parallel 4, global batch 16), one spare. Attempt 0: rank 2 (node n2) computes a
    NaN at step 3 (named, skipped) and hangs at step 5 (named by the watchdog): n2 is left out, the
    spare n3 comes in. Attempt 1: rank 2, now on n3, is killed (SIGKILL) at step 7: the others say
    their last word as they go, rank 2 says none, the supervisor names it from the heartbeats and n3
    is left out; no spare is left, and the run finishes on n1 alone at data parallel 2, the global
    batch kept by accumulation, each attempt resuming from the last checkpoint. The log keeps it all."""
    hostfile = tmp_path / "allocation"
    hostfile.write_text("n1\nn2\nn3\n")
    config = fault_config(tmp_path, cache, watchdog={"step_timeout_s": HANG_TIMEOUT_S, "first_step_timeout_s": 600})
    config["train_batch_size"] = 16
    config.pop("gradient_accumulation_steps", None)  # derived: 1 at data parallel 4, 2 at 2
    path = write_config(tmp_path, config)
    faults = [
        {"kind": "nan_loss", "step": 3, "rank": 2},
        {"kind": "sleep", "step": 5, "rank": 2, "seconds": 3600},
        {"kind": "kill", "step": 7, "rank": 2, "attempt": 1},
    ]
    command = [
        sys.executable,
        "-m",
        "ds_optimus.reliability.supervise",
        "--backoff",
        "0",
        "--hosts",
        str(hostfile),
        "--ranks-per-node",
        "2",
        "--spares",
        "1",
        "--",
        sys.executable,
        *SIMULATE,
        "--hostfile",
        "{hostfile}",
        "--ppn",
        "2",
        "--",
        sys.executable,
        "-m",
        "ds_optimus.train",
        "--config",
        str(path),
    ]
    proc = subprocess.run(
        command, cwd=tmp_path, env=env_with(faults), capture_output=True, text=True, timeout=LONG_TEST_TIMEOUT_S - 60
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    run = Path(config["optimus"]["train"]["output_dir"])
    faults_seen = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert [(f["step"], f["kind"], f["ranks"], f["hosts"], f["attempt"]) for f in faults_seen] == [
        (3, "nonfinite", [2], ["n2"], 0),
        (5, "hang", [2], ["n2"], 0),
        (7, "lost", [2], ["n3"], 1),
    ], faults_seen
    assert "supervise: leaving out n2 (out: n2); running on 2 nodes, spares n3 in" in output, output[-5000:]
    assert "supervise: attempt 1: rank 2 (host n3) ended without a word at step 7" in output
    assert (
        "supervise: leaving out n3 (out: n2, n3); running on 1 node (fewer than the 2 planned: the "
        "data-parallel size shrinks)"
    ) in output
    assert [(run / "hosts" / f"attempt-{i}.txt").read_text().split() for i in range(3)] == [
        ["n1", "n2"],
        ["n1", "n3"],
        ["n1"],
    ]
    log = (run / "log.txt").read_text()
    assert "resumed from" in log and "step_00000004 at step 4" in log and "step_00000006 at step 6" in log
    assert "saved by 4 ranks" in log and "resumed by 2 ranks" in log  # the reshard, said
    # the hang's report, the watchdog's stop and the supervisor's decisions are in the log, not only on stderr
    assert "[ds_optimus watchdog] step 5: rank 2 (host n2) did not reach the collective" in log
    assert "the watchdog stopped the run: step 5 exceeded its" in log
    assert "supervise: leaving out n3 (out: n2, n3); running on 1 node" in log
    assert "supervise: attempt 1: rank 2 (host n3) ended without a word at step 7" in log
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(map(int, summary["losses"])) == [7, 8] and all(math.isfinite(v) for v in summary["losses"].values())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records if "loss" in r} == set(range(1, 9))  # the losses continue to step 8


@pytest.mark.slow
def test_the_docs_simulated_cluster_runs_as_written(tmp_path):
    """docs/cluster.md's nodes simulated on one machine, its commands run as the page gives them (in a
    folder of their own, `python` this interpreter): the killed rank is named, its node left out, the
    run finished on the spare, and the lines the page shows are printed."""
    from doc_blocks import ROOT, block_commands, doc_block, ran

    commands = block_commands(doc_block("Three simulated nodes", "bash"))
    assert len(commands) == 2
    (tmp_path / "ds_configs").symlink_to(ROOT / "ds_configs")
    env = {**env_with(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for command in commands:
        ran(command)
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        outputs.append(proc.stdout + proc.stderr)
    for line in doc_block("relaunches on\nn1 and the spare n3", "text").splitlines():
        assert line in outputs[-1], (line, outputs[-1][-5000:])
    run = tmp_path / "runs" / "simulated"
    assert [
        (f["step"], f["kind"], f["hosts"]) for f in map(json.loads, (run / "faults.jsonl").read_text().split("\n")[:-1])
    ] == [(3, "lost", ["n2"])]
    assert [(run / "hosts" / f"attempt-{i}.txt").read_text().split() for i in range(2)] == [["n1", "n2"], ["n1", "n3"]]
    assert json.loads((run / "summary.json").read_text())["losses"].keys() >= {"3", "4"}


def test_the_supervisor_stops_in_one_line_when_too_few_nodes_remain(tmp_path):
    from ds_optimus.reliability.allocation import Allocation, AllocationError

    allocation = Allocation(["n1", "n2", "n3"], spares=1)
    assert allocation.choose({}, 1) == ["n1", "n2"]
    assert allocation.choose({"n1": 1}, 1) == ["n2", "n3"]  # the spare steps in
    assert allocation.choose({"n1": 1, "n2": 2}, 3) == ["n2", "n3"]  # two strikes of three: still in
    fits = {1: "expert parallel size 4 does not divide the world size 2"}.get
    with pytest.raises(AllocationError) as err:
        allocation.choose({"n1": 1, "n2": 1}, 1, fits)
    assert str(err.value) == (
        "1 healthy node left (left out: n1, n2) and the layout runs on none of 1 down to 1 "
        "(1: expert parallel size 4 does not divide the world size 2); stopping"
    )
    with pytest.raises(AllocationError, match="leaves none"):
        Allocation(["n1"], spares=1)
    # a refusal that no smaller count changes (not about ranks or the world) ends the search at once
    asked = []
    many = Allocation([f"n{i}" for i in range(1, 9)], spares=0)
    with pytest.raises(AllocationError, match="data path"):
        many.choose({"n1": 1}, 1, lambda count: asked.append(count) or "data path '/x' does not exist")
    assert asked == [7]


def test_strikes_count_this_jobs_faults_by_short_host_name(tmp_path):
    from ds_optimus.reliability.allocation import Allocation
    from ds_optimus.reliability.fault_log import append_fault, read_faults, strikes

    append_fault(tmp_path, 3, "nonfinite", [2], ["x2"])  # gethostname()'s short name
    append_fault(tmp_path, 4, "nonfinite", [0, 2, 4], ["x1", "x2", "x3"])  # spread through the exchange
    append_fault(tmp_path, 5, "straggler", [1], ["x1"])  # said, never struck
    records = read_faults(tmp_path)
    assert strikes(records) == {"x2": 1}
    assert strikes(records, since=records[-1]["time"] + 1) == {}  # an earlier job's faults
    allocation = Allocation(["x1.hsn.example.gov", "x2.hsn.example.gov", "x3.hsn.example.gov"], spares=1)
    assert allocation.choose(strikes(records), 1) == ["x1.hsn.example.gov", "x3.hsn.example.gov"]


@pytest.mark.slow
def test_the_probe_strikes_a_failing_node_before_a_relaunch(tmp_path):
    from ds_optimus.reliability.allocation import Allocation
    from ds_optimus.reliability.supervise import run_probe

    probe = [
        sys.executable,
        *SIMULATE,
        "--hostfile",
        "{hostfile}",
        "--ppn",
        "1",
        "--",
        sys.executable,
        "-m",
        "ds_optimus.reliability.probe",
    ]
    env = {**env_with([{"kind": "probe", "host": "n2"}])}
    log = []
    old = dict(os.environ)
    os.environ.update(env)
    try:
        failing = run_probe(probe, ["n1", "n2", "n3"], 1, tmp_path, 1, log.append)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert failing == ["n2"] and log == ["supervise: probe of 3 nodes: n2 failed"]
    results = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "probe" / "attempt-1").glob("*.json")}
    assert results["n2"]["ok"] is False and results["n2"]["reason"] == "fault injected" and results["n1"]["ok"]
    assert results["n1"]["collective"] is None  # the three joined and exchanged, the failed node too
    assert Allocation(["n1", "n2", "n3", "n4"], spares=1).choose({"n2": 1}, 1) == ["n1", "n3", "n4"]

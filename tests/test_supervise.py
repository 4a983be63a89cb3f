"""The supervisor's rules, each on a stand-in run (a Python one-liner that exits as told): the back-off
doubling up to its cap, the restarts used up, no progress twice, success and preemption ending it, a
signal passed on to the run (whose exit status becomes the supervisor's) or arriving between attempts,
and the command line's refusals. The back-offs are waited by a recording `sleep`, not by the clock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_optimus.reliability.signals import EXIT_PREEMPTED
from ds_optimus.reliability.supervise import ATTEMPT_VAR, EXIT_GAVE_UP, main, supervise


def exits(status: int, record: Path | None = None) -> list[str]:
    """A run that appends its attempt number to `record` (if given) and exits with `status`."""
    code = "import os, sys\n"
    if record is not None:
        code += f"open({str(record)!r}, 'a').write(os.environ[{ATTEMPT_VAR!r}] + '\\n')\n"
    return [sys.executable, "-c", code + f"sys.exit({status})"]


def run(command, **kwargs):
    said, waits = [], []
    status = supervise(command, log=said.append, sleep=waits.append, **kwargs)
    return status, said, waits


def test_backoff_doubles_up_to_its_cap_until_the_restarts_are_used_up(tmp_path):
    record = tmp_path / "attempts"
    status, said, waits = run(
        exits(1, record), max_restarts=4, backoff=10, max_backoff=30, progress=tmp_path / "progress.json"
    )
    assert status == EXIT_GAVE_UP
    assert waits == [10, 20, 30, 30]
    assert record.read_text().split() == ["0", "1", "2", "3", "4"]  # each attempt knows its number
    assert said[-1] == "supervise: 4 restarts used up; giving up"
    assert "supervise: attempt 0 failed with status 1 before its first step" in said
    assert "supervise: restart 3 of 4 in 30 s" in said


def test_no_restart_at_all_and_a_zero_backoff(tmp_path):
    status, said, waits = run(exits(7), max_restarts=0, backoff=0, progress=tmp_path / "progress.json")
    assert (status, waits) == (EXIT_GAVE_UP, [])
    status, said, waits = run(exits(7), max_restarts=2, backoff=0, progress=tmp_path / "progress.json")
    assert waits == [0, 0]


def test_two_failures_at_the_same_step_give_up_and_progress_restarts(tmp_path):
    progress = tmp_path / "progress.json"
    progress.write_text(json.dumps({"step": 4}))
    status, said, waits = run(exits(1), max_restarts=5, backoff=1, progress=progress)
    assert status == EXIT_GAVE_UP and waits == [1]
    assert said[-1] == "supervise: two failures in a row after step 4 without progress; giving up"
    # a run that moves on between failures is restarted each time
    code = (
        f"import json, sys; p = {str(progress)!r}; s = json.load(open(p))['step']; "
        "json.dump({'step': s + 1}, open(p, 'w')); sys.exit(0 if s == 6 else 1)"
    )
    status, said, waits = run([sys.executable, "-c", code], max_restarts=5, backoff=1, progress=progress)
    assert status == 0 and waits == [1, 2]
    assert [line for line in said if "failed" in line] == [
        "supervise: attempt 0 failed with status 1 after step 5",
        "supervise: attempt 1 failed with status 1 after step 6",
    ]


def test_success_and_preemption_end_it_at_once(tmp_path):
    assert run(exits(0), progress=tmp_path / "p.json") == (0, [], [])
    status, said, waits = run(exits(EXIT_PREEMPTED), progress=tmp_path / "p.json")
    assert (status, waits) == (EXIT_PREEMPTED, [])
    assert said == [f"supervise: the run exited with status {EXIT_PREEMPTED} after a signal; not restarting"]


def test_a_signal_during_the_backoff_starts_no_further_attempt(tmp_path):
    record = tmp_path / "attempts"
    said = []

    def sleep(seconds):  # the scheduler's SIGTERM arrives while the supervisor waits to restart
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    status = supervise(
        exits(1, record), max_restarts=3, backoff=5, progress=tmp_path / "p.json", log=said.append, sleep=sleep
    )
    assert status == 128 + signal.SIGTERM and record.read_text().split() == ["0"]
    assert said[-1] == f"supervise: signal {signal.SIGTERM} before attempt 1; not starting it"
    assert signal.getsignal(signal.SIGTERM) is previous  # its handlers are taken down again


@pytest.mark.parametrize("status", [42, EXIT_PREEMPTED])
def test_sigterm_reaches_the_run_whose_exit_status_is_the_supervisors(tmp_path, status):
    """The supervisor as its own process, as a job script starts it; SIGTERM once the run is up (it says so
    by a file): the run gets the signal, exits with its own status, and is not restarted."""
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (
        "import pathlib, signal, sys, time\n"
        f"def stop(signum, frame):\n    pathlib.Path({str(got)!r}).write_text(str(signum))\n"
        f"    sys.exit({status})\n"
        f"signal.signal(signal.SIGTERM, stop)\npathlib.Path({str(ready)!r}).touch()\n"
        "while True:\n    time.sleep(1)\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds_optimus.reliability.supervise",
            "--backoff",
            "0",
            "--progress",
            str(tmp_path / "p.json"),
            "--",
            sys.executable,
            "-c",
            child,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    while not ready.exists():  # bounded by the test's own time-out only: no clock in the check
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == status and got.read_text() == str(int(signal.SIGTERM))
    assert (
        err.strip().splitlines()[-1] == f"supervise: the run exited with status {status} after a signal; not restarting"
    )


def test_a_launch_refused_before_its_first_step_is_not_relaunched(tmp_path):
    """A failure before the first step is put to the trainer's `--check` (here a stand-in): refused, the
    supervisor stops at once with status 2 (a config error fails every relaunch alike); passing, or
    after progress, it restarts as before. What it decides is in the run's log.txt too."""
    progress = tmp_path / "progress.json"
    asked = []
    reason = "optimus.expert_parallel.size 3 does not divide the data-parallel size 4"
    status, said, waits = run(
        exits(2), max_restarts=3, backoff=30, progress=progress, refused=lambda nodes: asked.append(nodes) or reason
    )
    assert (status, waits, asked) == (2, [], [None])
    assert said[-1] == (
        f"supervise: the trainer refuses this launch ({reason}); not restarting: every relaunch would stop on it"
    )
    log = (tmp_path / "log.txt").read_text()
    assert "supervise: attempt 0 failed with status 2 before its first step" in log and reason in log
    status, said, waits = run(exits(1), max_restarts=2, backoff=0, progress=progress, refused=lambda nodes: None)
    assert status == EXIT_GAVE_UP and waits == [0, 0]  # --check passes: a failure of another kind
    progress.write_text(json.dumps({"step": 4}))
    code = (
        f"import json, sys; p = {str(progress)!r}; s = json.load(open(p))['step']; "
        "json.dump({'step': s + 1}, open(p, 'w')); sys.exit(0 if s == 5 else 1)"
    )
    asked.clear()
    status, said, waits = run(
        [sys.executable, "-c", code],
        max_restarts=2,
        backoff=0,
        progress=progress,
        refused=lambda nodes: asked.append(nodes) or reason,
    )
    assert status == 0 and asked == []  # it made progress: no config error, not asked


def test_ranks_that_ended_without_a_word_are_named_and_their_node_left_out(tmp_path):
    """Attempt 0's heartbeats: rank 1 (node n2) said nothing, rank 0 said `error`: the supervisor names
    rank 1 and its host as `lost`, and the spare takes n2's place in attempt 1."""
    from ds_optimus.reliability.allocation import Allocation
    from ds_optimus.reliability.fault_log import read_faults
    from ds_optimus.reliability.heartbeat import Heartbeat

    for rank, host, word in ((0, "n1", "error"), (1, "n2", "")):
        heartbeat = Heartbeat(tmp_path, rank, host, attempt=0)
        heartbeat.beat(3)
        if word:
            heartbeat.last_word(word)
        heartbeat.close()
    code = f"import os, sys; sys.exit(0 if os.environ[{ATTEMPT_VAR!r}] == '1' else 1)"
    allocation = Allocation(["n1", "n2", "n3"], spares=1)
    status, said, waits = run(
        [sys.executable, "-c", code, "{hosts}"],
        max_restarts=2,
        backoff=0,
        progress=tmp_path / "progress.json",
        allocation=allocation,
    )
    assert status == 0
    assert [(f["step"], f["kind"], f["ranks"], f["hosts"], f["attempt"]) for f in read_faults(tmp_path)] == [
        (3, "lost", [1], ["n2"], 0)
    ]
    assert (
        f"supervise: attempt 0: rank 1 (host n2) ended without a word at step 3 (killed outright, out of memory, "
        f"or the node lost); recorded in {tmp_path}/faults.jsonl"
    ) in said
    assert "supervise: leaving out n2 (out: n2); running on 2 nodes, spares n3 in" in said
    assert [(tmp_path / "hosts" / f"attempt-{i}.txt").read_text().split() for i in (0, 1)] == [
        ["n1", "n2"],
        ["n1", "n3"],
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--"], "no command to run (put it after --)"),
        (["--max-restarts", "-1", "--", "true"], "--max-restarts and --backoff must be >= 0"),
        (["--backoff", "-5", "--", "true"], "--max-restarts and --backoff must be >= 0"),
        (["--", "mpiexec", "--hostfile", "{hostfile}", "true"], "{hostfile} needs --hosts (the allocation's nodes)"),
        (["--probe", "true", "--", "true"], "--probe needs --hosts (the allocation's nodes)"),
        (["--hosts", "pbs", "--", "true"], "--hosts pbs: PBS_NODEFILE is not set (not inside a job?)"),
        (["--hosts", "slurm", "--", "true"], "--hosts slurm: SLURM_JOB_NODELIST is not set (not inside a job?)"),
        (["--hosts", "HOSTS", "--ranks-per-node", "0", "--", "true"], "--ranks-per-node and --strikes must be >= 1"),
        (
            ["--hosts", "HOSTS", "--spares", "2", "--", "true"],
            "--hosts HOSTS: 2 spare nodes leaves none of the allocation's 2 to run on",
        ),
        (["--hosts", "no-such-file", "--", "true"], "--hosts no-such-file: cannot read the host file 'no-such-file'"),
        (
            ["--hosts", "HOSTS", "--", "mpiexec", "-n", "{ranks}", "true"],
            "{ranks} needs --ranks-per-node ({ranks} = nodes x ranks per node)",
        ),
        (
            ["--hosts", "HOSTS", "--", "mpiexec", "--hostfile", "{hostsfile}", "true"],
            "{hostsfile} in the command is not a placeholder "
            "(the supervisor fills {hostfile}, {hosts}, {nodes}, {ranks})",
        ),
    ],
)
def test_argument_errors_are_one_line_and_run_nothing(tmp_path, monkeypatch, capsys, argv, message):
    (tmp_path / "HOSTS").write_text("n1\nn2\n")
    monkeypatch.chdir(tmp_path)
    for name in ("PBS_NODEFILE", "SLURM_JOB_NODELIST", "DS_OPTIMUS_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    ran = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: ran.append(a) or pytest.fail("ran the command"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and ran == []
    last = err.strip().splitlines()[-1]
    assert last.startswith("ds_optimus.reliability.supervise: error: " + message), err

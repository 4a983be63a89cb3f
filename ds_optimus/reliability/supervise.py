"""Restart a failed training run from its last good checkpoint (docs/reliability.md, docs/cluster.md).

    python -m ds_optimus.reliability.supervise [--max-restarts 3] [--backoff 30] -- \\
        deepspeed --num_gpus 8 --module ds_optimus.train --config ds_configs/mula-7b-a1b.json

A failed run is relaunched after a doubling back-off and resumes from its newest intact checkpoint. It stops on
success, on preemption (exit 75), after `--max-restarts`, on two failures in a row at the same step (from
progress.json), or when `--check` refuses a launch that failed before its first step (exit 2). With `--hosts`
it leaves out nodes struck `--strikes` times in faults.jsonl (ranks silent in their heartbeats count, as `lost`),
taking `--spares` or fewer nodes where `--check` allows, and fills `{hostfile}`, `{hosts}`, `{nodes}`, `{ranks}`.
Each attempt gets `DS_OPTIMUS_ATTEMPT=<n>`; SIGTERM/SIGINT are passed on to the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..launch.hosts import short_host
from ..run_log import append_log
from .allocation import PLACEHOLDERS, Allocation, AllocationError, fill
from .fault_log import append_fault, describe, read_faults, strikes
from .heartbeat import silent_ranks
from .signals import EXIT_PREEMPTED

EXIT_GAVE_UP = 3
EXIT_REFUSED = 2  # the trainer's status for a config or launch it refuses
ATTEMPT_VAR = "DS_OPTIMUS_ATTEMPT"  # the restart count, in every attempt's environment
DEFAULT_OUTPUT_DIR = "runs/mula"  # optimus.train.output_dir when a config does not set it


def _config_of(command: list[str]) -> tuple[str, list[str]] | None:
    """The config path and `--set` overrides of the command's trainer (None without --config)."""
    if "--config" not in command or command.index("--config") + 1 >= len(command):
        return None
    overrides = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "--set"]
    return command[command.index("--config") + 1], overrides


def _progress_file(command: list[str]) -> Path | None:
    """`<optimus.train.output_dir>/progress.json` of the config the command trains (with its --set)."""
    from ..schema import apply_overrides, load_json_config

    found = _config_of(command)
    if found is None:
        return None
    train = apply_overrides(load_json_config(found[0]), found[1]).get("optimus", {}).get("train", {})
    return Path(train.get("output_dir", DEFAULT_OUTPUT_DIR)) / "progress.json"


def layout_check(command: list[str], ranks_per_node: int):
    """`fits(nodes)`: None when the trainer's `--check` passes at nodes x ranks_per_node ranks (nodes
    None: the world it finds itself), else its one-line reason."""
    found = _config_of(command)

    def fits(nodes: int | None) -> str | None:
        if found is None:
            return None
        world = ["--world", str(nodes * ranks_per_node)] if nodes is not None else []
        check = [
            sys.executable,
            "-m",
            "ds_optimus.train",
            "--config",
            found[0],
            *[a for o in found[1] for a in ("--set", o)],
            "--check",
            *world,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        proc = subprocess.run(check, capture_output=True, text=True, env=env)  # the supervisor imports no training code
        lines = proc.stderr.strip().splitlines()
        return None if proc.returncode == 0 else (lines[-1] if lines else f"--check exited {proc.returncode}")

    return fits


def _step(progress: Path | None) -> int | None:
    try:
        return int(json.loads(progress.read_text())["step"]) if progress is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def supervise(
    command: list[str],
    max_restarts: int = 3,
    backoff: float = 30.0,
    max_backoff: float = 600.0,
    progress: Path | None = None,
    log=print,
    allocation: Allocation | None = None,
    ranks_per_node: int = 1,
    strikes_to_leave_out: int = 1,
    fits=None,
    probe: list[str] | None = None,
    sleep=time.sleep,
    refused=None,
) -> int:
    """Run `command` until it succeeds or a rule above stops it; returns the exit status to use.
    `refused(nodes)`: the trainer's `--check` refusal of a launch (None: it would start)."""
    known = progress is not None or _config_of(command) is not None
    progress = progress or _progress_file(command)
    output_dir = progress.parent if progress is not None else Path(DEFAULT_OUTPUT_DIR)
    child: subprocess.Popen | None = None
    stopping = []

    def say(message: str) -> None:
        """To `log`, and to the run's log.txt where the run is known."""
        log(message)
        if known:
            try:
                append_log(output_dir, message)
            except OSError:
                pass

    def forward(signum, frame):
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    started = time.time()  # faults from here on are this job's (faults.jsonl outlives jobs)
    try:
        failed_at: int | None = None
        left_out = 0
        for attempt in range(max_restarts + 1):
            if attempt:
                wait = min(max_backoff, backoff * 2 ** (attempt - 1))
                say(f"supervise: restart {attempt} of {max_restarts} in {wait:g} s")
                sleep(wait)
            env = {**os.environ, ATTEMPT_VAR: str(attempt)}
            run = command
            if allocation is not None and not stopping:
                try:
                    hosts = _choose_hosts(
                        allocation,
                        output_dir,
                        strikes_to_leave_out,
                        fits,
                        say,
                        probe if attempt else None,
                        ranks_per_node,
                        attempt,
                        started,
                    )
                except AllocationError as err:
                    say(f"supervise: {err}")
                    return EXIT_GAVE_UP
                left_out = len(allocation.out)
                hostfile = output_dir / "hosts" / f"attempt-{attempt}.txt"
                run = fill(command, hosts, ranks_per_node, hostfile)
                env["DS_OPTIMUS_HOSTFILE"] = str(hostfile)  # rank 0's host: the attempt's first, not the allocation's
            if stopping:  # a signal during the back-off or the probe
                say(f"supervise: signal {stopping[0]} before attempt {attempt}; not starting it")
                return 128 + stopping[0]
            before = _step(progress)
            child = subprocess.Popen(run, env=env)
            status = child.wait()
            if status == 0:
                return 0
            if status == EXIT_PREEMPTED or stopping:
                say(f"supervise: the run exited with status {status} after a signal; not restarting")
                return status
            step = _step(progress)
            where = f"after step {step}" if step is not None else "before its first step"
            say(f"supervise: attempt {attempt} failed with status {status} {where}")
            lost = _name_the_silent(output_dir, attempt, started, say)
            if refused is not None and step == before and not lost:
                reason = refused(len(hosts) if allocation is not None else None)
                if reason:
                    say(
                        f"supervise: the trainer refuses this launch ({reason}); not restarting: every relaunch "
                        "would stop on it"
                    )
                    return EXIT_REFUSED
            # a failure that named a node not yet left out changes the next attempt: not "no progress"
            newly_out = (
                allocation is not None
                and len(_struck(allocation, output_dir, strikes_to_leave_out, started)) > left_out
            )
            if step is not None and step == failed_at and not newly_out:
                say(f"supervise: two failures in a row after step {step} without progress; giving up")
                return EXIT_GAVE_UP
            failed_at = step
        say(f"supervise: {max_restarts} restarts used up; giving up")
        return EXIT_GAVE_UP
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _name_the_silent(output_dir: Path, attempt: int, since: float, log) -> list[int]:
    """Record as `lost`, and return, the attempt's ranks silent in their heartbeats that no fault names yet."""
    named = {
        rank
        for record in read_faults(output_dir)
        if record.get("attempt") == attempt and record.get("time", 0) >= since
        for rank in record.get("ranks", [])
    }
    silent = [beat for beat in silent_ranks(output_dir, attempt) if beat.rank not in named]
    if not silent:
        return []
    ranks, hosts, step = [b.rank for b in silent], [b.host for b in silent], max(b.step for b in silent)
    detail = "ended without a word: killed (SIGKILL, the out-of-memory killer) or its node lost"
    append_fault(output_dir, step, "lost", ranks, hosts, detail, attempt=attempt)
    log(
        f"supervise: attempt {attempt}: {describe(ranks, hosts)} ended without a word at step {step} (killed "
        f"outright, out of memory, or the node lost); recorded in {output_dir}/faults.jsonl"
    )
    return ranks


def _struck(allocation: Allocation, output_dir: Path, strikes_to_leave_out: int, since: float) -> list[str]:
    counts = strikes(read_faults(output_dir), since)
    return [h for h in allocation.hosts if counts.get(short_host(h), 0) >= strikes_to_leave_out]


def _choose_hosts(
    allocation: Allocation,
    output_dir: Path,
    strikes_to_leave_out: int,
    fits,
    log,
    probe: list[str] | None,
    ranks_per_node: int,
    attempt: int,
    since: float,
) -> list[str]:
    """The attempt's hosts (after the probe, when given: the nodes it finds failing are struck too)."""
    before = list(allocation.out)
    hosts = allocation.choose(strikes(read_faults(output_dir), since), strikes_to_leave_out, fits)
    if probe:
        failing = run_probe(probe, hosts, ranks_per_node, output_dir, attempt, log)
        for host in failing:
            append_fault(output_dir, None, "probe", [], [host], "failed the pre-launch probe")
        if failing:
            counts = strikes(read_faults(output_dir), since)
            struck = {short_host(h): strikes_to_leave_out for h in failing}
            hosts = allocation.choose({**counts, **struck}, strikes_to_leave_out, fits)
    new = [h for h in allocation.out if h not in before]
    if new or len(hosts) != allocation.nodes:
        spares = [h for h in hosts if allocation.hosts.index(h) >= len(allocation.hosts) - allocation.spares]
        log(
            f"supervise: leaving out {', '.join(new) or 'none new'} (out: {', '.join(allocation.out)}); "
            f"running on {len(hosts)} node{'s' if len(hosts) != 1 else ''}"
            + (f", spares {', '.join(spares)} in" if spares else "")
            + (
                f" (fewer than the {allocation.nodes} planned: the data-parallel size shrinks)"
                if len(hosts) < allocation.nodes
                else ""
            )
        )
    return hosts


def run_probe(
    probe: list[str],
    hosts: list[str],
    ranks_per_node: int,
    output_dir: Path,
    attempt: int,
    log,
    timeout_s: float = 300.0,
) -> list[str]:
    """Run the probe command on `hosts` (`DS_OPTIMUS_PROBE_DIR` set); returns those with no passing result."""
    folder = output_dir / "probe" / f"attempt-{attempt}"
    folder.mkdir(parents=True, exist_ok=True)
    hostfile = output_dir / "hosts" / f"probe-{attempt}.txt"
    command = fill(probe, hosts, ranks_per_node, hostfile)
    env = {**os.environ, "DS_OPTIMUS_PROBE_DIR": str(folder), "DS_OPTIMUS_HOSTFILE": str(hostfile)}
    try:
        subprocess.run(command, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log(f"supervise: the probe ran past {timeout_s:g} s")
    passed = set()
    for path in folder.glob("*.json"):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if result.get("ok"):
            passed.add(short_host(str(result.get("host"))))
    failing = [host for host in hosts if short_host(host) not in passed]
    log(
        f"supervise: probe of {len(hosts)} node{'s' if len(hosts) != 1 else ''}: "
        + (f"{', '.join(failing)} failed" if failing else "all passed")
    )
    return failing


def main(argv: list[str] | None = None) -> int:
    from ..command_line import ArgumentParser

    parser = ArgumentParser(
        "ds_optimus.reliability.supervise",
        description="Restart a failed training run from its last good checkpoint.",
        usage="%(prog)s [options] -- COMMAND ...",
    )
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--backoff", type=float, default=30.0, help="seconds before the first restart (doubles)")
    parser.add_argument("--max-backoff", type=float, default=600.0)
    parser.add_argument(
        "--progress",
        type=Path,
        default=None,
        help="the run's progress.json (default: found through the command's --config)",
    )
    parser.add_argument(
        "--hosts",
        default=None,
        metavar="pbs|slurm|FILE",
        help="the allocation's nodes: PBS's node file, Slurm's node list, or a host file; failing "
        "nodes are then left out (the command's {hostfile} {hosts} {nodes} {ranks} are filled)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks a node runs ({ranks} = nodes x this; needed by {ranks}; default 1)",
    )
    parser.add_argument(
        "--spares", type=int, default=0, help="the allocation's last N nodes, held back for failing ones"
    )
    parser.add_argument(
        "--strikes", type=int, default=1, help="faults naming a node (faults.jsonl) before it is left out (default 1)"
    )
    parser.add_argument(
        "--probe",
        default=None,
        metavar="COMMAND",
        help="a per-node probe run before each relaunch (placeholders as the command's), e.g. "
        '"mpiexec -n {nodes} --ppn 1 --hostfile {hostfile} python -m '
        'ds_optimus.reliability.probe"',
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (put it after --)")
    if args.max_restarts < 0 or args.backoff < 0:
        parser.error("--max-restarts and --backoff must be >= 0")
    try:
        progress = args.progress or _progress_file(command)
    except ValueError as err:  # a config that does not parse: the run itself will say so
        print(f"supervise: cannot read the command's config ({err}); no progress tracking", file=sys.stderr)
        progress = None

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    allocation = fits = None
    placeholders = [p for p in PLACEHOLDERS if any(p in arg for arg in command)]
    unknown = sorted({word for arg in command for word in re.findall(r"\{[a-z_]+\}", arg)} - set(PLACEHOLDERS))
    if unknown:
        parser.error(
            f"{unknown[0]} in the command is not a placeholder (the supervisor fills {', '.join(PLACEHOLDERS)})"
        )
    if "{ranks}" in placeholders and args.ranks_per_node is None:
        parser.error("{ranks} needs --ranks-per-node ({ranks} = nodes x ranks per node)")
    ranks_per_node = args.ranks_per_node if args.ranks_per_node is not None else 1
    if args.hosts is None:
        if placeholders or args.probe:
            parser.error(f"{(placeholders or ['--probe'])[0]} needs --hosts (the allocation's nodes)")
    else:
        if ranks_per_node < 1 or args.strikes < 1:
            parser.error("--ranks-per-node and --strikes must be >= 1")
        from ..launch.environment import LaunchError, job_hosts
        from ..launch.hosts import HostListError, read_hostfile

        try:
            env = {
                "pbs": {"DS_OPTIMUS_HOSTFILE": os.environ.get("PBS_NODEFILE", "")},
                "slurm": {"SLURM_JOB_NODELIST": os.environ.get("SLURM_JOB_NODELIST", "")},
            }.get(args.hosts)
            found = job_hosts(env) if env is not None else (read_hostfile(args.hosts), args.hosts)
            if found is None:
                parser.error(
                    f"--hosts {args.hosts}: {'PBS_NODEFILE' if args.hosts == 'pbs' else 'SLURM_JOB_NODELIST'} "
                    "is not set (not inside a job?)"
                )
            allocation = Allocation(found[0], args.spares)
        except (LaunchError, HostListError, AllocationError) as err:
            parser.error(f"--hosts {args.hosts}: {err}")
    check = layout_check(command, ranks_per_node)
    fits = check if allocation is not None else None
    probe = shlex.split(args.probe) if args.probe else None
    return supervise(
        command,
        args.max_restarts,
        args.backoff,
        args.max_backoff,
        progress,
        log,
        allocation,
        ranks_per_node,
        args.strikes,
        fits,
        probe,
        refused=check,
    )


if __name__ == "__main__":
    sys.exit(main())

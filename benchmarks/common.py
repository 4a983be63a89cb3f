"""Shared helpers of the benchmark scripts: interleaved timing, machine description, JSON output."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ds_optimus.command_line import deepspeed_launcher

RESULTS = Path(__file__).resolve().parent / "results"


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(
    contestants: dict[str, Callable[[], object]], repeats: int, warmup: int, device: str = "cpu"
) -> dict[str, dict[str, float]]:
    """Run every contestant `warmup` times, then `repeats` rounds in which each runs once (in turn,
    so slow drifts of the machine hit all alike); returns median/min/max seconds per contestant, and
    `host_median_s`: the median time until the call returns, before the device is waited for (on an
    accelerator, a host time near the whole time says the host sets the pace, not the kernels)."""
    for _ in range(warmup):
        for fn in contestants.values():
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in contestants}
    host: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(repeats):
        for name, fn in contestants.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            host[name].append(time.perf_counter() - start)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {
        n: {
            "median_s": statistics.median(t),
            "min_s": min(t),
            "max_s": max(t),
            "host_median_s": statistics.median(host[n]),
        }
        for n, t in times.items()
    }


def machine() -> dict[str, object]:
    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def profile_table(fn: Callable[[], object], device: str, iters: int = 3, rows: int = 15) -> str:
    """torch.profiler's table of the operators and kernels of `iters` calls of `fn` (after one
    untimed call), by self device time and by self CPU time (CPU time alone on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        synchronize(device)
    keys = ["self_device_time_total", "self_cpu_time_total"] if cuda else ["self_cpu_time_total"]
    averages = prof.key_averages()  # on a GPU also by host time: where the host spends a call
    return "\n".join(f"{iters} calls, sorted by {key}\n" + averages.table(sort_by=key, row_limit=rows) for key in keys)


def write_text_result(name: str, text: str) -> Path:
    """Write `text` to benchmarks/results/<name> (or $BENCH_RESULTS), beside the JSON results."""
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(text + "\n")
    return path


def write_result(name: str, payload: dict) -> Path:
    """Write `payload` (plus the machine) to benchmarks/results/<name>.json (or $BENCH_RESULTS)."""
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def launch_deepspeed(command: list[str], work: Path, gpus: int) -> None:
    """`deepspeed --num_gpus GPUS COMMAND...` in `work`, with the repository importable and a free
    port of its own (a previous launch may still hold the default one); a failure raises with the
    ends of its output."""
    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = deepspeed_launcher()
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [str(launcher), "--num_gpus", str(gpus), "--master_port", str(port), *command],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")

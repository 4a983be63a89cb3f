"""Run layouts for a few steps on this machine, through the real entry point (the `deepspeed`
launcher and `ds_optimus.train`), and read back each rank's peak tensor memory and the step time."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .configs import layout_config
from .layout import Layout


@dataclass(frozen=True)
class Measurement:
    layout: Layout
    peak_bytes: list[int]  # per rank, over the profiled steps
    initialized_bytes: list[int]  # per rank, once the engine was built (weights and optimizer state)
    step_seconds: float  # median of the unprofiled steps
    tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_json(),
            "peak_bytes": self.peak_bytes,
            "initialized_bytes": self.initialized_bytes,
            "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_s,
        }


class MeasureError(RuntimeError):
    """A measuring run that failed; the message ends with its output's last lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_layout(
    layout: Layout,
    preset: str,
    *,
    steps: int = 6,
    memory_steps: int = 2,
    workdir: str | Path | None = None,
    base: dict[str, Any] | None = None,
    timeout_s: float = 900,
    overrides: dict[str, Any] | None = None,
) -> Measurement:
    """Train `preset` under `layout` for `steps` steps on this machine's CPU with `layout.world`
    processes; memory comes from the first `memory_steps` steps (profiled), time from the rest."""
    if steps <= memory_steps:
        raise ValueError("steps must exceed memory_steps: the profiled steps are not timed")
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="ds_optimus_measure_") if own else workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        config = measuring_config(
            layout, preset, work, steps=steps, memory_steps=memory_steps, base=base, overrides=overrides
        )
        path = work / "config.json"
        path.write_text(json.dumps(config, indent=2))
        command = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(layout.world),
            "--master_port",
            str(free_port()),
            "--module",
            "ds_optimus.train",
            "--config",
            str(path),
        ]
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)  # ds_optimus.train shares the cores out itself
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s)
        summary_path = work / "run" / "summary.json"
        if done.returncode != 0 or not summary_path.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise MeasureError(f"layout {layout.describe()} failed with exit status {done.returncode}:\n{tail}")
        return measurement(layout, json.loads(summary_path.read_text()), memory_steps)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def measuring_config(
    layout: Layout,
    preset: str,
    work: Path,
    *,
    steps: int,
    memory_steps: int,
    base: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The training config that measures `layout` in folder `work`: `steps` steps of `preset`, the
    first `memory_steps` profiled for memory, no evaluation, sample, warm-up, checkpoint or wandb."""
    config = layout_config(layout, preset, base=base)
    optimus = config["optimus"]
    optimus["model"] = {"preset": preset, **({"overrides": overrides} if overrides else {})}
    optimus["train"].update(
        steps=steps,
        eval_interval=0,
        eval_batches=1,
        sample_tokens=0,
        warmup_steps=0,
        output_dir=str(work / "run"),
        measure_memory_steps=memory_steps,
    )
    optimus["checkpoint"] = {"interval": 0, "keep_last": 1, "dir": str(work / "checkpoints"), "resume": False}
    optimus["wandb"] = {"mode": "disabled"}
    # Not `moe.force_uniform_routing`: it would take the routing noise out of the expert compute, but it
    # gives each token k consecutive experts, held by as few EP ranks as k experts can be, so a deduplicated
    # exchange would be measured sending far fewer rows than real routing sends (and than the time model counts).
    data = optimus.setdefault("data", {})
    data.setdefault("sources", ["embedded"])
    data["cache_dir"] = os.environ.get("DS_OPTIMUS_MEASURE_CACHE", str(work / "data_cache"))
    data["val_fraction"] = data.get("val_fraction", 0.05)
    return config


def measurement(layout: Layout, summary: dict[str, Any], memory_steps: int) -> Measurement:
    """What a measuring run's summary (rank 0's `summary.json`) says of `layout`."""
    memory = summary["memory"]
    timed = [s for step, s in summary["step_seconds"].items() if int(step) > memory_steps]
    seconds = statistics.median(timed)
    return Measurement(
        layout=layout,
        peak_bytes=[m["peak_bytes"] for m in memory],
        initialized_bytes=[m["marks"].get("initialized", 0) for m in memory],
        step_seconds=seconds,
        tokens_per_s=layout.tokens_per_step / seconds,
    )

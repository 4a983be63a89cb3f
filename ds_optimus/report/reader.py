"""Reading a run's `metrics.jsonl` into plain lists and arrays (no plotting here)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class ReportError(Exception):
    """A run folder or metrics file that cannot be reported on."""


@dataclass
class ExpertLoads:
    """Token slots per MoE layer and expert, summed over ranks and each logged window."""

    steps: list[int]  # the logged steps, increasing; column t covers the steps after steps[t-1] up to steps[t]
    counts: np.ndarray  # [MoE layers, experts, logged steps], integers

    def relative(self) -> np.ndarray:
        """Counts over their layer and window's mean (1.0: balanced; NaN for an empty window)."""
        mean = self.counts.mean(axis=1, keepdims=True).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, self.counts / np.where(mean > 0, mean, 1.0), np.nan)


@dataclass
class RunMetrics:
    """A run's `metrics.jsonl`; a step logged more than once keeps its later values."""

    path: Path
    records: list[dict] = field(default_factory=list)  # one per logged step, merged, by step
    skipped: list[tuple[int, int]] = field(default_factory=list)  # (logged step, updates skipped in its window)
    rewinds: list[tuple[int, int]] = field(default_factory=list)  # (last step seen, step the log went back to)
    unreadable: int = 0  # lines that were not JSON records with a step (a cut last line is not counted)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """The steps that logged `key` and its finite values there."""
        steps, values = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps.append(record["step"])
                values.append(float(value))
        return steps, values

    def has(self, key: str) -> bool:
        return any(key in record for record in self.records)

    def layer_keys(self, prefix: str) -> list[str]:
        """Keys `prefix0`, `prefix1`, ... (per-layer metrics), in layer order."""
        found = {k for record in self.records for k in record if k.startswith(prefix) and k[len(prefix) :].isdigit()}
        return sorted(found, key=lambda k: int(k[len(prefix) :]))

    def expert_loads(self) -> ExpertLoads | None:
        """Every logged step's `expert_tokens` as one array; None where none were recorded."""
        rows = [(r["step"], r["expert_tokens"]) for r in self.records if _is_table(r.get("expert_tokens"))]
        if not rows:
            return None
        shape = np.shape(rows[-1][1])
        rows = [(step, table) for step, table in rows if np.shape(table) == shape]  # another layout: the last wins
        counts = np.array([table for _, table in rows], dtype=np.int64).transpose(1, 2, 0)
        return ExpertLoads(steps=[step for step, _ in rows], counts=counts)


def _is_table(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(row, list) and row for row in value)


def metrics_path(run_dir: str | Path) -> Path:
    """`RUN_DIR/metrics.jsonl`, or a one-line `ReportError` naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(f"{run_dir} does not exist (give the run's folder, its optimus.train.output_dir)")
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder (give the run's folder, its optimus.train.output_dir)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: not a training run's folder, or no step was logged yet")
    return path


def load_metrics(run_dir: str | Path) -> RunMetrics:
    """Read `RUN_DIR/metrics.jsonl`, leaving out a last line still being written."""
    path = metrics_path(run_dir)
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ReportError(f"cannot read {path}: {err.strerror or err}") from None
    lines = text.split("\n")
    lines.pop()  # after the last newline: empty, or a line the trainer is still writing
    run = RunMetrics(path)
    merged: dict[int, dict] = {}
    timeline: list[tuple[int, int]] = []  # (step, cumulative skipped updates) of the history that stands
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            run.unreadable += 1
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            run.unreadable += 1
            continue
        if timeline and step < timeline[-1][0]:  # the run went back (a rollback, or lines kept past a resume)
            run.rewinds.append((timeline[-1][0], step))
            while timeline and timeline[-1][0] >= step:
                timeline.pop()
        skipped = record.get("skipped_steps")
        if isinstance(skipped, int) and not isinstance(skipped, bool):
            before = timeline[-1][1] if timeline else 0
            if skipped > before:
                run.skipped.append((step, skipped - before))
            timeline.append((step, skipped))
        merged.setdefault(step, {}).update(record)
    if not merged:
        what = "is empty" if not text.strip() else "holds no complete record"
        raise ReportError(f"{path} {what}: no step has been logged yet")
    run.records = [merged[step] for step in sorted(merged)]
    return run


def load_downstream(run_dir: str | Path) -> dict[str, list[tuple[int, float, float | None]]]:
    """Scores from `RUN_DIR/eval/step_N.json`: {task: [(step, acc_norm or else acc, its stderr), ...]} by step."""
    import json

    scores: dict[str, list[tuple[int, float, float | None]]] = {}
    for path in sorted(Path(run_dir, "eval").glob("step_*.json")):
        try:
            record = json.loads(path.read_text())
            step, tasks = int(record["step"]), record["tasks"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for task, metrics in tasks.items():
            metric = "acc_norm" if "acc_norm" in metrics else "acc" if "acc" in metrics else None
            if metric is not None:
                scores.setdefault(task, []).append((step, metrics[metric], metrics.get(f"{metric}_stderr")))
    return {task: sorted(points) for task, points in scores.items()}

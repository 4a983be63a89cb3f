"""The report's PNGs, drawn with matplotlib's object API on the Agg canvas (no display, and no
change to the pyplot backend of a notebook that calls `write_report`)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .reader import ExpertLoads, ReportError, RunMetrics, load_downstream, load_metrics

MAX_HEATMAP_COLUMNS = 400  # a longer run's windows are summed into this many columns
SKIP_COLOR, REWIND_COLOR = "C3", "C4"
MIX_COLOR = "0.3"  # the data mixture's change markers


class MissingMatplotlib(ReportError):
    """matplotlib is not installed."""


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingMatplotlib("the plots need matplotlib: pip install matplotlib") from None


def _figure(rows: int = 1, height: float = 3.6, width: float = 8.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _smooth(values: list[float]) -> np.ndarray | None:
    """A centred running mean over about 2 % of the points (None below 50 points: the raw line is clear)."""
    if len(values) < 50:
        return None
    width = max(3, len(values) // 50) | 1
    padded = np.pad(np.asarray(values, dtype=float), width // 2, mode="edge")
    return np.convolve(padded, np.ones(width) / width, mode="valid")


def _line(ax, steps: list[int], values: list[float], label: str, color: str) -> None:
    smooth = _smooth(values)
    ax.plot(
        steps,
        values,
        color=color,
        alpha=0.35 if smooth is not None else 1.0,
        linewidth=1.0,
        label=label if smooth is None else f"{label} (each logged step)",
    )
    if smooth is not None:
        ax.plot(steps, smooth, color=color, linewidth=1.8, label=f"{label} (running mean)")


def _mark_rewinds(ax, run: RunMetrics) -> None:
    """Each stretch of steps the run went back over (a rollback) as a shaded span."""
    for i, (last, back_to) in enumerate(run.rewinds):
        ax.axvspan(
            back_to,
            last,
            color=REWIND_COLOR,
            alpha=0.15,
            linewidth=0,
            label="rolled back and trained again" if i == 0 else None,
        )


def _mark_events(ax, run: RunMetrics) -> None:
    """Skipped updates as vertical lines and rollbacks as spans, once each in the legend."""
    for i, (step, _) in enumerate(run.skipped):
        ax.axvline(step, color=SKIP_COLOR, linestyle=":", linewidth=1, label="update skipped" if i == 0 else None)
    _mark_rewinds(ax, run)


def _legend(ax, **options) -> None:
    if ax.get_legend_handles_labels()[0]:  # nothing drawn (no finite value): no empty legend, no warning
        ax.legend(**options)


def _save(fig, folder: Path, name: str, dpi: int, written: list[Path]) -> None:
    path = folder / name
    fig.savefig(path, dpi=dpi)
    written.append(path)


def plot_loss(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    fig, (ax,) = _figure()
    steps, loss = run.series("loss")
    if steps:
        _line(ax, steps, loss, "training loss", "C0")
    eval_steps, held_out = run.series("eval_loss")
    if eval_steps:
        ax.plot(eval_steps, held_out, "o-", color="C1", linewidth=1.8, markersize=5, label="held-out loss")
    _mark_events(ax, run)
    ax.set(
        xlabel="step",
        ylabel="loss (nats/token)",
        title="loss" + ("" if eval_steps else " (no held-out evaluation logged)"),
    )
    _legend(ax)
    _save(fig, folder, "loss.png", dpi, written)


def plot_lr(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    steps, lr = run.series("lr")
    if not steps:
        return
    fig, (ax,) = _figure(height=3.0)
    ax.plot(steps, lr, color="C0")
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _save(fig, folder, "lr.png", dpi, written)


def plot_grad_norm(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    steps, norm = run.series("grad_norm")
    if not steps:
        return
    fig, (ax,) = _figure()
    _line(ax, steps, norm, "gradient norm", "C0")
    if min(norm) > 0:
        ax.set_yscale("log")
    _mark_events(ax, run)
    ax.set(xlabel="step", ylabel="global gradient norm (before clipping)", title="gradient norm")
    _legend(ax)
    _save(fig, folder, "grad_norm.png", dpi, written)


def plot_throughput(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    steps, tps = run.series("tokens_per_s")
    if not steps:
        return
    mfu_steps, mfu = run.series("mfu")
    fig, axes = _figure(rows=2 if mfu_steps else 1, height=2.8 if mfu_steps else 3.6)
    _line(axes[0], steps, tps, "tokens/s", "C0")
    axes[0].set(
        ylabel="tokens / s (all ranks)",
        ylim=(0, None),
        title="throughput, mean over each log interval" + ("" if mfu_steps else " (no MFU: no peak_tflops)"),
    )
    if mfu_steps:
        _line(axes[1], mfu_steps, [100 * m for m in mfu], "MFU", "C1")
        axes[1].set(ylabel="MFU (% of peak_tflops)", ylim=(0, None))
        _legend(axes[1])
    _legend(axes[0], loc="lower right")
    axes[-1].set_xlabel("step")
    _save(fig, folder, "throughput.png", dpi, written)


def source_intervals(run: RunMetrics) -> tuple[list[int], list[dict[str, float]]]:
    """The logged steps that count each source's tokens (`tokens/<name>`: its tokens so far) and, for
    each, the tokens every counted source gave in the interval that ends there: since the previous
    such step, or from 0 for a source that step did not count (added, or renamed, at a resume)."""
    steps, intervals, previous = [], [], {}
    for record in run.records:
        counts = {
            key[len("tokens/") :]: float(value)
            for key, value in record.items()
            if key.startswith("tokens/")
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and np.isfinite(value)
        }
        if not counts:
            continue
        steps.append(record["step"])
        intervals.append({name: max(0.0, count - previous.get(name, 0.0)) for name, count in counts.items()})
        previous = counts
    return steps, intervals


_STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (.*)$")  # a line of log.txt: its time, then the message
_LAUNCH = re.compile(r"^data: [\d,]+ train / [\d,]+ held-out tokens")  # every launch says its data first
_RESUMED = re.compile(r"^resumed from .+ at step (\d+)$")
_CHANGED = "data changed since the checkpoint (optimus.data.allow_change): "


def resumed_changes(log: Path) -> dict[int, list[str]]:
    """{step: what changed in the data when the run resumed there, on optimus.data.allow_change}, as
    the run's `log.txt` says it, for the history that stands: a later launch that resumes at an
    earlier step, or starts afresh, replaces what was logged after that step."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    found: dict[int, list[str]] = {}
    launched, notes = False, []

    def settle(start: int) -> None:
        for step in [s for s in found if s >= start]:
            del found[step]
        if notes:
            found[start] = list(notes)

    for line in lines:
        stamped = _STAMPED.match(line)
        if stamped is None:
            continue
        message = stamped.group(1)
        if _LAUNCH.match(message):
            if launched:  # the launch before resumed from nothing: a fresh start
                notes.clear()
                settle(0)
            launched, notes = True, []
        elif launched and message.startswith(_CHANGED):
            notes.append(message[len(_CHANGED) :])
        elif launched and (resumed := _RESUMED.match(message)):
            settle(int(resumed.group(1)))
            launched = False
    if launched:
        notes.clear()
        settle(0)
    return found


def _change_label(changes: list[str]) -> str:
    """What the user changed, short: "'tok' was added (weight 2)"; the shares only when nothing else is said."""
    done = [c.removeprefix("source ") for c in changes if not c.startswith("the share of ")]
    if not done:
        return "shares changed"
    return "; ".join(done[:2]) + (f" (+{len(done) - 2} more)" if len(done) > 2 else "")


def mixture_changes(run: RunMetrics, steps: list[int], intervals: list[dict[str, float]]) -> list[tuple[int, str]]:
    """(step, label) of each change of the mixture: a resume on changed sources or weights (from
    `log.txt`), and a source counted from one logged step on, or no longer (from `metrics.jsonl`;
    placed at the last step before the change, where the run resumed when checkpoints fall on logged
    steps)."""
    last = steps[-1] if steps else 0
    marks = {
        step: _change_label(changes)
        for step, changes in resumed_changes(run.path.parent / "log.txt").items()
        if step <= last
    }
    for i in range(1, len(steps)):
        before, after, start, end = intervals[i - 1], intervals[i], steps[i - 1], steps[i]
        if set(before) != set(after) and not any(start <= step < end for step in marks):
            marks[start] = ", ".join(
                [f"+{name}" for name in sorted(set(after) - set(before))]
                + [f"-{name}" for name in sorted(set(before) - set(after))]
            )
    return sorted(marks.items())


def data_mixture_figure(run: RunMetrics):
    """The figure of `data_mixture.png` (None without per-source token counts): each source's tokens
    so far, and its share of the tokens drawn in each log interval; a dashed line at each step where
    the sources or their weights changed."""
    steps, intervals = source_intervals(run)
    if not steps:
        return None
    names = sorted({name for counts in intervals for name in counts})
    changes = mixture_changes(run, steps, intervals)
    fig, axes = _figure(rows=2, height=2.8)
    for i, name in enumerate(names):
        color = f"C{i % 10}"
        tokens_at, tokens = run.series(f"tokens/{name}")
        epochs = run.series(f"epochs/{name}")[1]
        axes[0].plot(tokens_at, tokens, color=color, label=f"{name} ({epochs[-1]:.2f} epochs)" if epochs else name)
        at = [(step, counts) for step, counts in zip(steps, intervals, strict=True) if name in counts]
        shares = [
            100 * counts[name] / total if (total := sum(counts.values())) > 0 else float("nan") for _, counts in at
        ]
        axes[1].plot(
            [step for step, _ in at],
            shares,
            color=color,
            marker="o",
            markersize=2.5,
            drawstyle="steps-pre",
            gid=f"share/{name}",
        )  # a point at each interval's end, level across the interval
    for k, (step, label) in enumerate(changes):
        for ax in axes:
            ax.axvline(
                step,
                color=MIX_COLOR,
                linestyle="--",
                linewidth=1,
                gid="mixture-change",
                label="mixture changed" if k == 0 and ax is axes[0] else None,
            )
        axes[0].annotate(
            label,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="left",
            fontsize=7,
            color=MIX_COLOR,
        )
    axes[0].set(ylabel="tokens drawn", title="data mixture: tokens of each source so far")
    axes[1].set(
        ylabel="share of the interval's\ntokens (%)",
        xlabel="step",
        ylim=(0, 100),
        title="each source's share of the tokens drawn in each log interval",
    )
    _legend(axes[0], loc="upper left")
    return fig


def plot_data_mixture(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    """`data_mixture.png`: `data_mixture_figure` (nothing for a run without per-source counts)."""
    fig = data_mixture_figure(run)
    if fig is not None:
        _save(fig, folder, "data_mixture.png", dpi, written)


def plot_skipped(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    steps, total = run.series("skipped_steps")
    if not steps:
        return
    fig, (ax,) = _figure(height=3.0)
    ax.step(steps, total, where="post", color="C0", label="skipped updates so far (run's count)")
    if run.skipped:
        at, count = zip(*run.skipped, strict=True)
        ax.vlines(at, 0, count, color=SKIP_COLOR, linewidth=4, label="skipped in the logged window")
    _mark_rewinds(ax, run)
    seen, kept = sum(count for _, count in run.skipped), int(total[-1])
    title = f"updates skipped by the numerical guards: {kept}" if kept else "updates skipped: none"
    if seen > kept:
        title += f" ({seen} including rolled-back steps)"
    if not seen and not kept:  # an empty frame would look like a plot that failed to draw
        ax.text(
            0.5,
            0.5,
            "no skipped steps: every update was applied",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=12,
            color="0.3",
        )
    ax.set(xlabel="step", ylabel="updates", ylim=(0, max(1, *total, *(c for _, c in run.skipped)) * 1.15), title=title)
    _legend(ax, loc="upper left")
    _save(fig, folder, "skipped_steps.png", dpi, written)


def plot_stragglers(run: RunMetrics, run_dir: Path, folder: Path, dpi: int, written: list[Path]) -> None:
    """The last rank's lateness to the step's reduction (`straggler_seconds`, logged every
    `optimus.watchdog.straggler_interval` steps) against the step time, and the stragglers named in
    faults.jsonl with their hosts."""
    steps, late = run.series("straggler_seconds")
    if not steps:
        return
    fig, (ax,) = _figure(height=3.2)
    ax.plot(steps, late, "o-", color="C3", markersize=3, label="last rank's lateness to the step's reduction")
    at, step_seconds = run.series("step_seconds")
    if at:
        ax.plot(at, step_seconds, color="0.6", linewidth=1, label="step time")
    named = []
    try:
        lines = (run_dir / "faults.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "straggler" and record.get("step") in steps:
            named.append(record)
    for record in named[-12:]:  # the latest, each with its hosts
        y = late[steps.index(record["step"])]
        ax.annotate(
            ", ".join(record.get("hosts", [])[:3]),
            (record["step"], y),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set(
        xlabel="step",
        ylabel="seconds",
        title=f"stragglers: {len(named)} step(s) with ranks named late" if named else "stragglers: none named",
    )
    _legend(ax, loc="upper left")
    _save(fig, folder, "stragglers.png", dpi, written)


# the phase profiler's phases (`optimus.profile`), bottom to top; "rest": the step's time in none of them
PROFILE_PHASES = ("data", "forward", "backward", "pipeline", "reduce", "optimizer", "rest")
_COMM = "profile/comm/"


def _value(record: dict, key: str) -> float:
    value = record.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    return float(value) if ok else 0.0


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return ""


def plot_profile(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    """`profile.png` (a run with `optimus.profile` on): each phase's time per profiled step, stacked, with
    the ranks' mean wait at the step's reduction for the slowest (jitter) and its spread; below, the
    collectives' time by kind, each with its bytes a step."""
    records = [r for r in run.records if "profile/step_s" in r]
    names = [p for p in PROFILE_PHASES if any(f"profile/{p}_s" in r for r in records)]
    if not records or not names:
        return
    kinds = sorted(
        {key[len(_COMM) : -len("_s")] for r in records for key in r if key.startswith(_COMM) and key.endswith("_s")}
    )
    fig, axes = _figure(rows=2 if kinds else 1, height=3.2)
    steps = [r["step"] for r in records]
    series = [[1e3 * _value(r, f"profile/{name}_s") for r in records] for name in names]
    axes[0].stackplot(steps, *series, labels=names, colors=[f"C{i}" for i in range(len(names))], alpha=0.85)
    rows = [r for r in run.records if "profile/jitter_s" in r]
    if rows:  # a step's jitter is logged with a later step: drawn at the step it describes
        axes[0].errorbar(
            [int(_value(r, "profile/ranks_step")) for r in rows],
            [1e3 * _value(r, "profile/jitter_s") for r in rows],
            yerr=[1e3 * _value(r, "profile/jitter_std_s") for r in rows],
            color="black",
            marker="o",
            markersize=3,
            linewidth=1,
            capsize=2,
            label="jitter: wait at the step's reduction (mean, sd over ranks)",
        )
    totals = list(map(sum, zip(*series, strict=True)))
    top = _scale_top(totals)
    if top < totals[0]:  # the first profiled step (compiles, first touches) would flatten the rest: off scale
        axes[0].annotate(
            f"{totals[0] / 1e3:.3g} s (off scale)",
            (steps[0], 1.5 * top),
            xytext=(4, -12),
            textcoords="offset points",
            fontsize="small",
            color="dimgray",
        )
    axes[0].set(
        ylabel="ms per step",
        ylim=(0, 1.5 * top if top > 0 else None),  # room for the legend
        title="where a step's time goes (rank 0's profiled steps)",
    )
    _legend(axes[0], loc="upper left", fontsize="small", ncol=2)
    for i, kind in enumerate(kinds):
        at, seconds = run.series(f"{_COMM}{kind}_s")
        _, nbytes = run.series(f"{_COMM}{kind}_bytes")
        per_step = f", {_size(nbytes[-1])}/step" if nbytes else ""
        axes[1].plot(at, [1e3 * s for s in seconds], marker=".", color=f"C{i % 10}", label=f"{kind}{per_step}")
    if kinds:
        top = max((line.get_ydata().max() for line in axes[1].get_lines()), default=0.0)
        axes[1].set(
            ylabel="ms per step",
            ylim=(0, 1.5 * top if top > 0 else None),
            title="collectives by kind (issue to completion; asynchronous ones: issue only)",
        )
        _legend(axes[1], loc="upper left", fontsize="small", ncol=2)
    axes[-1].set_xlabel("step")
    _save(fig, folder, "profile.png", dpi, written)


def _scale_top(totals: list[float]) -> float:
    """The step time the panel's scale reaches: the largest, less the first step's where that exceeds
    1.5x the others' largest (it alone would set the scale)."""
    rest = max(totals[1:], default=0.0)
    return max(totals) if len(totals) < 2 or totals[0] <= 1.5 * rest else rest


def _bin_columns(loads: ExpertLoads, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows' counts summed into at most `columns` columns, with the columns' step edges."""
    steps = np.asarray(loads.steps)
    first = steps[0] - (steps[1] - steps[0] if len(steps) > 1 else 1)
    edges = np.concatenate([[first], steps]).astype(float)
    counts = loads.counts
    if counts.shape[-1] > columns:
        cuts = np.linspace(0, counts.shape[-1], columns + 1).round().astype(int)
        counts = np.add.reduceat(counts, cuts[:-1], axis=-1)
        edges = edges[cuts]
    return counts, edges


def plot_expert_load(loads: ExpertLoads, folder: Path, dpi: int, written: list[Path]) -> None:
    from matplotlib.colors import TwoSlopeNorm

    counts, edges = _bin_columns(loads, MAX_HEATMAP_COLUMNS)
    layers, experts, _ = counts.shape
    relative = ExpertLoads(loads.steps, counts).relative()  # [layers, experts, columns]
    image = relative.reshape(layers * experts, -1)
    fig, (ax,) = _figure(height=min(12.0, max(3.5, 1.2 + 0.05 * layers * experts)), width=9.0)
    ax.grid(False)
    top = float(np.nanmax(image)) if np.isfinite(image).any() else 2.0
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, top))
    mesh = ax.pcolormesh(edges, np.arange(layers * experts + 1), image, cmap="RdBu_r", norm=norm, shading="flat")
    for layer in range(1, layers):
        ax.axhline(layer * experts, color="black", linewidth=0.8)
    ax.set_yticks(
        [(layer + 0.5) * experts for layer in range(layers)], [f"MoE layer {layer}" for layer in range(layers)]
    )
    ax.set_ylim(layers * experts, 0)  # layer 0, expert 0 at the top
    ax.set(
        xlabel="step",
        ylabel=f"expert (0-{experts - 1} in each layer)",
        title=f"expert load: tokens per expert over the layer's mean ({layers} MoE layers x {experts} experts)",
    )
    fig.colorbar(mesh, ax=ax, label="tokens / mean (1 = balanced, 0 = unused)")
    _save(fig, folder, "expert_load.png", dpi, written)


def plot_imbalance(run: RunMetrics, folder: Path, dpi: int, written: list[Path]) -> None:
    keys = run.layer_keys("expert_imbalance/layer_")
    if not keys:
        return
    fig, (ax,) = _figure()
    smoothed = False
    for i, key in enumerate(keys):
        steps, values = run.series(key)
        smooth = _smooth(values)
        smoothed = smoothed or smooth is not None
        ax.plot(
            steps,
            smooth if smooth is not None else values,
            linewidth=1.2,
            color=f"C{i % 10}",
            label=f"MoE layer {key.rsplit('_', 1)[-1]}",
        )
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set(
        xlabel="step",
        ylabel="max / mean tokens per expert",
        ylim=(0, None),
        title="expert-load imbalance per layer (1 = balanced)" + (" (running mean)" if smoothed else ""),
    )
    _legend(ax, ncol=max(1, len(keys) // 8), fontsize="small")
    _save(fig, folder, "expert_imbalance.png", dpi, written)


def plot_downstream(run_dir: Path, folder: Path, dpi: int, written: list[Path]) -> None:
    """`downstream.png`: each task's score (accuracy, normalised where the task has it) over the
    checkpoints' steps, with its standard error; nothing without `eval/step_N.json` files."""
    scores = load_downstream(run_dir)
    if not scores:
        return
    fig, (ax,) = _figure()
    for task, points in scores.items():
        steps, values, errors = zip(*points, strict=True)
        ax.errorbar(steps, values, yerr=[e or 0.0 for e in errors], marker="o", capsize=3, label=task)
    ax.set(
        xlabel="step",
        ylabel="accuracy (normalised where the task has it)",
        title="downstream tasks (lm-evaluation-harness, per checkpoint)",
    )
    _legend(ax, loc="best")
    _save(fig, folder, "downstream.png", dpi, written)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_report(
    run_dir: str | Path, out: str | Path | None = None, *, dpi: int = 100, say: Callable[[str], None] = _stderr
) -> list[Path]:
    """Draw the PNGs of a run folder's `metrics.jsonl` into `out` (default `RUN_DIR/plots`) and return
    their paths; `say` gets one-line notes (a dense run has no expert heatmap, ...)."""
    run = load_metrics(run_dir)
    _need_matplotlib()  # said before any folder is made
    folder = Path(out) if out is not None else Path(run_dir) / "plots"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"cannot make {folder}: {err.strerror or err}") from None
    written: list[Path] = []
    for plot in (plot_loss, plot_lr, plot_grad_norm, plot_throughput, plot_skipped, plot_data_mixture):
        plot(run, folder, dpi, written)
    loads = run.expert_loads()
    if loads is not None:
        plot_expert_load(loads, folder, dpi, written)
    elif run.has("expert_imbalance_max"):
        say(
            "no expert heatmap: this run's metrics.jsonl has no per-expert token counts (logged before they "
            "were recorded)"
        )
    else:
        say("no expert heatmap: a dense model (no MoE layer)")
    plot_imbalance(run, folder, dpi, written)
    plot_stragglers(run, Path(run_dir), folder, dpi, written)
    plot_profile(run, folder, dpi, written)
    plot_downstream(Path(run_dir), folder, dpi, written)
    if run.unreadable:
        say(f"{run.unreadable} line(s) of {run.path} were not metrics records and were left out")
    return written

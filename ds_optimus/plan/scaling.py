"""Scaling report: the best predicted layout of a model at each device count from N to M, its
tokens per second, and the scaling efficiency against N, as a table, JSON and a PNG plot."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .cluster import Cluster
from .layout import Layout, LayoutError
from .model import ModelShape
from .search import Plan, evaluate, search, text_table


class ScalingError(ValueError):
    """A scaling request that cannot be answered; one line saying why."""


@dataclass(frozen=True)
class ScalingPoint:
    devices: int
    plan: Plan | None  # None: nothing fits
    tried: int
    # the same layout's tokens/s at the ends of the cluster's band between network groups (minimal
    # routing, adaptive routing's best); the plan itself is at the cluster's own routing (the middle)
    band: tuple[float, float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_s if self.plan else 0.0


def _banded(
    model: ModelShape, cluster: Cluster, devices: int, plan: Plan | None, tried: int, expert_imbalance: float
) -> ScalingPoint:
    if plan is None:
        return ScalingPoint(devices, None, tried)
    ends = tuple(
        evaluate(model, plan.layout, replace(cluster, routing=routing), expert_imbalance).tokens_per_s
        for routing in ("minimal", "adaptive")
    )
    return ScalingPoint(devices, plan, tried, ends)


def device_counts(first: int, last: int) -> list[int]:
    """`first`, doubling, up to `last` (both included)."""
    if first < 1 or last < first:
        raise ScalingError(f"the device range {first}:{last} is empty")
    counts, d = [], first
    while d < last:
        counts.append(d)
        d *= 2
    counts.append(last)
    return counts


def scaling(
    model: ModelShape,
    cluster: Cluster,
    counts: list[int],
    seqs_per_device: float,
    seq_len: int,
    *,
    weak: bool = True,
    global_batch: int | None = None,
    progress=None,
    **kwargs: Any,
) -> list[ScalingPoint]:
    """The best plan at each device count. Weak scaling keeps `seqs_per_device` sequences per device
    per step (the global batch grows with the run); strong scaling keeps `global_batch`."""
    points = []
    for devices in counts:
        batch = round(seqs_per_device * devices) if weak else global_batch
        if batch is None or batch < 1:
            raise ScalingError("strong scaling needs a global batch")
        plans, tried = search(model, cluster, devices, batch, seq_len, **kwargs)
        points.append(
            _banded(model, cluster, devices, plans[0] if plans else None, tried, kwargs.get("expert_imbalance", 1.0))
        )
        if progress is not None:
            progress(points[-1])
    return points


def scale_layout(
    model: ModelShape, cluster: Cluster, layout: Layout, counts: list[int], expert_imbalance: float = 1.0
) -> list[ScalingPoint]:
    """One layout's shape at each device count (weak scaling: its EP, pipeline, exchange, optimizer,
    recomputation and sequences per data-parallel rank kept, the data-parallel size grown); a count
    it cannot run at has no plan. A plan is kept where it does not fit in memory (`Plan.fits`)."""
    points = []
    for devices in counts:
        candidate = layout.with_(world=devices)
        try:
            plan = evaluate(model, candidate, cluster, expert_imbalance)
        except LayoutError:
            plan = None
        points.append(_banded(model, cluster, devices, plan, 1, expert_imbalance))
    return points


def efficiency(points: list[ScalingPoint], end: int | None = None) -> list[float]:
    """Tokens/s per device at each count over that at the first count; `end` 0 or 1: at that end of
    the band (minimal routing, adaptive routing), each against the first count at the same end."""

    def rate(p: ScalingPoint) -> float:
        if p.plan is None:
            return 0.0
        return (p.band[end] if end is not None and p.band else p.tokens_per_s) / p.devices

    base = rate(points[0]) if points else 0.0
    return [rate(p) / base if base else 0.0 for p in points]


def format_scaling(points: list[ScalingPoint], label: str = "best layout") -> str:
    """The table: the middle of the band in every column, and the band's ends (minimal routing to
    adaptive routing's best) for the tokens/s per device, the MFU and the efficiency."""
    effs, lows, highs = efficiency(points), efficiency(points, 0), efficiency(points, 1)
    header = (
        "devices",
        label,
        "tokens/s",
        "per device",
        "band",
        "MFU",
        "band",
        "a2a %",
        "grad %",
        "bubble %",
        "efficiency",
        "band",
    )
    rows = []
    for point, eff, low, high in zip(points, effs, lows, highs, strict=True):
        if point.plan is None:
            rows.append((str(point.devices), "nothing fits", *["-"] * 10))
            continue
        t = point.plan.time
        fits = "" if point.plan.fits else " (does not fit)"
        band = point.band or (point.tokens_per_s, point.tokens_per_s)
        rows.append(
            (
                str(point.devices),
                point.plan.layout.describe() + fits,
                f"{point.tokens_per_s:,.0f}",
                f"{point.tokens_per_s / point.devices:,.0f}",
                f"{band[0] / point.devices:,.0f}-{band[1] / point.devices:,.0f}",
                f"{point.plan.mfu:.1%}",
                "-".join(f"{point.plan.mfu * b / point.tokens_per_s:.1%}" for b in band),
                f"{t.all_to_all / t.step:.0%}",
                f"{(t.grad_reduce + t.param_gather) / t.step:.0%}",
                f"{(t.bubble + t.p2p) / t.step:.0%}",
                f"{eff:.1%}",
                f"{low:.0%}-{high:.0%}",
            )
        )
    return text_table(header, rows)


def plot_scaling(
    points: list[ScalingPoint],
    path: str | Path,
    title: str,
    reference: float | None = None,
    others: tuple[tuple[str, list[ScalingPoint]], ...] = (),
    label: str = "predicted",
) -> Path:
    """Tokens/s against devices (log-log, with the ideal line from the first point) and the
    scaling efficiency, to a PNG. `reference`: an efficiency to mark at the last count; `others`:
    more (label, points) series, such as one fixed layout's."""
    try:
        import matplotlib
    except ImportError:
        raise ScalingError("the PNG needs matplotlib: pip install matplotlib (or ds_optimus[plan])") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in points if p.plan is not None]
    if not pts:
        raise ScalingError("no device count has a layout that fits: nothing to plot")
    devices = [p.devices for p in pts]
    tps = [p.tokens_per_s for p in pts]
    ideal = [tps[0] * d / devices[0] for d in devices]
    effs = [e for p, e in zip(points, efficiency(points), strict=True) if p.plan is not None]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.loglog(devices, ideal, "--", color="grey", label="linear from the first point")
    ax.loglog(devices, tps, "o-", color="C0", label=label)
    if all(p.band for p in pts):
        ax.fill_between(
            devices,
            [p.band[0] for p in pts],
            [p.band[1] for p in pts],
            color="C0",
            alpha=0.15,
            label="minimal to adaptive routing between groups",
        )
    series = [(name, [p for p in pts_ if p.plan is not None], pts_) for name, pts_ in others]
    for i, (name, kept, _) in enumerate(series, 2):
        ax.loglog([p.devices for p in kept], [p.tokens_per_s for p in kept], "s-", color=f"C{i}", label=name)
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens / s")
    ax.set_xticks(devices)
    ax.set_xticklabels([str(d) for d in devices], rotation=45)
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("throughput")
    ax2.semilogx(devices, [100 * e for e in effs], "o-", color="C0", label=label)
    _band(ax2, points, "C0")
    for i, (name, kept, all_points) in enumerate(series, 2):
        kept_effs = [e for p, e in zip(all_points, efficiency(all_points), strict=True) if p.plan is not None]
        ax2.semilogx([p.devices for p in kept], [100 * e for e in kept_effs], "s-", color=f"C{i}", label=name)
        _band(ax2, all_points, f"C{i}")
    if reference is not None:
        ax2.plot(
            [devices[-1]],
            [100 * reference],
            "s",
            color="C3",
            markersize=9,
            label=f"reference measurement ({reference:.0%})",
        )
    ax2.set_xticks(devices)
    ax2.set_xticklabels([str(d) for d in devices], rotation=45)
    ax2.minorticks_off()
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("devices")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(loc="lower left", fontsize=8)
    ax2.set_title("efficiency against the first point")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _band(ax, points: list[ScalingPoint], color: str) -> None:
    """Shade the efficiency between the band's ends (minimal routing, adaptive routing's best)."""
    kept = [
        (p, lo, hi)
        for p, lo, hi in zip(points, efficiency(points, 0), efficiency(points, 1), strict=True)
        if p.plan is not None and p.band
    ]
    if kept:
        ax.fill_between(
            [p.devices for p, _, _ in kept],
            [100 * lo for _, lo, _ in kept],
            [100 * hi for _, _, hi in kept],
            color=color,
            alpha=0.15,
        )

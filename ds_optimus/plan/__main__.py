"""Command line of the layout planner: `python -m ds_optimus.plan --help`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..command_line import ArgumentParser, fail
from ..schema import apply_overrides
from .cluster import BUILTIN, ClusterError, get_cluster
from .configs import layout_config, layout_from_config, template_for, template_path, write_config
from .layout import LayoutError
from .memory import gib
from .model import ModelShape
from .scaling import ScalingError, device_counts, efficiency, format_scaling, plot_scaling, scale_layout, scaling
from .search import (
    EXCHANGES,
    OPTIMIZERS,
    RECOMPUTE_CHOICES,
    evaluate,
    format_table,
    ranking_note,
    search,
    smallest_peak,
)

EPILOG = """examples:
  python -m ds_optimus.plan --model mula-7b-a1b --cluster h100 --devices 64 --write ds_configs/mula-7b-a1b-64xh100.json
  python -m ds_optimus.plan --model mula-220b-a10b --cluster aurora --devices 384 --scale 384:12288 --png scaling.png
  python -m ds_optimus.plan --config ds_configs/mula-220b-a10b-aurora.json --cluster aurora --scale 384:12288
  python -m ds_optimus.plan --model mula-tiny-moe --cluster local --devices 2 --measure 4
  python -m ds_optimus.plan --list-clusters
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        "ds_optimus.plan",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Predict per-rank memory and step time of a Mula model under each "
        "parallel layout on a cluster,\nrank the layouts, write the best as a "
        "DeepSpeed config. Layouts read\n  dpD epE [tpT[sp]] [ppP[vV][:schedule]] "
        "zeroZ[+opt] mbMxA [ckpt[:parts]] [hier] [dedup] [ovlC] [ag]:\nsizes "
        "(D data-parallel ranks per stage and TP position, T tensor-parallel "
        "ranks,\nsp: sequence-parallel, V virtual stages), optimizer, "
        "micro-batch x accumulation,\nrecomputation, and the EP exchange "
        "(two-step, deduplicated, overlapped with the experts in C "
        "chunks;\nag: the allgather dispatch).",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of --config (repeatable), as ds_optimus.train's --set does",
    )
    p.add_argument("--model", default=None, help="Mula preset (default: --config's, else mula-7b-a1b)")
    p.add_argument(
        "--config",
        metavar="PATH",
        help="a training config whose layout is evaluated beside the search (and scaled with --scale); "
        "its model, devices, batch and sequence length are the defaults",
    )
    p.add_argument(
        "--cluster",
        default="h100",
        help=f"built-in cluster ({', '.join(BUILTIN)}), 'local' (this machine, measured) or a JSON file",
    )
    p.add_argument("--devices", type=int, default=None, help="ranks (GPUs, GPU tiles or GCDs); default: one node")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (default: the preset's shipped config)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the shipped config's)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="training dtype (default: bf16 on accelerators, fp32 on a CPU cluster)",
    )
    _search_arguments(p.add_argument_group("the layouts searched"))
    _output_arguments(p.add_argument_group("what is written, measured or scaled"))
    p.add_argument("--list-clusters", action="store_true", help="print the built-in clusters and exit")
    return p


def _search_arguments(p) -> None:
    p.add_argument(
        "--no-pipeline",
        action="store_true",
        help="no pipeline stages (default: also pipeline-parallel layouts, 1F1B or interleaved)",
    )
    p.add_argument(
        "--tensor",
        default=None,
        metavar="T,T,...",
        help="tensor-parallel sizes to try, comma-separated (default: 1,2,4,8 for a dense model, 1 for "
        "an MoE one; each inside a node and dividing the model's widths)",
    )
    p.add_argument(
        "--dispatch",
        choices=("all", "alltoall", "allgather"),
        default="all",
        help="EP exchanges: the all-to-all, the allgather dispatch (EP inside a node), or both (default)",
    )
    p.add_argument(
        "--optimizer",
        choices=("all", "sharded", "deepspeed"),
        default="all",
        help="the EP-aware sharded optimizer, DeepSpeed's ZeRO, or both (default)",
    )
    p.add_argument("--no-checkpointing", action="store_true", help="never use activation checkpointing")
    p.add_argument(
        "--whole-layer-checkpointing",
        action="store_true",
        help="recompute whole decoder layers or nothing (no selective recomputation of parts)",
    )
    p.add_argument(
        "--exchange",
        choices=("all", "per-slot", "no-overlap"),
        default="all",
        help="EP exchanges to try: per slot, deduplicated, and deduplicated in 2 or 4 overlapped chunks "
        "(all, the default); per slot only; or no chunks",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="rows the busiest rank's experts receive over the mean (default 1.0)",
    )


def _output_arguments(p) -> None:
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--write", metavar="PATH", help="write the best layout as a DeepSpeed JSON config")
    p.add_argument(
        "--keep-layout",
        action="store_true",
        help="with --config and --write: write --config as it is (with --set), not the search's best",
    )
    p.add_argument(
        "--job",
        choices=("pbs", "slurm"),
        default=None,
        help="with --write: a job script beside the config (PATH with .pbs or .sbatch): mpiexec under PBS "
        "(Aurora), srun under Slurm, each wrapped by the supervisor",
    )
    p.add_argument("--spares", type=int, default=0, help="with --job: spare nodes to allocate for failing ones")
    p.add_argument("--walltime", default="06:00:00", help="with --job: HH:MM:SS (default 06:00:00)")
    p.add_argument("--account", default=None, help="with --job: the project to charge")
    p.add_argument("--queue", default=None, help="with --job: the queue (PBS) or partition (Slurm)")
    p.add_argument("--json", metavar="PATH", help="write everything shown as JSON")
    p.add_argument(
        "--measure",
        type=int,
        metavar="K",
        default=0,
        help="run the top K layouts for a few steps on this machine and compare",
    )
    p.add_argument("--measure-steps", type=int, default=6, help="steps per measured layout (default 6)")
    p.add_argument("--scale", metavar="N:M", help="scaling report from N to M devices (doubling)")
    p.add_argument(
        "--strong",
        action="store_true",
        help="scaling at a fixed global batch (default: weak scaling, a fixed batch per device)",
    )
    p.add_argument("--png", metavar="PATH", help="plot the scaling report to this PNG")
    p.add_argument(
        "--reference-efficiency",
        type=float,
        default=None,
        help="a measured efficiency at M devices to mark on the plot (e.g. 0.9)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ClusterError, LayoutError, ScalingError, ValueError, OSError) as err:
        return fail("ds_optimus.plan", err)


def _tensor_sizes(text: str | None) -> tuple[int, ...] | None:
    """`--tensor`'s sizes (None: the search's default); a one-line error for anything but positive integers."""
    if text is None:
        return None
    try:
        sizes = tuple(int(t) for t in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--tensor takes comma-separated positive integers, got {text!r}")
    return sizes


def _run(args: argparse.Namespace) -> int:
    if args.list_clusters:
        for name, c in BUILTIN.items():
            print(
                f"{name:9s} {c.device}: {c.devices_per_node}/node, {c.memory_gib:.0f} GiB, {c.peak_tflops:g} TFLOPS, "
                f"{c.intra_node_gbps:g} GB/s in node, {c.inter_node_gbps:.1f} GB/s between nodes ({c.notes})"
            )
        return 0
    _refuse_combinations(args)
    cluster = get_cluster(args.cluster)
    fixed = template = None  # the layout of --config; what --write keeps (its recipe, data, run settings)
    if args.config:
        given = apply_overrides(json.loads(Path(args.config).read_text()), args.set)
        model, fixed = layout_from_config(given, args.devices)
        args.model = args.model or model.name
        if args.model != model.name:
            model = ModelShape.from_preset(args.model)
        else:
            template = given
    else:
        args.model = args.model or "mula-7b-a1b"
        model = ModelShape.from_preset(args.model)
    source = args.config or template_path(args.model, cluster.name)  # where the defaults below come from
    template = template if template is not None else template_for(args.model, cluster.name)
    args.template = template
    seq_len = args.seq_len or (
        fixed.seq_len if fixed else template.get("optimus", {}).get("data", {}).get("seq_len", 4096)
    )
    devices = args.devices or (fixed.world if fixed else cluster.devices_per_node)
    global_batch = args.global_batch or (fixed.global_batch if fixed else template.get("train_batch_size")) or devices
    if fixed:
        fixed = fixed.with_(world=devices, seq_len=seq_len)
    dtype = args.dtype or ("fp32" if cluster.shared_compute else "bf16")
    for name, value in (
        ("--devices", devices),
        ("--global-batch", global_batch),
        ("--seq-len", seq_len),
        ("--top", args.top),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if args.expert_imbalance < 1:
        raise ValueError(f"--expert-imbalance must be at least 1, got {args.expert_imbalance}")
    options = _search_options(args, dtype)
    report: dict = {"model": args.model, "cluster": cluster.to_json(), "dtype": dtype, "seq_len": seq_len}

    print(
        f"{args.model}: {_count(model.total_params)} parameters ({_count(model.expert_params)} in experts), "
        f"{_count(model.active_params)} active; {model.flops_per_token(seq_len) / 1e9:.3g} GFLOP per token"
    )
    print(
        f"{cluster.name}: {cluster.device}, {cluster.devices_per_node} per node, {cluster.memory_gib:.0f} GiB "
        f"({gib(cluster.usable_bytes):.0f} usable), {cluster.peak_tflops:g} TFLOPS x "
        f"{cluster.compute_efficiency:.0%} (experts x {cluster.expert_efficiency:.1%})"
    )

    if args.scale:
        return _scale(args, model, cluster, seq_len, global_batch, devices, options, report, fixed)

    plans, tried = search(model, cluster, devices, global_batch, seq_len, **options)
    print(
        f"{devices} devices, {global_batch} x {seq_len} tokens per step ({dtype}): {tried} layouts tried, "
        f"{len(plans)} fit in memory\n"
    )
    if not tried:
        origin = (
            ""
            if args.global_batch or fixed
            else f" (the train_batch_size of {_shown(source) if source else 'the defaults'}; set --global-batch)"
        )
        raise LayoutError(
            f"a global batch of {global_batch} sequences{origin} does not divide over the "
            f"data-parallel ranks of any layout of {devices} devices; choose a multiple of {devices}"
        )
    if not plans:
        raise LayoutError(_nothing_fits(args, model, cluster, devices, global_batch, seq_len, options))
    print(format_table(plans, args.top))
    note = ranking_note(plans, args.top)
    if note:
        print(note)
    if fixed:
        report["config"] = _evaluate_config(args, model, fixed, cluster, plans[0])
    report["devices"], report["global_batch"] = devices, global_batch
    report["plans"] = [p.as_dict() for p in plans[: args.top]]
    if args.write:
        _write(args, plans[0].layout, fixed, template, devices, cluster)
    if args.measure:
        available = _local_ranks()
        if devices > available:
            raise ValueError(
                f"--measure runs the layouts on this machine, which runs at most {available} ranks; "
                f"{devices} devices asked (use --cluster local --devices {available})"
            )
        report["measured"] = _measure(args, plans[: args.measure], model)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _refuse_combinations(args: argparse.Namespace) -> None:
    """A one-line error for arguments that do not go together."""
    if args.job and not args.write:
        raise ValueError("--job goes with --write PATH (the config the job runs; the script is written beside it)")
    if args.job and args.scale:
        raise ValueError("--job writes one job, for one device count: leave out --scale")
    if args.keep_layout and not (args.config and args.write):
        raise ValueError("--keep-layout goes with --config PATH and --write PATH (the config written as it is)")
    if args.keep_layout and args.model:
        raise ValueError("--keep-layout writes --config's own model: leave out --model")
    if args.set and not args.config:
        raise ValueError("--set changes keys of --config: give --config")


def _search_options(args: argparse.Namespace, dtype: str) -> dict:
    """`search`'s keyword arguments from the command line's choices."""
    optimizers = {
        "all": OPTIMIZERS,
        "sharded": tuple(o for o in OPTIMIZERS if o[1]),
        "deepspeed": tuple(o for o in OPTIMIZERS if not o[1]),
    }[args.optimizer]
    dispatches = ("alltoall", "allgather") if args.dispatch == "all" else (args.dispatch,)
    checkpointing = RECOMPUTE_CHOICES
    if args.no_checkpointing:
        checkpointing = (False,)
    elif args.whole_layer_checkpointing:
        checkpointing = (False, True)
    unchunked = tuple(e for e in EXCHANGES if e[1] == 1)
    exchanges = {"all": EXCHANGES, "per-slot": EXCHANGES[:1], "no-overlap": unchunked}[args.exchange]
    return dict(
        dtype=dtype,
        pipeline=not args.no_pipeline,
        optimizers=optimizers,
        dispatches=dispatches,
        checkpointing=checkpointing,
        exchanges=exchanges,
        expert_imbalance=args.expert_imbalance,
        tensor=_tensor_sizes(args.tensor),
    )


def _write(args: argparse.Namespace, best, fixed, template: dict, devices: int, cluster) -> None:
    """Write --write's config (the search's best, or --config's own with --keep-layout) and its job."""
    if args.keep_layout:
        path, best = write_config(template, args.write), fixed
    else:
        path = write_config(layout_config(best, args.model, cluster, base=template), args.write)
        if fixed and best.describe() != fixed.describe():
            print(
                f"\n{args.write}: the search's best layout in place of {_shown(args.config)}'s "
                f"{fixed.describe()} (--keep-layout writes that one)"
            )
    if args.job:
        job = _write_job(args, path, devices, cluster)
        print(
            f"\nwrote {path} ({best.describe()}) and {job}: submit it with "
            f"{'qsub' if args.job == 'pbs' else 'sbatch'} {job}"
        )
    else:
        print(
            f"\nwrote {path} ({best.describe()}; run it with: deepspeed --num_nodes "
            f"{-(-devices // cluster.devices_per_node)} --num_gpus {min(devices, cluster.devices_per_node)} "
            f"--module ds_optimus.train --config {path})"
        )


def _write_job(args: argparse.Namespace, config_path: Path, devices: int, cluster) -> Path:
    """The job script for `config_path` on `devices` ranks of `cluster` (ds_optimus.launch.jobs)."""
    from ..launch.jobs import JobSpec, write_job
    from ..schema import load_json_config

    per_node = min(devices, cluster.devices_per_node)
    if devices % per_node:
        raise ValueError(f"--job: {devices} devices do not fill whole nodes of {cluster.devices_per_node}")
    output_dir = load_json_config(config_path).get("optimus", {}).get("train", {}).get("output_dir", "runs/mula")
    made_by = "python -m ds_optimus.plan " + " ".join(sys.argv[1:]) if sys.argv[1:] else "python -m ds_optimus.plan"
    spec = JobSpec(
        args.job,
        cluster.name,
        str(config_path),
        devices // per_node,
        per_node,
        output_dir,
        name=Path(config_path).stem[:15].rstrip("-_."),
        spares=args.spares,
        walltime=args.walltime,
        account=args.account,
        queue=args.queue,
        made_by=made_by,
    )
    return write_job(spec, Path(config_path).with_suffix(".pbs" if args.job == "pbs" else ".sbatch"))


def _local_ranks() -> int:
    """Ranks this machine can run: its accelerators, or on a CPU-only machine two per core."""
    import torch

    if torch.accelerator.is_available():  # CUDA, ROCm, XPU, ...
        return torch.accelerator.device_count()
    return 2 * (os.cpu_count() or 1)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _measure(args, plans, model) -> list[dict]:
    from .measure import MeasureError, measure_layout

    print(
        f"\nmeasuring {len(plans)} layouts on this machine, {args.measure_steps} steps each "
        f"(memory from the first 2, time from the rest):"
    )
    rows = []
    for i, plan in enumerate(plans, 1):
        print(f"  [{i}/{len(plans)}] {plan.layout.describe()} ...", flush=True)
        try:
            m = measure_layout(plan.layout, args.model, steps=args.measure_steps, memory_steps=2)
        except MeasureError as err:
            print(f"    failed: {err}")
            continue
        rows.append(
            {
                "layout": plan.layout.describe(),
                "predicted_peak_bytes": plan.memory.peak,
                "measured_peak_bytes": max(m.peak_bytes),
                "measured_peak_bytes_per_rank": m.peak_bytes,
                "predicted_step_s": plan.time.step,
                "measured_step_s": m.step_seconds,
            }
        )
    if not rows:
        return rows
    by_pred = sorted(range(len(rows)), key=lambda i: rows[i]["predicted_step_s"])
    by_meas = sorted(range(len(rows)), key=lambda i: rows[i]["measured_step_s"])
    for rank, i in enumerate(by_pred, 1):
        rows[i]["predicted_rank"] = rank
    for rank, i in enumerate(by_meas, 1):
        rows[i]["measured_rank"] = rank
    print("\n  layout                          peak MiB pred/meas (err)    step s pred/meas   rank pred/meas")
    for r in rows:
        err = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
        peaks = f"{r['predicted_peak_bytes'] / 2**20:7.1f} / {r['measured_peak_bytes'] / 2**20:7.1f}"
        print(
            f"  {r['layout']:30s}  {peaks} "
            f"({err:+.1%})   {r['predicted_step_s']:7.3f} / {r['measured_step_s']:7.3f}   "
            f"{r['predicted_rank']:4d} / {r['measured_rank']}"
        )
    return rows


def _evaluate_config(args, model, layout, cluster, best) -> dict:
    """Print --config's layout evaluated on the cluster: memory per stage, the step's parts, against the best."""
    plan = evaluate(model, layout, cluster, args.expert_imbalance)
    t, m = plan.time, plan.memory
    stages = (
        f" (stage {m.stage}; per stage {', '.join(f'{gib(x):.1f}' for x in m.stage_peaks)})" if m.stage_peaks else ""
    )
    fits = "fits" if plan.fits else f"does not fit the {gib(cluster.usable_bytes):.1f} usable"
    parts = {
        "compute": t.compute,
        "EP exchange": t.all_to_all,
        "gradient reduction": t.grad_reduce,
        "parameter gather": t.param_gather,
        "bubble": t.bubble,
        "stage sends": t.p2p,
        "fixed costs": t.overhead,
    }
    print(
        f"\n{args.config}: {layout.describe()}\n  peak {gib(m.peak):.1f} GiB{stages}, {fits}; step {t.step:.3g} s: "
        + ", ".join(f"{name} {value:.3g}" for name, value in parts.items() if value)
        + f"\n  {plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.1%}; row 1 is "
        f"{plan.time.step / best.time.step:.2f}x as fast"
    )
    return plan.as_dict()


def _shown(path) -> str:
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _nothing_fits(args, model, cluster, devices: int, global_batch: int, seq_len: int, options: dict) -> str:
    """Why nothing fits, in one line: the smallest peak any layout reaches against the usable memory,
    and the smallest device count (2x, 4x, ... 64x; the same global batch where it divides, else as many
    sequences per device) where one fits (the memory model alone: no step times)."""
    layout, peak = smallest_peak(model, cluster, devices, global_batch, seq_len, **options)
    usable = cluster.usable_bytes
    line = (
        f"no layout of {args.model} fits on {devices} x {cluster.device}: the smallest predicted peak is "
        f"{gib(peak):.1f} GiB per device ({layout.describe()}) against {gib(usable):.1f} GiB usable"
    )
    for factor in (2, 4, 8, 16, 32, 64):
        more = devices * factor
        batch = global_batch if global_batch % more == 0 else global_batch * factor  # else: as many per device
        print(f"(nothing fits on {devices}: trying {more} devices at {batch} sequences a step)", flush=True)
        found = smallest_peak(model, cluster, more, batch, seq_len, stop_below=usable, **options)
        if found is not None and found[1] <= usable:
            return f"{line}; {more} devices fit ({found[0].describe()}: --devices {more} --global-batch {batch})"
    fix = " or drop --no-pipeline" if args.no_pipeline else ""
    return f"{line}; none fits on up to {devices * 64} devices either: a smaller --seq-len or model{fix}"


def _scale(args, model, cluster, seq_len, global_batch, devices, options, report, fixed=None) -> int:
    try:
        first, last = (int(x) for x in args.scale.split(":"))
    except ValueError:
        raise ScalingError(f"--scale takes N:M (two device counts), got {args.scale!r}") from None
    counts = device_counts(first, last)
    per_device = global_batch / devices
    kind = (
        "strong scaling, global batch " + str(global_batch)
        if args.strong
        else f"weak scaling, {per_device:g} sequence{'' if per_device == 1 else 's'} per device per step"
    )
    print(f"scaling from {first} to {last} devices ({kind}):")
    points = scaling(
        model,
        cluster,
        counts,
        per_device,
        seq_len,
        weak=not args.strong,
        global_batch=global_batch,
        progress=lambda p: print(f"  {p.devices} devices: {p.tried} layouts", file=sys.stderr),
        **options,
    )
    print(format_scaling(points))
    report["scaling"] = _rows(points)
    others = ()
    if fixed is not None:
        if args.strong:
            raise ScalingError("--config scales its layout weakly (its batch per data-parallel rank); drop --strong")
        kept = scale_layout(model, cluster, fixed, counts, args.expert_imbalance)
        print(f"\n{args.config}'s layout at each count:")
        print(format_scaling(kept, "layout"))
        report["config_scaling"] = _rows(kept)
        others = ((f"{Path(args.config).stem}'s layout", kept),)
    if args.png:
        path = plot_scaling(
            points,
            args.png,
            f"{args.model} on {cluster.name}: {kind}",
            args.reference_efficiency,
            others=others,
            label="planner's best at each count" if others else "predicted",
        )
        print(f"wrote {path}")
    if args.write:
        _write_scaled(args, points, cluster)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _rows(points) -> list[dict]:
    return [
        {
            "devices": p.devices,
            "plan": p.plan.as_dict() if p.plan else None,
            "efficiency": e,
            "band": {
                "tokens_per_s": list(p.band) if p.band else None,
                "efficiency": [low, high],
                # the MFU scales with the tokens/s (the same layout, the same FLOPs a token)
                "mfu": [p.plan.mfu * b / p.tokens_per_s for b in p.band] if p.band and p.plan else None,
            },
        }
        for p, e, low, high in zip(
            points, efficiency(points), efficiency(points, 0), efficiency(points, 1), strict=True
        )
    ]


def _write_scaled(args, points, cluster) -> None:
    """--write with --scale: the best layout at each device count, as PATH with the count in its name."""
    target = Path(args.write)
    template = args.template
    for point in points:
        path = target.with_name(f"{target.stem}-{point.devices}{target.suffix or '.json'}")
        if point.plan is None:
            print(f"not written: {path} (no layout fits on {point.devices} devices)")
        else:
            written = write_config(layout_config(point.plan.layout, args.model, cluster, base=template), path)
            print(f"wrote {written} ({point.plan.layout.describe()})")


if __name__ == "__main__":
    sys.exit(main())

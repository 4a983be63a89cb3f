"""The layout planner held to measurements: every published or measured figure it can be run on with
the same layout and features, the planner's prediction beside it, and the error of each row. The
cluster constants are the built-in ones (`ds_optimus.plan.cluster`); nothing is fitted per row.

Rows:
  seed 220B     Mula-220B-A10B on Aurora, `ds_configs/mula-220b-a10b-aurora.json` as the seed ran it
                (DP x PP 8 x EP 12, all-gather exchange, MoE blocks, attention and norms recomputed,
                no hybrid sharding), weak scaling from 384 to 12,288 tiles: the seed reports 90 %
                (its paper, as ../shared/DESIGN.md gives it). The prediction is the middle of the
                band between minimal and adaptive routing across dragonfly groups, with both ends.
  H200 step     one GPU training 8 layers of the OLMoE-1B-7B shape (benchmarks/results/
                train_e2e_NVIDIA_H200.json): step time and peak memory, against the "h100" description
                (the H100 SXM's peak and SMs; the H200 has more and faster memory).
  Frontier      the Frontier study's dense 22B, 175B and 1T models (Dash et al., ISC 2024, arXiv
                2312.12705; presets frontier-22b/175b/1t) on the layouts of its authors' public
                Megatron-DeepSpeed launch scripts (TP x PP x DP, micro-batch 1, whole layers recomputed,
                ZeRO-1: here the sharded optimizer, as our pipeline needs it): the "GPU throughput" the
                paper reports (38.38 %, 36.14 %, 31.96 % of peak, Megatron's count, which adds the
                recomputed forward: 4/3 of the model FLOPs) against the predicted MFU x 4/3; and its
                weak-scaling claim (100 % for 175B to 1,024 GCDs and 1T to 3,072) against the predicted
                efficiency from the script's device count.
  CPU layouts   `python -m ds_optimus.plan --model mula-tiny-moe --cluster local --devices 2 --measure 4`
                run now: the four best layouts trained on this machine through the `deepspeed`
                launcher, step time and peak memory each (`--cpu-json FILE` reads an earlier run, or
                the CPU rows of an earlier plan_calibration.json).

    python benchmarks/plan_calibration.py [--cpu-json FILE]

Writes benchmarks/results/plan_calibration.json and prints the table docs/planner.md shows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
from common import write_result  # noqa: E402

SEED_EFFICIENCY = 0.90  # Mula-220B-A10B, 384 to 12,288 tiles (the seed's paper)


def seed_row() -> dict:
    from ds_optimus.plan import get_cluster
    from ds_optimus.plan.configs import layout_from_config
    from ds_optimus.plan.scaling import efficiency, scale_layout

    config = json.loads((ROOT / "ds_configs" / "mula-220b-a10b-aurora.json").read_text())
    model, layout = layout_from_config(config)
    points = scale_layout(model, get_cluster("aurora"), layout, [384, 12288])
    middle, low, high = (efficiency(points, end)[-1] for end in (None, 0, 1))
    return {
        "row": "Mula-220B-A10B on Aurora, the seed's layout, weak scaling 384 -> 12,288 tiles",
        "source": "the seed's paper (../shared/DESIGN.md): 90 %",
        "layout": layout.describe(),
        "quantity": "scaling efficiency",
        "measured": SEED_EFFICIENCY,
        "predicted": middle,
        "band": [low, high],
        "error": middle - SEED_EFFICIENCY,
        "error_kind": "points",
    }


# (preset, devices, TP, PP, global batch, sequence length, the paper's GPU throughput, weak-scaling target):
# the layouts of the study authors' launch scripts (launch_gpt22b/175b/1T_bf16.slurm)
FRONTIER = (
    ("frontier-22b", 16, 1, 8, 640, 2048, 0.3838, None),
    ("frontier-175b", 128, 4, 16, 640, 4096, 0.3614, 1024),
    ("frontier-1t", 1024, 4, 128, 1024, 2048, 0.3196, 3072),
)


def frontier_rows() -> list[dict]:
    from ds_optimus.plan import get_cluster
    from ds_optimus.plan.layout import Layout
    from ds_optimus.plan.model import ModelShape
    from ds_optimus.plan.scaling import efficiency, scale_layout
    from ds_optimus.plan.search import evaluate

    cluster, rows = get_cluster("frontier"), []
    source = "the Frontier study (arXiv 2312.12705)"
    for preset, devices, tp, pp, batch, seq, throughput, scaled in FRONTIER:
        model = ModelShape.from_preset(preset)
        dp = devices // (tp * pp)
        layout = Layout(
            world=devices,
            tp=tp,
            pp=pp,
            zero=1,
            sharded=True,
            micro=1,
            accumulation=batch // dp,
            checkpointing=True,
            seq_len=seq,
            dtype="bf16",
        )
        plan = evaluate(model, layout, cluster)
        counted = plan.mfu * 4 / 3  # as Megatron counts: the recomputed forward too
        name = preset.removeprefix("frontier-").upper()
        rows.append(
            {
                "row": f"{name} on {devices} MI250X GCDs, the study's script layout {layout.describe()}, "
                f"{seq:,}-token sequences: GPU throughput (MFU x 4/3; peak "
                f"{plan.memory.peak / 2**30:.1f} GiB)",
                "source": source,
                "layout": layout.describe(),
                "quantity": "throughput",
                "measured": throughput,
                "predicted": counted,
                "band": None,
                "error": counted - throughput,
                "error_kind": "points",
            }
        )
        if scaled:
            points = scale_layout(model, cluster, layout, [devices, scaled])
            middle, low, high = (efficiency(points, end)[-1] for end in (None, 0, 1))
            rows.append(
                {
                    "row": f"{name}, the same layout, weak scaling {devices:,} -> {scaled:,} GCDs",
                    "source": f"{source}: 100 %",
                    "layout": layout.describe(),
                    "quantity": "scaling efficiency",
                    "measured": 1.0,
                    "predicted": middle,
                    "band": [low, high],
                    "error": middle - 1.0,
                    "error_kind": "points",
                }
            )
    return rows


def gpu_rows() -> list[dict]:
    from summary import plan_check

    e2e = json.loads((ROOT / "benchmarks" / "results" / "train_e2e_NVIDIA_H200.json").read_text())
    check = plan_check(e2e)
    source = "benchmarks/results/train_e2e_NVIDIA_H200.json (ours)"
    rows = [
        {
            "row": "one H200, 8 layers of OLMoE-1B-7B, 2 x 4096 tokens, ZeRO-1: step time",
            "source": source,
            "layout": check["layout"],
            "quantity": "step s",
            "measured": check["measured_step_s"],
            "predicted": check["predicted_step_s"],
            "band": None,
            "error": check["predicted_step_s"] / check["measured_step_s"] - 1,
            "error_kind": "relative",
        }
    ]
    if check["measured_peak_bytes"]:
        rows.append(
            {
                "row": "the same run: peak memory",
                "source": source,
                "layout": check["layout"],
                "quantity": "peak GiB",
                "measured": check["measured_peak_bytes"] / 2**30,
                "predicted": check["predicted_peak_bytes"] / 2**30,
                "band": None,
                "error": check["predicted_peak_bytes"] / check["measured_peak_bytes"] - 1,
                "error_kind": "relative",
            }
        )
    return rows


def cpu_rows(path: str | None) -> list[dict]:
    if path is None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "measured.json"
            command = [
                sys.executable,
                "-m",
                "ds_optimus.plan",
                "--model",
                "mula-tiny-moe",
                "--cluster",
                "local",
                "--devices",
                "2",
                "--measure",
                "4",
                "--json",
                str(out),
            ]
            print("running:", " ".join(command[1:]), flush=True)
            subprocess.run(command, check=True, cwd=ROOT)
            measured = json.loads(out.read_text())["measured"]
    else:
        data = json.loads(Path(path).read_text())
        if "rows" in data:  # an earlier plan_calibration.json: its CPU rows as they were measured
            return [row for row in data["rows"] if row["source"].startswith("plan --measure")]
        measured = data["measured"]
    rows = []
    for m in measured:
        for quantity, pred, meas, scale in (
            ("step s", m["predicted_step_s"], m["measured_step_s"], 1),
            ("peak MiB", m["predicted_peak_bytes"], m["measured_peak_bytes"], 2**20),
        ):
            rows.append(
                {
                    "row": f"2 CPU ranks, mula-tiny-moe, {m['layout']}: {quantity.split()[0]}",
                    "source": "plan --measure, this machine",
                    "layout": m["layout"],
                    "quantity": quantity,
                    "measured": meas / scale,
                    "predicted": pred / scale,
                    "band": None,
                    "error": pred / meas - 1,
                    "error_kind": "relative",
                }
            )
    return rows


def _cell(value: float, quantity: str) -> str:
    return f"{value:.1%}" if quantity in ("scaling efficiency", "throughput") else f"{value:,.3g}"


def table(rows: list[dict]) -> str:
    lines = ["| measurement | source | measured | predicted (band) | error |", "|---|---|---|---|---|"]
    for r in rows:
        band = f" ({_cell(r['band'][0], r['quantity'])} – {_cell(r['band'][1], r['quantity'])})" if r["band"] else ""
        error = f"{100 * r['error']:+.1f} points" if r["error_kind"] == "points" else f"{r['error']:+.0%}"
        lines.append(
            f"| {r['row']} | {r['source']} | {_cell(r['measured'], r['quantity'])} | "
            f"{_cell(r['predicted'], r['quantity'])}{band} | {error} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-json",
        default=None,
        help="the JSON of an earlier `plan --measure` run, or an earlier plan_calibration.json",
    )
    args = parser.parse_args(argv)
    rows = [seed_row(), *frontier_rows(), *gpu_rows(), *cpu_rows(args.cpu_json)]
    print(table(rows))
    print(f"wrote {write_result('plan_calibration', {'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

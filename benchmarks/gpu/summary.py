"""The GPU battery's summary: every result under one folder against its target, the planner's
prediction for the end-to-end shape against what was measured, and one closing line.

    python benchmarks/gpu/summary.py OUT_DIR

Reads what `run_all.sh` leaves in OUT_DIR: `correctness.xml` (pytest -m gpu), `moe_kernels_*.json`,
`train_e2e.json`; writes `summary.json` and `plan_check.json` there. A step that did not run shows
as "not run" and its target as not met.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TARGETS = {  # what the battery is held to
    "kernels_fraction_of_dense_16k": 0.60,
    "kernels_vs_grouped_mm_16k": 1.3,
    "kernels_vs_grouped_mm_8k": 1.2,
    "e2e_vs_hf_trainer": 1.4,
    "e2e_vs_before": 1.71,
    "e2e_mfu": 0.35,
}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def correctness(out: Path) -> dict | None:
    path = out / "correctness.xml"
    if not path.exists():
        return None
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def kernels(out: Path) -> dict:
    """Per token count: the Triton layer's fraction of the dense rate and its speed over ours_grouped_mm."""
    found = sorted(p for p in out.glob("moe_kernels_*.json") if not p.name.startswith("moe_kernels_tuning_"))
    if not found:
        return {}
    data = json.loads(found[0].read_text())
    figures = {"gpu": data.get("machine", {}).get("gpu")}
    for tokens, result in data["results"].items():
        times = result["times"]
        if "ours_triton" not in times:
            continue
        triton = times["ours_triton"]
        figures[tokens] = {
            "fraction_of_dense": triton["fraction_of_dense"],
            "vs_grouped_mm": times["ours_grouped_mm"]["median_s"] / triton["median_s"]
            if "ours_grouped_mm" in times
            else None,
            "dense_tflops": times["dense"]["tflops"],
            "triton_tflops": triton["tflops"],
        }
    return figures


def plan_check(e2e: dict) -> dict | None:
    """The planner's step time and peak memory for ours' layout on one H100, against the measured."""
    ours = e2e["results"].get("ours")
    if ours is None:
        return None
    from ds_optimus.plan import Layout, ModelShape, evaluate, get_cluster

    shape = e2e["shape"]
    overrides = {
        k: v
        for k, v in shape.items()
        if k not in ("preset", "seq_len", "micro_batch", "dtype", "zero_stage", "processes")
    }
    model = ModelShape.from_preset(shape["preset"], **overrides)
    layout = Layout(
        world=1,
        ep=1,
        zero=1,
        sharded=True,
        micro=shape["micro_batch"],
        accumulation=1,
        seq_len=shape["seq_len"],
        dtype="bf16" if shape["dtype"] == "bf16" else "fp32",
    )
    plan = evaluate(model, layout, get_cluster("h100"))
    measured_peak = ours.get("peak_bytes")
    return {
        "layout": layout.describe(),
        "predicted_step_s": plan.time.step,
        "measured_step_s": ours["step_seconds"],
        "step_ratio": ours["step_seconds"] / plan.time.step,
        "predicted_peak_bytes": plan.memory.peak,
        "measured_peak_bytes": measured_peak,
        "peak_ratio": measured_peak / plan.memory.peak if measured_peak else None,
    }


def _fmt(value, kind: str) -> str:
    if value is None:
        return "not run"
    return f"{value:.0%}" if kind == "%" else f"{value:.2f}x"


def summarize(out: Path) -> tuple[list[tuple[str, str, str, bool]], str, dict]:
    """(rows of (figure, value, target, met), the closing line, everything as a dict)."""
    tests = correctness(out)
    k = kernels(out)
    e2e = _load(out / "train_e2e.json")
    k16, k8 = k.get("16384", {}), k.get("8192", {})
    res = (e2e or {}).get("results", {})
    ours = res.get("ours", {})
    figures = {
        "kernels_fraction_of_dense_16k": k16.get("fraction_of_dense"),
        "kernels_vs_grouped_mm_16k": k16.get("vs_grouped_mm"),
        "kernels_vs_grouped_mm_8k": k8.get("vs_grouped_mm"),
        "e2e_vs_hf_trainer": ours.get("vs_hf_trainer"),
        "e2e_vs_before": ours.get("vs_before"),
        "e2e_mfu": ours.get("mfu"),
    }
    labels = {
        "kernels_fraction_of_dense_16k": ("Triton fwd+bwd at 16k tokens, of the dense bf16 rate", "%"),
        "kernels_vs_grouped_mm_16k": ("Triton over ours on grouped_mm, 16k tokens", "x"),
        "kernels_vs_grouped_mm_8k": ("Triton over ours on grouped_mm, 8k tokens", "x"),
        "e2e_vs_hf_trainer": ("end-to-end tokens/s over Trainer + OLMoE", "x"),
        "e2e_vs_before": ("end-to-end tokens/s over the before run", "x"),
        "e2e_mfu": ("end-to-end MFU", "%"),
    }
    rows = []
    if tests is None:
        rows.append(("correctness (pytest -m gpu)", "not run", "all pass", False))
    else:
        ok = tests["failures"] == tests["errors"] == 0 and tests["passed"] > 0
        rows.append(
            (
                "correctness (pytest -m gpu)",
                f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, {tests['skipped']} skipped",
                "all pass",
                ok,
            )
        )
    for key, (label, kind) in labels.items():
        value, target = figures[key], TARGETS[key]
        rows.append(
            (
                label,
                _fmt(value, kind),
                (f">= {target:.0%}" if kind == "%" else f">= {target}x"),
                value is not None and value >= target,
            )
        )
    check = plan_check(e2e) if e2e else None
    if check:
        rows.append(("planner: measured / predicted step time", f"{check['step_ratio']:.2f}", "report", True))
        if check["peak_ratio"] is not None:
            rows.append(("planner: measured / predicted peak memory", f"{check['peak_ratio']:.2f}", "report", True))

    def part(value, kind):
        return "-" if value is None else (f"{value * 100:.0f} %" if kind == "%" else f"{value:.2f}x")

    line = (
        f"gpu battery: kernels {part(figures['kernels_fraction_of_dense_16k'], '%')} of dense "
        f"({part(figures['kernels_vs_grouped_mm_16k'], 'x')} grouped_mm), "
        f"e2e {part(figures['e2e_vs_hf_trainer'], 'x')} Trainer+OLMoE, MFU {part(figures['e2e_mfu'], '%')}"
    )
    everything = {
        "correctness": tests,
        "kernels": k,
        "figures": figures,
        "targets": TARGETS,
        "met": {key: figures[key] is not None and figures[key] >= TARGETS[key] for key in TARGETS},
        "plan_check": check,
        "line": line,
        "e2e_not_run": (e2e or {}).get("not_run"),
        "gpu": k.get("gpu"),
    }
    return rows, line, everything


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python benchmarks/gpu/summary.py OUT_DIR (the folder run_all.sh wrote)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    rows, line, everything = summarize(out)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{width}}  {'value':>28}  {'target':>9}  met")
    for label, value, target, met in rows:
        print(f"{label:<{width}}  {value:>28}  {target:>9}  {'yes' if met else 'NO'}")
    (out / "summary.json").write_text(json.dumps(everything, indent=2) + "\n")
    if everything["plan_check"]:
        (out / "plan_check.json").write_text(json.dumps(everything["plan_check"], indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

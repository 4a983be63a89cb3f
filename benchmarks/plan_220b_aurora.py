"""Mula-220B-A10B on Aurora, term by term: the seed's layout as it ran (`ds_configs/mula-220b-a10b-aurora.json`)
against the planner's best at 3,072 and 12,288 tiles, and what each of this library's features adds,
one at a time from the seed's layout at 12,288 tiles. Each step time is the middle of the band
between minimal and adaptive routing across dragonfly groups (`ds_optimus.plan.cluster`), with both
ends. Arithmetic only (the planner's models), no run.

    python benchmarks/plan_220b_aurora.py

Prints the two markdown tables of docs/planner.md and writes benchmarks/results/plan_220b_aurora_terms.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_result  # noqa: E402

from ds_optimus.plan import get_cluster  # noqa: E402
from ds_optimus.plan.configs import layout_from_config  # noqa: E402
from ds_optimus.plan.search import evaluate  # noqa: E402


def seed_layout():
    config = json.loads((ROOT / "ds_configs" / "mula-220b-a10b-aurora.json").read_text())
    return layout_from_config(config)


def best_layout(devices: int):
    """The planner's best at `devices` tiles, from the committed scaling report (docs/planner.md's run)."""
    from ds_optimus.plan.layout import Layout

    report = json.loads((ROOT / "benchmarks" / "results" / "plan_mula-220b-a10b_aurora.json").read_text())
    for row in report["scaling"]:
        if row["devices"] == devices:
            return Layout(**row["plan"]["layout"])
    raise SystemExit(f"no {devices}-tile row in the scaling report")


def band(model, layout, cluster) -> tuple[float, float, float]:
    return tuple(
        evaluate(model, layout, replace(cluster, routing=r)).time.step for r in ("middle", "minimal", "adaptive")
    )


def terms(model, layout, cluster) -> dict:
    plan = evaluate(model, layout, cluster)
    t = plan.time
    return {
        "layout": layout.describe(),
        "fits": plan.fits,
        "peak_gib": plan.memory.peak / 2**30,
        "step": band(model, layout, cluster),
        "compute": t.compute,
        "experts": t.experts,
        "all_to_all": t.all_to_all,
        "all_to_all_hidden": t.all_to_all_hidden,
        "bubble": t.bubble,
        "p2p": t.p2p,
        "grad_reduce": t.grad_reduce,
        "param_gather": t.param_gather,
        "overhead": t.overhead,
        "mfu": plan.mfu,
        "tokens_per_s_per_tile": plan.tokens_per_s / layout.world,
    }


def main() -> int:
    cluster = get_cluster("aurora")
    model, seed = seed_layout()
    columns = {
        "seed, 3,072": (seed.with_(world=3072)),
        "seed, 12,288": seed.with_(world=12288),
        "best, 3,072": best_layout(3072),
        "best, 12,288": best_layout(12288),
    }
    rows = {name: terms(model, layout, cluster) for name, layout in columns.items()}
    print("| | " + " | ".join(rows) + " |")
    print("|---" * (len(rows) + 1) + "|")

    def line(label, fmt):
        print(f"| {label} | " + " | ".join(fmt(r) for r in rows.values()) + " |")

    line("layout", lambda r: f"`{r['layout']}`")
    line("peak per tile (largest stage)", lambda r: f"{r['peak_gib']:.1f} GiB")
    line(
        "step (band: minimal to adaptive routing)",
        lambda r: f"{r['step'][0]:.2f} s ({r['step'][1]:.2f}-{r['step'][2]:.2f})",
    )
    line("compute (the experts' part)", lambda r: f"{r['compute']:.2f} s ({r['experts']:.2f})")
    line("EP exchange exposed (hidden)", lambda r: f"{r['all_to_all']:.2f} s ({r['all_to_all_hidden']:.2f})")
    line("pipeline bubble + sends", lambda r: f"{r['bubble']:.2f} + {r['p2p']:.2f} s")
    line("gradient reduction exposed", lambda r: f"{r['grad_reduce']:.2f} s")
    line("parameter gather exposed", lambda r: f"{r['param_gather']:.2f} s")
    line("fixed costs", lambda r: f"{r['overhead']:.2f} s")
    line("MFU", lambda r: f"{r['mfu']:.1%}")
    line("tokens/s per tile", lambda r: f"{r['tokens_per_s_per_tile']:.0f}")

    # one feature at a time, from the seed's layout at 12,288 tiles, each kept
    steps = [
        ("the seed's layout", {}),
        ("bf16 gradients on the wire (fp32 sums in the buckets)", {"reduce_dtype": "bf16"}),
        ("4 virtual stages per rank, interleaved 1F1B", {"schedule": "interleaved_1f1b", "virtual_stages": 4}),
        ("the zero-bubble schedule", {"schedule": "interleaved_zb"}),
        ("the norms alone recomputed", {"checkpointing": ("norms",)}),
        (
            "the deduplicated all-to-all in 4 chunks for the allgather",
            {"dispatch": "alltoall", "dedup": True, "chunks": 4},
        ),
        ("EP 24 over two nodes, hierarchical", {"ep": 24, "hierarchical": True}),
        ("the parameter gather under the next forward", {"gather_overlap": True}),
        ("shard groups of 4 tiles (hybrid sharding)", {"shard_group": 4}),
    ]
    layout, base, ladder = seed.with_(world=12288), None, []
    print("\n| change (kept from the row above) | step s (band) | MFU | peak GiB | x the seed's |")
    print("|---|---|---|---|---|")
    for label, change in steps:
        layout = layout.with_(**change)
        plan = evaluate(model, layout, cluster)
        mid, low, high = band(model, layout, cluster)
        base = base or mid
        ladder.append(
            {
                "change": label,
                "layout": layout.describe(),
                "step": [mid, low, high],
                "mfu": plan.mfu,
                "peak_gib": plan.memory.peak / 2**30,
                "fits": plan.fits,
            }
        )
        fits = "" if plan.fits else " (does not fit)"
        print(
            f"| {label} | {mid:.2f} ({low:.2f}-{high:.2f}) | {plan.mfu:.1%} | {plan.memory.peak / 2**30:.1f}{fits} | "
            f"{base / mid:.2f} |"
        )
    print(f"wrote {write_result('plan_220b_aurora_terms', {'columns': rows, 'ladder': ladder})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The layout planner's predictions against real runs on this machine.

Memory: each layout of a matrix (1, 2 and 4 processes; ZeRO 0, 1 and 2 through the EP-aware sharded
optimizer and through DeepSpeed's own; EP 1, 2 and 4; accumulation and activation checkpointing)
trains `mula-tiny-moe` for a few steps through the deepspeed launcher and `ds_optimus.train`, with
the per-rank tensor memory recorded (`optimus.train.measure_memory_steps`). Every rank's peak is
compared with the planner's prediction.

Time: for each tiny preset, layouts of 2 ranks (what the search ranks for `--devices 2` on a
2-core machine) and one global batch (16 x 128 tokens), differing in EP, micro-batch and
accumulation, optimizer and ZeRO stage, and activation checkpointing, run in interleaved rounds;
the median step time of each is ranked against the predicted ranking.

    python benchmarks/plan_validation.py [--rounds 4] [--steps 10] [--skip-memory] [--skip-ranking]

Results: benchmarks/results/plan_memory_cpu.json and plan_ranking_cpu.json.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from ds_optimus.plan import Layout, ModelShape, estimate_memory, evaluate, local_cluster  # noqa: E402
from ds_optimus.plan.measure import measure_layout  # noqa: E402

PRESET = "mula-tiny-moe"
BASE = dict(seq_len=128, dtype="fp32", overlap_comm=False)

MEMORY_MATRIX = [
    dict(world=1, ep=1, zero=0, sharded=False, micro=8),
    dict(world=1, ep=1, zero=1, micro=8),
    dict(world=2, ep=1, zero=2, micro=8),
    dict(world=2, ep=2, zero=1, micro=8),
    dict(world=2, ep=2, zero=0, sharded=False, micro=8),
    dict(world=2, ep=1, zero=1, sharded=False, micro=8, bucket_size=5_000_000),
    dict(world=2, ep=2, zero=2, sharded=False, micro=8, bucket_size=5_000_000),
    dict(world=2, ep=2, zero=2, micro=4, accumulation=2),
    dict(world=4, ep=4, zero=2, micro=8),
    dict(world=4, ep=2, zero=1, micro=8, checkpointing=True),
    dict(world=4, ep=4, zero=1, micro=4, accumulation=2),
    dict(world=4, ep=1, zero=0, sharded=False, micro=8),
]

# Layouts the search ranks for `--devices 2` on this 2-core machine (one global batch of 16 x 128).
RANKING = {
    "mula-tiny-moe": [
        dict(world=2, ep=1, zero=1, micro=8),
        dict(world=2, ep=2, zero=1, micro=8),
        dict(world=2, ep=1, zero=1, micro=8, checkpointing=True),
        dict(world=2, ep=1, zero=2, micro=1, accumulation=8),
        dict(world=2, ep=2, zero=1, micro=2, accumulation=4),
    ],
    "mula-tiny-dense": [
        dict(world=2, zero=1, micro=8),
        dict(world=2, zero=0, sharded=False, micro=8),
        dict(world=2, zero=1, micro=8, checkpointing=True),
        dict(world=2, zero=2, micro=1, accumulation=8),
        dict(world=2, zero=1, micro=4, accumulation=2),
    ],
}


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs)
    return score / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the ranking set")
    parser.add_argument("--steps", type=int, default=10, help="steps per ranking run (2 profiled, not timed)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-ranking", action="store_true")
    args = parser.parse_args()
    model = ModelShape.from_preset(PRESET)
    result: dict = {"preset": PRESET}

    if not args.skip_memory:
        rows = []
        print("memory: predicted peak against every rank's measured peak (MiB)")
        for spec in MEMORY_MATRIX:
            layout = Layout(**{**BASE, **spec})
            began = time.perf_counter()
            m = measure_layout(layout, PRESET, steps=3, memory_steps=2)
            est = estimate_memory(model, layout)
            errors = [est.peak / peak - 1 for peak in m.peak_bytes]
            worst = max(errors, key=abs)
            rows.append(
                {
                    "layout": layout.describe(),
                    "spec": spec,
                    "predicted_bytes": est.peak,
                    "predicted": est.as_dict(),
                    "measured_bytes": m.peak_bytes,
                    "initialized_bytes": m.initialized_bytes,
                    "worst_error": worst,
                }
            )
            print(
                f"  {layout.describe():32s} predicted {est.peak / 2**20:6.1f}  measured "
                f"{', '.join(f'{b / 2**20:.1f}' for b in m.peak_bytes):36s} worst {worst:+.1%}  "
                f"({time.perf_counter() - began:.0f} s)",
                flush=True,
            )
        result["memory"] = rows
        result["memory_worst_error"] = max((abs(r["worst_error"]) for r in rows), default=0.0)
        print(
            f"worst error over {sum(len(r['measured_bytes']) for r in rows)} ranks: {result['memory_worst_error']:.1%}"
        )
        print(f"wrote {write_result('plan_memory_cpu', result)}")

    if not args.skip_ranking:
        cluster = local_cluster()
        print(f"\nranking: {cluster.notes}; {args.rounds} interleaved rounds, {args.steps} steps each")
        result = {
            "preset": PRESET,
            "ranking": {"cluster": cluster.to_json(), "rounds": args.rounds, "steps": args.steps, "presets": {}},
        }
        runs = [
            (preset, i, Layout(**{**BASE, **spec})) for preset, specs in RANKING.items() for i, spec in enumerate(specs)
        ]
        times: dict[tuple[str, int], list[float]] = {(preset, i): [] for preset, i, _ in runs}
        for round_ in range(args.rounds):
            shift = round_ * 3 % len(runs)
            for preset, i, layout in runs[shift:] + runs[:shift]:
                m = measure_layout(layout, preset, steps=args.steps, memory_steps=2)
                times[preset, i].append(m.step_seconds)
            print(f"  round {round_ + 1}: " + ", ".join(f"{times[p, i][-1]:.3f}" for p, i, _ in runs), flush=True)
        for preset, specs in RANKING.items():
            model = ModelShape.from_preset(preset)
            layouts = [Layout(**{**BASE, **spec}) for spec in specs]
            predicted = [evaluate(model, layout, cluster).time.step for layout in layouts]
            measured = [statistics.median(times[preset, i]) for i in range(len(layouts))]
            tau = kendall_tau(predicted, measured)
            pairs = [
                (i, j)
                for i, j in itertools.combinations(range(len(layouts)), 2)
                if max(predicted[i], predicted[j]) / min(predicted[i], predicted[j]) > 1.15
            ]
            agree = sum(1 for i, j in pairs if (predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0)
            pred_rank = {i: r for r, i in enumerate(sorted(range(len(layouts)), key=predicted.__getitem__), 1)}
            meas_rank = {i: r for r, i in enumerate(sorted(range(len(layouts)), key=measured.__getitem__), 1)}
            print(f"\n  {preset:32s} {'predicted s':>11s} {'measured s':>10s}  rank pred/meas")
            for i, layout in enumerate(layouts):
                print(
                    f"  {layout.describe():32s} {predicted[i]:11.3f} {measured[i]:10.3f}  "
                    f"{pred_rank[i]:4d} / {meas_rank[i]}"
                )
            print(
                f"  Kendall tau {tau:.2f}; pairs predicted more than 15 % apart ordered the same: {agree}/{len(pairs)}"
            )
            result["ranking"]["presets"][preset] = {
                "layouts": [lay.describe() for lay in layouts],
                "predicted_s": predicted,
                "measured_s": measured,
                "measured_rounds_s": [times[preset, i] for i in range(len(layouts))],
                "kendall_tau": tau,
                "clear_pairs": len(pairs),
                "clear_pairs_agreeing": agree,
            }
        print(f"wrote {write_result('plan_ranking_cpu', result)}")


if __name__ == "__main__":
    main()

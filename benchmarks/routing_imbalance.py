"""How unevenly a trained router spreads tokens over expert-parallel ranks: the figure the layout
planner multiplies the experts' compute and exchange by (the busiest rank sets the pace).

A small Mula with the routing of Mula-220B-A10B (240 experts, top-8, softmax scores; hidden 128, 4
layers) trains on the embedded corpus through `ds_optimus.train` (the `deepspeed` launcher, 1 CPU
process) with the Mula (OLMoE) recipe's balancing: the load-balancing loss at 0.01. (The
auxiliary-loss-free bias is made for sigmoid scores: added to softmax scores of 240 experts, about
1/240 each, a step of 1e-3 already overshoots and the loads oscillate; a run with it measured an
expert-load spread of 2.8.) Every step's tokens per expert and layer come from its `metrics.jsonl` (`expert_tokens`).
Over the second half of the run (the router settled), for each expert-parallel size R that divides
the experts (k = 240 / R consecutive experts a rank), each step's and layer's imbalance is the
busiest rank's tokens over the mean; the report gives their mean and 90th percentile, beside the
planner's approximation from the per-expert spread alone: 1 + c * sqrt(2 ln R) / sqrt(k), c the
coefficient of variation of the experts' loads (the largest of R near-normal rank loads).

    python benchmarks/routing_imbalance.py [--steps 200] [--router aux-free]

`--router aux-free` trains with the auxiliary-loss-free bias on sigmoid scores instead (DeepSeek-V3's
recipe: bias step 1e-3, no balancing loss). Writes benchmarks/results/routing_imbalance_cpu.json
(`_aux_free` added for that router); both report the spread a uniform random router would show with
as many slots an expert (the sampling floor). A CPU-sized router (hidden 128, 68 slots per
expert and step) concentrates its load far more than a large model's: the figures bound what a
collapsed router costs, and the layout planner does not take them as its default (docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import launch_deepspeed, write_result  # noqa: E402

EXPERTS, TOP_K = 240, 8


# the two balancing recipes: the Mula (OLMoE) one, and DeepSeek-V3's auxiliary-loss-free bias on sigmoid
# scores (bias step 1e-3, their update rate) with no load-balancing loss
ROUTERS = {
    "loss": {"router_aux_loss_coef": 0.01},
    "aux-free": {"router_scoring_func": "sigmoid", "router_bias_update_rate": 1e-3, "router_aux_loss_coef": 0.0},
}


def config(work: Path, steps: int, router: str = "loss") -> dict:
    base = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    base.pop("train_batch_size", None)
    base.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    base["optimus"].update(
        expert_parallel={"size": 1},
        model={
            "preset": "mula-tiny-moe",
            "overrides": {
                "num_experts": EXPERTS,
                "num_experts_per_tok": TOP_K,
                "moe_intermediate_size": 32,
                **ROUTERS[router],
            },
        },
        data={"sources": ["embedded"], "seq_len": 256, "val_fraction": 0.02, "cache_dir": str(work / "cache")},
        train={
            "steps": steps,
            "output_dir": str(work / "run"),
            "eval_interval": 0,
            "log_interval": 1,
            "sample_tokens": 0,
            "export": False,
            "warmup_steps": 10,
        },
        checkpoint={"enabled": False, "resume": False},
        wandb={"mode": "disabled"},
    )
    return base


def imbalance(rows: list[list[int]], ranks: int) -> list[float]:
    """Busiest rank's tokens over the mean, per layer row, with experts split into `ranks` runs."""
    out = []
    for row in rows:
        k = len(row) // ranks
        loads = [sum(row[r * k : (r + 1) * k]) for r in range(ranks)]
        out.append(max(loads) / (sum(loads) / ranks))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--router",
        choices=sorted(ROUTERS),
        default="loss",
        help="loss: the load-balancing loss at 0.01 (softmax); aux-free: the sigmoid router's bias",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = work / "config.json"
        path.write_text(json.dumps(config(work, args.steps, args.router)))
        print(f"training {args.steps} steps of a {EXPERTS}-expert top-{TOP_K} model ...", flush=True)
        launch_deepspeed(["--module", "ds_optimus.train", "--config", str(path)], work, gpus=1)
        records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "expert_tokens" in r]
    late = [r for r in steps if r["step"] > args.steps // 2]
    rows = [row for r in late for row in r["expert_tokens"]]
    cvs = [statistics.pstdev(row) / statistics.fmean(row) for row in rows]
    c = statistics.fmean(cvs)
    per_ep = {}
    print(f"steps {late[0]['step']}-{late[-1]['step']}, {len(rows)} layer rows; expert-load CV c = {c:.3f}")
    print(f"{'EP ranks':>8} {'experts/rank':>12} {'mean':>7} {'p90':>7} {'model':>7}")
    for ranks in [r for r in range(2, EXPERTS + 1) if EXPERTS % r == 0 and r <= 48]:
        values = sorted(imbalance(rows, ranks))
        k = EXPERTS // ranks
        model = 1 + c * math.sqrt(2 * math.log(ranks)) / math.sqrt(k)
        entry = {
            "experts_per_rank": k,
            "mean": statistics.fmean(values),
            "p90": values[int(0.9 * (len(values) - 1))],
            "model": model,
        }
        per_ep[ranks] = entry
        print(f"{ranks:>8} {k:>12} {entry['mean']:>7.3f} {entry['p90']:>7.3f} {model:>7.3f}")
    first_cv = statistics.fmean(statistics.pstdev(row) / statistics.fmean(row) for row in steps[0]["expert_tokens"])
    slots = statistics.fmean(sum(row) for row in rows) / EXPERTS
    print(
        f"{slots:.0f} token slots an expert and layer row: uniform random routing alone gives c = "
        f"{math.sqrt(1 / slots):.3f}"
    )
    payload = {
        "router": args.router,
        "recipe": ROUTERS[args.router],
        "experts": EXPERTS,
        "top_k": TOP_K,
        "steps": args.steps,
        "slots_per_expert": slots,
        "sampling_cv": math.sqrt(1 / slots),
        "late_steps": [late[0]["step"], late[-1]["step"]],
        "expert_load_cv": c,
        "expert_load_cv_first_step": first_cv,
        "per_ep": per_ep,
    }
    name = "routing_imbalance_cpu" + ("" if args.router == "loss" else "_" + args.router.replace("-", "_"))
    print(f"wrote {write_result(name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What `optimus.train.compile` costs and gains: `python -m ds_optimus.train` on one process, eager
against every decoder layer compiled with `torch.compile`, on the same shape, data and config.

Rounds alternate the two (a fresh process each, so every compiled run pays its compilation); per
run, the first step's seconds (compilation included) and the median step after `--warmup` steps;
the figures are medians over rounds. On a machine with a GPU the entry point runs there (add
`--bf16` for bfloat16).

    python benchmarks/compile_layers.py [--steps 30] [--warmup 5] [--repeats 3] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    intermediate_size=512,
)
SEQ_LEN, MICRO_BATCH = 256, 8


def ds_config(work: Path, name: str, steps: int, compile_: bool, bf16: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "optimus": {
            "model": {"preset": "mula-tiny-moe", "overrides": SHAPE},
            "sharded_optimizer": {"enabled": True},
            "data": {"sources": ["embedded"], "seq_len": SEQ_LEN, "cache_dir": str(work / "cache")},
            "train": {
                "steps": steps,
                "output_dir": str(work / name),
                "eval_interval": 0,
                "eval_batches": 1,
                "sample_tokens": 0,
                "warmup_steps": 2,
                "compile": compile_,
            },
            "checkpoint": {"interval": 0, "resume": False},
            "wandb": {"mode": "disabled"},
        },
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def run(work: Path, name: str, steps: int, compile_: bool, bf16: bool) -> list[float]:
    """One fresh run; its per-step seconds."""
    config = ds_config(work, name, steps, compile_, bf16)
    shutil.rmtree(work / name, ignore_errors=True)
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "ds_optimus.train", "--config", str(path)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((work / name / "summary.json").read_text())
    return [summary["step_seconds"][k] for k in sorted(summary["step_seconds"], key=int)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and the configs, run nothing")
    args = parser.parse_args()
    if args.steps <= args.warmup + 1 or args.repeats < 1:
        parser.error("--steps must exceed --warmup + 1 and --repeats must be >= 1")
    from ds_optimus.config import OptimusConfig

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for compile_ in (False, True):  # the configs parse before anything runs
            OptimusConfig.from_ds_config(ds_config(work, "check", args.steps, compile_, args.bf16))
        if args.dry_run:
            print("compile_layers: configs valid; nothing run (--dry-run)")
            return 0
        first: dict[str, list[float]] = {"eager": [], "compiled": []}
        steady: dict[str, list[float]] = {"eager": [], "compiled": []}
        for round_ in range(args.repeats):
            for name in ("eager", "compiled"):
                seconds = run(work, name, args.steps, name == "compiled", args.bf16)
                first[name].append(seconds[0])
                steady[name].append(statistics.median(seconds[args.warmup :]))
                print(
                    f"round {round_ + 1}: {name:8s} first step {seconds[0]:7.2f} s, "
                    f"median step {steady[name][-1] * 1e3:8.1f} ms",
                    flush=True,
                )
    figures = {
        name: {"first_step_s": statistics.median(first[name]), "median_step_s": statistics.median(steady[name])}
        for name in first
    }
    speedup = figures["eager"]["median_step_s"] / figures["compiled"]["median_step_s"]
    cost = figures["compiled"]["first_step_s"] - figures["eager"]["first_step_s"]
    print(f"\n{'':10s} {'first step s':>13s} {'median step ms':>15s}")
    for name, f in figures.items():
        print(f"{name:10s} {f['first_step_s']:13.2f} {f['median_step_s'] * 1e3:15.1f}")
    print(
        f"compiled/eager step time: {1 / speedup:.3f} (speed-up {speedup:.3f}x); compilation costs "
        f"{cost:.1f} s once per process"
    )
    path = write_result(
        "compile_layers_" + ("bf16" if args.bf16 else "fp32"),
        {
            "shape": {**SHAPE, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH},
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "figures": figures,
            "speedup": speedup,
            "compile_cost_s": cost,
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput on CPU: `ds_optimus.train` against Transformers' `Trainer` training
`OlmoeForCausalLM` of the same shape with the same DeepSpeed config (ZeRO-1, float32, the same
batch, sequence length and packed tokens), both through the `deepspeed` launcher with 2 processes.

Contestants, run in turn (interleaved) for `--repeats` rounds of `--steps` steps each:
  ours_ep1   python -m ds_optimus.train, data parallel only
  ours_ep2   the same with expert parallelism 2
  hf_trainer Trainer + OlmoeForCausalLM (Transformers' default experts implementation: grouped_mm
             with PyTorch >= 2.9)
  hf_trainer_eager  the same with experts_implementation="eager" (Transformers' loop over experts)
Tokens/s is from the median step time after `--warmup` steps; the figure is the median over rounds.

    python benchmarks/train_throughput.py [--steps 30] [--warmup 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_deepspeed, write_result  # noqa: E402

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
    max_position_embeddings=1024,
    pad_token_id=0,
    eos_token_id=1,
)
SEQ_LEN, MICRO_BATCH = 256, 8


def ds_config(work: Path, ep: int, steps: int) -> dict:
    return {
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
            "model": {"preset": "mula-tiny-moe", "overrides": {**SHAPE, "intermediate_size": 512}},
            "expert_parallel": {"size": ep},
            "data": {
                "sources": ["embedded"],
                "seq_len": SEQ_LEN,
                "val_fraction": 0.02,
                "cache_dir": str(work / "cache"),
            },
            "train": {
                "steps": steps,
                "output_dir": str(work / f"ours_ep{ep}"),
                "eval_interval": 0,
                "eval_batches": 1,
                "sample_tokens": 0,
                "warmup_steps": 2,
            },
            "checkpoint": {"interval": 0, "resume": False},
            "wandb": {"mode": "disabled"},
        },
    }


def launch(args: list[str], work: Path) -> None:
    launch_deepspeed(args, work, gpus=2)


def run_ours(work: Path, ep: int, steps: int) -> list[float]:
    config = ds_config(work, ep, steps)
    shutil.rmtree(config["optimus"]["train"]["output_dir"], ignore_errors=True)  # a fresh run each round
    path = work / f"ours_ep{ep}.json"
    path.write_text(json.dumps(config))
    launch(["--module", "ds_optimus.train", "--config", str(path)], work)
    records = [json.loads(line) for line in (work / f"ours_ep{ep}" / "metrics.jsonl").read_text().splitlines()]
    return [r["step_seconds"] for r in records if "step_seconds" in r]


def run_trainer(work: Path, steps: int, data: Path, impl: str | None = None) -> tuple[list[float], str | None]:
    from transformers import OlmoeConfig

    config = ds_config(work, 1, steps)
    path = work / "hf.json"
    path.write_text(json.dumps(config))
    olmoe = OlmoeConfig(**SHAPE, intermediate_size=SHAPE["moe_intermediate_size"], norm_topk_prob=False)
    out = work / "hf_times.json"
    launch(
        [
            str(ROOT / "benchmarks" / "_trainer_baseline.py"),
            "--config",
            str(path),
            "--model",
            json.dumps(olmoe.to_diff_dict()),
            "--data",
            str(data),
            "--seq-len",
            str(SEQ_LEN),
            "--steps",
            str(steps),
            "--out",
            str(out),
            *(["--experts-implementation", impl] if impl else []),
        ],
        work,
    )
    result = json.loads(out.read_text())
    return result["step_seconds"], result.get("experts_implementation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated contestants (default: all)")
    args = parser.parse_args()
    tokens_per_step = MICRO_BATCH * 2 * SEQ_LEN
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # tokenize once (the first run of ours builds the cache the baseline reads too)
        run_ours(work, 1, 2)
        data = next(p for p in (work / "cache").iterdir() if (p / "meta.json").exists())
        names = args.only.split(",") if args.only else ["ours_ep1", "ours_ep2", "hf_trainer", "hf_trainer_eager"]
        rounds: dict[str, list[float]] = {name: [] for name in names}
        impl = None
        for r in range(args.repeats):
            for name in rounds:
                if name == "hf_trainer":
                    times, impl = run_trainer(work, args.steps, data)
                elif name == "hf_trainer_eager":
                    times, _ = run_trainer(work, args.steps, data, "eager")
                else:
                    times = run_ours(work, int(name[-1]), args.steps)
                step = statistics.median(times[args.warmup :])
                rounds[name].append(tokens_per_step / step)
                print(f"round {r + 1}: {name:<11} {tokens_per_step / step:9.0f} tokens/s", flush=True)
    results = {
        name: {"tokens_per_s_median": statistics.median(v), "tokens_per_s_rounds": v} for name, v in rounds.items()
    }
    if "hf_trainer" not in results:
        return
    base = results["hf_trainer"]["tokens_per_s_median"]
    print(f"\n{'contestant':<12}{'tokens/s':>10}{'vs Trainer+OLMoE':>18}")
    for name, v in results.items():
        v["speedup_vs_hf_trainer"] = v["tokens_per_s_median"] / base
        print(f"{name:<12}{v['tokens_per_s_median']:>10.0f}{v['speedup_vs_hf_trainer']:>17.2f}x")
    write_result(
        "train_throughput_cpu",
        {
            "shape": {
                **SHAPE,
                "seq_len": SEQ_LEN,
                "micro_batch": MICRO_BATCH,
                "processes": 2,
                "zero_stage": 1,
                "dtype": "float32",
            },
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "hf_experts_implementation": impl,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()

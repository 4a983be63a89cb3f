"""End-to-end training on one GPU: ds_optimus against the peers, in one run, same shape, data and
DeepSpeed config.

The model is OLMoE-1B-7B-shaped (`mula-7b-a1b`: hidden 2048, 64 experts of 1024, top-8, vocabulary
50304) with `--layers` decoder layers (16 is the whole model; fewer where it does not fit), trained on
sequences of `--seq-len` tokens from the embedded corpus, `--micro` sequences per step, bf16, ZeRO
stage 1. Contestants, each through its real entry point and the `deepspeed` launcher, in turn for
`--repeats` rounds:

  ours        python -m ds_optimus.train: the EP-aware sharded optimizer, experts backend "auto"
              (the Triton kernels on a GPU)
  before      the same run with DeepSpeed's own ZeRO optimizer and the reference experts path (one
              matmul pair per expert): what Optimus' "up to 1.71x" is measured against
  hf_trainer  Transformers' Trainer + OlmoeForCausalLM, experts implementation "grouped_mm"
              ("sonicmoe" as well where that implementation imports)

Tokens/s comes from the median step time after `--warmup` steps, the figure is the median over
rounds; MFU counts the model FLOPs of `ds_optimus.plan` (6 x active parameters + attention) against
`--peak-tflops` (989 for an H100 SXM; the GPU's name picks it when known). ours also records its
peak memory, for the planner check of `benchmarks/gpu/summary.py`.

    python benchmarks/gpu/train_e2e.py [--layers 16] [--micro 2] [--steps 20] [--warmup 6] [--repeats 2]
    python benchmarks/gpu/train_e2e.py --dry-run    # a tiny CPU run of every contestant (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import launch_deepspeed, write_result  # noqa: E402

PEAK_TFLOPS = {"H100 80GB HBM3": 989.0, "H100 SXM": 989.0, "H200": 989.0, "H100 PCIe": 756.0}
TINY = {"preset": "mula-tiny-moe", "overrides": {}}
PROFILED = 2  # with --profile: the last steps of ours' first round, recorded by torch.profiler


def ds_config(work: Path, name: str, model: dict, args, *, before: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 4e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "optimus": {
            "model": model,
            "moe": {"experts_backend": "reference" if before else "auto"},
            "sharded_optimizer": {"enabled": not before},
            "data": {
                "sources": ["embedded"],
                "seq_len": args.seq_len,
                "val_fraction": 0.02,
                "cache_dir": str(work / "cache"),
            },
            "train": {
                "steps": args.steps,
                "output_dir": str(work / name),
                "eval_interval": 0,
                "eval_batches": 1,
                "sample_tokens": 0,
                "warmup_steps": 2,
                "measure_memory_steps": 0 if before else 3,
                "export": False,
            },  # neither the export nor a checkpoint: a throughput measurement
            "checkpoint": {"enabled": False, "resume": False},
            "wandb": {"mode": "disabled"},
        },
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def launch(command: list[str], work: Path) -> None:
    launch_deepspeed(command, work, gpus=1)


def run_ours(work: Path, name: str, model: dict, args, before: bool, profile: bool = False) -> dict:
    config = ds_config(work, name, model, args, before=before)
    profiled = [args.steps - PROFILED + 1, args.steps] if profile else None
    config["optimus"]["train"]["profile_steps"] = profiled
    shutil.rmtree(work / name, ignore_errors=True)  # a fresh run each round
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    launch(["--module", "ds_optimus.train", "--config", str(path)], work)
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    if profiled:  # the profiler's table beside the results; its steps are slower, so left out of the timing
        records = [r for r in records if r.get("step", 0) < profiled[0]]
        table = (work / name / "profile.txt").read_text()
        Path(
            os.environ.get("BENCH_RESULTS", ROOT / "benchmarks" / "results"), f"train_e2e_profile_{name}.txt"
        ).write_text(table)
    summary = json.loads((work / name / "summary.json").read_text())
    peaks = [m["peak_bytes"] for m in summary.get("memory") or []]
    return {
        "step_seconds": [r["step_seconds"] for r in records if "step_seconds" in r],
        "losses": [r["loss"] for r in records if "loss" in r],
        "peak_bytes": max(peaks) if peaks else None,
    }


def run_trainer(work: Path, model: dict, args, impl: str) -> dict:
    from ds_optimus.hf_models.mula import MulaConfig
    from ds_optimus.hf_models.mula.convert_olmoe import mula_to_olmoe_config

    config = ds_config(work, "hf", model, args, before=False)
    del config["optimus"]  # the peer as users run it: DeepSpeed's ZeRO-1 and Transformers' experts, nothing of ours
    path = work / "hf.json"
    path.write_text(json.dumps(config))
    olmoe = mula_to_olmoe_config(MulaConfig.from_preset(model["preset"], **model["overrides"]))
    data = next(p for p in (work / "cache").iterdir() if (p / "meta.json").exists())
    out = work / f"hf_{impl}.json"
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
            str(args.seq_len),
            "--steps",
            str(args.steps),
            "--out",
            str(out),
            "--experts-implementation",
            impl,
        ],
        work,
    )
    result = json.loads(out.read_text())
    return {
        "step_seconds": result["step_seconds"],
        "losses": result["losses"],
        "experts_implementation": result.get("experts_implementation"),
    }


def sonicmoe_available() -> bool:
    """Whether Transformers' "sonicmoe" experts can load here (CUDA, the `kernels` package and the
    CuTe DSL; the kernel itself comes from the Hub, which a machine without a network lacks)."""
    try:
        from transformers.integrations.sonicmoe import is_sonicmoe_loadable

        return bool(is_sonicmoe_loadable())
    except Exception:  # an older Transformers, or a failing import: not available either way
        return False


def peak_tflops(requested: float | None) -> float | None:
    if requested:
        return requested
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of the OLMoE-1B-7B shape (16: all)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=2, help="sequences per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=6, help="steps left out of the median")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every contestant")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    parser.add_argument("--only", default=None, help="comma-separated contestants (default: all)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"record ours' last {PROFILED} steps of the first round with torch.profiler (left out of "
        "its timing): the top kernels in train_e2e_profile_ours.txt beside the JSON",
    )
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset on the CPU, 3 steps, float32")
    args = parser.parse_args(argv)
    for key in ("layers", "seq_len", "micro", "steps", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be a positive integer")
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    if args.profile and args.warmup + PROFILED >= args.steps:
        parser.error(f"--profile records the last {PROFILED} steps: --steps must exceed --warmup + {PROFILED}")
    args.dtype = "bf16"
    model = {"preset": "mula-7b-a1b", "overrides": {"num_hidden_layers": args.layers}}
    if args.dry_run:
        args.seq_len, args.micro, args.steps, args.warmup, args.repeats, args.dtype = 64, 2, 3, 1, 1, "fp32"
        args.steps += PROFILED if args.profile else 0
        model = TINY
    names = ["ours", "before", "hf_trainer"] + (["hf_trainer_sonicmoe"] if sonicmoe_available() else [])
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only: unknown or unavailable contestants {', '.join(unknown)} (have {', '.join(names)})")
        if not {"ours", "before"} & set(wanted):
            parser.error("--only: the Trainer reads the corpus ours or before tokenizes: include one of them")
        names = [n for n in names if n in wanted]  # ours and before first

    from ds_optimus.plan import ModelShape

    shape = ModelShape.from_preset(model["preset"], **model["overrides"])
    flops_per_token = shape.flops_per_token(args.seq_len)
    tokens_per_step = args.micro * args.seq_len
    peak = peak_tflops(args.peak_tflops)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    details: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(args.repeats):
            for name in names:
                if name == "hf_trainer_sonicmoe":
                    try:
                        result = run_trainer(work, model, args, "sonicmoe")
                    except RuntimeError as err:  # its kernel comes from the Hub at first use
                        print(f"{name}: not run ({str(err).splitlines()[-1][:200]})", flush=True)
                        skipped[name] = str(err)[-500:]
                        continue
                elif name == "hf_trainer":
                    result = run_trainer(work, model, args, "grouped_mm")
                else:
                    profile = args.profile and name == "ours" and r == 0  # the first round: kept if cut off
                    result = run_ours(work, name, model, args, before=name == "before", profile=profile)
                step = statistics.median(result["step_seconds"][args.warmup :])  # profiled steps left out
                rounds[name].append(tokens_per_step / step)
                details[name] = {k: v for k, v in result.items() if k != "step_seconds"}
                print(f"round {r + 1}: {name:<20}{tokens_per_step / step:>10.0f} tokens/s", flush=True)
            report(
                args,
                model,
                rounds,
                details,
                skipped,
                flops_per_token,
                tokens_per_step,
                peak,
                final=r == args.repeats - 1,
            )
    return 0


def report(
    args,
    model: dict,
    rounds: dict,
    details: dict,
    skipped: dict,
    flops_per_token: float,
    tokens_per_step: int,
    peak: float | None,
    final: bool,
) -> None:
    """The figures of the rounds so far into train_e2e.json (written after every round, so that a run
    cut off keeps what it finished); the table too once the last round is in."""
    results = {}
    for name, values in rounds.items():
        if not values:
            continue
        tps = statistics.median(values)
        results[name] = {
            "tokens_per_s": tps,
            "tokens_per_s_rounds": values,
            **details[name],
            "step_seconds": tokens_per_step / tps,
            "mfu": tps * flops_per_token / (peak * 1e12) if peak else None,
        }
    for v in results.values():
        v["vs_hf_trainer"] = (
            v["tokens_per_s"] / results["hf_trainer"]["tokens_per_s"] if "hf_trainer" in results else None
        )
        v["vs_before"] = v["tokens_per_s"] / results["before"]["tokens_per_s"] if "before" in results else None
    if final:
        print(f"\n{'contestant':<20}{'tokens/s':>10}{'MFU':>7}{'vs Trainer+OLMoE':>18}{'vs before':>11}")
        for name, v in results.items():
            mfu = f"{v['mfu']:.1%}" if v["mfu"] is not None else "-"
            vs = [f"{x:.2f}x" if x is not None else "-" for x in (v["vs_hf_trainer"], v["vs_before"])]
            print(f"{name:<20}{v['tokens_per_s']:>10.0f}{mfu:>7}{vs[0]:>18}{vs[1]:>11}")
    payload = {
        "shape": {
            "preset": model["preset"],
            **model["overrides"],
            "seq_len": args.seq_len,
            "micro_batch": args.micro,
            "dtype": args.dtype,
            "zero_stage": 1,
            "processes": 1,
        },
        "flops_per_token": flops_per_token,
        "peak_tflops": peak,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rounds_done": max(map(len, rounds.values()), default=0),
        "results": results,
        "not_run": skipped,
    }
    path = write_result("train_e2e_dry_run" if args.dry_run else "train_e2e", payload)
    if final:
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

"""What the phase profiler (`optimus.profile`) costs a training step, on CPU: the shipped tiny config
(`ds_configs/mula-tiny-moe-cpu.json`: EP 2, the sharded optimizer, 2 processes through the
`deepspeed` launcher), eval, checkpoints and export off, timed per whole loop iteration (from one
step's first `pre_step` hook to the next one's: the step, every callback, the profiler's wait for
the device and its extra metrics line included).

Contestants, run in turn (interleaved, the order alternating) for `--repeats` rounds of `--steps`
steps each, the first `--warmup` steps left out:
  off        no `optimus.profile` section
  on         `optimus.profile.enabled`, every step profiled and its collectives counted
The figure of a run is its median iteration; a contestant's is the median over rounds; the overhead
is on / off - 1. As a finer check, one more run of 4 x `--steps` profiles every second step
(`interval` 2): its profiled iterations against its other ones, in one process pair, so the spread
from launch to launch drops out (the step's flags are sent on both kinds of step, so that part of
the cost, 5 numbers in the step's all-reduce, is not in this ratio).

    python benchmarks/profile_overhead.py [--steps 40] [--warmup 10] [--repeats 5]     # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_deepspeed, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ds_config(work: Path, name: str, steps: int, profile: dict | None) -> dict:
    config = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    optimus = config["optimus"]
    optimus["train"].update(
        steps=steps, output_dir=str(work / name), eval_interval=0, sample_tokens=0, export=False, log_interval=1
    )
    optimus["data"]["cache_dir"] = str(work / "cache")
    optimus.update(checkpoint={"enabled": False, "resume": False}, wandb={"mode": "disabled"})
    if profile is not None:
        optimus["profile"] = profile
    return config


def worker(config_path: str, out: str) -> None:
    """Under the launcher: train the config with a clock first among the callbacks; rank 0 writes the
    seconds of each loop iteration (pre_step of step s to pre_step of step s + 1) to `out`."""
    from ds_optimus.verbosity import quiet_libraries

    quiet_libraries(False)  # before DeepSpeed and Transformers are imported
    from ds_optimus.train import Callback, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks: dict[int, float] = {}

        def pre_step(self, step: int) -> None:
            self.marks[step] = time.perf_counter()

    trainer = Trainer(json.loads(Path(config_path).read_text()))
    clock = Clock()
    clock.trainer = trainer
    trainer.callbacks.insert(0, clock)  # first: a step's own pre_step hooks (the profiler's) are in its iteration
    trainer.train()
    if trainer.rank == 0:
        steps = sorted(clock.marks)
        iterations = {s: clock.marks[s + 1] - clock.marks[s] for s in steps[:-1]}
        Path(out).write_text(json.dumps(iterations))


def run(work: Path, name: str, steps: int, profile: dict | None) -> dict[int, float]:
    """Launch one run on 2 processes; {step: seconds of its loop iteration} (the last step has none)."""
    path, out = work / f"{name}.json", work / f"{name}_times.json"
    path.write_text(json.dumps(ds_config(work, name, steps, profile)))
    launch_deepspeed([str(Path(__file__).resolve()), "--worker", str(path), str(out)], work, gpus=2)
    return {int(step): seconds for step, seconds in json.loads(out.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    contestants = {"off": None, "on": {"enabled": True}}
    rounds: dict[str, list[float]] = {name: [] for name in contestants}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(work, "tokenize", 2, None)  # the data cache, once, outside the timed runs
        for r in range(args.repeats):
            for name in list(contestants) if r % 2 == 0 else list(reversed(contestants)):
                times = run(work, name, args.steps, contestants[name])
                rounds[name].append(statistics.median(t for s, t in times.items() if s > args.warmup))
                print(f"round {r + 1}: {name:<4} {1e3 * rounds[name][-1]:8.1f} ms per step", flush=True)
        times = run(work, "alternate", 4 * args.steps, {"enabled": True, "interval": 2})
    kept = {s: t for s, t in times.items() if s > args.warmup}
    alternate = {
        "profiled_median_s": statistics.median(t for s, t in kept.items() if s % 2 == 0),
        "other_median_s": statistics.median(t for s, t in kept.items() if s % 2 == 1),
    }
    alternate["ratio"] = alternate["profiled_median_s"] / alternate["other_median_s"]
    results = {name: {"median_s": statistics.median(v), "rounds_s": v} for name, v in rounds.items()}
    ratio = results["on"]["median_s"] / results["off"]["median_s"]
    print(f"\n{'contestant':<34}{'ms/step':>9}{'vs off':>9}")
    for name, v in results.items():
        print(f"{name:<34}{1e3 * v['median_s']:>9.1f}{v['median_s'] / results['off']['median_s']:>8.3f}x")
    print(f"{'interval 2: profiled steps':<34}{1e3 * alternate['profiled_median_s']:>9.1f}{alternate['ratio']:>8.3f}x")
    print(f"{'interval 2: the others':<34}{1e3 * alternate['other_median_s']:>9.1f}{1:>8.3f}x")
    print(
        f"overhead: {100 * (ratio - 1):+.2f} % (whole runs), {100 * (alternate['ratio'] - 1):+.2f} % (interleaved "
        f"steps of one run); {time.perf_counter() - began:.0f} s in all"
    )
    write_result(
        "profile_overhead_cpu",
        {
            "config": "ds_configs/mula-tiny-moe-cpu.json, 2 processes (EP 2, sharded optimizer), eval/checkpoints off",
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "results": results,
            "overhead": ratio - 1,
            "interval_2": alternate,
            "interval_2_overhead": alternate["ratio"] - 1,
        },
    )


if __name__ == "__main__":
    if "--worker" in sys.argv:  # launched: the launcher adds --local_rank=N
        worker(*[a for a in sys.argv[1:] if a != "--worker" and not a.startswith("--local_rank")])
    else:
        main()

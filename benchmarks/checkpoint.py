"""Checkpoint save and load: ds_optimus' verified checkpoints (synchronous and asynchronous)
against DeepSpeed's own `save_checkpoint`, and the disk's raw write rate, in one process. The
writers take turns in a rotating order (each comes first, second, ... in turn), since a write slows
the one after it while the disk flushes.

A Mula MoE model of about 31 M parameters (float32; the checkpoint, weights plus fp32 master weights
and Adam moments, is a few hundred MB) trained by two DeepSpeed engines built from the same weights:
ours (ZeRO-1 with the EP-aware sharded optimizer, `CheckpointManager`) and DeepSpeed's ZeRO-1. Per
round, interleaved, after a warm-up round:

  ours sync      CheckpointManager.save: write, fsync, CRC-32 manifest, rename, `latest`
  ours async     the time the training loop is blocked (state copied to CPU memory), and the time the
                 background thread takes to finish the checkpoint
  deepspeed      engine.save_checkpoint of the DeepSpeed ZeRO-1 engine (it returns before its files
                 reach the disk: no fsync), and the same followed by an fsync of each of its files
  raw write      the same number of bytes written to one file and fsynced: the disk's floor
  load           CheckpointManager.latest_good (checksums) + load, and DeepSpeed's load_checkpoint

Step-time overhead of asynchronous saves: median training-step time while a background save is
being written, against steps with no save in flight (same engine, alternating).

    python benchmarks/checkpoint.py [--rounds 3] [--dir /path/on/the/file/system/to/measure]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

import ds_optimus  # noqa: E402,F401  (hooks DeepSpeed's engine before it is imported)

MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
)
MICRO, SEQ = 2, 128


def ds_config(sharded: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}},
        "optimus": {"sharded_optimizer": {"enabled": sharded}},
    }


def build(sharded: bool):
    import deepspeed

    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
    from ds_optimus.parallel.expert_parallel import moe_param_groups

    torch.manual_seed(0)
    model = MulaForCausalLM(MulaConfig(**MODEL))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=moe_param_groups(model, weight_decay=0.1), config=ds_config(sharded)
    )
    return engine


def train_step(engine, gen: torch.Generator) -> float:
    began = time.perf_counter()
    batch = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=gen)
    out = engine(input_ids=batch, labels=batch)
    engine.backward(out.loss)
    engine.step()
    return time.perf_counter() - began


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(path: Path, size: int) -> None:
    block = os.urandom(1 << 24)
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="training steps per async-overhead sample")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    from ds_optimus.checkpoint import CheckpointManager
    from ds_optimus.train.startup import init_distributed

    init_distributed()
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    ours, peer = build(True), build(False)
    params = sum(p.numel() for p in ours.module.parameters())
    gen = torch.Generator().manual_seed(0)
    for engine in (ours, peer):
        train_step(engine, gen)  # optimizer state exists
    manager = CheckpointManager(root / "ours", keep_last=2)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "ours_sync",
            "ours_async_blocking",
            "ours_async_total",
            "deepspeed_save",
            "deepspeed_save_fsync",
            "raw_write",
            "ours_load",
            "deepspeed_load",
        )
    }
    size = ds_size = 500_000_000  # until measured
    state = {"step": 0}

    def raw():
        began = time.perf_counter()
        raw_write(root / "raw.bin", size)
        (root / "raw.bin").unlink()
        return {"raw_write": time.perf_counter() - began}

    def ours_sync():
        nonlocal size
        state["step"] += 1
        began = time.perf_counter()
        path = manager.save(state["step"], ours, {})
        took = time.perf_counter() - began
        size = folder_bytes(path)
        return {"ours_sync": took}

    def ours_async():
        state["step"] += 1
        began = time.perf_counter()
        manager.save(state["step"], ours, {}, background=True)
        blocked = time.perf_counter() - began
        manager.wait()
        return {"ours_async_blocking": blocked, "ours_async_total": manager.writer.last_seconds}

    def deepspeed_save():
        nonlocal ds_size
        shutil.rmtree(root / "deepspeed", ignore_errors=True)
        began = time.perf_counter()
        peer.save_checkpoint(str(root / "deepspeed"), tag="t")
        saved = time.perf_counter() - began
        for file in (root / "deepspeed" / "t").rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        ds_size = folder_bytes(root / "deepspeed" / "t")
        return {"deepspeed_save": saved, "deepspeed_save_fsync": time.perf_counter() - began}

    def loads():
        began = time.perf_counter()
        manager.load(manager.latest_good(report=print), ours)
        ours_s = time.perf_counter() - began
        began = time.perf_counter()
        peer.load_checkpoint(str(root / "deepspeed"), tag="t")
        return {"ours_load": ours_s, "deepspeed_load": time.perf_counter() - began}

    writers = [raw, ours_sync, ours_async, deepspeed_save]
    for round_ in range(args.rounds + 1):  # round 0 is the warm-up
        k = round_ % len(writers)  # each contestant takes each place in the order in turn
        for contestant in [*writers[k:], *writers[:k], loads]:
            for key, value in contestant().items():
                if round_ > 0:
                    times[key].append(value)

    # Step-time overhead of asynchronous saves: steps with a save being written vs steps without.
    quiet, busy = [], []
    for _ in range(args.rounds):
        quiet += [train_step(ours, gen) for _ in range(args.steps)]
        state["step"] += 1
        manager.save(state["step"], ours, {}, background=True)
        while manager.writer.busy:
            busy.append(train_step(ours, gen))
        manager.wait()
    shutil.rmtree(root, ignore_errors=True)

    median = {k: statistics.median(v) for k, v in times.items()}
    gb = size / 1e9
    print(
        f"\nmodel {params / 1e6:.1f} M parameters; our checkpoint {size / 1e6:.0f} MB, DeepSpeed's "
        f"{ds_size / 1e6:.0f} MB; {args.rounds} rounds, medians"
    )
    print(f"{'':<28}{'seconds':>9}{'GB/s':>8}{'vs raw':>8}")
    rows = [
        ("ours, synchronous save", "ours_sync", size),
        ("ours, async: loop blocked", "ours_async_blocking", size),
        ("ours, async: until written", "ours_async_total", size),
        ("DeepSpeed save_checkpoint", "deepspeed_save", ds_size),
        ("DeepSpeed save + fsync", "deepspeed_save_fsync", ds_size),
        ("raw write + fsync", "raw_write", size),
        ("ours, verify + load", "ours_load", size),
        ("DeepSpeed load_checkpoint", "deepspeed_load", ds_size),
    ]
    for label, key, nbytes in rows:
        ratio = median[key] / median["raw_write"]
        print(f"{label:<28}{median[key]:>9.3f}{nbytes / 1e9 / median[key]:>8.2f}{ratio:>7.2f}x")
    quiet_s, busy_s = statistics.median(quiet), statistics.median(busy) if busy else float("nan")
    print(
        f"\ntraining step: {quiet_s * 1e3:.0f} ms without a save in flight, {busy_s * 1e3:.0f} ms while one is "
        f"written ({busy_s / quiet_s - 1:+.0%}, {len(busy)} steps sampled); a synchronous save stops the loop for "
        f"{median['ours_sync'] / quiet_s:.1f} steps' time, an asynchronous one for "
        f"{median['ours_async_blocking'] / quiet_s:.2f}"
    )
    payload = {
        "parameters": params,
        "checkpoint_bytes": size,
        "deepspeed_checkpoint_bytes": ds_size,
        "rounds": args.rounds,
        "median_s": median,
        "all_s": times,
        "gb_per_s": {key: nbytes / 1e9 / median[key] for _, key, nbytes in rows},
        "step_s": {"no_save_in_flight": quiet_s, "async_save_in_flight": busy_s, "busy_samples": len(busy)},
        "checkpoint_gb": gb,
    }
    print(f"wrote {write_result('checkpoint_cpu', payload)}")


if __name__ == "__main__":
    main()

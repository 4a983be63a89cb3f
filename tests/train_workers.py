"""Functions run on every rank by the multi-process training tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_optimus.command_line import deepspeed_launcher  # noqa: F401  (the tests' import of it)
from ds_optimus.train import Callback, Trainer, pretrain

ROOT = Path(__file__).resolve().parents[1]
# The watchdog's step time-out where a test hangs a rank on purpose (which it does for ever): far above
# any healthy step of the tiny runs, a fraction of a second here and a few seconds on a 2-core machine
# loaded several times over, so only the injected hang trips it, whatever the load.
HANG_TIMEOUT_S = 20


def child_pythonpath() -> str:
    """PYTHONPATH for a launched process: the repository first, then the caller's (where packages
    installed with `pip install --target` may live, as on the GPU machine)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def tiny_config(tmp_path: Path, cache: Path, **optimus) -> dict:
    config = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    del config["train_batch_size"]  # the tests run it on 1 and 2 processes
    config["optimus"].update(
        model={"preset": "mula-tiny-moe"},
        expert_parallel={"size": 1},
        data={"sources": ["embedded"], "seq_len": 32, "val_fraction": 0.05, "cache_dir": str(cache)},
        train={
            "steps": 8,
            "seed": 0,
            "output_dir": str(tmp_path / "run"),
            "eval_interval": 4,
            "eval_batches": 2,
            "warmup_steps": 2,
            "sample_tokens": 0,
            "plots": False,
        },  # plots: by the tests that check them
        checkpoint={"interval": 4, "keep_last": 2},
        wandb={"mode": "disabled"},
    )
    for section, values in optimus.items():
        config["optimus"].setdefault(section, {}).update(values)
    return config


def pretrain_worker(rank: int, world: int, config: dict) -> dict:
    return pretrain(config)


def left_alive_worker(rank: int, world: int, config: dict) -> dict:
    """What of a finished run this process still holds once the garbage is collected: engines, optimizers
    and the watchdog's thread (an engine held keeps its process groups, and their polling gloo threads,
    past `destroy_process_group`)."""
    import gc
    import threading

    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_optimus.optim.sharded import ShardedOptimizer

    pretrain(config)
    gc.collect()
    objects = gc.get_objects()
    return {
        "engines": sum(issubclass(type(o), DeepSpeedEngine) for o in objects),
        "optimizers": sum(issubclass(type(o), ShardedOptimizer) for o in objects),
        "watchdogs": [t.name for t in threading.enumerate() if t.name == "ds_optimus-watchdog"],
    }


def cli_errors_worker(rank: int, world: int, configs: list[tuple[dict, list[str]]], tmp: str) -> list:
    """Run the command line on each (config, overrides: `--set` values, or options such as `--check`);
    return (exit status, stderr) of each."""
    from ds_optimus.train.cli import main

    results = []
    for i, (config, overrides) in enumerate(configs):
        path = f"{tmp}/bad{i}-rank{rank}.json"  # one file per rank: a rank must not read another's half-written one
        with open(path, "w") as f:
            json.dump(config, f)
        err = io.StringIO()
        args = sum(([o] if o.startswith("--") else ["--set", o] for o in overrides), [])
        with contextlib.redirect_stderr(err):
            status = main(["--config", path, *args])
        results.append((status, err.getvalue()))
    return results


class _SyncMode(TorchDispatchMode):
    """Records what makes the host wait for the device: `aten._local_scalar_dense` (`.item()`,
    `float(t)`, `if t:`) and copies from an accelerator to the CPU."""

    def __init__(self, syncs: list[str]) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.append("item")
        elif func is torch.ops.aten._to_copy.default:
            device = kwargs.get("device")
            if args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu":
                self.syncs.append("to_host")
        elif func is torch.ops.aten.copy_.default:
            if args[1].device.type != "cpu" and args[0].device.type == "cpu":
                self.syncs.append("to_host")
        return func(*args, **kwargs)


class HostSyncCounter(Callback):
    """Counts host syncs per training step, from the step's `pre_step` to the end of every
    callback's `post_step` (add it last): the dispatcher's `_local_scalar_dense` and device-to-host
    copies, and `Tensor.tolist()`, which bypasses the dispatcher."""

    def __init__(self) -> None:
        self.per_step: dict[int, list[str]] = {}

    def pre_step(self, step: int) -> None:
        self.syncs: list[str] = []
        self.mode = _SyncMode(self.syncs)
        self.mode.__enter__()
        self.original_tolist = original = torch.Tensor.tolist
        syncs = self.syncs

        def tolist(tensor):
            syncs.append("tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist

    def post_step(self, step: int) -> None:
        torch.Tensor.tolist = self.original_tolist
        self.mode.__exit__(None, None, None)
        self.per_step[step] = self.syncs


def count_syncs_worker(rank: int, world: int, config: dict) -> dict:
    """Train `config` with a `HostSyncCounter`; returns {step: [sync kinds]}."""
    counter = HostSyncCounter()
    Trainer(config, callbacks=[counter]).train()
    return counter.per_step


def metrics_worker(rank: int, world: int, config: dict) -> list[dict]:
    """Train `config`; returns the records of its metrics.jsonl (rank 0) or []."""
    pretrain(config)
    path = Path(config["optimus"]["train"]["output_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if rank == 0 else []


def communication_worker(rank: int, world: int, config: dict) -> dict:
    """Train `config`; returns the losses and what the sharded optimizer sent and held."""
    trainer = Trainer(config)
    summary = trainer.train()
    optimizer = trainer.engine.optimizer
    return {
        "losses": summary["losses"],
        "comm_bytes": dict(optimizer.comm_bytes),
        "bucket_dtypes": sorted({str(optimizer.bucket_dtype(s)) for s in optimizer.spaces}),
    }


def drain_worker(rank: int, world: int, config: dict) -> dict:
    """Train `config` (pipeline stages); returns the losses; at every step's end of the schedule (before
    the optimizer's boundary) how many of this rank's gradient buckets were already reduced, out of how
    many; and the most gradient buckets holding gradients when a chunk's forward pass began (between
    backward passes)."""
    trainer = Trainer(config)
    launched: list[tuple[int, int]] = []

    def build(original):
        def finalize():
            optimizer = trainer.engine.optimizer
            launched.append((optimizer._next, len(optimizer._order)))
            return original()

        return finalize

    optimizer = trainer.engine.optimizer
    optimizer.finalize_gradient_accumulation_boundary = build(optimizer.finalize_gradient_accumulation_boundary)
    held: list[int] = []  # at each forward pass of a chunk: the buckets holding gradients

    def count_held(module, args):
        held.append(sum(b.grad is not None for space in optimizer.spaces for b in space.buckets))

    for _, chunk in trainer.train_module.chunks:
        chunk.register_forward_pre_hook(count_held)
    summary = trainer.train()
    return {**summary, "launched": launched, "held_at_forward": max(held), "buckets": len(optimizer._order)}


class RoundingPerturbation(Callback):
    """Before the first step, every parameter element times (1 +- 2**-24), signs drawn from a fixed
    seed: one float32 rounding's worth of change, the size of what reordering a float32 sum does."""

    def pre_train(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for param in self.trainer.engine.module.parameters():
                signs = torch.randint(0, 2, param.shape, generator=gen).to(param.dtype) * 2 - 1
                param.mul_(1 + signs.to(param.device) * 2.0**-24)


def compiled_losses_worker(rank: int, world: int, config: dict, perturb: bool = False) -> tuple[list[float], int]:
    """Train `config`; returns the per-step losses and how many graphs torch.compile captured. A code
    object compiled more than twice (training, then the evaluation's no-grad mode) fails the run:
    no step may recompile. `perturb`: with `RoundingPerturbation`."""
    torch._dynamo.config.recompile_limit = 2
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    summary = Trainer(config, callbacks=[RoundingPerturbation()] if perturb else []).train()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return [summary["losses"][s] for s in sorted(summary["losses"])], graphs


class CountingCallback(Callback):
    """A user's callback with state: counts the steps it saw; stops the run at `stop_at`."""

    state_key = "counting"

    def __init__(self, stop_at: int | None = None) -> None:
        self.seen = 0
        self.stop_at = stop_at

    def post_step(self, step: int) -> None:
        self.seen += 1
        if step == self.stop_at:
            self.trainer.request_stop("asked by the counting callback")

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state.get("seen", 0)


def counting_worker(rank: int, world: int, config: dict, stop_at: int | None) -> tuple[dict, int]:
    """Train `config` with a `CountingCallback`; returns the summary and the count it ended with."""
    counter = CountingCallback(stop_at)
    summary = Trainer(config, callbacks=[counter]).train()
    return summary, counter.seen

"""Functions run on every rank by the multi-process training tests."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from ds_optimus.train import pretrain

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, cache: Path, **optimus) -> dict:
    config = json.loads((ROOT / "ds_configs" / "mula-tiny-moe-cpu.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    del config["train_batch_size"]  # the tests run it on 1 and 2 processes
    config["optimus"].update(
        model={"preset": "mula-tiny-moe"},
        expert_parallel={"size": 1},
        data={"sources": ["embedded"], "seq_len": 32, "val_fraction": 0.05, "cache_dir": str(cache)},
        train={"steps": 8, "seed": 0, "output_dir": str(tmp_path / "run"), "eval_interval": 4, "eval_batches": 2,
               "warmup_steps": 2, "sample_tokens": 0},
        checkpoint={"interval": 4, "keep_last": 2},
        wandb={"mode": "disabled"},
    )
    for section, values in optimus.items():
        config["optimus"].setdefault(section, {}).update(values)
    return config


def pretrain_worker(rank: int, world: int, config: dict) -> dict:
    return pretrain(config)


def cli_errors_worker(rank: int, world: int, configs: list[tuple[dict, list[str]]], tmp: str) -> list:
    """Run the command line on each (config, overrides); return (exit status, stderr) of each."""
    from ds_optimus.train.cli import main

    results = []
    for i, (config, overrides) in enumerate(configs):
        path = f"{tmp}/bad{i}.json"
        with open(path, "w") as f:
            json.dump(config, f)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(["--config", path, *sum((["--set", o] for o in overrides), [])])
        results.append((status, err.getvalue()))
    return results

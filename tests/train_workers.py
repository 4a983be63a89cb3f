"""Functions run on every rank by the multi-process training tests."""

from __future__ import annotations

import contextlib
import io
import json

from ds_optimus.train import pretrain


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

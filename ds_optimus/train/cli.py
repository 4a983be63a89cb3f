"""Command line of the pretraining entry point.

    deepspeed --num_gpus N --module ds_optimus.train --config ds_configs/NAME.json [--set KEY=VALUE ...]
    ds-optimus-train --config ds_configs/mula-tiny-moe-cpu.json         # one process, no launcher

`--set optimus.train.steps=20 --set train_micro_batch_size_per_gpu=4` overrides config keys
(values parse as JSON when they can). A bad config, data path or layout ends the run with one line
naming the problem and exit status 2.
"""

from __future__ import annotations

import argparse

from ..cli import ArgumentParser, fail

NAME = "ds_optimus.train"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(NAME, description="Pretrain a Mula model with DeepSpeed.")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config with an optimus section")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, dotted (repeatable)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # from the launcher
    args = parser.parse_args(argv)

    from ..config import ConfigError, apply_overrides, load_json_config
    from ..data.corpus import DataError
    from ..parallel.groups import LayoutError
    from ..reliability import CheckpointError
    from .trainer import pretrain

    try:
        config = apply_overrides(load_json_config(args.config), args.overrides)
        summary = pretrain(config)
    except (ConfigError, DataError, LayoutError, CheckpointError) as err:
        return fail(NAME, err)
    losses = list(summary["losses"].values())
    if losses and summary.get("rank", 0) == 0:
        print(f"trained steps {summary['start_step'] + 1}-{summary['start_step'] + len(losses)}: "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              + (f"model saved to {summary['hf_dir']}" if summary["finished"] else "stopped early, resumable"),
              flush=True)
    return 0

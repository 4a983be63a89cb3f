"""Command line of the pretraining entry point.

    deepspeed --num_gpus N --module ds_optimus.train --config ds_configs/NAME.json [--set KEY=VALUE ...]
    ds-optimus-train --config ds_configs/mula-tiny-moe-cpu.json         # one process, no launcher
    python -m ds_optimus.train --config ds_configs/mula-7b-a1b.json --check --world 32   # check, do not run

`--set optimus.train.steps=20 --set train_micro_batch_size_per_gpu=4` overrides config keys
(values parse as JSON when they can). A bad config, data path or layout ends the run with one line
naming the problem and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from ..command_line import ArgumentParser, fail, launch_rank, said_by_every_rank

NAME = "ds_optimus.train"

# How the communication backends report a peer that died or closed its connections (gloo, NCCL, oneCCL).
PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "remote process exited",
    "communicator was aborted",
)
BACKENDS = ("gloo", "nccl", "ccl", "c10d", "processgroup")


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is a communication backend's saying that another rank went away (the failure is
    that rank's); other errors, a broken pipe of this process's own output among them, are not."""
    import torch.distributed as dist

    text = str(error).lower()
    from_backend = isinstance(error, getattr(dist, "DistBackendError", ())) or (
        isinstance(error, RuntimeError) and any(name in text for name in BACKENDS)
    )
    return from_backend and any(marker in text for marker in PEER_LOST)


def _first_line(error: BaseException) -> str:
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return line if len(line) <= 160 else line[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(NAME, launched=True, description="Pretrain a Mula model with DeepSpeed.")
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config with an optimus section")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, dotted (repeatable)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, layout, model (meta device), data and memory without training, "
        "print what would run and exit (0: it would start; 2: the error it would stop on)",
    )
    parser.add_argument(
        "--world",
        type=int,
        default=None,
        metavar="N",
        help="with --check: the number of ranks it would run on (default: WORLD_SIZE, or the config's batch sizes)",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        metavar="NAME",
        help="with --check: a planner cluster (h100, aurora, frontier, local, or a JSON file) whose "
        "device memory the predicted peak must fit",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="let DeepSpeed, Transformers and wandb print what they print (default: their errors "
        "only; also DS_OPTIMUS_VERBOSE=1)",
    )
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # from the launcher
    args = parser.parse_args(argv)
    if (args.world is not None or args.cluster is not None) and not args.check:
        parser.error("--world and --cluster go with --check")
    from ..verbosity import quiet_libraries

    quiet_libraries(args.verbose)

    from ..checkpoint.files import CheckpointError
    from ..config import ConfigError, apply_overrides, load_json_config
    from ..data.errors import DataError
    from ..parallel.groups import LayoutError
    from .trainer import pretrain

    try:
        try:
            config = apply_overrides(load_json_config(args.config), args.overrides)
        except ConfigError as err:
            raise said_by_every_rank(err) from None  # the same file and --set on every rank
        if args.check:
            from ..plan import ClusterError
            from .preflight import check_run

            try:
                lines = check_run(config, args.world, args.cluster)
            except ClusterError as err:
                raise ConfigError(f"--cluster: {err}") from None
            print(f"{args.config}: ready to run", *lines, sep="\n  ")
            return 0
        summary = pretrain(config)
    except (ConfigError, DataError, LayoutError, CheckpointError) as err:
        return fail(NAME, err, launched=True)
    except Exception as err:
        if not lost_a_peer(err):
            raise
        # Another rank failed first (its own error is printed above) or was killed: this one only lost its
        # connection, in a collective or a pipeline stage's send; one line, not a second traceback.
        print(
            f"{NAME}: rank {launch_rank()}: stopped, another rank failed first ({_first_line(err)})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    losses = list(summary["losses"].values())
    if losses and summary.get("rank", 0) == 0:
        print(
            f"trained steps {summary['start_step'] + 1}-{summary['start_step'] + len(losses)}: "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
            + (
                (
                    "finished, not exported (train.export is false)"
                    if "hf_dir" not in summary
                    else f"model saved to {summary['hf_dir']}"
                )
                if summary["finished"]
                else "stopped early, resumable"
            ),
            flush=True,
        )
    return 0

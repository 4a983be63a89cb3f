"""Command line of the run report: `python -m ds_optimus.report RUN_DIR [--out DIR] [--dpi N]`."""

from __future__ import annotations

import sys

from ..command_line import ArgumentParser, fail
from . import ReportError, write_report


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("ds_optimus.report", description="Draw a training run's metrics.jsonl as PNG plots.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (optimus.train.output_dir)")
    parser.add_argument("--out", metavar="DIR", default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of the PNGs (default 100)")
    args = parser.parse_args(argv)
    if args.dpi <= 0:
        parser.error(f"--dpi must be a positive integer, got {args.dpi}")
    try:
        written = write_report(args.run_dir, args.out, dpi=args.dpi)
    except ReportError as err:
        return fail("ds_optimus.report", err)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

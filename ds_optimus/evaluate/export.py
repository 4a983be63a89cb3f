"""Export one checkpoint as a Hugging Face folder: `python -m ds_optimus.evaluate.export CHECKPOINT OUT`.

Any checkpoint folder of a run does: a full one (`checkpoints/step_N`) or a model-only "cold" one
(`checkpoints/cold/stepN-tokensTB`, `optimus.checkpoint.keep_every`), on any layout it was written
by (pipeline stages, expert and tensor parallelism, staggered parts). The files are checked against
the manifest first, and only the model's are read; the optimizer state is not opened.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..command_line import ArgumentParser, fail

NAME = "ds_optimus.evaluate.export"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        NAME,
        description="Write a run's checkpoint (full or cold) as a Hugging Face folder that AutoModelForCausalLM loads.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (with its meta.json)")
    parser.add_argument("out", help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    from ..checkpoint.files import CheckpointError
    from . import EvaluationError, export_checkpoint

    checkpoint = Path(args.checkpoint)
    if not (checkpoint / "meta.json").is_file():
        return fail(NAME, f"{checkpoint} is not a checkpoint folder (it has no meta.json)")
    try:
        out = export_checkpoint(checkpoint, Path(args.out))
    except (EvaluationError, CheckpointError, OSError) as err:
        return fail(NAME, err)
    print(f"{checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

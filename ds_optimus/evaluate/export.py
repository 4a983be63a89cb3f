"""Export a checkpoint (full or cold, any layout) as a Hugging Face folder:
`python -m ds_optimus.evaluate.export CHECKPOINT OUT`. Only the model's files are read, after the manifest check.
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

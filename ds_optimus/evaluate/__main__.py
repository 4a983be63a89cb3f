"""Command line of downstream evaluation: `python -m ds_optimus.evaluate --help`."""

from __future__ import annotations

import argparse
import sys

from ..command_line import ArgumentParser, fail

NAME = "ds_optimus.evaluate"
EPILOG = """examples:
  python -m ds_optimus.evaluate runs/mula-tiny-moe --tasks pydoc_cloze             # newest checkpoint, no download
  python -m ds_optimus.evaluate runs/mula-7b --all --tasks mula-suite --limit 500  # every checkpoint not scored yet
  python -m ds_optimus.evaluate runs/mula-7b/hf --tasks arc_easy,hellaswag --num-fewshot 5
  python -m ds_optimus.evaluate runs/x --tasks my_task --include my_tasks/         # YAML tasks of your own

tasks: lm-eval's names (lm-eval's task index), mula-suite (what Optimus scored its checkpoints on:
arc_easy, arc_challenge, hellaswag, piqa, boolq, sciq, winogrande, openbookqa, mmlu; their datasets
come from the Hub or its local cache), pydoc_cloze (made here from the embedded corpus: a smoke test),
and the tasks of YAML files in --include folders. Needs lm-evaluation-harness: pip install -e ".[eval]".
"""


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        NAME,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Score a model, a checkpoint or a training run's checkpoints on downstream "
        "tasks with\nlm-evaluation-harness; the scores go to <run>/eval/step_N.json, "
        "which the run's report plots.",
    )
    parser.add_argument(
        "target", metavar="RUN_OR_FOLDER", help="a run's folder, one of its checkpoints, or a Hugging Face folder"
    )
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument(
        "--include", action="append", default=[], metavar="DIR", help="a folder of task YAML files (repeatable)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--step", type=int, default=None, help="of a run: the checkpoint of this step (default: the newest)"
    )
    which.add_argument("--all", action="store_true", help="of a run: every checkpoint not yet scored on the tasks")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=0, help="examples in each prompt (default 0)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="cpu, cuda, xpu, ... (default: the accelerator, else cpu)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: bfloat16 on an accelerator, float32 on the CPU",
    )
    parser.add_argument("--out", default=None, help="the results file (one model; default: <run>/eval/step_N.json)")
    parser.add_argument("--keep-export", action="store_true", help="keep a checkpoint's exported HF folder")
    parser.add_argument("--verbose", action="store_true", help="let lm-eval, Transformers and datasets print")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        parser.error("--tasks names no task")
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be a positive integer, got {value}")
    if args.num_fewshot < 0:
        parser.error(f"--num-fewshot must be >= 0, got {args.num_fewshot}")

    from ..verbosity import quiet_libraries

    quiet_libraries(args.verbose)
    from pathlib import Path

    from ..checkpoint.files import CheckpointError
    from .harness import EvaluationError, load_tasks, require_lm_eval
    from .run import evaluate, resolve, results_path, scored_already, summary_line

    try:
        if args.out and args.all:
            raise EvaluationError("--out names one results file; --all scores several checkpoints")
        require_lm_eval()
        targets = resolve(args.target, args.step, args.all)
        if args.all:
            targets = [t for t in targets if not scored_already(results_path(t[1], t[2]), tasks)]
            if not targets:
                print(
                    f"every checkpoint of {args.target} is scored on {', '.join(tasks)} already "
                    f"({Path(args.target) / 'eval'})"
                )
                return 0
        device, dtype = _device(args.device, args.dtype)
        print(f"loading the tasks {', '.join(tasks)}", flush=True)  # a misspelled one stops here, before any model
        loaded = load_tasks(tasks, args.include, targets[0][1] / "eval", args.verbose)
        for model, run, step in targets:
            print(f"scoring {model} on {', '.join(tasks)} ({device}, {dtype})", flush=True)
            path, record = evaluate(
                model,
                run,
                step,
                tasks,
                out=Path(args.out) if args.out else None,
                loaded=loaded,
                keep_export=args.keep_export,
                include=args.include,
                limit=args.limit,
                num_fewshot=args.num_fewshot,
                batch_size=args.batch_size,
                device=device,
                dtype=dtype,
                verbose=args.verbose,
            )
            print(f"{summary_line(record)} ({record['seconds']:.0f} s): {path}", flush=True)
    except (EvaluationError, CheckpointError, OSError) as err:
        return fail(NAME, err)
    return 0


def _device(device: str | None, dtype: str | None) -> tuple[str, str]:
    import torch

    if device is None:
        device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    return device, dtype or ("float32" if device == "cpu" else "bfloat16")


if __name__ == "__main__":
    sys.exit(main())

"""What `python -m ds_optimus.evaluate TARGET` scores and where the scores go.

TARGET: a Hugging Face folder, a run's folder (its newest intact checkpoint, `--step N` or `--all`) or one
checkpoint, exported on the fly into `<run>/eval/hf-step_N/` (removed unless kept). Step N's scores go to
`<run>/eval/step_N.json`, a folder's outside a run to `<folder>/eval/results.json`. Nothing but `eval/` is
changed: damaged checkpoints are skipped and named, not set aside."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from .harness import EvaluationError, load_tasks, score


def checkpoints_of(run: Path) -> list[Path]:
    """The run's complete checkpoint folders, oldest first."""
    from ..checkpoint.manager import CheckpointManager

    return CheckpointManager(run / "checkpoints").complete()


def resolve(target: str | Path, step: int | None = None, every: bool = False) -> list[tuple[Path, Path, int | None]]:
    """(HF or checkpoint folder to score, its run or the folder itself, step or None) per model TARGET names."""
    from ..checkpoint.manager import step_of

    target = Path(target)
    if not target.exists():
        raise EvaluationError(f"{target} does not exist")
    if (target / "meta.json").exists() and target.parent.name == "checkpoints":  # one checkpoint
        return [(target, target.parent.parent, json.loads((target / "meta.json").read_text()).get("step"))]
    if (target / "meta.json").exists() and target.parent.name == "cold":  # a model-only one (checkpoint.keep_every)
        return [(target, target.parent.parent.parent, json.loads((target / "meta.json").read_text()).get("step"))]
    if (target / "checkpoints").is_dir():  # a run
        found = checkpoints_of(target)
        if step is not None:
            found = [p for p in found if step_of(p) == step]
            if not found:
                raise EvaluationError(f"{target} has no complete checkpoint of step {step}")
        elif not every:
            found = found[-1:]
        if not found:
            raise EvaluationError(f"{target} has no complete checkpoint to score")
        return [(p, target, step_of(p)) for p in found]
    if (target / "config.json").exists():  # a Hugging Face folder; <run>/hf is the run's last step
        run = target.parent if (target.parent / "metrics.jsonl").exists() else None
        return [(target, run or target, _last_step(run) if run else None)]
    raise EvaluationError(
        f"{target} is neither a Hugging Face folder (config.json), a run (checkpoints/) nor a checkpoint (meta.json)"
    )


def _last_step(run: Path) -> int | None:
    try:
        return max(map(int, json.loads((run / "summary.json").read_text())["losses"]))
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """Write `checkpoint` as a Hugging Face folder `out` (every expert), checked against its manifest first."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from ..checkpoint.files import load, verify
    from ..checkpoint.manager import MANIFEST_KEYS, MODEL_FILE, consolidated_state
    from ..hf_models.mula import MulaConfig, MulaForCausalLM

    # the files the export reads, not the optimizer's state (most of a checkpoint's bytes)
    problem = verify(checkpoint, required=MANIFEST_KEYS, only=lambda name: name.startswith(("model", "experts_")))
    if problem:
        raise EvaluationError(f"checkpoint {checkpoint} is damaged: {problem}")
    if not (checkpoint / MODEL_FILE).exists():
        raise EvaluationError(
            f"checkpoint {checkpoint} has no {MODEL_FILE} (written before checkpoints kept the "
            "model's config): score the run's exported hf/ folder instead"
        )
    record = load(checkpoint / MODEL_FILE)
    config = MulaConfig.from_dict(record["config"])
    with torch.device("meta"):
        model = MulaForCausalLM(config)
    model.load_state_dict(consolidated_state(checkpoint), strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    with _no_progress_bars():  # a library call: Transformers' shard bar would land in the caller's log
        model.save_pretrained(out)
    if "tokenizer" in record:
        special = record["tokenizer"]["special_tokens"]
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(record["tokenizer"]["json"]),
            model_max_length=config.max_position_embeddings,
            **special,
        )
        tokenizer.save_pretrained(out)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad
        ).save_pretrained(out)
    return out


def results_path(run: Path, step: int | None) -> Path:
    """Where the scores of `step` of `run` go."""
    return run / "eval" / (f"step_{step:08d}.json" if step is not None else "results.json")


def evaluate(
    model: Path,
    run: Path,
    step: int | None,
    tasks: list[str],
    *,
    out: Path | None = None,
    keep_export: bool = False,
    **options: Any,
) -> tuple[Path, dict[str, Any]]:
    """Score one model and write the scores; returns (results file, its content). `loaded`: from `load_tasks`."""
    from ..checkpoint.files import write_text_atomic

    export = None
    if options.get("loaded") is None:
        options["loaded"] = load_tasks(tasks, options.get("include", ()), run / "eval", options.get("verbose", False))
    if (model / "meta.json").exists():  # the tasks are known before the export is written
        export = run / "eval" / f"hf-{model.name}"
        shutil.rmtree(export, ignore_errors=True)
        folder = export_checkpoint(model, export)
    else:
        folder = model
    try:
        scored = score(folder, tasks, work_dir=run / "eval", **options)
    finally:
        if export is not None and not keep_export:
            shutil.rmtree(export, ignore_errors=True)
    for entry in scored["tasks"].values():
        entry.update(num_fewshot=options.get("num_fewshot", 0), limit=options.get("limit"))
    path = out or results_path(run, step)
    # the step's scores on other tasks (scored at training time, say) stay; a task scored again is replaced
    earlier = read_results(path).get("tasks", {})
    record = {"step": step, "model": str(model), "time": time.time(), **scored, "tasks": {**earlier, **scored["tasks"]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=2))
    return path, {**record, "tasks": scored["tasks"]}


def read_results(path: Path) -> dict[str, Any]:
    """A results file's record ({} if none or unreadable)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def scored_already(path: Path, tasks: list[str]) -> bool:
    """Whether results file `path` scores every one of `tasks` (expanded)."""
    from .tasks import expand

    return set(expand(tasks)) <= set(read_results(path).get("tasks", {}))


def summary_line(record: dict[str, Any]) -> str:
    """`task acc 0.412 (n 200), ...` of a results record."""
    parts = []
    for task, metrics in record["tasks"].items():
        metric = next((m for m in ("acc_norm", "acc", "exact_match", "f1") if m in metrics), None)
        value = f"{metric} {metrics[metric]:.3f}" if metric else "no score"
        parts.append(f"{task} {value}" + (f" (n {metrics['samples']})" if metrics.get("samples") else ""))
    return ", ".join(parts)

"""The one module that drives lm-evaluation-harness (optional: `pip install -e ".[eval]"`): a Hugging Face
model folder scored on tasks, lm-eval's own output kept quiet unless asked for."""

from __future__ import annotations

import difflib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from .tasks import BUILTIN, expand, write_pydoc_cloze

LM_EVAL_REQUIREMENT = "lm-eval>=0.4.13,<0.5"


class EvaluationError(RuntimeError):
    """What stops an evaluation, in one line."""


def require_lm_eval():
    """The `lm_eval` module, or an EvaluationError saying how to install it."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (its imports fail where lm-eval is partial)
    except ImportError as err:
        raise EvaluationError(
            f'downstream evaluation needs lm-evaluation-harness ({err}): pip install -e ".[eval]" '
            f"(or pip install '{LM_EVAL_REQUIREMENT}')"
        ) from None
    return lm_eval


def task_names(folders: list[str]) -> set[str]:
    """The task names the YAML files of `folders` declare (`task: NAME`), read without lm-eval."""
    names = set()
    for folder in folders:
        for path in Path(folder).rglob("*.yaml"):
            names.update(re.findall(r"^task:\s*['\"]?([\w.-]+)", path.read_text(), re.M))
    return names


def load_tasks(tasks: list[str], include: list[str] = (), work_dir: str | Path = ".", verbose: bool = False):
    """(names, lm-eval's task manager) for `tasks` (`pydoc_cloze` made in `work_dir`); an unknown task is a
    one-line EvaluationError. Cheap: called before an export, a misspelled task stops it early."""
    lm_eval = require_lm_eval()
    from lm_eval.tasks import TaskManager

    names = expand(list(tasks))
    include = [str(Path(p).expanduser()) for p in include]
    for path in include:
        if not Path(path).is_dir():
            raise EvaluationError(f"task folder {path!r} does not exist")
    if BUILTIN & set(names):
        include.append(str(write_pydoc_cloze(Path(work_dir) / "tasks")))
    local = set(names) <= task_names(include)
    if local:  # nothing to fetch: no dataset lookup may go to the network
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if not verbose:
        _quiet(lm_eval)
    try:  # a task file lm-eval cannot read: one line, not a traceback
        manager = TaskManager(include_path=include or None, include_defaults=not local)
    except Exception as err:
        text = str(err).strip()
        raise EvaluationError(f"{type(err).__name__}: {text.splitlines()[0] if text else ''}") from None
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        known = [*manager.all_tasks, *sorted(BUILTIN - set(manager.all_tasks)), "mula-suite"]
        close = difflib.get_close_matches(unknown[0], known, n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        where = (
            f"nor in the YAML files of {', '.join(include)}"
            if include
            else "give YAML tasks of your own with --include"
        )
        raise EvaluationError(
            f"unknown task {unknown[0]!r} ({hint}lm-eval {lm_eval.__version__} knows "
            f"{len(manager.all_tasks):,} tasks; {where})"
        )
    return names, manager


def score(
    folder: str | Path,
    tasks: list[str],
    *,
    include: list[str] = (),
    limit: int | None = None,
    num_fewshot: int = 0,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "float32",
    work_dir: str | Path | None = None,
    verbose: bool = False,
    loaded=None,
) -> dict[str, Any]:
    """Score the HF model in `folder` on `tasks` (`loaded`: what `load_tasks` returned); returns
    {"tasks": {task: {metric: value, "samples": n}}, "seconds", "lm_eval"}."""
    lm_eval = require_lm_eval()
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names, manager = loaded or load_tasks(tasks, include, work_dir or folder, verbose)
    try:  # a model folder that does not load: one line, not a traceback
        began = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        lm = HFLM(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_length=getattr(model.config, "max_position_embeddings", None),
        )
    except EvaluationError:
        raise
    except Exception as err:
        text = str(err).strip()
        raise EvaluationError(f"{type(err).__name__}: {text.splitlines()[0] if text else ''}") from None
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=False,
            bootstrap_iters=1000,
        )
    except Exception as err:  # datasets not cached offline, a task's own failure: said in one line
        text = str(err).strip()
        raise EvaluationError(f"lm-eval failed: {type(err).__name__}: {text.splitlines()[0] if text else ''}") from None
    scores = {}
    for task, metrics in {**results.get("results", {}), **results.get("groups", {})}.items():
        entry = {}
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if kind and isinstance(value, (int, float)):
                entry[metric if kind == "none" else key] = value
        entry["samples"] = results.get("n-samples", {}).get(task, {}).get("effective")
        scores[task] = entry
    return {"tasks": scores, "seconds": round(time.perf_counter() - began, 2), "lm_eval": lm_eval.__version__}


def _quiet(lm_eval) -> None:
    """Turn off lm-eval's INFO logging, progress bars and environment report (`git`, `pip list`, `nvidia-smi`)."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    import lm_eval.evaluator as evaluator

    for name, replacement in (("add_env_info", lambda *a, **k: None), ("get_git_commit_hash", lambda *a, **k: None)):
        if hasattr(evaluator, name):
            setattr(evaluator, name, replacement)
    import tqdm

    def silent(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm.tqdm(*args, **kwargs)

    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.models.huggingface

    for module in (lm_eval.models.huggingface, lm_eval.api.model, lm_eval.api.task):
        if hasattr(module, "tqdm"):
            module.tqdm = silent

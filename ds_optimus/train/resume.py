"""Where a run resumes: its last step, whether it is finished already, what changed since its checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

# What makes a model another one: its parameters' names and shapes follow from these.
_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "tie_word_embeddings",
)


def _finished_with_this_model(opt, checkpoint: Path, summary: Path) -> bool:
    """Whether the summary says finished and `checkpoint` holds the configured model."""
    import json

    from ..checkpoint.files import CheckpointError, load
    from ..checkpoint.manager import MODEL_FILE

    try:
        if not json.loads(summary.read_text()).get("finished"):
            return False
        saved = load(checkpoint / MODEL_FILE)["config"]
    except (OSError, ValueError, KeyError, CheckpointError):
        return False
    now = opt.model.mula_config().to_dict()
    return all(saved.get(key) == now.get(key) for key in _SHAPE_KEYS)


def last_step(opt, tokens_per_step: int, start_step: int = 0, trained: int | None = None) -> int:
    """`train.steps`, or sooner the step reaching `train.stop_after_tokens` from `trained` tokens at `start_step`."""
    from ..optim.schedule import steps_for_tokens, token_count

    stop = token_count(opt.train.stop_after_tokens, "optimus.train.stop_after_tokens")
    if stop is None:
        return opt.train.steps
    if trained is None:
        return min(opt.train.steps, steps_for_tokens(stop, tokens_per_step))
    left = stop - trained
    return min(opt.train.steps, start_step + (steps_for_tokens(left, tokens_per_step) if left > 0 else 0))


def finished_already(opt, output_dir: Path, last: int) -> int | None:
    """The newest complete checkpoint's step if the run finished there, else None (rank 0's view, collective)."""
    from ..checkpoint.manager import step_of

    found: list[int | None] = [None]
    if dist.get_rank() == 0 and opt.checkpoint.resume and opt.checkpoint.enabled:
        complete = opt.checkpoint.build(output_dir).complete()
        step = step_of(complete[-1]) if complete else 0
        summary = output_dir / "summary.json"
        if complete and step >= last and summary.exists():
            found = [step if _finished_with_this_model(opt, complete[-1], summary) else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    return found[0]


def resume_changes(extra: dict[str, Any], trainer) -> list[str]:
    """Notes on a resume whose tokens a step or LR-schedule length differ from the checkpoint's."""
    tokens, steps = trainer.tokens_per_step, trainer.opt.train.steps
    notes, saved, saved_steps = [], extra.get("tokens_per_step"), extra.get("steps")
    if saved is not None and saved != tokens:
        notes.append(
            f"the global batch changed since the checkpoint: {saved:,} -> {tokens:,} tokens a step; "
            "the LR schedule and train.steps count steps, so each remaining step takes "
            f"{tokens / saved:.3g}x the tokens"
        )
    scheduler = trainer.ds_config.get("scheduler")
    follows = not scheduler or scheduler.get("params", {}).get("total_num_steps") == steps
    if saved_steps is not None and saved_steps != steps and follows:
        notes.append(
            f"train.steps changed since the checkpoint: {saved_steps:,} -> {steps:,}; the LR schedule "
            f"{'stretches' if steps > saved_steps else 'shrinks'} to the new length from here on"
        )
    return notes

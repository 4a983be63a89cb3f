"""The model card (`README.md`) of an exported Mula folder: Hub metadata as YAML front matter, then
the architecture and size, the training run (its config, data fingerprint, steps, tokens and losses)
and how to load the model. Built at export only; nothing in training reads it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainingRecord:
    """What a model card tells of the run that trained the model (any field may be unknown)."""

    config: dict[str, Any] | None = None  # the run's DeepSpeed config with its optimus section
    data_fingerprint: str | None = None  # the packed data's cache key (sources, tokenizer, split)
    datasets: tuple[str, ...] = ()  # Hub datasets among the sources
    steps: int | None = None  # optimizer steps taken
    tokens: int | None = None  # training tokens consumed
    loss: float | None = None  # the last step's training loss
    eval_loss: float | None = None  # the last held-out LM loss
    eval_step: int | None = None  # the step after which `eval_loss` was measured


def training_record(trainer) -> TrainingRecord:
    """The record of a `ds_optimus.train.Trainer` that has trained: its effective config, the
    fingerprint of its packed data, steps and tokens so far, and its last losses."""
    packed = getattr(trainer, "packed", None)
    fingerprint = packed.fingerprint if packed is not None else None
    sources = trainer.ds_config.get("optimus", {}).get("data", {}).get("sources", [])
    datasets = tuple(
        s["hf"] for s in sources if isinstance(s, dict) and isinstance(s.get("hf"), str) and not os.path.exists(s["hf"])
    )  # a name on the Hub, not a local folder
    losses, evals = trainer.summary.get("losses", {}), trainer.summary.get("evals", {})
    last_eval = max(evals) if evals else None
    return TrainingRecord(
        config=trainer.ds_config,
        data_fingerprint=fingerprint,
        datasets=datasets,
        steps=trainer.step,
        tokens=trainer.train_loader.tokens_consumed,
        loss=losses[max(losses)] if losses else None,
        eval_loss=evals[last_eval] if evals else None,
        eval_step=last_eval,
    )


def model_card(
    config,
    *,
    record: TrainingRecord | None = None,
    tokenizer=None,
    name: str | None = None,
    repo_id: str | None = None,
    license: str | None = None,
) -> str:
    """The README.md text of a folder holding a Mula model of `config`: front matter for the Hub
    (license only when given), architecture and parameter counts, `record`'s training run, the
    tokenizer, and how to load it (as `repo_id`, or a placeholder id)."""
    from huggingface_hub import ModelCardData

    moe = config.num_experts > 0
    metadata = ModelCardData(
        library_name="transformers",
        license=license,
        pipeline_tag="text-generation",
        tags=["mula", "moe", "ds_optimus"] if moe else ["mula", "ds_optimus"],
        datasets=list(record.datasets) if record and record.datasets else None,
    )
    kind = "Mixture-of-Experts" if moe else "dense"
    title = name or repo_id or f"Mula {kind} language model"
    parts = [
        f"---\n{metadata.to_yaml()}\n---\n",
        f"# {title}\n",
        f"A {kind} decoder-only causal language model of the Mula family"
        + (
            ", pretrained with ds_optimus (a DeepSpeed extension for pretraining Mixture-of-Experts models)."
            if record
            else ", saved by ds_optimus."
        )
        + "\n",
        _architecture(config),
    ]
    if record is not None:
        parts.append(_training(record))
    if tokenizer is not None:
        parts.append(_tokenizer(tokenizer))
    parts.append(_loading(repo_id))
    return "\n".join(parts)


def _architecture(config) -> str:
    from ..hf_models.mula import count_parameters

    moe = config.num_experts > 0
    total, active = count_parameters(config)
    rows = [
        ("decoder layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        (
            "attention heads (key/value heads)",
            f"{config.num_attention_heads} ({config.num_key_value_heads}), head size {config.head_dim}",
        ),
    ]
    if moe:
        moe_layers = len(config.moe_layers)
        rows += [
            ("MoE layers", f"{moe_layers} of {config.num_hidden_layers}"),
            (
                "experts per MoE layer (routed per token)",
                f"{config.num_experts} ({config.num_experts_per_tok}), {config.router_scoring_func} router",
            ),
            ("expert intermediate size", config.moe_intermediate_size),
        ]
        if moe_layers < config.num_hidden_layers:
            rows.append(("dense FFN intermediate size", config.intermediate_size))
    else:
        rows.append(("FFN intermediate size (SwiGLU)", config.intermediate_size))
    rows += [
        ("vocabulary", config.vocab_size),
        ("context length (positions)", config.max_position_embeddings),
        ("embeddings", "tied to the LM head" if config.tie_word_embeddings else "untied"),
        ("parameters", f"{_count(total)} total, {_count(active)} active per token" if moe else _count(total)),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    attention = "grouped-query" if config.num_key_value_heads < config.num_attention_heads else "multi-head"
    dropping = (
        "dropless"
        if config.moe_capacity_factor is None
        else f"capacity factor {config.moe_capacity_factor}: slots beyond it are dropped"
    )
    norm = "RMSNorm" if getattr(config, "norm_type", "rms_norm") == "rms_norm" else "LayerNorm"
    if not getattr(config, "norm_elementwise_affine", True):
        norm = f"non-parametric {norm}"
    layers = (
        f"{norm} pre-norm decoder layers"
        + (" with QK-norm" if config.qk_norm else "")
        + f", rotary position embeddings, {attention} attention and SwiGLU feed-forward networks"
        + (
            f"; MoE layers hold stacked SwiGLU experts and send each token to its top-k experts ({dropping})."
            if moe
            else "."
        )
    )
    exact = f"{total:,} total, {active:,} active" if moe else f"{total:,}"
    return (
        f"## Architecture\n\n{layers}\n\n| | |\n|---|---|\n{table}\n\n"
        f"Parameters: {exact}, the embeddings included (once when tied).\n"
    )


def _training(record: TrainingRecord) -> str:
    facts = []
    if record.steps is not None:
        facts.append(f"- optimizer steps: {record.steps:,}")
    if record.tokens is not None:
        compact = f" ({_count(record.tokens)})" if record.tokens >= 1e5 else ""
        facts.append(f"- training tokens: {record.tokens:,}{compact}")
    if record.loss is not None:
        facts.append(f"- final training loss: {record.loss:.4f}")
    if record.eval_loss is not None:
        after = f" (after step {record.eval_step:,})" if record.eval_step is not None else ""
        facts.append(f"- held-out LM loss: {record.eval_loss:.4f}{after}")
    if record.data_fingerprint is not None:
        facts.append(
            f"- data fingerprint: `{record.data_fingerprint}` (a hash of each data source's identity and "
            "weight; a text source's identity covers its files, the tokenizer and the held-out split)"
        )
    lines = ["## Training\n", "\n".join(facts) + "\n" if facts else ""]
    if record.config is not None:
        text = json.dumps(record.config, indent=2, default=str)
        lines.append(
            "The run's DeepSpeed config (its `optimus` section holds the model, data and training "
            "settings of ds_optimus):\n\n" + _fenced(text, "json")
        )
    return "\n".join(lines)


def _tokenizer(tokenizer) -> str:
    special = [
        f"{role} `{getattr(tokenizer, role + '_token')}` = {getattr(tokenizer, role + '_token_id')}"
        for role in ("bos", "eos", "pad")
        if getattr(tokenizer, role + "_token_id", None) is not None
    ]
    return (
        f"## Tokenizer\n\n{len(tokenizer):,} tokens (a fast tokenizer: `tokenizer.json`); "
        + ", ".join(special)
        + ". `generation_config.json` carries the same ids.\n"
    )


def _loading(repo_id: str | None) -> str:
    model_id = json.dumps(repo_id or "<org>/<name>")
    note = "" if repo_id else "Replace `<org>/<name>` with the Hub id of this model, or the path of its folder.\n\n"
    code = (
        "import ds_optimus  # registers Mula with the Auto classes\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"model = AutoModelForCausalLM.from_pretrained({model_id})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({model_id})\n"
        'ids = tokenizer("The with statement", return_tensors="pt").input_ids\n'
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=40)[0]))\n"
    )
    remote = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"model = AutoModelForCausalLM.from_pretrained({model_id}, trust_remote_code=True)\n"
        f"tokenizer = AutoTokenizer.from_pretrained({model_id}, trust_remote_code=True)\n"
    )
    return (
        "## How to load\n\n"
        + note
        + "With ds_optimus installed:\n\n"
        + _fenced(code, "python")
        + "\nWithout it, the folder's own model code (`configuration_mula.py`, `modeling_mula.py`: they import "
        "only `torch` and `transformers`) loads it; `AutoTokenizer` reads the model's config first, so it "
        "takes `trust_remote_code=True` as well (`PreTrainedTokenizerFast.from_pretrained` loads the "
        "tokenizer alone without it):\n\n" + _fenced(remote, "python")
    )


def _fenced(text: str, language: str) -> str:
    """`text` in a code fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}\n"


def _count(n: int) -> str:
    """A count as the README writes them: 0.92M, 6.92B."""
    for scale, suffix, least in ((1e12, "T", 1e12), (1e9, "B", 1e9), (1e6, "M", 1e5)):
        if n >= least:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:,}"

"""The pre-flight of `python -m ds_optimus.train --config X.json --check [--world N]`: everything about a
run that can
be known before it is launched, without a process group: the config (DeepSpeed's keys too), the
batch sizes and layout for the world size it would run with, the tokenizer, the model (built on the
meta device, and a folder's weights against it), the data sources and their token cache, the
planner's memory estimate per rank and the checkpoint it would resume from. `check_run` returns
what would run, in lines; anything that would stop the run is the one-line error it would be."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Any

from ..schema import ConfigError


def resolve_world(ds_config: dict[str, Any], world: int | None, stages: int = 1, tensor: int = 1) -> tuple[int, str]:
    """The world size to check against and where it comes from: `--world`, the launcher's
    WORLD_SIZE, or the config's three batch sizes (the data-parallel size, times the `stages` of a
    pipeline and the `tensor` ranks of a TP group); else one process per stage and TP rank."""
    if world is not None:
        if world < 1:
            raise ConfigError(f"--world must be a positive integer, got {world}")
        return world, "--world"
    if os.environ.get("WORLD_SIZE", "").isdigit():
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    total, micro, accumulation = (ds_config.get(k) for k in keys)
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (total, micro, accumulation)):
        if total % (micro * accumulation) == 0:
            times = [f"{stages} pipeline stages"] * (stages > 1) + [f"tensor parallel size {tensor}"] * (tensor > 1)
            return (
                total // (micro * accumulation) * stages * tensor,
                " x ".join(["train_batch_size / (micro-batch x accumulation)", *times]),
            )
    return stages * tensor, "no --world given"


@contextlib.contextmanager
def _guessed(world: int, source: str):
    """A layout error at a world size that was guessed (from the batch sizes, or one per stage) says
    so: the launch, not the check, decides the world size, and the batch sizes may be what is wrong."""
    try:
        yield
    except ValueError as err:  # ConfigError and LayoutError
        if source in ("--world", "WORLD_SIZE"):
            raise
        raise type(err)(
            f"{err} (the world size {world} is not given but taken from {source}: pass --world N, the "
            "ranks the launch will start, or correct the batch sizes)"
        ) from None


def check_run(ds_config: dict[str, Any], world: int | None = None, cluster: str | None = None) -> list[str]:
    """What the run of `ds_config` would be at `world` ranks, in lines; raises the one-line error
    (ConfigError, DataError, LayoutError, ...) that would stop it. `cluster` (a planner cluster
    name or file) adds a check of the predicted memory per rank against its devices'."""
    import torch

    from ..config import check_run_config, resolve_batch_sizes, resolve_schedule
    from ..data import load_tokenizer
    from ..data.tokenizer import looks_like_a_path
    from ..hf_models.mula import MulaForCausalLM, count_parameters
    from ..parallel.dims import ParallelDims
    from ..parallel.stages import check_pipeline

    config = copy.deepcopy(ds_config)
    opt = check_run_config(config)
    stages, tp = opt.pipeline_parallel.size, opt.tensor_parallel.size
    world, source = resolve_world(config, world, stages, tp)
    with _guessed(world, source):
        dims = ParallelDims.from_config(opt, world)  # the trainer's layout, with its checks
        dp = dims.dp  # the ranks of a pipeline stage and TP position: data parallelism
        micro, accumulation = resolve_batch_sizes(config, dp, stages, tp)
    name = opt.data.tokenizer
    try:  # a Hub tokenizer from the local cache only: a check never waits on the network
        tokenizer = load_tokenizer(name, local_files_only=True)
    except ValueError as err:
        if name is None or os.path.exists(os.path.expanduser(name)) or looks_like_a_path(name):
            raise ConfigError(f"optimus.data.tokenizer: {err}") from None
        tokenizer = None  # a Hub name not cached here: the run downloads it
    model_config = opt.model.mula_config(tokenizer, opt.data.seq_len)
    ep = opt.expert_parallel
    # a dense model's EP size is wrong at any world size: that refusal says nothing of a guessed one
    with _guessed(world, source) if model_config.num_experts else contextlib.nullcontext():
        dims.check_experts(model_config.num_experts)
    if stages > 1:  # the trainer's own checks, with its words
        check_pipeline(opt, config, model_config, accumulation)
    with torch.device("meta"):
        model = MulaForCausalLM(model_config)
    _check_weights(opt.model.path, model)
    if tp > 1:  # the trainer's split, on the meta device: a width the TP size does not divide is its error
        from ..parallel.tensor_parallel import apply_tensor_parallel

        with torch.device("meta"):
            split = MulaForCausalLM(model_config)
            apply_tensor_parallel(split, None, tp, 0)
        if opt.tensor_parallel.sequence_parallel:
            from ..parallel.tensor_parallel import apply_sequence_parallel

            apply_sequence_parallel(split, None)
    total, active = count_parameters(model_config)
    experts = (
        f", {model_config.num_experts} experts top-{model_config.num_experts_per_tok}"
        if model_config.num_experts
        else ", dense"
    )
    stage = config.get("zero_optimization", {}).get("stage", 0)
    optimizer = "the EP-aware sharded optimizer" if opt.sharded_optimizer.enabled else "DeepSpeed's optimizer"
    exchange = ""
    if ep.size > 1:
        if getattr(ep, "dispatch", "alltoall") == "allgather":
            exchange = f", expert parallel {ep.size} (allgather dispatch)"
        else:
            hierarchy = (
                f", hierarchical over nodes of {ep.node_size}" if ep.node_size and ep.node_size < ep.size else ""
            )
            dedup = str(ep.dedup).lower() if isinstance(ep.dedup, bool) else f'"{ep.dedup}"'  # as the JSON has it
            exchange = f", expert parallel {ep.size} (dedup {dedup}, chunks {ep.chunks}{hierarchy})"
    pipeline = ""
    if stages > 1:
        pp = opt.pipeline_parallel
        virtual = f", {pp.virtual_stages} virtual stages" if pp.virtual_stages > 1 else ""
        pipeline = (
            f", pipeline {stages} stages of {dp * tp} ranks ({pp.schedule}{virtual}, {accumulation} micro-batches)"
        )
    sequence = " with sequence parallelism" if opt.tensor_parallel.sequence_parallel else ""
    tensor = f", tensor parallel {tp}{sequence} (inside each group of {tp} consecutive ranks)" if tp > 1 else ""
    ranks = _count(world, "rank") if stages == 1 and tp == 1 else _count(dp, "data-parallel rank")
    tokens = micro * accumulation * dp * opt.data.seq_len
    opt = resolve_schedule(opt, tokens)  # train.tokens: the steps they take at this batch
    lines = [
        f"model     {opt.model.describe()}: {total / 1e6:,.2f}M parameters ({active / 1e6:,.2f}M active per token), "
        f"{model_config.num_hidden_layers} layers{experts}; built on the meta device",
        f"layout    {_count(world, 'rank')} ({source}): data parallel {dp}{tensor}{exchange}{pipeline}; "
        f"ZeRO-{stage} with {optimizer}" + _recompute_note(opt.train.recompute),
        f"batch     {_count(micro, 'sequence')} x {accumulation} accumulation x {ranks} = "
        f"{_count(micro * accumulation * dp, 'sequence')} of {opt.data.seq_len} tokens ({tokens:,} tokens) per step",
        *_data_lines(opt, tokenizer),
        _memory_line(model_config, opt, config, world, micro, accumulation, cluster),
        _run_line(opt, tokenizer, world, tokens, total * _weight_bytes(config)),
    ]
    return lines


def _recompute_note(recompute: bool | tuple[str, ...]) -> str:
    """What the layout line says of activation recomputation."""
    if recompute is True:
        return "; every decoder layer recomputed in the backward pass"
    names = {"moe": "the MoE block", "attention": "the attention", "norms": "the norms"}
    parts = [names[p] for p in recompute or ()]
    if not parts:
        return ""
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"; {listed} of every decoder layer recomputed in the backward pass"


def _check_weights(path: str | None, model) -> None:
    """A Mula or OLMoE folder's weights against the model built on the meta device, from the files'
    headers only (names and shapes; no tensor is read), as the start checks them."""
    from ..parallel.model_source import check_folder_weights, has_weights

    folder = Path(path) if path else None
    if folder is None or not has_weights(folder):
        return
    kind = json.loads((folder / "config.json").read_text()).get("model_type")
    check_folder_weights(folder, model.config, kind, when=" at the start")


def _data_lines(opt, tokenizer) -> list[str]:
    from ..data.shards import TokenStream
    from ..data.sources import DistinctFiles, is_saved_dataset, parse_sources, resolve_files
    from ..data.token_files import token_files
    from ..data.units import source_folder

    sources = parse_sources(opt.data.sources)
    described = []
    distinct = DistinctFiles()  # a file two sources train on, as the run's start refuses it
    for i, source in enumerate(sources):
        share = f", weight {source.weight:g}" if source.weight is not None else ""
        if source.kind == "files" and not is_saved_dataset(source.target):
            files = resolve_files(source)  # a missing path is the error it would be at start
            distinct.add(i, source, files)
            described.append(
                f"{source.label}: {source.target} ({_count(len(files), 'file')}, "
                f"{sum(p.stat().st_size for p in files):,} bytes{share})"
            )
        elif source.kind == "tokens":  # the headers, and the first tokens against the vocabulary, as at start
            train = token_files(source.target, source.dtype)
            distinct.add(i, source, [Path(f.path) for f in train])
            files = train + (token_files(source.val, source.dtype) if source.val else [])
            first = TokenStream(files).head(1 << 16)
            if tokenizer is not None and first.size and first.max() >= len(tokenizer):
                raise ConfigError(
                    f"optimus.data.sources: source {source.label!r} holds token id {int(first.max())}, "
                    f"outside the tokenizer's {len(tokenizer)} tokens (tokenized with another one?)"
                )
            tokens = sum(f.length for f in files)
            described.append(
                f"{source.label}: {source.target} ({_count(len(files), 'token file')}, {tokens:,} "
                f"tokens read in place{share})"
            )
        elif source.kind in ("hf", "files"):
            where = "a local dataset folder" if os.path.exists(source.target) else "from the Hub, not checked here"
            described.append(f"{source.label}: {source.target} ({where}{share})")
        else:
            described.append(f"embedded (the Python reference manual{share})")
    if tokenizer is None:
        return [
            f"data      {'; '.join(described)}; tokenizer {opt.data.tokenizer} (from the Hub, not in the local "
            "cache: downloaded at the start; its size against the model's vocabulary not checked here)",
            "tokens    tokenized at the start, unless a cache made with that tokenizer is found then",
        ]
    name = opt.data.tokenizer or f"the shipped {len(tokenizer)}-token BPE"
    ready, todo = 0, []
    for source in sources:
        if source.kind == "tokens":
            continue
        folder = source_folder(source, tokenizer, opt.data.cache_dir, opt.data.val_fraction)
        if (folder / "meta.json").exists():
            ready += json.loads((folder / "meta.json").read_text())["train_tokens"]
        else:
            todo.append(source.label)
    in_place = sum(1 for s in sources if s.kind == "tokens")
    cache = f"{ready:,} train tokens prepared in {opt.data.cache_dir}" if ready else f"cache {opt.data.cache_dir}"
    if in_place == len(sources):
        cache = "pre-tokenized sources only: nothing to tokenize"
    if todo:
        cache += (
            f"; {', '.join(todo)} tokenized at the start (every rank its share), or before with python -m "
            "ds_optimus.data.prepare"
        )
    return [f"data      {'; '.join(described)}; tokenizer {name}", f"tokens    {cache}"]


def _memory_line(model_config, opt, config, world, micro, accumulation, cluster) -> str:
    from ..plan.cluster import get_cluster
    from ..plan.configs import layout_of
    from ..plan.layout import LayoutError
    from ..plan.memory import estimate_memory, gib
    from ..plan.model import ModelShape

    shape = ModelShape.from_config(model_config)
    layout = layout_of(opt, config, world, micro, accumulation, shape)
    try:
        layout.check(shape.experts, shape.layers)
    except LayoutError as err:
        raise ConfigError(f"layout: {err}") from None
    memory = estimate_memory(shape, layout)
    parts = {
        "weights": memory.weights,
        "optimizer state": memory.optimizer_state,
        "gradients and buffers": memory.gradients_at_peak + memory.buffers,
        "activations": memory.activations,
    }
    parts["the rest at the peak (loss gradients, a recomputed layer, the exchange)"] = memory.peak - sum(parts.values())
    where = f" (stage {memory.stage} of {layout.pp}, the largest)" if layout.pp > 1 else ""
    line = (
        f"memory    predicted peak {gib(memory.peak):,.2f} GiB per rank{where} ("
        + ", ".join(f"{name} {gib(value):,.2f}" for name, value in parts.items())
        + "; the planner's estimate)"
    )
    if memory.stage_peaks:
        line += "; per stage " + ", ".join(f"{gib(peak):,.1f}" for peak in memory.stage_peaks) + " GiB"
    if cluster is not None:
        device = get_cluster(cluster)
        usable = device.usable_bytes if hasattr(device, "usable_bytes") else device.memory_bytes
        if memory.peak > usable:
            raise ConfigError(
                f"predicted peak {gib(memory.peak):,.1f} GiB per rank does not fit the "
                f"{gib(usable):,.1f} GiB usable on {_a(device.device)} ({device.name}); see "
                "python -m ds_optimus.plan for layouts that fit"
            )
        line += (
            f"; fits the {gib(usable):,.1f} GiB usable on {_a(device.device)} ({device.memory_gib:.1f} GiB less "
            f"{device.memory_reserve_gib:g} reserved)"
        )
    return line


def _data_change(opt, tokenizer, checkpoint: Path) -> None:
    """The one line the run would stop on when its data differs from `checkpoint`'s (its manifest
    holds the loader's record; shares of sources not prepared yet are not compared)."""
    import numpy as np

    from ..data.mixture import changed_data_message, data_changes
    from ..data.sources import parse_sources
    from ..data.units import plan_sources

    try:
        saved = json.loads((checkpoint / "meta.json").read_text()).get("data", {}).get("sources")
    except (OSError, ValueError):
        return
    if saved is None or tokenizer is None or opt.data.allow_change:
        return
    plans = plan_sources(parse_sources(opt.data.sources), tokenizer, opt.data.cache_dir, opt.data.val_fraction)
    sizes = []
    for plan in plans:
        if plan.train_files is not None:
            sizes.append(sum(f.length for f in plan.train_files) // opt.data.seq_len)
        elif (plan.folder / "meta.json").exists():
            sizes.append(json.loads((plan.folder / "meta.json").read_text())["train_tokens"] // opt.data.seq_len)
        else:
            sizes.append(None)
    weights = [p.source.weight for p in plans]
    if all(w is not None for w in weights):
        shares = list(np.asarray(weights, dtype=float) / sum(weights))
    elif all(n is not None for n in sizes) and sum(sizes):
        shares = [n / sum(sizes) for n in sizes]
    else:
        shares = [None] * len(plans)
    changes = data_changes(saved, [p.source.label for p in plans], [p.identity for p in plans], shares, weights)
    if changes:
        raise ConfigError(changed_data_message(changes, since=str(checkpoint)))


def _weight_bytes(ds_config: dict[str, Any]) -> int:
    """Bytes of a weight as the model holds it: 2 under bf16 or fp16, else 4."""
    half = any(ds_config.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
    return 2 if half else 4


def _run_line(
    opt, tokenizer=None, world: int | None = None, tokens_per_step: int | None = None, model_bytes: int | None = None
) -> str:
    from ..checkpoint.manager import describe_layout, saved_layout, step_of, trained_without_checkpoint
    from .resume import last_step

    train, checkpoint = opt.train, opt.checkpoint
    manager = checkpoint.build(train.output_dir)  # the run's own manager, as the trainer builds it
    complete = manager.complete()
    done = step_of(complete[-1]) if complete else 0
    stop = last_step(opt, tokens_per_step) if tokens_per_step else train.steps
    if complete and checkpoint.resume and done >= stop:
        further = (
            "raise optimus.train.stop_after_tokens to train further"
            if stop < train.steps
            else "raise optimus.train.steps to train further; the LR schedule then stretches to the new length"
        )
        start = f"nothing to train: {complete[-1]} is step {done} of {stop} ({further})"
    elif complete and checkpoint.resume:
        _data_change(opt, tokenizer, complete[-1])
        start = f"resumes from {complete[-1]} (if intact)"
        try:
            saved = saved_layout(json.loads((complete[-1] / "meta.json").read_text()))
        except (OSError, ValueError, KeyError):
            saved = None  # the run's own checks of the checkpoint say what is wrong with it
        now = (world, opt.expert_parallel.size, opt.pipeline_parallel.size, opt.tensor_parallel.size) if world else None
        if saved and now and saved != now:
            start += f", saved by {describe_layout(*saved)}: its state resharded to {describe_layout(*now)}"
    elif complete:
        raise ConfigError(
            f"checkpoint.resume is false but {manager.directory} holds checkpoints of an earlier run; "
            "remove them or point checkpoint.dir elsewhere"
        )
    else:
        refused = (
            trained_without_checkpoint(train.output_dir, manager.directory)
            if (checkpoint.resume and checkpoint.enabled)
            else None
        )
        if refused:
            raise ConfigError(refused)
        start = f"starts at step 0 (no checkpoint in {manager.directory})"
    every = f"every {checkpoint.interval} steps and " if checkpoint.interval else ""
    saves = (
        f"checkpoints {every}at the end (keep {checkpoint.keep_last})"
        if checkpoint.enabled
        else "no checkpoints (checkpoint.enabled is false)"
    )
    if checkpoint.enabled and checkpoint.keep_every:
        saves += f", the model alone every {checkpoint.keep_every} steps (kept"
        count = stop // checkpoint.keep_every
        if model_bytes and count:  # never pruned: what they come to by the run's end
            saves += f": {count:,} of {_bytes(model_bytes)}, {_bytes(count * model_bytes)} by the end"
        saves += ")"
    length = f"{train.steps} steps"
    if train.tokens is not None and tokens_per_step:
        length += f" ({train.tokens} tokens)"
    if stop < train.steps:
        length += f", stopping after step {stop} (train.stop_after_tokens {train.stop_after_tokens})"
    return f"run       {length} into {train.output_dir}; {saves}; {start}"


def _count(n: int, noun: str) -> str:
    """ "1 rank", "2 ranks"."""
    return f"{n} {noun}{'s' * (n != 1)}"


def _a(noun: str) -> str:
    """`noun` with its indefinite article, by sound: "an Intel Max 1550 tile", "an NVIDIA H100", "a CPU"."""
    first = noun.split()[0] if noun.split() else ""
    vowel = first[:1] in "AEFHILMNORSX" if first.isupper() else first[:1].lower() in "aeio"
    return f"{'an' if vowel else 'a'} {noun}"


def _bytes(count: float) -> str:
    """A size in binary units, 3 significant digits: 11.4 MiB, 440 GiB, 1.72 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1000:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:,.3g} TiB" if count < 1000 else f"{count:,.0f} TiB"

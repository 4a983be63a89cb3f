"""The trainer's pieces, each usable on its own: process group, batch sizes, LR schedule, data preparation,
recomputation, compilation, the HF export and a sample from it.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..command_line import said_by_every_rank
from ..config import ConfigError, check_run_config, resolve_batch_sizes, resolve_schedule  # noqa: F401  (re-exported: the trainer's pieces)


def init_distributed() -> str:
    """torch.distributed through DeepSpeed from whichever launcher started this process (or none); returns a log
    line."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ..integrations.deepspeed_ops import prepare_op_builds
    from ..launch.environment import LaunchError, adopt, open_files_for

    if dist.is_initialized():
        return launch_summary()
    try:
        world = adopt()
        if world.rank == 0:
            open_files_for(world.size)  # rank 0's store holds a connection per rank
    except LaunchError as err:
        raise said_by_every_rank(ConfigError(f"launch: {err}")) from None
    note = world_size_note(world.rank, world.size, os.environ)
    if note:
        print(note, file=sys.stderr, flush=True)
    prepare_op_builds()
    if world.launcher == "none":  # plain `python -m ds_optimus.train`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    accelerator = get_accelerator()
    backend = accelerator.communication_backend_name()
    if accelerator.device_name() == "cpu" and backend == "ccl":
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            backend = "gloo"
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    except dist.DistNetworkError as err:  # rank 0 could not open the rendezvous port
        if "EADDRINUSE" not in str(err) and "address already in use" not in str(err).lower():
            raise
        raise ConfigError(
            f"port {os.environ.get('MASTER_PORT')} on {os.environ.get('MASTER_ADDR')} is in use (another "
            "job on this machine?): set MASTER_PORT to a free port (the deepspeed launcher: "
            "--master_port N)"
        ) from None
    if "LOCAL_RANK" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:  # the launcher did not say
        local_rank, local_size = _local_place()
        os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size))
    from ..launch.environment import bind_cpus

    bound = bind_cpus(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    if accelerator.device_name() == "cpu":
        if bound:
            torch.set_num_threads(len(bound))  # its own cores: no further split
        else:
            cpu_threads_per_rank()
    return launch_summary()


def world_size_note(rank: int, size: int, env) -> str | None:
    """Rank 0's warning when the world size is Slurm's task count without an srun step."""
    from ..launch.environment import SIZE_FROM_VARIABLE

    if rank != 0 or not env.get(SIZE_FROM_VARIABLE) or env.get("SLURM_STEP_ID"):
        return None
    return (
        f"launch: waiting for {size} ranks ({env[SIZE_FROM_VARIABLE]}, no srun step): inside a batch script, "
        "start the ranks with srun"
    )


def launch_summary() -> str:
    """One line: world, launcher, rendezvous and this rank's CPU cores."""
    from ..launch.environment import LAUNCHER_VARIABLE, LAUNCHERS, SIZE_FROM_VARIABLE

    launcher = os.environ.get(LAUNCHER_VARIABLE, "none")
    names = {
        "none": "no launcher",
        "openmpi": "Open MPI's mpiexec",
        "pals": "Cray PALS mpiexec",
        "mpich": "MPICH/Intel MPI mpiexec",
    }  # else the launcher table's own words
    started_by = names.get(launcher) or next((x.what for x in LAUNCHERS if x.name == launcher), launcher)
    how = os.environ.get("DS_OPTIMUS_RENDEZVOUS")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    size_from = os.environ.get(SIZE_FROM_VARIABLE)
    size_from = f" (the size from {size_from}: no srun step variables)" if size_from else ""
    world = dist.get_world_size()
    return (
        f"world: {world} rank{'s' if world != 1 else ''}{size_from}, "
        f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} on this host, started by {started_by}; rendezvous "
        f"{os.environ.get('MASTER_ADDR')}:"
        f"{os.environ.get('MASTER_PORT')}"
        + (f" ({how})" if how else "")
        + (f"; rank {dist.get_rank()} on CPU cores {_ranges(cores)}" if cores else "")
    )


def _ranges(cores: list[int]) -> str:
    out, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            out.append(f"{start}" if start == core else f"{start}-{core}")
            start = None
    return ",".join(out)


def cpu_threads_per_rank() -> int:
    """On CPU, give each local rank its share of the cores (unless OMP_NUM_THREADS is set); returns the count."""
    # The deepspeed launcher leaves every rank at all cores: N ranks would run N x cores threads.
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or _local_world_size())
    threads = max(1, cores // max(1, local))
    torch.set_num_threads(threads)
    return threads


def _local_world_size() -> int:
    return _local_place()[1]


def _local_place() -> tuple[int, int]:
    """(local rank, ranks on this host), by an all-gather of host names."""
    from ..launch.environment import this_host

    me = this_host()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, me)
    return names[: dist.get_rank()].count(me), names.count(me)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_schedule(train, lr: float):
    """`optimizer -> LambdaLR`: warm-up, then cosine decay to min_lr_ratio x `lr`."""
    from ..optim.schedule import lr_factor, warmup_start

    start = warmup_start(train.lr_schedule, train.warmup_start_lr, train.min_lr_ratio, lr)
    factor = lr_factor(train.lr_schedule, train.steps, train.warmup_steps, train.min_lr_ratio, start)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def scheduler_defaults(ds_config: dict[str, Any], steps: int) -> None:
    """Give DeepSpeed's decaying schedulers the run's length when the config leaves it out."""
    scheduler = ds_config.get("scheduler")
    if scheduler and scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        scheduler.setdefault("params", {}).setdefault("total_num_steps", steps)


def prepare_everywhere(data, tokenizer):
    """Open the run's data, tokenizing what is not prepared: rank 0 plans and broadcasts, each rank tokenizes its
    share."""
    from ..data import DataError, parse_sources, prepare_data
    from ..data.units import plan_sources

    sources = parse_sources(data.sources)
    if not dist.is_initialized():  # the Hugging Face Trainer's script prepares before its group exists
        from ..data.prepare import launch_world

        rank, world = launch_world()
        return prepare_data(
            sources,
            tokenizer,
            data.cache_dir,
            data.val_fraction,
            workers=data.workers,
            rank=rank,
            world=world,
            progress=rank == 0,
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:
        check_shared_folder(Path(data.cache_dir), "optimus.data.cache_dir")
    found: list[Any] = [None]
    if rank == 0:
        try:
            found[0] = ("plan", plan_sources(sources, tokenizer, data.cache_dir, data.val_fraction))
        except Exception as err:  # whatever it is, the ranks waiting below must hear of it
            found[0] = ("error", str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}")
    if world > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0][0] == "error":
        raise said_by_every_rank(DataError(found[0][1]))
    return prepare_data(
        sources,
        tokenizer,
        data.cache_dir,
        data.val_fraction,
        workers=data.workers,
        rank=rank,
        world=world,
        progress=rank == 0,
        plan=found[0][1],
    )


def describe_data(packed, loader) -> str:
    """One line on the run's data: tokens, documents, source shares."""
    tokens_only = sum(1 for s in packed.sources if s.documents is None)
    docs = f" from {packed.documents:,} documents" if packed.documents else ""
    if tokens_only:
        docs += f"{' and' if docs else ' from'} {tokens_only} pre-tokenized source{'s' if tokens_only > 1 else ''}"
    line = f"data: {packed.train_tokens:,} train / {packed.val_tokens:,} held-out tokens{docs} ({packed.root})"
    if len(loader.names) > 1:
        line += "; drawn " + ", ".join(
            f"{name} {share:.1%}" for name, share in zip(loader.names, loader.weights, strict=True)
        )
    return line


def check_shared_folder(folder: Path, what: str) -> None:
    """Raise on every rank unless all ranks see rank 0's files in `folder` (collective)."""
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f".shared-probe-{token[0]}").write_text(token[0])
        except OSError as err:
            token[0] = f"error: {err}"
    dist.broadcast_object_list(token, src=0)
    if token[0].startswith("error: "):
        raise said_by_every_rank(ValueError(f"{what} {str(folder)!r}: {token[0][7:]}"))
    probe = folder / f".shared-probe-{token[0]}"  # one launch's own, beside another's that started with it
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else socket.gethostname())
    blind = sorted({host for host in blind if host is not None})
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    if blind:
        raise said_by_every_rank(
            ValueError(
                f"{what} {str(folder)!r} is not shared: rank 0's files there are not seen on {', '.join(blind[:4])}"
                f"{' ...' if len(blind) > 4 else ''}; put it on a filesystem every node mounts"
            )
        )


def enable_activation_checkpointing(model, parts: bool | Sequence[str] = True) -> None:
    """Recompute each decoder layer in backward, or only `parts` of each (`MulaDecoderLayer.recompute`)."""
    if parts is not True:
        layers = [m for m in model.modules() if isinstance(getattr(type(m), "recompute", None), property)]
        if not layers:
            raise ValueError(f"selective recomputation needs Mula decoder layers; {type(model).__name__} has none")
        for layer in layers:
            layer.recompute = tuple(parts or ())
        return
    kwargs = {"use_reentrant": False}  # the sharded optimizer's gradient hooks then fire once per parameter
    if hasattr(model, "activation_checkpointing_enable"):  # the name since Transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_layers(model) -> int:
    """Compile every decoder layer in place; returns the count."""
    layers = model.model.layers
    layers = list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)  # a pipeline stage's
    for layer in layers:
        layer.compile()
    return len(layers)


def export(model, tokenizer, folder: Path, groups, record=None) -> None:
    """Write an HF folder for the Hub (collective): the model with every expert gathered, tokenizer, generation
    config, a Mula model's card."""
    from ..parallel.expert_parallel import export_pretrained
    from .model_card import model_card

    is_mula = getattr(model.config, "model_type", None) == "mula"
    if tokenizer is not None and getattr(model.config, "max_position_embeddings", None):
        tokenizer.model_max_length = model.config.max_position_embeddings  # not the "unlimited" 1e30
    card = model_card(model.config, record=record, tokenizer=tokenizer) if is_mula else None
    generation = generation_config(tokenizer) if tokenizer is not None else None
    tensor = groups.tensor if groups is not None else None
    if groups is None or (groups.pipeline is None and tensor is None):
        export_pretrained(model, folder, groups, tokenizer=tokenizer, model_card=card, generation_config=generation)
        return
    from ..parallel.expert_parallel import gather_experts
    from ..parallel.tensor_parallel import join_for_writer, split_parameters

    # each stage's first rank writes (rank 0 without stages); its EP group gathers the experts, its TP group
    # the split weights
    writer = groups.pipeline.stage_ranks[0] if groups.pipeline is not None else 0
    state = (
        model.state_dict()
        if groups.ep_size == 1 or writer not in groups.ep_ranks
        else gather_experts(model, groups, writer)
    )
    if tensor is not None:
        state = (
            join_for_writer(state, split_parameters(model), tensor.group, tensor.ranks.index(writer))
            if writer in tensor.ranks
            else None
        )
    if groups.pipeline is None:
        export_pretrained(
            model,
            folder,
            groups,
            tokenizer=tokenizer,
            model_card=card,
            generation_config=generation,
            state_dict=state if dist.get_rank() == writer else {},
        )
        return
    from ..parallel.pipeline import write_stage_weights

    export_pretrained(
        model, folder, groups, tokenizer=tokenizer, model_card=card, generation_config=generation, state_dict={}
    )
    write_stage_weights(folder, state, groups.pipeline)


def generation_config(tokenizer):
    """A `GenerationConfig` of `tokenizer`'s bos, eos and pad (else eos) ids."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)


def sample(folder: Path, prompt: str, new_tokens: int, seed: int = 0) -> str:
    """A continuation of `prompt` by the model in `folder` (top-k sampling, fixed seed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=True,  # a small model decoded greedily mostly repeats one token
            top_k=40,
            temperature=0.8,
            repetition_penalty=1.3,
            pad_token_id=tokenizer.pad_token_id,
        )
    torch.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def data_prompt(packed, tokenizer, tokens: int = 6) -> str:
    """The first held-out (else training) document's first `tokens` tokens, up to its end."""
    for split in ("val", "train"):
        ids = packed.tokens(split).head(tokens).tolist()
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        if ids:
            return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.eos_token


def dense_fingerprint(model) -> float:
    """The sum of the non-expert weights: equal on every rank unless replicas diverged."""
    from ..parallel.expert_parallel import is_expert_param

    with torch.no_grad():
        model.state_dict(keep_vars=True)  # waits for a parameter all-gather still under way (overlap_param_gather)
        return float(sum(p.detach().double().sum() for p in model.parameters() if not is_expert_param(p)))


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
    found: list[int | None] = [None]
    if dist.get_rank() == 0 and opt.checkpoint.resume and opt.checkpoint.enabled:
        complete = opt.checkpoint.build(output_dir).complete()
        step = int(complete[-1].name.split("_")[-1]) if complete else 0
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

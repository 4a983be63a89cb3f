"""`engine.save_checkpoint` / `engine.load_checkpoint` for engines running the sharded optimizer.

A checkpoint is `<save_dir>/<tag>/` (default tag `global_step<N>`; `latest` names the newest): model, optimizer,
client and engine files, and the manifest `meta.json`, written last. State is keyed by parameter name and global
element range, never by rank, so a checkpoint loads on any layout (world size, EP size, ZeRO stage, bucket size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..command_line import said_by_every_rank
from ..optim.shard_state import files_holding, held_ranges, load_spaces
from ..optim.spaces import ShardedOptimizerError
from ..parallel.expert_parallel import expert_groups_of, is_expert_param
from ..parallel.tensor_parallel import Split, TensorParallelError, join_parts, split_parameters
from .files import CheckpointError, CheckpointWriter, copy_to_cpu, gather, load
from .model_files import grouped, read_weights, this_ranks_parts
from .rng import numpy_array_types

ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


# What a checkpoint of another model in the run's folder asks the user to do (every rank raises it alike).
_OTHER_MODEL = (
    "it is a checkpoint of another model: start in another optimus.train.output_dir, or set "
    "optimus.checkpoint.resume=false"
)


class CheckpointLoadError(CheckpointError):
    """A checkpoint folder this engine cannot load; the message says why in one line."""


def model_files(
    engine, groups, exclude_frozen_parameters: bool = False, min_part_bytes: int | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """This rank's model files (dense, TP-split and expert weights, each by its first replica or, with
    `min_part_bytes`, in parts by many) and their manifest entries. Collective-free."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = engine.module
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if exclude_frozen_parameters else set()
    experts = {n for n, p in module.named_parameters() if is_expert_param(p)}
    state = {k: v.detach() for k, v in module.state_dict().items() if k not in frozen}
    files: dict[str, Any] = {}
    about: dict[str, dict[str, Any]] = {}

    def add(written: tuple[dict, dict]) -> None:
        files.update(written[0])
        about.update(written[1])

    # With pipeline stages, each stage's ranks write its stage's part (names are the whole model's).
    pipeline, tensor = pipeline_of(engine, groups), getattr(groups, "tensor", None)
    splits = split_parameters(module) if tensor is not None else {}
    part = f"_pp{pipeline.stage:03d}" if pipeline is not None else ""
    dense = {k: v for k, v in state.items() if k not in experts and k not in splits}
    stage_ranks = list(pipeline.stage_ranks) if pipeline is not None else list(range(world))
    add(this_ranks_parts(f"model_dense{part}", dense, None, stage_ranks, rank, min_part_bytes))
    if splits:  # each TP position's part, by that position's data-parallel ranks
        add(
            this_ranks_parts(
                f"model_tensor{part}_tp{tensor.rank:03d}",
                {k: v for k, v in state.items() if k in splits},
                {
                    "tp_size": tensor.size,
                    "tp_rank": tensor.rank,
                    "splits": {k: [list(v.full), v.dim, v.start, v.stop] for k, v in splits.items() if k in state},
                },
                list(groups.dp_ranks),
                rank,
                min_part_bytes,
            )
        )
    if experts and groups is not None and (tensor is None or tensor.rank == 0):  # by the EP rank's replicas
        add(
            this_ranks_parts(
                f"model_experts_ep{groups.ep_rank:03d}{part}",
                {k: v for k, v in state.items() if k in experts},
                {"ep_size": groups.ep_size, "ep_rank": groups.ep_rank},
                list(groups.edp_ranks),
                rank,
                min_part_bytes,
            )
        )
    return files, about


def checkpoint_files(
    engine,
    groups,
    client_state=None,
    exclude_frozen_parameters: bool = False,
    copy: bool = False,
    min_part_bytes: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """This rank's checkpoint files {name: object}, the manifest fields and its files' entries; collective-free.
    `copy` snapshots every tensor, for a save while training goes on."""
    rank = dist.get_rank()
    files, about = model_files(engine, groups, exclude_frozen_parameters, min_part_bytes)
    optim = files[f"optim_rank{rank:05d}.pt"] = engine.optimizer.state_dict()
    files[f"client_rank{rank:05d}.pt"] = client_state or {}
    if rank == 0:
        scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        files["engine.pt"] = {
            "lr_scheduler": scheduler,
            "counters": {k: getattr(engine, k) for k in ENGINE_COUNTERS},
            "param_groups": optim["param_groups"],
        }  # what the scheduler's lists follow
    files = copy_to_cpu(files, copy)
    meta = {**layout_meta(engine, groups), "zero_stage": engine.optimizer.stage}
    return files, meta, {**about, f"optim_rank{rank:05d}.pt": {"holds": held_ranges(optim)}}


def layout_meta(engine, groups) -> dict[str, Any]:
    """The manifest's format and layout fields of a checkpoint of `engine`."""
    pipeline, tensor = pipeline_of(engine, groups), getattr(groups, "tensor", None)
    return {
        "format": "ds_optimus.checkpoint/1",
        "world_size": dist.get_world_size(),
        "ep_size": groups.ep_size if groups is not None else 1,
        "pp_size": dist.get_world_size() // len(pipeline.stage_ranks) if pipeline is not None else 1,
        "tp_size": tensor.size if tensor is not None else 1,
    }


def save_checkpoint(
    engine, save_dir, tag=None, client_state=None, save_latest: bool = True, exclude_frozen_parameters: bool = False
) -> bool:
    """Write a checkpoint of `engine` (collective: every rank calls it)."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    tags = [None] * world
    dist.all_gather_object(tags, tag)
    if len(set(tags)) != 1:
        raise ValueError(f"save_checkpoint: ranks passed different tags ({', '.join(sorted(set(map(str, tags))))})")
    root = Path(save_dir)
    writer = CheckpointWriter(rank, world)
    writer.prepare(root, tag)
    files, meta, about = checkpoint_files(
        engine, expert_groups_of(engine.module), client_state, exclude_frozen_parameters
    )
    writer.write(root, tag, files, {**meta, "tag": tag}, save_latest=save_latest, about=about)
    return True


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn=None,
):
    """Load a `save_checkpoint` checkpoint; returns (path, client_state), or (None, None) without tag or `latest`."""
    if custom_load_fn is not None:
        raise NotImplementedError("custom_load_fn is not supported with the sharded optimizer")
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            return None, None
        tag = latest.read_text().strip()
    path = root / str(tag)
    client = load_folder(
        engine,
        path,
        expert_groups_of(engine.module),
        load_module_strict=load_module_strict,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states,
        load_module_only=load_module_only,
    )
    return str(path), client


def load_folder(
    engine,
    path: Path,
    groups,
    *,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    meta: dict | None = None,
) -> Any:
    """Load folder `path` (manifest `meta` if already read) into `engine`; returns the client state.
    Errors (CheckpointLoadError, CheckpointError) are raised on every rank alike."""
    path, optimizer, error = Path(path), engine.optimizer, None
    optim = load_optimizer_states and not load_module_only
    try:
        meta = meta or _manifest(path)
        client, saved, shards = _read_and_load_weights(
            engine, path, groups, meta, load_module_strict, optim, not load_module_only
        )
        if optim:  # this rank's state from the files (a one-line error for an element none holds)
            load_spaces(optimizer.spaces, shards)
    except CheckpointError as err:
        error = err
    except Exception as err:  # a file that loads but is not what it should be: no rank may go on alone
        text = str(err).strip().splitlines()
        error = CheckpointLoadError(
            f"{path}: "
            + (
                str(err)
                if isinstance(err, ShardedOptimizerError)
                else f"{type(err).__name__}: {text[0] if text else ''}"
            )
        )
    _agree(error)  # before the optimizer's collectives: no rank goes on while another stopped
    if optim:
        optimizer.load_shards(shards, filled=True)
    else:
        optimizer.refresh_master_from_params()
    if saved is not None:
        if load_lr_scheduler_states and saved["lr_scheduler"] is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(  # its per-group lists follow rank 0's param groups
                _fit_scheduler_state(saved["lr_scheduler"], saved["param_groups"], optimizer.param_groups)
            )
        for key, value in saved["counters"].items():
            setattr(engine, key, value)
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    return client


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointLoadError(f"{path} is not a complete ds_optimus checkpoint ({type(err).__name__})") from None


def _read_and_load_weights(engine, path: Path, groups, meta: dict, strict: bool, optim: bool, engine_state: bool):
    """Load the model's weights; returns (client state, engine state or None, this rank's optimizer files)."""
    rank, world, module = dist.get_rank(), dist.get_world_size(), engine.module
    # A rank's own client state when the world size is unchanged, rank 0's otherwise. The small files
    # are read first: one that is refused leaves the engine untouched.
    source = rank if meta["world_size"] == world else 0
    client = load(path / f"client_rank{source:05d}.pt", allow=numpy_array_types())  # numpy: older RNG states
    saved = load(path / "engine.pt") if engine_state else None
    if saved is not None and "param_groups" not in saved:  # written before engine.pt kept rank 0's groups
        saved["param_groups"] = load(path / "optim_rank00000.pt", mmap=True)["param_groups"]
    shards = [load(path / name, mmap=True) for name in optimizer_files(meta, engine.optimizer.spaces)] if optim else []
    # one file per pipeline stage (or its parts), mapped: a stage copies only its own part, and opens only
    # the parts holding its weights (or names of no stage, which then fail below)
    own, whole = module.state_dict().keys(), _whole_model_names(module) if pipeline_of(engine, groups) else None
    wanted = None if whole is None else (lambda name: name in own or name not in whole)
    state, _ = read_weights(path, [f for f in meta["files"] if f.startswith("model_dense")], wanted, meta["files"])
    state.update(_split_weights(module, path, meta, state))  # first: what is not among them may be experts
    state.update(_expert_weights(engine, path, meta, state, groups))
    if whole is not None:  # a stage keeps its part; a name of no stage stays, and fails
        state = {k: v for k, v in state.items() if k in own or k not in whole}
    try:
        module.load_state_dict(state, strict=strict)
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        first = next((line for line in lines if "key" in line or "size mismatch" in line), lines[0] if lines else "")
        first = first if len(first) <= 160 else first[:157] + "..."
        raise CheckpointLoadError(f"{path} does not fit this model ({first}); {_OTHER_MODEL}") from None
    return client, saved, shards


def _agree(error: CheckpointError | None) -> None:
    """Raise the first failing rank's error on every rank (collective), or nothing if none failed."""
    errors = [e for e in gather(dist.get_world_size(), (type(error).__name__, str(error)) if error else None) if e]
    if errors:
        kind, message = errors[0]
        raise said_by_every_rank((CheckpointLoadError if kind == "CheckpointLoadError" else CheckpointError)(message))


def optimizer_files(meta: dict, spaces) -> list[str]:
    """Optimizer files holding elements of `spaces`: at least one, all where the manifest does not say."""
    names = [f"optim_rank{r:05d}.pt" for r in range(meta["world_size"])]
    records = meta["files"] if isinstance(meta["files"], dict) else {}
    return files_holding({n: (records.get(n) or {}).get("holds") for n in names}, spaces) or names[:1]


def _expert_weights(engine, path: Path, meta: dict, dense: dict[str, torch.Tensor], groups) -> dict[str, torch.Tensor]:
    """This rank's slice of every expert weight, cut from saved weights of any EP size, opening only needed files."""
    params = dict(engine.module.named_parameters())
    if groups is not None and groups.ep_size > 1:
        wanted = {
            n: (groups.ep_rank * p.shape[0], (groups.ep_rank + 1) * p.shape[0], p.shape[0] * groups.ep_size)
            for n, p in params.items()
            if is_expert_param(p)
        }
    else:  # every expert here; those the checkpoint keeps in its EP shards
        shards = any(f.startswith("model_experts_") for f in meta["files"])
        wanted = {n: (0, p.shape[0], p.shape[0]) for n, p in params.items() if n not in dense and shards}
    files: dict[int, dict] = {}
    out = {}
    for name, (lo, hi, experts) in wanted.items():
        if name in dense:
            out[name] = dense.pop(name)[lo:hi].clone()
            continue
        pieces, saved_per = [], -(-experts // meta["ep_size"])
        for q in range(lo // saved_per, min(meta["ep_size"], -(-hi // saved_per))):
            if q not in files:  # EP rank q's file, or one per pipeline stage (or their parts)
                files[q] = read_weights(
                    path,
                    [f for f in meta["files"] if f.startswith(f"model_experts_ep{q:03d}")],
                    wanted.__contains__,
                    meta["files"],
                )[0]
            if name not in files[q]:
                raise CheckpointLoadError(f"{path} has no weight {name}: {_OTHER_MODEL}")
            per = files[q][name].shape[0]
            a, b = max(lo, q * per), min(hi, (q + 1) * per)
            if a < b:
                pieces.append(files[q][name][a - q * per : b - q * per])
        if sum(len(piece) for piece in pieces) != hi - lo:  # saved for another number of experts
            raise CheckpointLoadError(f"{path} holds {name} for another number of experts: {_OTHER_MODEL}")
        out[name] = torch.cat(pieces).clone()
    return out


def _split_weights(module, path: Path, meta: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of every TP-split weight, from saved whole tensors (`state`) or parts of any TP size."""
    splits = split_parameters(module)
    parts: dict[str, list] = {}
    own = module.state_dict()
    for group in grouped(list(meta["files"]), "model_tensor").values():  # a TP position's file, or its parts
        weights, saved = read_weights(path, group, own.__contains__, meta["files"])
        for name, tensor in weights.items():
            full, dim, start, stop = saved["splits"][name]
            parts.setdefault(name, []).append((Split(tuple(full), dim, start, stop), tensor))
    out = {}
    for name, pieces in parts.items():
        if name not in own:
            continue  # another pipeline stage's
        split = splits.get(name) or Split(pieces[0][0].full, pieces[0][0].dim, 0, pieces[0][0].full[pieces[0][0].dim])
        if split.dim != pieces[0][0].dim:
            raise CheckpointLoadError(f"{path}: {name} is split along another dimension; {_OTHER_MODEL}")
        try:
            out[name] = join_parts(pieces, split.start, split.stop)
        except TensorParallelError as err:
            raise CheckpointLoadError(f"{path}: {name}: {err}; {_OTHER_MODEL}") from None
    for name, split in splits.items():  # saved whole (without tensor parallelism): this rank's part of it
        if name in state and name not in out and tuple(state[name].shape) == split.full:
            out[name] = state[name].narrow(split.dim, split.start, split.stop - split.start).clone()
    return out


def pipeline_of(engine, groups):
    """The pipeline layout of `engine`'s model: its groups', or the one its engine was given."""
    return getattr(groups, "pipeline", None) or getattr(getattr(engine, "mpu", None), "pipeline", None)


def _whole_model_names(module) -> set[str]:
    """State-dict names of the whole model a pipeline stage belongs to (built on the meta device)."""
    with torch.device("meta"):
        return set(type(module)(module.config).state_dict())


def _fit_scheduler_state(state, saved_groups: list[dict], groups: list[dict]):
    """Scheduler `state` with its per-group lists mapped to `groups` by name (else the first saved group)."""
    if not isinstance(state, dict) or len(saved_groups) == len(groups):
        return state
    names = [g.get("name") for g in saved_groups]
    source = [names.index(g.get("name")) if g.get("name") in names else 0 for g in groups]
    state = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = state.get(key)
        if isinstance(values, list) and len(values) == len(saved_groups):
            state[key] = [values[i] for i in source]
    return state

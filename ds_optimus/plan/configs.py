"""A layout written out as a DeepSpeed JSON config with an `optimus` section, like `ds_configs/`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ..parallel.traffic import dedup_sends_fewer_bytes
from .cluster import Cluster
from .layout import DTYPE_BYTES, Layout, LayoutError, hierarchy_node_size
from .model import ModelShape

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def template_path(preset: str, cluster: str | None = None) -> Path | None:
    """The shipped config a plan of `preset` starts from: the cluster's own (`ds_configs/<preset>-<cluster>.json`,
    e.g. the Mula runs on Aurora: their sequence length and global batch), else the preset's, else the
    tiny CPU one; None where none is shipped."""
    names = ([f"{preset}-{cluster}.json"] if cluster else []) + [
        f"{preset}.json",
        f"{preset}-cpu.json",
        "mula-tiny-moe-cpu.json",
    ]
    return next((CONFIG_DIR / n for n in names if (CONFIG_DIR / n).exists()), None)


def template_for(preset: str, cluster: str | None = None) -> dict[str, Any]:
    """The shipped config of `template_path`, else a minimal one."""
    path = template_path(preset, cluster)
    if path is not None:
        return json.loads(path.read_text())
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 4e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "optimus": {},
    }


def layout_config(
    layout: Layout, preset: str, cluster: Cluster | None = None, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The DeepSpeed config that runs `preset` under `layout` (from `base`, or the preset's shipped
    config, keeping its optimizer, data and schedule)."""
    config = copy.deepcopy(base if base is not None else template_for(preset))
    config["train_batch_size"] = layout.global_batch
    config["train_micro_batch_size_per_gpu"] = layout.micro
    config["gradient_accumulation_steps"] = layout.accumulation
    for key in ("bf16", "fp16"):
        config.pop(key, None)
    if layout.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif layout.dtype == "fp16":
        config["fp16"] = {"enabled": True}
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = layout.zero
    if layout.zero == 0:
        for key in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"):
            zero.pop(key, None)
    else:
        zero["overlap_comm"] = layout.overlap_comm
        zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = layout.bucket_size
    optimus = config.setdefault("optimus", {})
    optimus.setdefault("model", {})["preset"] = preset
    # node_size selects the hierarchical exchange: whole nodes, or gcd(ep, devices per node) sub-nodes
    # where the groups are not aligned to nodes (the planner's `hierarchy_node_size`)
    # (an EP group's ranks on a node: devices per node over the TP size, as an EP group is one TP position's)
    node_size = (
        hierarchy_node_size(layout.ep, cluster.devices_per_node // layout.tp)
        if layout.hierarchical and cluster is not None
        else None
    )
    optimus["expert_parallel"] = {
        "size": layout.ep,
        "node_size": node_size,
        "dedup": layout.dedup,
        "chunks": layout.chunks,
    }
    if layout.dispatch != "alltoall":  # the default is left out
        optimus["expert_parallel"]["dispatch"] = layout.dispatch
    if layout.pp > 1:  # the runtime's balanced split of the layers (`layers` null)
        optimus["pipeline_parallel"] = {
            "size": layout.pp,
            "schedule": layout.schedule,
            "virtual_stages": layout.virtual_stages,
            "layers": None,
        }
    else:
        optimus.pop("pipeline_parallel", None)
    if layout.tp > 1:
        optimus["tensor_parallel"] = {"size": layout.tp, "sequence_parallel": layout.sp}
    else:
        optimus.pop("tensor_parallel", None)
    sharded = optimus.setdefault("sharded_optimizer", {})
    sharded["enabled"] = layout.sharded
    if layout.sharded:
        sharded["bucket_size"] = layout.bucket_size
        sharded["overlap_comm"] = layout.overlap_comm
        sharded["shard_group_size"] = layout.shard_group
        sharded["overlap_param_gather"] = layout.gather_overlap
        if layout.reduce_dtype:
            sharded["reduce_dtype"] = layout.reduce_dtype
        else:
            sharded.pop("reduce_dtype", None)
    else:
        for key in ("bucket_size", "reduce_dtype", "overlap_comm", "shard_group_size", "overlap_param_gather"):
            sharded.pop(key, None)
    optimus.setdefault("data", {})["seq_len"] = layout.seq_len
    train = optimus.setdefault("train", {})
    ckpt = layout.checkpointing
    train["activation_checkpointing"] = ckpt if isinstance(ckpt, bool) else list(ckpt)  # the parts recomputed
    if cluster is not None and not cluster.shared_compute:
        train["peak_tflops"] = cluster.peak_tflops
    return config


def layout_of(
    opt: Any, ds_config: dict[str, Any], world: int, micro: int, accumulation: int, model: ModelShape | None = None
) -> Layout:
    """The layout a parsed training config (`opt`, the `OptimusConfig` of `ds_config`) runs at `world`
    ranks with its resolved micro-batch and accumulation: the inverse of `layout_config`. `dedup`
    "auto" is decided as the runtime decides it, by the bytes (`model` needed; else per slot)."""
    dtype = (
        "bf16"
        if ds_config.get("bf16", {}).get("enabled")
        else "fp16"
        if ds_config.get("fp16", {}).get("enabled")
        else "fp32"
    )
    ep, pp, sharded = opt.expert_parallel, opt.pipeline_parallel, opt.sharded_optimizer
    dispatch = getattr(ep, "dispatch", "alltoall")
    hierarchical = bool(ep.node_size and ep.node_size < ep.size) and dispatch == "alltoall"
    dedup = ep.dedup
    if dispatch != "alltoall":
        dedup = False
    elif dedup == "auto":
        destinations = ep.size // ep.node_size if hierarchical else ep.size
        dedup = ep.chunks > 1 or bool(
            model is not None
            and model.experts
            and ep.size > 1
            and dedup_sends_fewer_bytes(
                model.experts, model.top_k, destinations, model.hidden * DTYPE_BYTES[dtype], DTYPE_BYTES[dtype]
            )
        )
    zero = ds_config.get("zero_optimization", {})
    return Layout(
        world=world,
        ep=ep.size,
        pp=pp.size,
        zero=zero.get("stage", 0),
        sharded=sharded.enabled,
        micro=micro,
        accumulation=accumulation,
        checkpointing=opt.train.recompute,
        hierarchical=hierarchical,
        dedup=bool(dedup),
        chunks=ep.chunks,
        seq_len=opt.data.seq_len,
        dtype=dtype,
        reduce_dtype=sharded.reduce_dtype,
        bucket_size=sharded.bucket_size,
        schedule=pp.schedule,
        virtual_stages=pp.virtual_stages,
        dispatch=dispatch,
        shard_group=sharded.shard_group_size if sharded.enabled else None,
        gather_overlap=bool(sharded.enabled and sharded.overlap_param_gather),
        tp=opt.tensor_parallel.size,
        sp=opt.tensor_parallel.sequence_parallel,
    )


def layout_from_config(ds_config: dict[str, Any], world: int | None = None) -> tuple[ModelShape, Layout]:
    """(its model, its layout) of a training config at `world` ranks (default: the world its batch
    sizes record, times its pipeline stages); a one-line error where they do not fit together."""
    from ..config import OptimusConfig, resolve_batch_sizes

    config = copy.deepcopy(ds_config)
    opt = OptimusConfig.from_ds_config(config)
    model = ModelShape.from_config(opt.model.mula_config(), name=opt.model.preset or opt.model.path)
    stages, tensor = opt.pipeline_parallel.size, opt.tensor_parallel.size
    if world is None:
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        total, micro, accumulation = (config.get(k) for k in keys)
        if not all(isinstance(v, int) and v > 0 for v in (total, micro, accumulation)):
            raise LayoutError(
                "the config does not record its world size (train_batch_size, micro-batch and "
                "accumulation): give --devices"
            )
        world = total // (micro * accumulation) * stages * tensor
    if world % (stages * tensor):
        raise LayoutError(
            f"optimus.pipeline_parallel.size {stages} x optimus.tensor_parallel.size {tensor} does not "
            f"divide the {world} ranks"
        )
    micro, accumulation = resolve_batch_sizes(config, world // stages // tensor, stages, tensor)
    return model, layout_of(opt, config, world, micro, accumulation, model)


def write_config(config: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path

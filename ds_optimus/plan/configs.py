"""A layout written out as a DeepSpeed JSON config with an `optimus` section, like `ds_configs/`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .cluster import Cluster
from .layout import Layout, LayoutError, hierarchy_node_size

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def template_for(preset: str) -> dict[str, Any]:
    """The shipped config of a preset (`ds_configs/<preset>.json`), else the tiny CPU one."""
    for name in (f"{preset}.json", f"{preset}-cpu.json", "mula-tiny-moe-cpu.json"):
        path = CONFIG_DIR / name
        if path.exists():
            return json.loads(path.read_text())
    return {"optimizer": {"type": "AdamW", "params": {"lr": 4e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                       "weight_decay": 0.1}}, "optimus": {}}


def layout_config(layout: Layout, preset: str, cluster: Cluster | None = None,
                  base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config that runs `preset` under `layout` (from `base`, or the preset's shipped
    config, keeping its optimizer, data and schedule)."""
    if layout.pp > 1:
        raise LayoutError(f"layout {layout.describe()} uses pipeline parallelism, which ds_optimus.train does "
                          "not run; it is planned only")
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
    node_size = hierarchy_node_size(layout.ep, cluster.devices_per_node) \
        if layout.hierarchical and cluster is not None else None
    optimus["expert_parallel"] = {"size": layout.ep, "node_size": node_size, "dedup": layout.dedup,
                                  "chunks": layout.chunks}
    sharded = optimus.setdefault("sharded_optimizer", {})
    sharded["enabled"] = layout.sharded
    if layout.sharded:
        sharded["bucket_size"] = layout.bucket_size
        sharded["overlap_comm"] = layout.overlap_comm
        if layout.reduce_dtype:
            sharded["reduce_dtype"] = layout.reduce_dtype
        else:
            sharded.pop("reduce_dtype", None)
    else:
        for key in ("bucket_size", "reduce_dtype", "overlap_comm"):
            sharded.pop(key, None)
    optimus.setdefault("data", {})["seq_len"] = layout.seq_len
    train = optimus.setdefault("train", {})
    ckpt = layout.checkpointing
    train["activation_checkpointing"] = ckpt if isinstance(ckpt, bool) else list(ckpt)  # the parts recomputed
    if cluster is not None and not cluster.shared_compute:
        train["peak_tflops"] = cluster.peak_tflops
    return config


def write_config(config: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path

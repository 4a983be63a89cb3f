"""Layout planning: predict per-rank memory and step time of a Mula model under each parallel
layout (data, expert and pipeline parallel) on a described cluster, rank the layouts, write the best
as a DeepSpeed config, check the predictions against real runs, and project scaling
(`python -m ds_optimus.plan --help`).

Imports neither DeepSpeed nor the training code; `measure` starts real runs in subprocesses.
"""

from .cluster import BUILTIN, Cluster, ClusterError, get_cluster, local_cluster
from .configs import layout_config, layout_from_config
from .layout import Layout, LayoutError
from .memory import MemoryEstimate, estimate_memory
from .model import ModelShape
from .scaling import ScalingPoint, efficiency, scaling
from .search import Plan, evaluate, search
from .timing import TimeEstimate, estimate_time

__all__ = [
    "BUILTIN",
    "Cluster",
    "ClusterError",
    "Layout",
    "LayoutError",
    "MemoryEstimate",
    "ModelShape",
    "Plan",
    "ScalingPoint",
    "TimeEstimate",
    "efficiency",
    "estimate_memory",
    "estimate_time",
    "evaluate",
    "get_cluster",
    "layout_config",
    "layout_from_config",
    "local_cluster",
    "scaling",
    "search",
]

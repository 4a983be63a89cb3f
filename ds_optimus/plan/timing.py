"""Per-step time of a layout: compute, expert-parallel all-to-all, gradient reduction, parameter
all-gather, and the pipeline bubble.

Ranks are placed as `ds_optimus.parallel` places them: consecutive ranks form an EP group, so an EP
group stays inside a node while `ep <= devices_per_node`, and the expert-data-parallel group
(stride `ep`) and the dense data-parallel group (all ranks) span nodes as soon as the run does.

Collectives cost bandwidth time (bytes each rank sends over its link's rate x the cluster's
`comm_efficiency`) plus latency (one step per peer for all-to-all; 2 log2(n) steps for the
reduce-scatter and all-gather, as tree and hierarchical algorithms take on large groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster
from .layout import Layout
from .memory import local_params
from .model import ModelShape


@dataclass(frozen=True)
class TimeEstimate:
    compute: float  # all micro-batches' forward and backward (with recomputation) per step
    all_to_all: float  # EP dispatch and combine, per step
    grad_reduce: float  # exposed gradient reduction (what the backward pass does not hide)
    param_gather: float  # the all-gather of updated parameters (and ZeRO-0's all-reduce)
    bubble: float  # pipeline fill and drain
    overhead: float  # per-layer fixed costs (launches, Python)

    @property
    def step(self) -> float:
        return self.compute + self.all_to_all + self.grad_reduce + self.param_gather + self.bubble + self.overhead

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "all_to_all": self.all_to_all, "grad_reduce": self.grad_reduce,
                "param_gather": self.param_gather, "bubble": self.bubble, "overhead": self.overhead,
                "step": self.step}


def _link(cluster: Cluster, nodes: int) -> tuple[float, float]:
    """(bytes/s, latency s) of a collective whose group spans `nodes` nodes (1: inside a node;
    beyond `group_nodes`, the tapered links between groups)."""
    if nodes <= 1:
        return cluster.intra_node_gbps * 1e9 * cluster.comm_efficiency, cluster.intra_node_latency_us * 1e-6
    bandwidth = cluster.inter_node_gbps * 1e9 * cluster.comm_efficiency
    if cluster.group_nodes is not None and nodes > cluster.group_nodes:
        bandwidth *= cluster.global_bandwidth_fraction
    return bandwidth, cluster.inter_node_latency_us * 1e-6


def ring_time(nbytes: float, group: int, cluster: Cluster, nodes: int) -> float:
    """Reduce-scatter or all-gather of `nbytes` (the full buffer) over `group` ranks on `nodes` nodes."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    bw, latency = _link(cluster, nodes)
    return nbytes * (group - 1) / group / bw + 2 * math.log2(group) * latency


def all_to_all_time(nbytes: float, ep: int, cluster: Cluster, hierarchical: bool) -> float:
    """One exchange in which each rank sends `nbytes` in total, spread evenly over its EP group."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    n = cluster.devices_per_node
    intra_bw, intra_lat = _link(cluster, 1)
    if n % ep == 0:  # every group is inside one node
        return nbytes * (ep - 1) / ep / intra_bw + (ep - 1) * intra_lat
    nodes = -(-ep // n)
    inter_bw, inter_lat = _link(cluster, nodes)
    if not hierarchical or ep % n:
        # every rank talks to all ep - 1 peers; the off-node share crosses the NICs (a group not
        # aligned to nodes has ranks with at least half of their peers elsewhere)
        local = n if ep % n == 0 else max(1, min(n, ep) // 2)
        return max(nbytes * (ep - local) / ep / inter_bw, nbytes * (local - 1) / ep / intra_bw) + (ep - 1) * inter_lat
    # step 1 inside the node (gathering what goes to each local index), step 2 between nodes with
    # one aggregated message per node pair
    step1 = nbytes * (n - 1) / n / intra_bw + (n - 1) * intra_lat
    step2 = nbytes * (nodes - 1) / nodes / inter_bw + (nodes - 1) * inter_lat
    return step1 + step2


def estimate_time(model: ModelShape, layout: Layout, cluster: Cluster, expert_imbalance: float = 1.0,
                  overlap: bool | None = None) -> TimeEstimate:
    """Seconds per optimizer step of `model` under `layout` on `cluster`."""
    # on a CPU the processes share the cores, however many there are
    ranks_on_node = layout.world if cluster.shared_compute else min(layout.world, cluster.devices_per_node)
    rate = cluster.rate(ranks_on_node)
    tokens = layout.tokens_per_micro
    micro_batches = layout.accumulation
    flops = model.flops_per_token(layout.seq_len) * tokens
    if layout.checkpointing:  # one more forward of the layers (not of the LM head): a third of theirs
        flops += (flops - 6.0 * model.vocab * model.hidden * tokens) / 3
    # the experts' FLOPs run at the expert kernels' rate, and the busiest rank's experts take
    # `expert_imbalance` times their share
    recompute = 4 / 3 if layout.checkpointing else 1.0
    experts = 6.0 * model.moe_layers * model.top_k * 3 * model.hidden * model.expert_intermediate * tokens * recompute
    seconds = (flops - experts) / rate + experts * expert_imbalance / (rate * cluster.expert_efficiency)
    per_micro = seconds / layout.pp
    compute = per_micro * micro_batches
    overhead = (cluster.overhead_per_micro_batch_s
                + cluster.overhead_per_layer_s * model.layers / layout.pp * recompute) * micro_batches

    p, r = layout.param_bytes, layout.reduce_bytes
    # four exchanges per MoE layer and micro-batch (dispatch and combine, forward and backward),
    # six with recomputation; each moves the routed rows of the rank's tokens
    exchanges = (6 if layout.checkpointing else 4) * model.moe_layers / layout.pp
    rows_bytes = tokens * model.top_k * model.hidden * p * expert_imbalance
    a2a = exchanges * all_to_all_time(rows_bytes, layout.ep, cluster, layout.hierarchical) * micro_batches
    # each forward first exchanges the token counts (a few bytes: latency only)
    counts = (2 if layout.checkpointing else 1) * model.moe_layers / layout.pp
    a2a += counts * all_to_all_time(4.0 * model.experts, layout.ep, cluster, layout.hierarchical) * micro_batches

    dense, expert = local_params(model, layout)
    run_nodes = -(-layout.world // cluster.devices_per_node)
    dp_nodes = run_nodes  # the data-parallel group is every rank (of a pipeline stage)
    # the expert-data-parallel group takes every ep-th rank: one per node once ep >= a node
    edp_nodes = min(layout.edp, run_nodes) if run_nodes > 1 else 1
    # the slowest of the ranks sets the pace of every synchronising step
    straggle = cluster.step_jitter * math.sqrt(2 * math.log(layout.world)) if layout.world > 1 else 0.0
    compute *= 1 + straggle
    if overlap is None:
        overlap = not cluster.shared_compute  # gloo on CPU: the sharded optimizer does not overlap
    if layout.zero == 0:
        # all-reduce = reduce-scatter + all-gather, once per step after the last micro-batch
        reduce = 2 * (ring_time(p * dense, layout.dp, cluster, dp_nodes)
                      + ring_time(p * expert, layout.edp, cluster, edp_nodes))
        gather = 0.0
        exposed = reduce
    else:
        once = (ring_time(r * dense, layout.dp, cluster, dp_nodes)
                + ring_time(r * expert, layout.edp, cluster, edp_nodes))
        reductions = micro_batches if layout.zero == 2 else 1
        reduce = once * reductions
        gather = (ring_time(p * dense, layout.dp, cluster, dp_nodes)
                  + ring_time(p * expert, layout.edp, cluster, edp_nodes))
        if overlap:
            # buckets are reduced while the backward pass goes on (two thirds of the compute); the
            # last bucket's reduction is always exposed
            backward = compute * 2 / 3 / micro_batches
            buckets = max(1.0, (dense + expert) / layout.bucket_size)
            exposed = max(reduce / buckets, reduce - backward * reductions)
        else:
            exposed = reduce
    bubble = 0.0
    if layout.pp > 1:
        # 1F1B: (pp - 1) micro-batch slots of fill and drain, plus the activations sent between stages
        send = ring_time(tokens * model.hidden * p * 2, 2, cluster, min(run_nodes, 2))
        bubble = (layout.pp - 1) * (per_micro + send) + micro_batches * 2 * send
    return TimeEstimate(compute=compute, all_to_all=a2a, grad_reduce=exposed, param_gather=gather,
                        bubble=bubble, overhead=overhead)

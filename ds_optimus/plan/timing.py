"""Per-step time of a layout: compute, the expert-parallel exchange, gradient reduction, parameter
all-gather, and with pipeline stages the schedule's bubble and the sends between stages.

Ranks are placed as `ds_optimus.parallel` places them: consecutive ranks form an EP group, so an EP
group stays inside a node while `ep` divides `devices_per_node` (else some groups straddle two
nodes), and the expert-data-parallel group (stride `ep`) and the dense data-parallel group (all
ranks) span nodes as soon as the run does.

The EP exchange sends a token as `top_k` rows (per slot) or once per rank, or hierarchically per
node, owning one of its experts (deduplicated; expected counts from `ds_optimus.parallel.traffic`
under uniform routing). With `chunks` > 1 it is pipelined against the layer's experts. The allgather
dispatch instead all-gathers the group's tokens and reduce-scatters the experts' outputs.

With P pipeline stages (stage s = ranks [s·D, (s+1)·D)), each stage runs its layers (the runtime's
balanced split) for every micro-batch; the slowest stage sets the pace, and the schedule adds (P-1)/V of
its micro-batch slots of fill and drain, (P-1)/(V·m+P-1) of the step (a third of that for the
zero-bubble schedule). Gradients are reduced over a stage's D ranks in the schedule's drain,
overlapping its last backward pass (ZeRO-2 over one chunk per rank: at every micro-batch).

Collectives cost bandwidth time (bytes each rank sends over its link's rate x the cluster's
`comm_efficiency`) plus latency (one step per peer for all-to-all; 2 log2(n) steps for the
reduce-scatter and all-gather, as tree and hierarchical algorithms take on large groups).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from functools import lru_cache

from ..parallel.stages import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from ..parallel.traffic import expected_groups_hit, metadata_bytes
from .cluster import Cluster
from .layout import Layout, hierarchy_node_size
from .memory import local_params
from .model import ModelShape
from .pipeline_model import idle_slots, stages, virtual_of


@dataclass(frozen=True)
class TimeEstimate:
    compute: float  # all micro-batches' forward and backward (with recomputation) per step
    all_to_all: float  # EP dispatch and combine, per step
    grad_reduce: float  # exposed gradient reduction (what the backward pass does not hide)
    param_gather: float  # the all-gather of updated parameters (and ZeRO-0's all-reduce)
    bubble: float  # pipeline fill and drain
    overhead: float  # per-layer fixed costs (launches, Python)
    experts: float = 0.0  # of compute: the experts' grouped GEMMs (before the stragglers' share)
    all_to_all_hidden: float = 0.0  # EP exchange time hidden under the experts' compute (not in step)
    p2p: float = 0.0  # the pipeline's sends of activations and their gradients between stages
    reduce_across: float = 0.0  # of grad_reduce: hybrid sharding's all-reduce across shard groups
    gather_hidden: float = 0.0  # parameter all-gather time hidden under the next forward (not in step)
    tensor: float = 0.0  # tensor parallelism's all-reduces (or all-gathers and reduce-scatters) in the layers

    @property
    def step(self) -> float:
        return (
            self.compute
            + self.all_to_all
            + self.grad_reduce
            + self.param_gather
            + self.bubble
            + self.overhead
            + self.p2p
            + self.tensor
        )

    @property
    def communication(self) -> float:
        """Exposed communication: the EP exchange, gradient reduction, parameter gather, stage sends, the
        tensor-parallel collectives."""
        return self.all_to_all + self.grad_reduce + self.param_gather + self.p2p + self.tensor

    def as_dict(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "all_to_all": self.all_to_all,
            "grad_reduce": self.grad_reduce,
            "param_gather": self.param_gather,
            "bubble": self.bubble,
            "p2p": self.p2p,
            "overhead": self.overhead,
            "step": self.step,
            "experts": self.experts,
            "all_to_all_hidden": self.all_to_all_hidden,
            "reduce_across": self.reduce_across,
            "gather_hidden": self.gather_hidden,
            "tensor": self.tensor,
        }


def _link(cluster: Cluster, nodes: int, pattern: str = "ring") -> tuple[float, float]:
    """(bytes/s, latency s) of a collective whose group spans `nodes` nodes (1: inside a node;
    beyond `group_nodes`, the tapered links between groups: `Cluster.global_fraction` of a ring's or an
    all-to-all's `pattern`)."""
    if nodes <= 1:
        return cluster.intra_node_gbps * 1e9 * cluster.comm_efficiency, cluster.intra_node_latency_us * 1e-6
    bandwidth = cluster.inter_node_gbps * 1e9 * cluster.comm_efficiency * cluster.global_fraction(nodes, pattern)
    return bandwidth, cluster.inter_node_latency_us * 1e-6


def ring_time(nbytes: float, group: int, cluster: Cluster, nodes: int) -> float:
    """Reduce-scatter or all-gather of `nbytes` (the full buffer) over `group` ranks on `nodes` nodes."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    bw, latency = _link(cluster, nodes)
    return nbytes * (group - 1) / group / bw + 2 * math.log2(group) * latency


# the routing weights travel in fp32 beside the deduplicated rows (traffic.py's default too)
ROUTING_WEIGHT_BYTES = 4


@dataclass(frozen=True)
class Exchange:
    """What one rank sends in one EP exchange: `tokens` tokens of `row_bytes` each, routed to `top_k`
    of `experts` experts (uniformly, as `ds_optimus.parallel.traffic` assumes). Per slot, a token
    goes as `top_k` rows; deduplicated, as one row (plus `meta_bytes` of expert ids and weights) per
    group of ranks owning at least one of its experts."""

    tokens: float
    row_bytes: float
    experts: int = 1
    top_k: int = 1
    dedup: bool = False
    meta_bytes: float = 0.0

    def to_each(self, groups: int) -> float:
        """Bytes to each of `groups` equal groups of consecutive ranks of the EP group (for groups of
        one rank, to each rank; for nodes, to each node)."""
        if not self.dedup:
            return self.tokens * self.top_k / groups * self.row_bytes
        rows = expected_groups_hit(self.experts, self.top_k, groups) / groups
        return self.tokens * rows * (self.row_bytes + self.meta_bytes)


def exchange_steps(x: Exchange, ep: int, devices_per_node: int, hierarchical: bool) -> list[tuple[float, float]]:
    """The steps of one exchange over an EP group of `ep` consecutive ranks: (bytes a rank sends over
    its node's links, bytes over the NICs) per step, one step, or two for the hierarchical exchange."""
    n = devices_per_node
    if ep <= 1:
        return []
    if n % ep == 0:  # every group is inside one node
        return [((ep - 1) * x.to_each(ep), 0.0)]
    # a group not aligned to nodes has ranks with at least half of their peers elsewhere
    local = n if ep % n == 0 else max(1, min(n, ep) // 2)
    size = hierarchy_node_size(ep, n) if hierarchical else None
    if size is None:  # every rank sends to all ep - 1 peers; the off-node ones through the NICs
        each = x.to_each(ep)
        return [((local - 1) * each, (ep - local) * each)]
    groups = ep // size
    # between (sub-)nodes, on the rail of the rank's local index: what goes to each other node, once
    # per node hit when deduplicated. Sub-nodes of an unaligned group (size = gcd(ep, n) < n) are
    # parts of physical nodes; as in the flat rule, a rank has `local` of its group on its own node,
    # so (ep - local) of the ep - size ranks of the other sub-nodes are off-node and the rest on its
    # node's links (aligned groups: local = n = size, every other node off-node).
    between = (groups - 1) * x.to_each(groups)
    off = (ep - max(local, size)) / (ep - size)
    # inside each sub-node, from the rank of the rail to the other ranks its rows are for (per slot:
    # gathering what goes to each local index first, the same bytes): size - 1 of each node's ranks
    inside = groups * (size - 1) * x.to_each(ep)
    return [(between * (1 - off), between * off), (inside, 0.0)]


def all_to_all_time(nbytes: float | Exchange, ep: int, cluster: Cluster, hierarchical: bool, chunks: int = 1) -> float:
    """One exchange in which each rank sends `nbytes` per slot (or an `Exchange`) over its EP group,
    cut into `chunks` pieces that each pay the collective's latency."""
    x = nbytes if isinstance(nbytes, Exchange) else Exchange(tokens=float(nbytes), row_bytes=1.0)
    n = cluster.devices_per_node
    if ep <= 1 or x.tokens * x.row_bytes <= 0:
        return 0.0
    intra_bw, intra_lat = _link(cluster, 1)
    inter_bw, inter_lat = _link(cluster, max(2, -(-ep // n)), "all")  # unaligned, even a small group spans 2
    steps = exchange_steps(x, ep, n, hierarchical)
    seconds = sum(max(intra / intra_bw, inter / inter_bw) for intra, inter in steps)
    if n % ep == 0:  # one step per peer
        latency = (ep - 1) * intra_lat
    elif len(steps) == 2:
        size = hierarchy_node_size(ep, n)
        latency = (size - 1) * intra_lat + (ep // size - 1) * inter_lat
    else:
        latency = (ep - 1) * inter_lat
    return seconds + chunks * latency


def overlapped(a: float, b: float, chunks: int) -> float:
    """Exposed seconds of an exchange of `a` s cut into `chunks`, pipelined against `b` s of the
    experts' compute: the pair takes max(a, b) + min(a, b) / chunks (the first chunk's exchange, or
    the last one's compute, waits alone), of which b is compute."""
    return max(a, b) + min(a, b) / chunks - b


def exchange_seconds(
    model: ModelShape, layout: Layout, cluster: Cluster, expert_imbalance: float, passes: tuple[int, ...], overlap: bool
) -> tuple[float, float, float]:
    """Seconds of one MoE layer's EP exchange for one micro-batch over every pass (forward, backward,
    recomputation): (exposed, hidden under the experts, the token counts' exchange)."""
    tokens, p, ep = layout.tokens_per_micro / layout.sp_size, layout.param_bytes, layout.ep  # SP: its tokens
    if ep <= 1:
        return 0.0, 0.0, 0.0
    counts_passes = len(passes) - 1  # each forward (and recomputed one) first exchanges the counts (latency only)
    if layout.dispatch == "allgather":
        # all-gather the group's tokens with their routing, run the local experts, reduce-scatter the
        # partial outputs (backward: the reverse): (EP-1)·T·H each way, whatever top-k is
        # (`ds_optimus.parallel.allgather`); flat, on the links of the nodes the group spans
        nodes = 1 if cluster.devices_per_node % ep == 0 else max(2, -(-ep // cluster.devices_per_node))
        gathered = ep * tokens * (model.hidden * p + metadata_bytes(model.top_k, ROUTING_WEIGHT_BYTES))
        link = ring_time(gathered, ep, cluster, nodes) + ring_time(ep * tokens * model.hidden * p, ep, cluster, nodes)
        counts = ring_time(4.0 * ep * (model.experts // ep + 1), ep, cluster, nodes)  # one small all-gather
        return link * len(passes), 0.0, counts * counts_passes
    # per pass a dispatch and a combine of the routed rows of the rank's tokens (the busiest rank's:
    # `expert_imbalance` times the mean). Deduplicated rows carry their slots' ids and weights;
    # counted on every exchange (at most 48 bytes a row for top-8: under 1 % of a 4096-wide bf16 row)
    rows = Exchange(
        tokens=tokens * expert_imbalance,
        row_bytes=model.hidden * p,
        experts=model.experts,
        top_k=model.top_k,
        dedup=layout.dedup,
        meta_bytes=metadata_bytes(model.top_k, ROUTING_WEIGHT_BYTES) if layout.dedup else 0.0,
    )
    link = 2 * all_to_all_time(rows, ep, cluster, layout.hierarchical, layout.chunks)
    # in chunks, the exchange of one runs while the experts compute another; only the layer's experts
    # hide it (not attention), and only where communication and compute do not share cores
    layer_forward = expert_seconds(model, layout, cluster, expert_imbalance)
    hides = overlap and layout.chunks > 1
    exposed = sum(overlapped(link, layer_forward * k, layout.chunks) if hides else link for k in passes)
    counts = all_to_all_time(4.0 * model.experts, ep, cluster, layout.hierarchical)
    return exposed, len(passes) * link - exposed, counts * counts_passes


def p2p_seconds(model: ModelShape, layout: Layout, cluster: Cluster) -> float:
    """The pipeline's point-to-point sends on a step's critical path: each of the V·m + P - 1 slots of
    the schedule receives a micro-batch's activations (micro x seq x hidden) forward and their gradient
    backward, from the rank at the same place in the neighbouring stage, D ranks away (another node
    once a stage fills one; another dragonfly group once it fills one)."""
    if layout.pp <= 1:
        return 0.0
    per_node, stage = cluster.devices_per_node, layout.dp * layout.tp  # a stage's ranks
    nodes = 1 if stage < per_node else stage // per_node + 1  # the two ranks' nodes and those between
    bandwidth, latency = _link(cluster, nodes)
    send = layout.tokens_per_micro * model.hidden * layout.param_bytes / bandwidth + latency
    slots = virtual_of(layout.schedule, layout.virtual_stages) * layout.accumulation + layout.pp - 1
    return 2 * send * slots


def estimate_time(
    model: ModelShape, layout: Layout, cluster: Cluster, expert_imbalance: float = 1.0, overlap: bool | None = None
) -> TimeEstimate:
    """Seconds per optimizer step of `model` under `layout` on `cluster`; with pipeline stages, the
    slowest stage's micro-batches, the schedule's bubble and the sends between stages."""
    if overlap is None:
        overlap = not cluster.shared_compute  # gloo on CPU: the sharded optimizer does not overlap
    # the step but its optimizer: the same for every optimizer, ZeRO stage and bucketing the search tries
    compute, a2a, bubble, overhead, tensor, micro_forward, experts, hidden, p2p = _steps_cached(
        model, cluster, expert_imbalance, overlap, *_step_fields(layout)
    )
    exposed, gather, across, gather_hidden = optimizer_seconds(model, layout, cluster, compute, micro_forward, overlap)
    return TimeEstimate(
        compute=compute,
        all_to_all=a2a,
        grad_reduce=exposed,
        param_gather=gather,
        bubble=bubble,
        overhead=overhead,
        experts=experts,
        all_to_all_hidden=hidden,
        p2p=p2p,
        reduce_across=across,
        gather_hidden=gather_hidden,
        tensor=tensor,
    )


# The layout's fields that `step_seconds` reads (none of the optimizer's: ZeRO stage, sharding, buckets,
# reduction dtype, shard groups, gather overlap); tests/test_plan.py holds it to that.
STEP_FIELDS = (
    "world",
    "ep",
    "pp",
    "micro",
    "accumulation",
    "checkpointing",
    "hierarchical",
    "dedup",
    "chunks",
    "seq_len",
    "dtype",
    "schedule",
    "virtual_stages",
    "dispatch",
    "tp",
    "sp",
)
_step_fields = operator.attrgetter(*STEP_FIELDS)


@lru_cache(maxsize=65536)  # a search asks again for each of up to 5 optimizers and the hybrid variants
def _steps_cached(model: ModelShape, cluster: Cluster, expert_imbalance: float, overlap: bool, *fields) -> tuple:
    return step_seconds(
        model, Layout(**dict(zip(STEP_FIELDS, fields, strict=True))), cluster, expert_imbalance, overlap
    )


def step_seconds(
    model: ModelShape, layout: Layout, cluster: Cluster, expert_imbalance: float, overlap: bool
) -> tuple[float, ...]:
    """A step's seconds but the optimizer's: (compute, exchange, bubble, fixed costs, tensor-parallel
    collectives, one micro-batch's forward on the slowest stage, experts, exchange hidden, stage sends)."""
    rate = _rate(layout, cluster)
    tokens = layout.tokens_per_micro
    micro_batches = layout.accumulation
    # recomputation runs the recomputed parts' forward again: the whole layers (not the LM head), or
    # the attention (projections and products) and/or the FFN (router and experts, with their exchange)
    dense_again, experts_again = model.recompute_flops_per_token(layout.checkpointing, layout.seq_len)
    # the zero-bubble schedule's input- and weight-gradient passes are two autograd calls, and each
    # recomputes the checkpointed regions (their exchange included)
    twice = 2 if layout.schedule in ZERO_BUBBLE_SCHEDULES and layout.pp > 1 else 1
    dense_again, experts_again = dense_again * twice, experts_again * twice
    flops = (model.flops_per_token(layout.seq_len) + dense_again + experts_again) * tokens
    # the experts' FLOPs run at the expert kernels' rate (forward 2 FLOPs per weight and token,
    # backward 4, recomputation 2 more)
    again = experts_again > 0
    recompute = (3 + twice) / 3 if again else 1.0
    passes = (1, 2) + (1,) * twice if again else (1, 2)  # forward, backward, each recomputation
    experts_flops = 6.0 * model.moe_layers * model.top_k * 3 * model.hidden * model.expert_intermediate * tokens
    expert_layer = expert_seconds(model, layout, cluster, expert_imbalance) * sum(passes)
    head = 6.0 * model.vocab * model.hidden * tokens / rate  # the LM head, forward and backward
    # the layers' matmuls but the experts' (recomputation included), one micro-batch; tensor parallelism
    # splits them and the head over its ranks (the experts stay whole on each)
    layers = ((flops - experts_flops * recompute) / rate - head) / layout.tp
    head /= layout.tp
    # a layer's fixed costs: a third more for its recomputed forward, a ninth per part recomputed
    launches = 1 / 3 if layout.checkpointing is True else len(layout.checkpointing or ()) / 9
    # an EP group is consecutive among one TP position's ranks: a node holds devices_per_node / tp of it
    ep_cluster = (
        replace(cluster, devices_per_node=max(1, cluster.devices_per_node // layout.tp)) if layout.tp > 1 else cluster
    )
    exposed_layer, hidden_layer, counts_layer = exchange_seconds(
        model, layout, ep_cluster, expert_imbalance, passes, overlap
    )
    # the slowest of the ranks sets the pace of every synchronising step
    straggle = cluster.step_jitter * math.sqrt(2 * math.log(layout.world)) if layout.world > 1 else 0.0

    # one micro-batch on each stage (the whole model without a pipeline): its share of the layers, its
    # MoE layers' experts and exchanges, the head on the last; the slowest stage sets the pace
    virtual = virtual_of(layout.schedule, layout.virtual_stages)
    parts = (
        [(1.0, model.layers, model.moe_layers, True, True)]
        if layout.pp == 1
        else [
            (st.layer_share, st.layers, st.moe_layers, st.first, st.last)
            for st in stages(model, layout.seq_len, layout.pp, virtual, layout.schedule in V_SCHEDULES)
        ]
    )
    slowest = None
    for share, n_layers, n_moe, first, last in parts:
        compute = (layers * share + expert_layer * n_moe + (head if last else 0.0)) * (1 + straggle)
        tensor = tensor_seconds(model, layout, cluster, n_layers, n_moe, first, last)
        # the chunked exchange's hidden part slows the compute it runs under by the contention share
        a2a = (exposed_layer + counts_layer + cluster.overlap_contention * hidden_layer) * n_moe
        # a micro-batch's fixed costs once per chunk of layers the stage runs it through
        overhead = cluster.overhead_per_micro_batch_s * virtual + cluster.overhead_per_layer_s * n_layers * (
            1 + launches
        )
        if slowest is None or compute + a2a + overhead + tensor > sum(slowest[:3]) + slowest[4]:
            slowest = (compute, a2a, overhead, n_moe, tensor)
    compute, a2a, overhead, n_moe, tensor = slowest
    # one micro-batch's forward on the slowest stage: a third of forward + backward, a quarter with recomputation
    micro_forward = compute / (4 if layout.checkpointing else 3)
    # the schedule's fill and drain: (P - 1) / V of the slowest stage's micro-batch slots, a third of
    # that where the zero-bubble schedule fills it with weight-gradient passes, the V-shaped schedules'
    # replayed (`pipeline_model.idle_slots` of the step's compute, exchanges and fixed costs)
    bubble = idle_slots(layout.schedule, layout.pp, micro_batches, layout.virtual_stages) * (
        compute + a2a + overhead + tensor
    )
    return (
        compute * micro_batches,
        a2a * micro_batches,
        bubble,
        overhead * micro_batches,
        tensor * micro_batches,
        micro_forward,
        expert_layer * n_moe * micro_batches,
        hidden_layer * n_moe * micro_batches,
        p2p_seconds(model, layout, cluster),
    )


def tensor_seconds(
    model: ModelShape, layout: Layout, cluster: Cluster, layers: int, moe_layers: int, first: bool, last: bool
) -> float:
    """One micro-batch's tensor-parallel collectives on a rank of a stage with `layers` decoder layers
    (`moe_layers` of them MoE), inside a node and not overlapped: an all-reduce of the micro-batch's
    hidden states (sequence parallelism: an all-gather and a reduce-scatter, the same bytes) where each
    split block's output leaves it forward and where its input's gradient leaves it backward, again for
    a recomputed block; the MoE block is whole (none); the embedding's forward and the head's backward."""
    if layout.tp <= 1:
        return 0.0
    nodes = -(-layout.tp // cluster.devices_per_node)
    one = 2 * ring_time(layout.tokens_per_micro * model.hidden * layout.param_bytes, layout.tp, cluster, nodes)
    parts = layout.checkpointing
    again = {part: parts is True or bool(parts) and part in parts for part in ("attention", "moe")}
    count = layers * (2 + again["attention"]) + (layers - moe_layers) * (2 + again["moe"]) + first + last
    return count * one


def optimizer_seconds(
    model: ModelShape, layout: Layout, cluster: Cluster, compute: float, micro_forward: float, overlap: bool
) -> tuple[float, float, float, float]:
    """A step's (gradient reduction exposed, parameter gather exposed, all-reduce across shard groups,
    gather hidden under the next forward), given the step's `compute` and one micro-batch's forward
    on the slowest stage (`micro_forward`)."""
    micro_batches = layout.accumulation
    p = layout.param_bytes
    dense, expert = local_params(model, layout)
    # the data-parallel group is a pipeline stage's ranks at one TP position (every tp-th rank)
    dp_nodes = -(-(layout.dp * layout.tp) // cluster.devices_per_node)
    # the expert-data-parallel group takes every ep-th rank: one per node once ep >= a node
    edp_nodes = min(layout.edp, dp_nodes) if dp_nodes > 1 else 1
    across = gather_hidden = 0.0
    if layout.zero == 0:
        # all-reduce = reduce-scatter + all-gather, once per step after the last micro-batch
        reduce = 2 * (
            ring_time(p * dense, layout.dp, cluster, dp_nodes) + ring_time(p * expert, layout.edp, cluster, edp_nodes)
        )
        gather = 0.0
        exposed = reduce
    else:
        once, across, gather = optimizer_collectives(dense, expert, layout, cluster)
        # ZeRO-2 reduces at every micro-batch (with pipeline stages where each rank runs one chunk); else
        # the step's sum once: without stages after the last micro-batch's backward, with stages in the
        # drain, each bucket as the stage's last backward pass completes it
        reductions = micro_batches if layout.reduces_each_micro_batch else 1
        reduce = once * reductions
        if layout.sharded and layout.gather_overlap and overlap:
            # every bucket launched at the step's end, each layer waiting for its own: hidden under the
            # first micro-batch's forward, but the first bucket (the embedding's)
            first = gather * min(1.0, layout.bucket_size / max(dense + expert, 1.0))
            hidden = min(gather - first, micro_forward)
            # the forward it hides under runs slower by the contention share of it
            gather, gather_hidden = gather - hidden + cluster.overlap_contention * hidden, hidden
        if overlap:
            # buckets are reduced while the backward pass goes on (two thirds of the compute; with stages
            # the last stage-rank's last backward pass, the drain's end); the last bucket's reduction is
            # always exposed
            backward = compute * 2 / 3 / micro_batches
            buckets = max(1.0, (dense + expert) / layout.bucket_size)
            exposed = max(reduce / buckets, reduce - backward * reductions)
            exposed += cluster.overlap_contention * (reduce - exposed)  # the backward under it slows
        else:
            exposed = reduce
        exposed += across  # at the step's start, after the last reduction
    return exposed, gather, across, gather_hidden


def optimizer_collectives(dense: float, expert: float, layout: Layout, cluster: Cluster) -> tuple[float, float, float]:
    """Seconds of one step's (gradient reduce-scatter inside the shard groups, all-reduce of the shards
    across them, parameter all-gather inside them) for `dense` and `expert` elements per rank. Dense
    state is sharded over the data-parallel group (consecutive ranks), expert state over the
    expert-data-parallel group (every ep-th rank, one per node once ep >= a node); with hybrid sharding
    (`shard_group`) each over runs of that many of the group's ranks, replicated across the runs."""
    per_node = cluster.devices_per_node
    dp_nodes = -(-(layout.dp * layout.tp) // per_node)
    out = [0.0, 0.0, 0.0]
    # with tensor parallelism both groups take every tp-th rank (one TP position's)
    # (under sequence parallelism the experts' over their EDP groups of every TP position: T times the ranks)
    sp = layout.sp_size
    groups = ((dense, layout.dp, layout.tp), (expert, layout.edp * sp, layout.ep * layout.tp // sp))
    for elements, size, stride in groups:
        if not elements or size <= 1:
            continue
        nodes = min(size, -(-size * stride // per_node), dp_nodes)  # the group's ranks are on this many nodes
        shard = layout.shard_size(size)
        replicas = size // shard
        # the nodes the most spread run touches: runs start at multiples of their span of ranks, and one
        # that does not line up with the nodes straddles one more
        span = shard * stride
        shard_nodes = nodes if replicas == 1 else min(shard, _nodes_touched(span, per_node))
        out[0] += ring_time(layout.reduce_bytes * elements, shard, cluster, shard_nodes)
        # all-reduce (reduce-scatter + all-gather) of the shard, over ranks on separate nodes mostly
        out[1] += 2 * ring_time(layout.reduce_bytes * elements / shard, replicas, cluster, min(replicas, nodes))
        out[2] += ring_time(layout.param_bytes * elements, shard, cluster, shard_nodes)
    return out[0], out[1], out[2]


@lru_cache(maxsize=1024)
def _nodes_touched(span: int, per_node: int) -> int:
    """The most nodes a run of `span` consecutive ranks starting at a multiple of `span` covers."""
    return max(-(-((k * span) % per_node + span) // per_node) for k in range(per_node))


def _rate(layout: Layout, cluster: Cluster) -> float:
    """Dense matmul FLOP/s of one rank (on a CPU the processes share the cores, however many there are)."""
    return cluster.rate(layout.world if cluster.shared_compute else min(layout.world, cluster.devices_per_node))


def expert_seconds(model: ModelShape, layout: Layout, cluster: Cluster, expert_imbalance: float = 1.0) -> float:
    """Forward seconds of one MoE layer's experts (grouped GEMMs) for one micro-batch, at the expert
    kernels' rate (`Cluster.expert_efficiency` of the peak), on the busiest rank (its experts get
    `expert_imbalance` times the mean rows)."""
    # under sequence parallelism a rank's MoE blocks route its 1/T of the tokens
    flops = 2.0 * model.top_k * 3 * model.hidden * model.expert_intermediate * layout.tokens_per_micro / layout.sp_size
    ranks = layout.world if cluster.shared_compute else min(layout.world, cluster.devices_per_node)
    return flops * expert_imbalance / cluster.expert_rate(ranks)

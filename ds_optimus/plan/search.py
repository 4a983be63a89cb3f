"""Search over layouts: every combination of data/expert/pipeline parallel sizes (with the pipeline's
schedule and virtual stages), optimizer and ZeRO stage, micro-batch and accumulation, activation
recomputation (none, parts of each layer, or whole layers), and EP exchange (all-to-all flat or
hierarchical, per slot or deduplicated, overlapped in chunks; or the allgather dispatch) that fits in
memory, ranked by predicted tokens per second."""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, fields
from typing import Any

from .cluster import Cluster
from .layout import DISPATCHES, Layout, hierarchy_node_size
from .memory import MemoryEstimate, estimate_memory, memory_within
from .model import ModelShape
from .timing import TimeEstimate, estimate_time

TIE_BAND = 0.02  # predicted step times closer than this are ranked as a tie
HYBRID_TRIED = 200  # the fastest layouts tried again with hybrid sharding and the overlapped gather

# (ZeRO stage, EP-aware sharded optimizer)
OPTIMIZERS = ((1, True), (2, True), (0, False), (1, False), (2, False))
# EP exchanges (dedup, chunks): per slot, deduplicated, deduplicated and overlapped in 2 or 4 chunks
EXCHANGES = ((False, 1), (True, 1), (True, 2), (True, 4))
# pipeline: virtual stages (chunks of layers per stage rank) the interleaved 1F1B is tried with
VIRTUAL_STAGES = (2, 4)
# activation recomputation: none; the norms (almost free); the attention with them; the MoE block
# (the largest activations; its forward at the expert kernels' rate and its exchange run again), also
# with the norms; MoE, attention and norms (each layer's input and middle residual kept); whole layers
RECOMPUTE_CHOICES = (
    False,
    ("norms",),
    ("attention", "norms"),
    ("moe",),
    ("moe", "norms"),
    ("moe", "attention", "norms"),
    True,
)


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate
    cluster: Cluster
    model: ModelShape

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.time.step

    @property
    def mfu(self) -> float:
        flops = self.model.flops_per_token(self.layout.seq_len) * self.tokens_per_s
        peak = self.cluster.peak_tflops * 1e12 * (1 if self.cluster.shared_compute else self.layout.world)
        return flops / peak

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.cluster.usable_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_json(),
            "describe": self.layout.describe(),
            "memory_bytes": self.memory.as_dict(),
            "time_s": self.time.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "fits": self.fits,
        }


def evaluate(model: ModelShape, layout: Layout, cluster: Cluster, expert_imbalance: float = 1.0) -> Plan:
    """The memory and time predictions of one layout."""
    layout.check(model.experts, model.layers)
    return Plan(
        layout=layout,
        memory=estimate_memory(model, layout, expert_imbalance),
        time=estimate_time(model, layout, cluster, expert_imbalance),
        cluster=cluster,
        model=model,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, micro_batches: int, layers: int, virtual_stages=VIRTUAL_STAGES) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) tried for `pp` stages and a step of `micro_batches`: 1F1B (GPipe
    where there are fewer micro-batches than stages, which 1F1B cannot run), and the interleaved 1F1B
    and zero-bubble schedules with V chunks per rank where P·V divides the layers, cutting the bubble
    from (P-1)/(m+P-1) to (P-1)/(V·m+P-1) (a third of that with zero bubble; with m below P or not a
    multiple of it, what the replay of PyTorch's op lists idles) for V times the sends between stages;
    and the V-shaped ZB-V with two chunks per rank. (DualPipeV's gain is one micro-batch's forward run
    under another's backward, exchanges hidden under the other's compute;
    PyTorch's runtime runs such a pair one after the other, so it replays as ZB-V with half a
    micro-batch more held, and the search leaves it out.)"""
    if pp == 1:
        return [("1f1b", 1)]
    m = micro_batches
    out = [("1f1b", 1) if m >= pp else ("gpipe", 1)]
    rounds = max(1, m // pp)
    out += [
        (name, v)
        for name in ("interleaved_1f1b", "interleaved_zb")
        for v in virtual_stages
        if layers % (pp * v) == 0 and m % rounds == 0
    ]
    if layers % (2 * pp) == 0:
        out.append(("zbv", 2))
    return out


def candidate_layouts(
    model: ModelShape,
    cluster: Cluster,
    devices: int,
    global_batch: int,
    seq_len: int,
    *,
    dtype: str = "bf16",
    pipeline: bool = True,
    optimizers=OPTIMIZERS,
    checkpointing: tuple = RECOMPUTE_CHOICES,
    max_ep: int | None = None,
    reduce_dtype: str | None = None,
    bucket_size: int = 50_000_000,
    exchanges=EXCHANGES,
    dispatches=DISPATCHES,
    virtual_stages=VIRTUAL_STAGES,
    tensor: tuple[int, ...] | None = None,
) -> list[Layout]:
    """Every layout of `devices` ranks that trains `global_batch` sequences per step; `exchanges`:
    the (dedup, chunks) pairs of the all-to-all to try where there is an EP exchange, `dispatches` the
    exchanges (the allgather one where the EP group is inside a node); `pipeline`: also pipeline
    stages (sizes up to 16 dividing the layers and the devices; untied models only), with the
    sharded optimizer; `tensor`: the tensor-parallel sizes to try (inside a node, dividing the model's
    widths; by default 1, 2, 4 and 8 for a dense model, and 1 for an MoE model, of which TP splits only the
    attention, embedding and head; each with and without sequence parallelism)."""
    overlap = not cluster.shared_compute  # gloo: no overlap
    layouts = []
    sizes = [p for p in _divisors(devices) if p <= 16 and model.layers % p == 0] if pipeline and not model.tied else [1]
    splits = [
        (p, t, s)
        for p in sizes
        for t in tensor_sizes(model, cluster, devices // p, tensor)
        for s in ((False, True) if t > 1 and seq_len % t == 0 else (False,))
    ]
    for pp, tp, sp in splits:
        dp = devices // pp // tp
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        eps = (
            [e for e in _divisors(dp) if model.experts % e == 0 and (max_ep is None or e <= max_ep)]
            if model.experts
            else [1]
        )
        # stages and tensor parallelism need the sharded optimizer
        opts = optimizers if pp == 1 and tp == 1 else [o for o in optimizers if o[1]]
        for ep in eps:
            # a hierarchical exchange where the group spans (sub-)nodes; dedup and chunks where there
            # is an exchange, chunks only where communication overlaps compute (not on shared cores);
            # the allgather dispatch inside a node
            hierarchies = (False, True) if hierarchy_node_size(ep, cluster.devices_per_node // tp) else (False,)
            tried = [(d, c) for d, c in exchanges if ep > 1 and (overlap or c == 1)] or [(False, 1)]
            modes = (
                [(h, d, c, "alltoall") for h in hierarchies for d, c in tried]
                if "alltoall" in dispatches or ep == 1
                else []
            )
            if ep > 1 and "allgather" in dispatches and (cluster.devices_per_node // tp) % ep == 0:
                modes.append((False, False, 1, "allgather"))
            for zero, sharded in opts:
                for micro in _divisors(per_rank):
                    for (schedule, virtual), ckpt, (hier, dedup, chunks, dispatch) in itertools.product(
                        schedules(pp, per_rank // micro, model.layers, virtual_stages), checkpointing, modes
                    ):
                        # the gradients travel in the weights' dtype unless told (buckets that add
                        # micro-batches up hold fp32 sums, cast at the collective)
                        reduce = reduce_dtype
                        layouts.append(
                            Layout(
                                world=devices,
                                ep=ep,
                                pp=pp,
                                zero=zero,
                                sharded=sharded,
                                micro=micro,
                                accumulation=per_rank // micro,
                                checkpointing=ckpt,
                                hierarchical=hier,
                                dedup=dedup,
                                chunks=chunks,
                                seq_len=seq_len,
                                dtype=dtype,
                                reduce_dtype=reduce,
                                bucket_size=bucket_size,
                                overlap_comm=overlap,
                                schedule=schedule,
                                virtual_stages=virtual,
                                dispatch=dispatch,
                                tp=tp,
                                sp=sp,
                            )
                        )
    return layouts


def tensor_sizes(model: ModelShape, cluster: Cluster, ranks: int, tried: tuple[int, ...] | None = None) -> list[int]:
    """The tensor-parallel sizes to try over `ranks` ranks of a stage: of `tried` (default: 1, 2, 4, 8 for a
    dense model, 1 for an MoE one) those inside a node that divide the ranks, the key/value heads, the
    FFN and the vocabulary."""
    tried = tried if tried is not None else ((1, 2, 4, 8) if not model.experts else (1,))
    widths = (model.kv_heads, model.heads, model.intermediate, model.vocab)
    return [
        t
        for t in tried
        if t == 1 or (cluster.devices_per_node % t == 0 and ranks % t == 0 and all(w % t == 0 for w in widths))
    ]


def shard_groups(dp: int, edp: int, devices_per_node: int) -> list[int | None]:
    """The sharded optimizer's shard group sizes tried: whole groups (None), and a node's devices, 4, 8,
    16, 32 or 64 ranks where that divides the data- and expert-data-parallel groups it cuts."""
    tried: list[int | None] = [None]
    for size in (devices_per_node, 4, 8, 16, 32, 64):
        if size < max(dp, edp) and all(n <= size or n % size == 0 for n in (dp, edp)) and size not in tried:
            tried.append(size)
    return tried


def search(
    model: ModelShape,
    cluster: Cluster,
    devices: int,
    global_batch: int,
    seq_len: int,
    *,
    expert_imbalance: float = 1.0,
    **kwargs: Any,
) -> tuple[list[Plan], int]:
    """(the layouts that fit, best first; how many were tried)."""
    layouts = candidate_layouts(model, cluster, devices, global_batch, seq_len, **kwargs)
    fitting = _fitting(model, layouts, cluster, expert_imbalance)
    # hybrid sharding and the overlapped parameter gather change only the optimizer's collectives and
    # memory: tried on the fastest layouts that fit without them (both hold more, so neither makes one
    # fit that did not); the gather overlaps only where communication overlaps compute
    fastest_first = sorted(fitting, key=lambda plan: plan.time.step)[:HYBRID_TRIED]
    gathers = (False, True) if not cluster.shared_compute else (False,)
    hybrid = [
        plan.layout.with_(shard_group=size, gather_overlap=gather)
        for plan in fastest_first
        if plan.layout.sharded
        for size in shard_groups(plan.layout.dp, plan.layout.edp, cluster.devices_per_node)
        for gather in gathers
        if size is not None or gather
    ]
    fitting += _fitting(model, hybrid, cluster, expert_imbalance)
    # fastest first, in bands of 2 % (finer than the model can tell apart); within a band the EP-aware
    # sharded optimizer first (its checkpoints reshard, the step guards act through it), then fewer
    # pipeline stages and chunks (fewer collectives to go wrong), then the faster, then the smaller;
    # ties keep the candidates' order
    fastest = min((plan.time.step for plan in fitting), default=1.0)
    fitting.sort(
        key=lambda plan: (
            math.floor((plan.time.step / fastest - 1) / TIE_BAND + 1e-9),
            not plan.layout.sharded,
            plan.layout.pp,
            plan.layout.chunks,
            plan.time.step,
            plan.memory.peak,
        )
    )
    return fitting, len(layouts) + len(hybrid)


def _fitting(model: ModelShape, layouts: list[Layout], cluster: Cluster, expert_imbalance: float) -> list[Plan]:
    """The plans of the layouts that fit, in their order: memory first, the time model only where it fits
    (at 220B on 12,288 Aurora tiles a third of the layouts do). The memory model does not read the
    all-to-all's dedup and chunks, so the exchange's variants share one estimate."""
    memory: dict[tuple, MemoryEstimate | None] = {}
    plans = []
    for layout in layouts:
        layout.check(model.experts, model.layers)
        key = _memory_key(layout)
        if key in memory:
            estimate = memory[key]
        else:
            estimate = memory[key] = memory_within(model, layout, cluster.usable_bytes, expert_imbalance)
        if estimate is not None:
            plans.append(
                Plan(
                    layout=layout,
                    memory=estimate,
                    cluster=cluster,
                    model=model,
                    time=estimate_time(model, layout, cluster, expert_imbalance),
                )
            )
    return plans


# every field of a layout but the two the memory model does not read (tests/test_plan.py holds that)
_memory_key = operator.attrgetter(*(f.name for f in fields(Layout) if f.name not in ("dedup", "chunks")))


def smallest_peak(
    model: ModelShape,
    cluster: Cluster,
    devices: int,
    global_batch: int,
    seq_len: int,
    *,
    expert_imbalance: float = 1.0,
    stop_below: float = 0.0,
    **kwargs: Any,
) -> tuple[Layout, float] | None:
    """(the layout with the smallest predicted peak per device, fitting or not; that peak in bytes), from
    the memory model alone; the first found under `stop_below` bytes ends the search. None without any."""
    best = None
    for layout in candidate_layouts(model, cluster, devices, global_batch, seq_len, **kwargs):
        layout.check(model.experts, model.layers)
        peak = estimate_memory(model, layout, expert_imbalance).peak
        if best is None or peak < best[1]:
            best = (layout, peak)
            if peak <= stop_below:
                break
    return best


def ranking_note(plans: list[Plan], top: int = 10) -> str | None:
    """A line saying so when the first plan is not the fastest (the ranking's 2 % bands put the
    sharded optimizer, fewer stages and fewer chunks first among layouts the model cannot tell apart); None else."""
    if not plans:
        return None
    fastest = min(range(len(plans)), key=lambda i: plans[i].time.step)
    if fastest == 0 or plans[fastest].time.step >= plans[0].time.step:
        return None
    gain = plans[0].time.step / plans[fastest].time.step - 1
    where = f"row {fastest + 1}" if fastest < top else f"{plans[fastest].layout.describe()} (not shown)"
    return (
        f"note: row 1 is not the fastest: {where} is predicted {gain:.1%} faster; layouts within "
        f"{TIE_BAND:.0%} of each other are ranked by the sharded optimizer first, then fewer pipeline stages and "
        "chunks, then speed"
    )


def format_table(plans: list[Plan], top: int = 10) -> str:
    """A text table of the first `top` plans."""
    small = plans and max(p.memory.peak for p in plans[:top]) < 2**30
    unit, scale = ("MiB", 2**20) if small else ("GiB", 2**30)
    header = ("#", "layout", f"peak {unit}", "states", "activ.", "step s", "tokens/s", "MFU", "comm %")
    rows = []
    for i, plan in enumerate(plans[:top], 1):
        m, t = plan.memory, plan.time
        states = m.weights + m.gradients_at_peak + m.optimizer_state + m.buffers
        comm = t.communication / t.step
        rows.append(
            (
                str(i),
                plan.layout.describe(),
                f"{m.peak / scale:.1f}",
                f"{states / scale:.1f}",
                f"{(m.activations + m.transient) / scale:.1f}",
                f"{t.step:.3g}",
                f"{plan.tokens_per_s:,.0f}",
                f"{plan.mfu:.1%}",
                f"{comm:.0%}",
            )
        )
    return text_table(header, rows)


def text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell, the second left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells) -> str:
        cells = [c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(cells)

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])

"""A parallel layout: how a run spreads over its ranks, and the batch it trains on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from math import gcd
from typing import Any

from ..parallel.dims import ParallelDims
from ..parallel.stages import MULTI_STAGE_SCHEDULES, ROUND_SCHEDULES, SCHEDULES, V_SCHEDULES

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# The parts of a decoder layer that selective activation recomputation recomputes, in the order
# `MulaDecoderLayer.recompute` keeps them (`optimus.train.activation_checkpointing` as a list).
RECOMPUTE_PARTS = ("moe", "attention", "norms")
# The EP exchanges (`optimus.expert_parallel.dispatch`): all-to-all of the routed rows, or Optimus'
# all-gather of the group's tokens and reduce-scatter of the outputs (flat, one chunk, no dedup).
DISPATCHES = ("alltoall", "allgather")
# Short labels of the pipeline schedules in `Layout.describe`: none for 1F1B, and none for the interleaved
# 1F1B with virtual stages (`pp8v2`)
SCHEDULE_LABELS = {
    "gpipe": ":gpipe",
    "interleaved_1f1b": ":interleaved",
    "looped_bfs": ":bfs",
    "interleaved_zb": ":zb",
    "zbv": ":zbv",
    "dualpipev": ":dualpipev",
}


class LayoutError(ValueError):
    """A layout that cannot run; one line saying why."""


@dataclass(frozen=True)
class Layout:
    world: int  # ranks (devices)
    ep: int = 1  # expert-parallel size
    pp: int = 1  # pipeline stages (`optimus.pipeline_parallel.size`); stage s = ranks [s·dp, (s+1)·dp)
    zero: int = 1  # ZeRO stage 0, 1 or 2
    sharded: bool = True  # the EP-aware sharded optimizer (stage 1/2) instead of DeepSpeed's
    micro: int = 1  # sequences per rank per micro-batch
    accumulation: int = 1
    # activation recomputation: False, True (every decoder layer whole) or the parts of each layer
    # recomputed, a tuple of RECOMPUTE_PARTS (`optimus.train.activation_checkpointing`)
    checkpointing: bool | tuple[str, ...] = False
    hierarchical: bool = False  # EP exchange in two steps, between (sub-)nodes and inside them
    dedup: bool = False  # send a token once per rank (node, hierarchical) owning its experts, not per slot
    chunks: int = 1  # pieces of each MoE exchange, overlapped with the experts' compute (dedup only)
    seq_len: int = 4096
    dtype: str = "bf16"
    reduce_dtype: str | None = None  # gradient reduction dtype; null: the parameters' dtype
    bucket_size: int = 50_000_000  # elements per communication bucket
    overlap_comm: bool = True  # reduce gradient buckets while the backward pass goes on (not on gloo)
    schedule: str = "1f1b"  # pipeline schedule (`ds_optimus.parallel.stages.SCHEDULES`) over the accumulation
    virtual_stages: int = 1  # chunks of layers per stage rank (the interleaved and looped schedules)
    dispatch: str = "alltoall"  # the EP exchange, one of DISPATCHES
    # the sharded optimizer's hybrid sharding: ranks per shard group (`shard_group_size`); None: whole groups
    shard_group: int | None = None
    gather_overlap: bool = False  # its parameter all-gather under the next forward (`overlap_param_gather`)
    # tensor parallelism (`optimus.tensor_parallel`): ranks splitting each layer (consecutive, innermost),
    # and whether the sequence is cut over them between the split blocks (`sequence_parallel`)
    tp: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        # a list of parts (from JSON) in RECOMPUTE_PARTS' order, so equal choices compare equal
        if isinstance(self.checkpointing, (list, tuple)):
            parts = tuple(self.checkpointing)
            known = tuple(p for p in RECOMPUTE_PARTS if p in parts)
            object.__setattr__(self, "checkpointing", known if len(known) == len(parts) else parts)

    @property
    def dp(self) -> int:
        """Data-parallel size (a pipeline stage's ranks at one TP position)."""
        return self.world // (self.pp * self.tp)

    @property
    def dims(self) -> ParallelDims:
        """The parallel sizes alone: the layout the trainer builds from the config this one writes."""
        return ParallelDims(self.world, self.pp, self.tp, self.ep, self.sp)

    @property
    def sp_size(self) -> int:
        """Ranks the sequence is cut over between the split blocks (1 without sequence parallelism)."""
        return self.tp if self.sp else 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert."""
        return self.dp // self.ep

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def reduces_each_micro_batch(self) -> bool:
        """Whether the sharded optimizer reduces every micro-batch's gradients (ZeRO-2 without stages, or
        with one chunk per stage rank) rather than the step's sum once (ZeRO-1; several chunks per rank)."""
        return self.zero == 2 and (self.pp == 1 or self.schedule not in MULTI_STAGE_SCHEDULES)

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype or self.dtype]

    @property
    def tokens_per_micro(self) -> int:
        """Tokens one rank processes per micro-batch."""
        return self.micro * self.seq_len

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro * self.accumulation * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def check(self, experts: int = 0, layers: int | None = None) -> None:
        """A one-line LayoutError when the layout is impossible for a model."""
        for key in (
            "world",
            "ep",
            "pp",
            "tp",
            "micro",
            "accumulation",
            "seq_len",
            "bucket_size",
            "chunks",
            "virtual_stages",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{key} must be a positive integer, got {value!r}")
        if self.world % self.pp:
            raise LayoutError(f"pipeline size {self.pp} does not divide world size {self.world}")
        if (self.world // self.pp) % self.tp:
            raise LayoutError(
                f"tensor-parallel size {self.tp} does not divide the {self.world // self.pp} ranks of a stage"
            )
        if self.tp > 1 and not self.sharded:
            raise LayoutError("tensor parallelism runs with the EP-aware sharded optimizer")
        if self.sp and self.tp == 1:
            raise LayoutError("sequence parallelism needs tensor parallelism")
        if self.sp and self.seq_len % self.tp:
            raise LayoutError(f"sequence parallelism: seq_len {self.seq_len} does not divide over tp {self.tp}")
        if self.dp % self.ep:
            raise LayoutError(f"expert-parallel size {self.ep} does not divide the data-parallel size {self.dp}")
        if experts and experts % self.ep:
            raise LayoutError(f"expert-parallel size {self.ep} does not divide the {experts} experts")
        if not experts and self.ep > 1:
            raise LayoutError("expert parallelism needs an MoE model")
        self._check_pipeline(layers)
        if self.zero not in (0, 1, 2):
            raise LayoutError(f"ZeRO stage must be 0, 1 or 2, got {self.zero!r}")
        if self.sharded and self.zero == 0:
            raise LayoutError("the sharded optimizer is ZeRO stage 1 or 2")
        ckpt = self.checkpointing
        if not isinstance(ckpt, bool) and (
            not ckpt or any(p not in RECOMPUTE_PARTS for p in ckpt) or len(set(ckpt)) != len(ckpt)
        ):
            raise LayoutError(
                f"checkpointing must be true, false or a list of distinct parts of "
                f"{', '.join(RECOMPUTE_PARTS)}, got {ckpt!r}"
            )
        for key in ("hierarchical", "dedup"):
            if not isinstance(getattr(self, key), bool):
                raise LayoutError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.chunks > 1 and not self.dedup:
            raise LayoutError(f"chunks {self.chunks} needs dedup: the overlapped exchange is the deduplicated one")
        if self.dtype not in DTYPE_BYTES or (self.reduce_dtype or self.dtype) not in DTYPE_BYTES:
            raise LayoutError(f"dtype must be one of {', '.join(DTYPE_BYTES)}")
        if self.shard_group is not None:
            if not isinstance(self.shard_group, int) or isinstance(self.shard_group, bool) or self.shard_group < 1:
                raise LayoutError(f"shard_group must be a positive integer or null, got {self.shard_group!r}")
            if not self.sharded:
                raise LayoutError("shard_group is the sharded optimizer's hybrid sharding")
            for size, name in ((self.dp, "data-parallel"), (self.edp, "expert-data-parallel")):
                if size > self.shard_group and size % self.shard_group:
                    raise LayoutError(f"shard group size {self.shard_group} does not divide the {name} size {size}")
        if self.dispatch not in DISPATCHES:
            raise LayoutError(f"dispatch must be one of {', '.join(DISPATCHES)}, got {self.dispatch!r}")
        if self.dispatch == "allgather" and (self.dedup or self.chunks > 1 or self.hierarchical):
            raise LayoutError(
                "the allgather dispatch is a flat exchange in one chunk without dedup; it does not take "
                "hierarchical, dedup or chunks"
            )

    def _check_pipeline(self, layers: int | None) -> None:
        """The pipeline's constraints, as `ds_optimus.train` and PyTorch's schedules state them."""
        if self.pp == 1:
            return
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.virtual_stages > 1 and self.schedule not in MULTI_STAGE_SCHEDULES:
            raise LayoutError(
                f"virtual_stages {self.virtual_stages} needs a schedule with several stages per rank "
                f"({', '.join(MULTI_STAGE_SCHEDULES)}); {self.schedule} runs one"
            )
        if self.schedule in V_SCHEDULES and self.virtual_stages != 2:
            raise LayoutError(
                f"{self.schedule} runs exactly two chunks of layers per rank; virtual_stages {self.virtual_stages}"
            )
        if self.schedule == "dualpipev" and self.accumulation < 2 * self.pp:
            raise LayoutError(
                f"dualpipev needs at least as many micro-batches as chunks of layers: accumulation "
                f"{self.accumulation} < {2 * self.pp}"
            )
        if layers is not None and self.pp * self.virtual_stages > layers:
            raise LayoutError(
                f"{self.pp} x {self.virtual_stages} chunks of layers need at least as many layers; the "
                f"model has {layers}"
            )
        if not self.sharded:
            raise LayoutError(
                "pipeline parallelism runs with the EP-aware sharded optimizer (it reduces the "
                "gradients in the schedule's drain)"
            )
        m = self.accumulation
        if self.schedule == "1f1b" and m < self.pp:
            raise LayoutError(f"1f1b needs at least as many micro-batches as stages: accumulation {m} < {self.pp}")
        rounds = max(1, m // self.pp)
        if self.schedule in ROUND_SCHEDULES and m % rounds:
            raise LayoutError(
                f"{self.schedule} runs rounds of {self.pp} micro-batches; accumulation {m} must divide into them"
            )

    def describe(self) -> str:
        """A short label: `dp48 ep8 pp4 zero1+opt mb2x4 ckpt` (`ckpt:moe+attn+norms`: those parts
        recomputed; `pp4v2`: 2 virtual stages; `:gpipe`, `:bfs`, `:zb`, `:zbv`, `:dualpipev`: those schedules;
        `ag`: the allgather dispatch;
        `zero1+opt/sg12`: hybrid sharding in groups of 12; `/pgo`: the parameter gather under the next forward)."""
        parts = [f"dp{self.dp}", f"ep{self.ep}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("sp" if self.sp else ""))
        if self.pp > 1:
            virtual = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            plain = self.schedule == "1f1b" or (self.schedule == "interleaved_1f1b" and virtual)
            parts.append(f"pp{self.pp}{virtual}{'' if plain else SCHEDULE_LABELS.get(self.schedule, self.schedule)}")
        parts.append(
            f"zero{self.zero}"
            + ("+opt" if self.sharded else "")
            + (f"/sg{self.shard_group}" if self.sharded and self.shard_group else "")
            + ("/pgo" if self.sharded and self.gather_overlap else "")
        )
        parts.append(f"mb{self.micro}x{self.accumulation}")
        if self.checkpointing is True:
            parts.append("ckpt")
        elif self.checkpointing:
            parts.append("ckpt:" + "+".join("attn" if p == "attention" else p for p in self.checkpointing))
        if self.hierarchical:
            parts.append("hier")
        if self.dedup:
            parts.append("dedup")
        if self.chunks > 1:
            parts.append(f"ovl{self.chunks}")
        if self.dispatch == "allgather":
            parts.append("ag")
        return " ".join(parts)

    def shard_size(self, group: int) -> int:
        """Ranks the sharded optimizer shards a group of `group` ranks over: its shard group, at most
        the whole group (hybrid sharding), or the whole group."""
        return min(self.shard_group or group, group)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> Layout:
        return replace(self, **changes)


def hierarchy_node_size(ep: int, devices_per_node: int) -> int | None:
    """Ranks per node of the hierarchical exchange of an EP group of `ep` consecutive ranks, or None
    when there is none: whole nodes when they tile the group, else gcd(ep, devices_per_node) ranks,
    sub-nodes that are whole parts of physical nodes (EP groups start at multiples of `ep`, nodes at
    multiples of `devices_per_node`; both are multiples of the gcd). The runtime needs it to divide ep."""
    size = gcd(ep, devices_per_node)
    return size if 1 < size < ep else None

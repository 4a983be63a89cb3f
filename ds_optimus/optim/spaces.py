"""The sharded optimizer's data: parameter spaces with this rank's fp32 state shard, their
communication buckets (laid out by `bucket_layout.py`), and a buffer pool."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .bucket_layout import chunked_runs, flat_runs, merge_copies, padding, split_buckets


class ShardedOptimizerError(RuntimeError):
    """A setting or checkpoint the sharded optimizer cannot work with."""


class BufferPool:
    """Reused CPU communication buffers (elsewhere it just allocates: caching allocators reuse memory)."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.allocated = 0  # bytes held by the pool

    def get(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialised 1-D buffer of `numel` elements."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        # a fresh CPU tensor of tens of MB page-faults per 4 KiB on first write (glibc returns large blocks)
        fits = [i for i, t in enumerate(self.free) if t.dtype == dtype and t.device == device and t.numel() >= numel]
        if fits:
            base = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        else:
            base = torch.empty(numel, dtype=dtype, device=device)
            self.allocated += base.numel() * base.element_size()
        return base[:numel]

    def put(self, tensor: torch.Tensor) -> None:
        """Hand a buffer of `get` back for reuse."""
        if tensor.device.type == "cpu":
            self.free.append(tensor._base if tensor._base is not None else tensor)


class Bucket:
    """One reduce-scatter / all-gather unit of a space, and its state within a step."""

    def __init__(self, params: list[int], runs, size: int, group_size: int, rank: int, shard_offset: int) -> None:
        self.params = params
        self.size = size
        self.shard = size // group_size
        self.shard_offset = shard_offset  # where this bucket's shard starts in the space's shard
        self.copies = merge_copies(runs)  # param -> [(start, offset, length)]
        self.mine = [r for r in runs if r.owner == rank]
        self.padding = padding(runs, size)
        # the full bucket of gradients: fp32 where it adds up micro-steps, else the reduction's dtype
        self.grad: torch.Tensor | None = None
        self.wire: torch.Tensor | None = None  # `grad` cast to the reduction's dtype, while in flight
        self.written: set[int] = set()  # params whose gradient is in `grad` (this accumulation)
        self.arrived: set[int] = set()  # params whose gradient arrived this micro-step
        self.last: set[int] = set()  # params whose last gradient of the step arrived (a pipeline's drain)
        self.complete = False
        self.work = None
        self.out: torch.Tensor | None = None
        self.received: torch.Tensor | None = None  # pairwise reduce-scatter: every rank's copy of my shard
        self.direct = False  # the reduce-scatter writes straight into the fp32 shard
        self.pending = False  # launched, not yet added to the shard
        self.launched = False  # reduced in this micro-step


class Space:
    """Parameters reduced over one process group (the dense ones, or one EP layout's experts)."""

    def __init__(
        self,
        key: str,
        params: list[torch.nn.Parameter],
        names: list[str],
        offsets: list[int],
        group,
        chunked: bool,
        bucket_size: int,
        reduce_dtype: torch.dtype,
        replicas=None,
    ) -> None:
        self.key = key
        self.params, self.names = params, names
        self.offsets = offsets  # where each (local) parameter starts in the full parameter, flattened
        # a parameter holding some columns of the full one (a tensor-parallel row-split weight): (its
        # columns, the full parameter's), its rows then lying `full` elements apart; None: contiguous
        self.columns: list[tuple[int, int] | None] = [None] * len(params)
        self.counted = True  # in the gradient norm (a parameter replicated over a TP group: on its first rank)
        self.group = group  # the shard group: the state is sharded over its ranks
        self.group_size = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        # hybrid sharding: the ranks holding the same shard in the other shard groups (None: none)
        self.replicas = replicas
        self.replica_rank = dist.get_rank(group=replicas) if replicas is not None else 0
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.reduce_dtype = reduce_dtype
        # gloo's reduce_scatter is slower than its all_reduce; a pairwise exchange (all_to_all) and a
        # local sum moves the same bytes as an ideal reduce-scatter (half an all-reduce's).
        self.pairwise = dist.get_backend(group) == "gloo"
        numels = [p.numel() for p in params]
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        shard_pos = 0
        for members in split_buckets(numels, bucket_size):
            make = chunked_runs if chunked else flat_runs
            runs, size = make([numels[i] for i in members], self.group_size, first=members[0])
            bucket = Bucket(members, runs, size, self.group_size, self.rank, shard_pos)
            self.buckets.append(bucket)
            for i in members:
                self.bucket_of[i] = bucket
            shard_pos += bucket.shard
        self.shard_numel = shard_pos
        f32 = dict(dtype=torch.float32, device=self.device)
        self.master = torch.zeros(shard_pos, **f32)
        self.exp_avg = torch.zeros(shard_pos, **f32)
        self.exp_avg_sq = torch.zeros(shard_pos, **f32)
        self.grad = torch.zeros(shard_pos, **f32)
        self.refresh_master()

    def own_runs(self) -> Iterable[tuple[int, int, int, int]]:
        """This rank's (param index, start in the local parameter, length, position in the shard)."""
        for bucket in self.buckets:
            for run in bucket.mine:
                yield run.param, run.start, run.length, bucket.shard_offset + run.offset - run.owner * bucket.shard

    def pieces(self) -> Iterable[tuple[int, int, int, int, int, int]]:
        """This rank's shard in full-parameter coordinates: (param index, first element, segment length,
        position in the shard, segments, stride)."""
        for i, start, length, pos in self.own_runs():
            if self.columns[i] is None:
                yield i, self.offsets[i] + start, length, pos, 1, length
                continue
            cols, full = self.columns[i]
            while length:
                row, col = divmod(start, cols)
                rows = length // cols if col == 0 else 0  # whole rows from here
                seg, count = (cols, rows) if rows else (min(cols - col, length), 1)
                yield i, self.offsets[i] + row * full + col, seg, pos, count, full
                start, length, pos = start + seg * count, length - seg * count, pos + seg * count

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Set this rank's fp32 master shard from the parameters."""
        for i, start, length, pos in self.own_runs():
            self.master[pos : pos + length].copy_(self.params[i].detach().reshape(-1)[start : start + length])

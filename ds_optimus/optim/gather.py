"""The sharded optimizer's parameter all-gather, at the end of `step()` or overlapped with the next forward
pass (each module's pre-hook waits for its own buckets; a full copy is held until then).
"""

from __future__ import annotations

import functools
import time

import torch

from ..parallel.collectives import collective
from .spaces import Bucket, BufferPool, Space


class ParamGather:
    """The all-gathers of one optimizer's spaces; `order`: (space, bucket) pairs in forward-use order."""

    def __init__(self, order: list[tuple[Space, Bucket]], pool: BufferPool, module=None, overlap: bool = False) -> None:
        self.order, self.pool = order, pool
        self.overlap = bool(overlap and module is not None)
        self.pending: dict[int, tuple] = {}  # id(bucket) -> (space, bucket, buffer, work)
        self.bucket_of: dict[int, int] = {}  # id(param) -> id(its bucket), while the bucket is pending
        # On gloo the work handles live until the next gather: a gloo worker thread dropping the last one
        # would free its tensors, needing the GIL, which aborts a process exiting right after a step.
        # (Elsewhere a handle holds its output buffer: dropped once the bucket is copied in.)
        self.works: list = []
        self.launch_s = 0.0  # seconds of the last step spent gathering (at once) or launching (overlapped)
        self.wait_s = 0.0  # seconds the forward pass waited for parameters since the last step
        self._hooks: list = []
        if self.overlap:
            self._register(module)

    def _register(self, module) -> None:
        params = {id(space.params[i]) for space, bucket in self.order for i in bucket.params}
        units = []
        compiled = [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
        inside = {id(sub) for m in compiled for sub in m.modules() if sub is not m}
        for m in compiled:  # the outermost compiled modules wait for their whole subtree
            if id(m) not in inside:
                units.append((m, [id(p) for p in m.parameters() if id(p) in params]))
        for m in module.modules():
            if id(m) in inside or getattr(m, "_compiled_call_impl", None) is not None:
                continue
            own = [id(p) for p in m._parameters.values() if p is not None and id(p) in params]
            if own:
                units.append((m, own))
        for m, ids in units:
            # first among the module's pre-hooks: any other one sees the new weights
            self._hooks.append(
                m.register_forward_pre_hook(functools.partial(_before_forward, self, tuple(ids)), prepend=True)
            )
        self._hooks.append(module.register_state_dict_pre_hook(lambda *args, **kwargs: self.wait_all()))
        self._hooks.append(module.register_load_state_dict_pre_hook(lambda *args, **kwargs: self.wait_all()))

    @torch.no_grad()
    def launch(self) -> None:
        """Gather every space's updated shards: at once, or launched for the next forward pass."""
        self.wait_all()  # a gather not yet taken (no forward since the last step) lands first
        start = time.perf_counter()
        self.works, self.wait_s = [], 0.0
        in_flight = []
        for space, bucket in self.order:
            buf = self.pool.get(bucket.size, space.dtype, space.device)
            own = buf[space.rank * bucket.shard : (space.rank + 1) * bucket.shard]
            own.copy_(space.master[bucket.shard_offset : bucket.shard_offset + bucket.shard])
            work = collective("all_gather")(buf, own, group=space.group, async_op=True)
            if space.device.type == "cpu":
                self.works.append(work)
            if self.overlap:
                self.pending[id(bucket)] = (space, bucket, buf, work)
                for i in bucket.params:
                    self.bucket_of[id(space.params[i])] = id(bucket)
            else:
                in_flight.append((space, bucket, buf, work))
                if len(in_flight) > 1:
                    _scatter(*in_flight.pop(0), self.pool)
        for item in in_flight:
            _scatter(*item, self.pool)
        self.launch_s = time.perf_counter() - start

    def waits_for(self, param: torch.nn.Parameter) -> bool:
        """Whether `param`'s new value is still on its way."""
        return id(param) in self.bucket_of

    @torch.no_grad()
    def wait_for(self, param_ids) -> None:
        """Wait for the buckets holding these parameters."""
        for pid in param_ids:
            key = self.bucket_of.get(pid)
            if key is not None:
                self._take(key)

    @torch.no_grad()
    def wait_all(self) -> None:
        """Wait for every bucket still on its way."""
        for key in list(self.pending):
            self._take(key)

    def _take(self, key: int) -> None:
        space, bucket, buf, work = self.pending.pop(key)
        start = time.perf_counter()
        _scatter(space, bucket, buf, work, self.pool)
        self.wait_s += time.perf_counter() - start
        for i in bucket.params:
            self.bucket_of.pop(id(space.params[i]), None)

    def remove_hooks(self) -> None:
        self.wait_all()
        [handle.remove() for handle in self._hooks]
        self._hooks = []


# only waits: every rank launches every gather in step(), so one rank reading weights alone cannot hang the others
@torch.compiler.disable  # host-side bookkeeping: a compiled module breaks its graph here, at its start
def _before_forward(gather: ParamGather, param_ids: tuple[int, ...], module, args) -> None:
    if gather.pending:
        gather.wait_for(param_ids)


@torch.no_grad()
def _scatter(space: Space, bucket: Bucket, buf: torch.Tensor, work, pool: BufferPool) -> None:
    """Wait for a bucket's all-gather and copy it into its parameters, bumping their version counters."""
    work.wait()
    for i, copies in bucket.copies.items():
        # through .data: an in-place copy into a view of the parameter breaks the profiler's memory tracking;
        # the version bump makes autograd refuse a backward through a value read before it arrived
        flat = space.params[i].data.view(-1)
        for start, offset, length in copies:
            flat[start : start + length].copy_(buf[offset : offset + length])
        torch.autograd.graph.increment_version(space.params[i])
    pool.put(buf)

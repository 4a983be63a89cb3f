"""The EP-aware sharded optimizer: ZeRO-1/2 with expert parameters sharded over their EDP group.

fp32 master weights and Adam moments are sharded over the data-parallel group, experts' over their EDP group.
Runs on its own (`backward(loss)`, `step()`) or as DeepSpeed's ZeRO optimizer (`integrations.deepspeed_engine`).
Gradients are reduce-scattered per bucket as backward completes it (ZeRO-1: only in a step's last micro-step);
`step()` runs fused Adam on the shard and all-gathers the new values (`gather.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.collectives import collective
from ..parallel.expert_parallel import is_expert_param
from ..parallel.groups import ExpertParallelGroups, hybrid_shard_groups
from .adam import adam_kind, adam_segments, fused_adam
from .gather import ParamGather
from .loss_scale import LossScaler
from .shard_state import STATE_FORMAT, load_spaces, restore_hyperparameters, shard_state
from .spaces import Bucket, BufferPool, ShardedOptimizerError, Space

__all__ = ["LossScaler", "STATE_FORMAT", "ShardedOptimizer", "ShardedOptimizerError"]


SQUARES_ROW = 4096  # elements per partial sum of the gradient norm's squares


def sum_of_squares(flat: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sum of squares of a 1-D float tensor as a `dtype` scalar: float32 row sums added up in `dtype`."""
    whole = flat.numel() - flat.numel() % SQUARES_ROW
    rows = flat[:whole].view(-1, SQUARES_ROW)
    # one float32 dot over a whole shard: 1.4e-3 relative error over 5e7 elements; these row sums: 2e-6
    total = torch.bmm(rows.unsqueeze(1), rows.unsqueeze(2)).reshape(-1).to(dtype).sum()
    tail = flat[whole:]
    return total + torch.dot(tail, tail).to(dtype)


class ShardedOptimizer:
    """ZeRO-1/2 over `init_optimizer`'s param groups (torch or DeepSpeed Adam/AdamW); `expert_groups`: from
    `apply_expert_parallel`; `shard_group_size`: ranks per hybrid shard group (None: all)."""

    def __init__(
        self,
        init_optimizer,
        *,
        param_names: dict[torch.nn.Parameter, str],
        stage: int,
        expert_groups: Iterable[ExpertParallelGroups] = (),
        dense_group=None,
        clip_grad: float = 0.0,
        bucket_size: int = 50_000_000,
        reduce_dtype: torch.dtype | None = None,
        overlap_comm: bool | None = None,
        loss_scaler: LossScaler | None = None,
        norm_group=None,
        shard_group_size: int | None = None,
        module: torch.nn.Module | None = None,
        overlap_param_gather: bool = False,
        accumulation_steps: int = 1,
        tensor_splits: dict[str, Any] | None = None,
        tensor_rank: int = 0,
        replicated_group=None,
    ) -> None:
        if stage not in (1, 2):
            raise ShardedOptimizerError(f"the sharded optimizer runs ZeRO stage 1 or 2, not {stage}")
        self.optimizer = init_optimizer
        self.param_groups = init_optimizer.param_groups  # shared: LR schedulers act on these dicts
        self.decoupled, self.amsgrad = adam_kind(init_optimizer)
        self.decay_after_update = False  # the weight decay after the update (`decay_after.apply_decay_after_update`)
        if self.amsgrad:
            raise ShardedOptimizerError("the sharded optimizer does not implement amsgrad")
        self.stage = stage
        self.clip_grad = float(clip_grad or 0.0)
        self.dense_group = dense_group if dense_group is not None else dist.group.WORLD
        # gradient norm over: every element on one of its ranks (with pipeline stages, the world)
        self.norm_group = norm_group if norm_group is not None else self.dense_group
        self.defer_reduction = False  # reduce only at the step's boundary also at ZeRO-2 (a pipeline schedule)
        # micro-steps a step adds up: ZeRO-1's buckets (and deferred ones) then hold fp32 sums, whatever
        # the reduction's dtype on the wire
        self.accumulation_steps = accumulation_steps
        # bytes handed to the gradient collectives, by kind (the wire dtype's), since construction
        self.comm_bytes = {"reduce_scatter": 0, "replica_all_reduce": 0}
        # Expert parameters name their layout by DeepSpeed's group name (`group_name`, "ep_size_{P}").
        self.expert_groups = {groups.name: groups for groups in expert_groups}
        self.world_size = dist.get_world_size(group=self.dense_group)
        if overlap_comm is None:  # on gloo the collectives' threads would share the backward pass's cores
            overlap_comm = dist.get_backend(self.dense_group) != "gloo"
        self.overlap_comm = overlap_comm
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = bool(loss_scaler and loss_scaler.dynamic)
        self._is_gradient_accumulation_boundary = True  # driven on its own, every backward ends a step
        self.overflow = False
        self._global_grad_norm: float | None = None
        self.skipped_steps = 0
        self.step_filter = None  # optional callable(global grad norm) -> decision with .skip
        self._reduced_this_step = 0  # reductions added to the shard since the last step
        self._finished = True
        self._pool = BufferPool()
        self.shard_group_size = shard_group_size
        # tensor parallelism: the split parameters by name (`parallel.tensor_parallel.Split`: the full shape,
        # the split dimension and this rank's part of it), and this rank's place in its TP group; the
        # other parameters are the same on every rank of the group, counted in the norm by its first
        self.tensor_splits, self.tensor_rank = dict(tensor_splits or {}), tensor_rank
        # sequence parallelism: the replicated parameters' gradients are parts of the whole on each TP rank,
        # the dense ones reduced (and their state sharded) over this group, every TP position's data-parallel
        # ranks; the experts' over their EDP groups of every TP position (`ExpertParallelGroups.edp_tp_group`)
        self.replicated_group = replicated_group
        self.spaces = self._build_spaces(param_names, bucket_size, reduce_dtype)
        device = self.spaces[0].device if self.spaces else torch.device("cpu")
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # the fused kernels read it on device
        # One launch order over all spaces, in the order backward completes the buckets (the one whose
        # earliest-defined parameter is latest first): every rank issues the same collectives in the
        # same sequence, across the dense and expert groups too, even when a parameter gets no gradient
        # on some ranks.
        first = {id(b): min(self._position[id(s.params[i])] for i in b.params) for s in self.spaces for b in s.buckets}
        self._order = sorted(((s, b) for s in self.spaces for b in s.buckets), key=lambda sb: -first[id(sb[1])])
        self._next = 0
        self._in_flight: list[tuple[Space, Bucket]] = []
        self._num_params = sum(len(s.params) for s in self.spaces)
        self._segments = adam_segments(self.spaces, self._group_of)
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, space, i))
            for space in self.spaces
            for i, p in enumerate(space.params)
        ]
        self._slot = {id(p): (space, i) for space in self.spaces for i, p in enumerate(space.params)}
        self._last: set[int] = set()  # ids of the parameters whose coming gradient is their last of the step
        # the next forward pass takes the buckets in the opposite order: earliest-defined parameter first
        self.gather = ParamGather(self._order[::-1], self._pool, module, overlap_param_gather)

    def _build_spaces(self, param_names, bucket_size: int, reduce_dtype) -> list[Space]:
        self._group_of: dict[int, int] = {}
        self._position: dict[int, int] = {}
        members: dict[tuple[str, torch.dtype], list[torch.nn.Parameter]] = {}
        # positions in the model's definition order (`param_names` is named_parameters()'s), not the
        # param groups' (which put every norm after every weight): the order forward uses them
        defined = {id(p): i for i, p in enumerate(param_names)}
        seen = set()
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                self._position[id(p)] = defined.get(id(p), len(defined) + len(self._position))
                if not p.is_contiguous():
                    raise ShardedOptimizerError(f"parameter {param_names.get(p, '?')} is not contiguous")
                self._group_of[id(p)] = g
                kind = p.group_name if is_expert_param(p) else "dense"
                if param_names.get(p) in self.tensor_splits:
                    kind = "tensor"  # this rank's part of a split parameter: reduced with the dense ones
                members.setdefault((kind, p.dtype), []).append(p)
        # under sequence parallelism the experts' gradients are parts too: reduced over their EDP groups of
        # every TP position
        sequence = self.replicated_group is not None
        kinds = {
            "dense": self.replicated_group or self.dense_group,
            "tensor": self.dense_group,
            **{
                name: g.edp_tp_group if sequence and g.edp_tp_group is not None else g.edp_group
                for name, g in self.expert_groups.items()
            },
        }
        hybrid = hybrid_shard_groups(kinds, self.shard_group_size)  # a LayoutError (one line) for a bad size
        spaces = []
        for (kind, dtype), params in members.items():
            # gradients arrive roughly in reverse order of definition
            params = sorted(params, key=lambda p: self._position[id(p)], reverse=True)
            names = [param_names.get(p) or f"param{i}" for i, p in enumerate(params)]
            columns = [None] * len(params)
            if kind == "dense":
                offsets, chunked = [0] * len(params), False
            elif kind == "tensor":
                offsets, columns = zip(*(self._place(name) for name in names), strict=True)
                chunked = False
            else:
                ep = self.expert_groups.get(kind)
                if ep is None:
                    raise ShardedOptimizerError(
                        f"expert parameters of layout {kind!r} but no such layout in "
                        "expert_groups; pass the groups apply_expert_parallel returned"
                    )
                chunked = True
                offsets = [ep.ep_rank * p.numel() for p in params]  # the local experts' place in the full weight
            rdtype = reduce_dtype or dtype
            shard, replicas = hybrid[kind]
            spaces.append(
                Space(
                    f"{kind}:{str(dtype).removeprefix('torch.')}",
                    params,
                    names,
                    list(offsets),
                    shard,
                    chunked,
                    bucket_size,
                    rdtype,
                    replicas,
                )
            )
            spaces[-1].columns = list(columns)
            # in the gradient norm: every split part, and a replicated parameter on the TP group's first rank
            spaces[-1].counted = kind == "tensor" or self.tensor_rank == 0 or sequence
        return spaces

    def _place(self, name: str) -> tuple[int, tuple[int, int] | None]:
        """This rank's part of split `name`: its first element, and (its, full) columns if split by columns."""
        split = self.tensor_splits[name]
        inner = math.prod(split.full[split.dim + 1 :])
        if split.dim == 0:
            return split.start * inner, None
        if split.dim != len(split.full) - 1:
            raise ShardedOptimizerError(
                f"{name}: a split along dimension {split.dim} of {len(split.full)} is not "
                "supported (rows or the last dimension only)"
            )
        return split.start, (split.stop - split.start, split.full[-1])

    # -- gradients ----------------------------------------------------------------------------------

    def _reducing(self) -> bool:
        return (self.stage == 2 and not self.defer_reduction) or self.is_gradient_accumulation_boundary()

    def bucket_dtype(self, space: Space) -> torch.dtype:
        """fp32 if a bucket sums several micro-steps and the wire dtype is narrower, else the wire dtype."""
        accumulates = self.defer_reduction or (self.stage == 1 and self.accumulation_steps > 1)
        if accumulates and space.reduce_dtype.itemsize < 4:
            return torch.float32
        return space.reduce_dtype

    def _bucket_buffer(self, space: Space, bucket: Bucket) -> torch.Tensor:
        if self.stage == 1:  # kept between micro-steps: its own memory
            buf = torch.empty(bucket.size, dtype=self.bucket_dtype(space), device=space.device)
        else:
            buf = self._pool.get(bucket.size, self.bucket_dtype(space), space.device)
        for offset, length in bucket.padding:
            buf[offset : offset + length].zero_()
        return buf

    @torch.no_grad()
    def _grad_ready(self, space: Space, i: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self._finished = False
        if self.gather.waits_for(param):
            raise ShardedOptimizerError(
                f"{space.names[i]} was used before its updated value arrived: something uses it outside the "
                "forward pass of the module that owns it; set optimus.sharded_optimizer.overlap_param_gather false"
            )
        bucket = space.bucket_of[i]
        if bucket.launched:
            raise ShardedOptimizerError(
                f"{space.names[i]} got a second gradient in one backward pass after its bucket was reduced "
                "(a parameter used in two reentrant activation-checkpointed regions?); use non-reentrant "
                "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        if bucket.grad is None:
            bucket.grad = self._bucket_buffer(space, bucket)
        flat = grad.reshape(-1)
        first = i not in bucket.written
        for start, offset, length in bucket.copies[i]:
            dst, src = bucket.grad[offset : offset + length], flat[start : start + length]
            dst.copy_(src) if first else dst.add_(src)
        bucket.written.add(i)
        bucket.arrived.add(i)
        param.grad = None  # the bucket holds it now
        if id(param) in self._last:
            bucket.last.add(i)
        if len(bucket.last) == len(bucket.params) or (self._reducing() and len(bucket.arrived) == len(bucket.params)):
            bucket.complete = True
            self._launch_ready()
        self._gradient_arrived()

    def last_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Mark `params`' coming gradients as the step's last, so their buckets reduce before the schedule ends."""
        self._last.update(id(p) for p in params if id(p) in self._slot)

    def gradients_ready(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Take gradients written into `params`' `.grad` outside autograd (a pipeline's weight-gradient pass)."""
        for param in params:
            slot = self._slot.get(id(param))
            if slot is not None and param.grad is not None:
                self._grad_ready(*slot, param)

    def _launch_ready(self) -> None:
        """Launch complete buckets, strictly in the one launch order."""
        while self._next < len(self._order) and self._order[self._next][1].complete:
            space, bucket = self._order[self._next]
            self._launch(space, bucket)
            self._next += 1

    def _launch(self, space: Space, bucket: Bucket) -> None:
        if bucket.grad is None:
            bucket.grad = self._bucket_buffer(space, bucket)
        for i in bucket.params:  # parameters without a gradient contribute zeros
            if i not in bucket.written:
                for _, offset, length in bucket.copies[i]:
                    bucket.grad[offset : offset + length].zero_()
        view = space.grad[bucket.shard_offset : bucket.shard_offset + bucket.shard]
        # the reduced shard: in the wire dtype from a reduce-scatter; in fp32 where the ranks' parts are
        # added here (the pairwise exchange, or one rank)
        local_sum = space.group_size == 1 or space.pairwise
        out_dtype = torch.float32 if local_sum else space.reduce_dtype
        bucket.direct = out_dtype == torch.float32 and self._reduced_this_step == 0
        bucket.out = view if bucket.direct else self._pool.get(bucket.shard, out_dtype, space.device)
        wire = bucket.grad  # cast to the wire dtype only here, at the collective
        if wire.dtype != space.reduce_dtype and space.group_size > 1:
            wire = self._pool.get(bucket.size, space.reduce_dtype, space.device)
            wire.copy_(bucket.grad)
        bucket.wire = wire
        if space.group_size == 1:  # nothing to exchange
            bucket.received = bucket.grad
        elif space.pairwise:
            bucket.received = self._pool.get(bucket.size, space.reduce_dtype, space.device)
            bucket.work = dist.all_to_all_single(bucket.received, wire, group=space.group, async_op=self.overlap_comm)
        else:
            bucket.work = collective("reduce_scatter")(bucket.out, wire, group=space.group, async_op=self.overlap_comm)
        if space.group_size > 1:
            self.comm_bytes["reduce_scatter"] += wire.numel() * wire.element_size()
        bucket.pending = bucket.launched = True
        self._in_flight.append((space, bucket))
        # Without overlap it is done already; with it, at most two buckets in flight, so that ZeRO-2
        # never holds more than a few buckets of full gradients.
        while len(self._in_flight) > (2 if self.overlap_comm else 0):
            self._complete(*self._in_flight.pop(0))

    def _complete(self, space: Space, bucket: Bucket) -> None:
        """Wait for a bucket's reduction and add its result to the fp32 shard."""
        if bucket.work is not None:
            bucket.work.wait()
        if bucket.wire is not None and bucket.wire is not bucket.grad:
            self._pool.put(bucket.wire)
        bucket.wire = None
        if bucket.received is not None:  # the ranks' parts added in fp32
            torch.sum(bucket.received.view(space.group_size, bucket.shard), 0, out=bucket.out, dtype=bucket.out.dtype)
            if bucket.received is not bucket.grad:
                self._pool.put(bucket.received)
        if not bucket.direct:
            view = space.grad[bucket.shard_offset : bucket.shard_offset + bucket.shard]
            if self._reduced_this_step == 0:
                view.copy_(bucket.out)
            else:
                view.add_(bucket.out)
            self._pool.put(bucket.out)
        bucket.work = bucket.out = bucket.received = None
        bucket.written.clear()
        bucket.arrived.clear()
        bucket.last.clear()
        if self.stage == 2:  # ZeRO-2 keeps only the reduced shard
            self._pool.put(bucket.grad)
            bucket.grad = None
        bucket.pending = False

    def _finish_reduction(self) -> None:
        """Launch what is left of this micro-step's reduction and wait for all of it."""
        if self._finished or not self._reducing():
            return
        for _, bucket in self._order:
            bucket.complete = True
        self._launch_ready()
        while self._in_flight:
            self._complete(*self._in_flight.pop(0))
        for _, bucket in self._order:
            bucket.complete = bucket.launched = False
        self._next = 0
        self._last.clear()
        self._reduced_this_step += 1
        self._finished = True

    # -- accumulation boundary and backward bookkeeping --------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends a step (ZeRO-1 reduces its gradients only then)."""
        return self._is_gradient_accumulation_boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Set whether the coming micro-step ends a step."""
        self._is_gradient_accumulation_boundary = bool(is_boundary)

    def finalize_gradient_accumulation_boundary(self) -> None:
        """End the step's accumulation now: reduce whatever is still unreduced."""
        self.set_gradient_accumulation_boundary(True)
        self._finish_reduction()

    # What a framework driving the optimizer adds around the backward pass (DeepSpeed's engine:
    # `ds_optimus.integrations.deepspeed_engine.ShardedOptimizer`); on its own there is nothing to add.
    def _backward_started(self) -> None: ...
    def _backward_ended(self) -> None: ...
    def _gradient_arrived(self) -> None: ...

    def backward_prologue(self) -> None:
        """Start a micro-step's backward pass."""
        for space in self.spaces:
            for bucket in space.buckets:
                bucket.arrived.clear()
        self._finished = False

    def backward_epilogue(self, **kwargs) -> None:
        """End a micro-step's backward pass: finish its reduction."""
        self._finish_reduction()

    # The names under which DeepSpeed's engine asks for the same at the end of a backward pass.
    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        self._finish_reduction()

    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        self._finish_reduction()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of `loss` (scaled when fp16 loss scaling is on), its gradients reduced into the shards."""
        self.backward_prologue()
        self._backward_started()
        self.scale_if_loss(loss).backward(retain_graph=retain_graph)
        self.backward_epilogue()
        self._backward_ended()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' gradients (the buckets and shards hold what was reduced)."""
        for p in (p for space in self.spaces for p in space.params):
            p.grad = None

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale (1 without loss scaling)."""
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    def scale_if_loss(self, value):
        """`value` times the loss scale when it is a scalar loss tensor, else `value` itself."""
        if self.loss_scaler is not None and isinstance(value, torch.Tensor) and value.dim() == 0:
            return self.loss_scaler.scale_loss(value)
        return value

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Clip, update this rank's shard, and all-gather the new parameters."""
        if self._reduced_this_step == 0:
            self._finished = False  # a step whose gradients never went through the hooks
            self._finish_reduction()
        self._reduce_across_replicas()
        # each rank's loss is a mean over its tokens: the global mean's gradient is the sum / DP size, experts too
        inv = 1.0 / (self.world_size * self.cur_scale)
        device = self.spaces[0].device if self.spaces else torch.device("cpu")
        wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        squares = torch.zeros((), dtype=wide, device=device)
        for space in self.spaces:  # each element counted once: by the first replica of its shard
            if space.replica_rank == 0 and space.counted:
                squares += sum_of_squares(space.grad, wide)
        dist.all_reduce(squares, group=self.norm_group)
        norm = math.sqrt(squares.item()) * inv
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)
        self._reduced_this_step = 0
        # A numerical guard (ds_optimus.reliability.guards) may veto the update; an fp16 overflow that
        # the dynamic loss scale answers is not a data problem and does not reach it.
        if self.step_filter is not None and not (self.overflow and self.dynamic_loss_scale):
            self.overflow = self.step_filter(norm).skip or self.overflow
        if self.overflow:
            self.skipped_steps += 1
            return
        clip = self.clip_grad / (norm + 1e-6) if self.clip_grad > 0 and norm > self.clip_grad else 1.0
        divisor = torch.full((), 1.0 / (inv * clip), dtype=torch.float32, device=self._step.device)  # no copy
        self._step += 1
        fused_adam(self._segments, self.param_groups, self._step, self.decoupled, divisor, self.decay_after_update)
        self.gather.launch()

    def _reduce_across_replicas(self) -> None:
        """Hybrid sharding: sum every reduced shard over its replicas, one async all-reduce per bucket."""
        works = []
        for space, bucket in self._order:
            if space.replicas is not None:  # fp16 sums of several micro-steps could overflow: fp32 then
                view = space.grad[bucket.shard_offset : bucket.shard_offset + bucket.shard]
                wire = view if space.reduce_dtype in (torch.float32, torch.float16) else view.to(space.reduce_dtype)
                self.comm_bytes["replica_all_reduce"] += wire.numel() * wire.element_size()
                works.append((view, wire, dist.all_reduce(wire, group=space.replicas, async_op=True)))
        for view, wire, work in works:
            work.wait()
            if wire is not view:
                view.copy_(wire)

    def wait_for_params(self) -> None:
        """Wait for every parameter's updated value (for code reading `param.data` before the next forward)."""
        self.gather.wait_all()

    # -- state ------------------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer, by kind."""
        state = sum(t.numel() * t.element_size() for s in self.spaces for t in (s.master, s.exp_avg, s.exp_avg_sq))
        grad_shard = sum(s.grad.numel() * s.grad.element_size() for s in self.spaces)
        buckets = 0
        if self.stage == 1 or self.defer_reduction:
            buckets = sum(b.size * self.bucket_dtype(s).itemsize for s in self.spaces for b in s.buckets)
        return {
            "optimizer_state": state,
            "gradient_shard": grad_shard,
            "gradient_buckets": buckets,
            "communication_buffers": self._pool.allocated,
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer-state shard, runs named by parameter and element range (any layout loads it)."""
        return {
            "format": STATE_FORMAT,
            "step": int(self._step.item()),
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "spaces": shard_state(self.spaces),
        }

    def load_state_dict(self, state_dict, load_optimizer_states: bool = True, **kwargs) -> None:
        """Load this rank's `state_dict()` (same layout, not hybrid) or a list of all ranks' (any layout)."""
        sources = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict]
        self.load_shards(sources)

    @torch.no_grad()
    def load_shards(self, sources: Iterable[dict[str, Any]], filled: bool = False) -> None:
        """Fill this rank's shard from a run's `state_dict()`s on any layout (`filled`: `load_spaces` ran), then
        set the parameters."""
        sources = list(sources)
        if not filled:
            load_spaces(self.spaces, sources)
        if sources:
            first = sources[0]
            self._step.fill_(first["step"])
            self.skipped_steps = first.get("skipped_steps", 0)
            if first.get("loss_scaler") and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(first["loss_scaler"])
            if first.get("param_groups"):
                restore_hyperparameters(self.param_groups, first["param_groups"])
        self.gather.launch()

    def refresh_master_from_params(self) -> None:
        """Set the fp32 master shard from the parameters (after loading weights only; code writing them
        calls `wait_for_params()` first)."""
        self.gather.wait_all()
        for space in self.spaces:
            space.refresh_master()

    def remove_hooks(self) -> None:
        """Detach the optimizer from the parameters' gradient hooks."""
        [handle.remove() for handle in self._hooks]
        self._hooks = []
        self.gather.remove_hooks()

    def destroy(self) -> None:
        """Remove the hooks: their autograd nodes, opaque to the GC, keep the optimizer alive."""
        self.remove_hooks()

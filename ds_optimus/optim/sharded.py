"""The EP-aware sharded optimizer: a ZeRO-1/2 stage that knows about expert parallelism.

Dense parameters' fp32 master weights and Adam moments are sharded over the data-parallel group,
each EP layout's expert parameters' over its expert-data-parallel (EDP) group, in shards aligned to
whole experts when the EDP size divides the local expert count (`layout.py`). DeepSpeed's engine
builds it in place of its own ZeRO optimizer when the config says so (`deepspeed_compat.py`), and
drives it through the same calls: `backward` (gradient hooks), `step`, `zero_grad`, checkpoints.

Per step:
- gradients are copied, as the backward pass produces them, into communication buckets, and each
  bucket is reduce-scattered with one collective as soon as it is complete (ZeRO-2: every
  micro-step, the reduced shard accumulated in fp32; ZeRO-1: gradients accumulate locally over the
  micro-steps and are reduce-scattered during the last one);
- the global gradient norm is one all-reduce of one number: every element of every parameter is
  held by exactly one rank's shard (dense over DP, experts over EDP, EP groups disjoint);
- Adam/AdamW runs on the shard with PyTorch's fused multi-tensor kernel, the unscaling, the
  averaging over ranks and the clipping folded into its gradient divisor;
- the updated shard is cast to the parameters' dtype and all-gathered, one collective per bucket.

Averaging: every rank's loss is the mean over its own tokens, so the gradient of the global mean is
the sum over ranks divided by the data-parallel world size, for expert weights too (an expert's
local gradient already sums the contributions of the tokens its EP group sent it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.expert_parallel import is_expert_param
from .deepspeed_compat import ZeROOptimizerBase
from .layout import chunked_runs, flat_runs, merge_copies, padding, split_buckets

STATE_FORMAT = "ds_optimus.sharded/1"


class ShardedOptimizerError(RuntimeError):
    """A setting or checkpoint the sharded optimizer cannot work with; one line saying why."""


class LossScaler:
    """Static or dynamic loss scaling for fp16 (the scale halves on overflow and doubles after
    `window` clean steps; `hysteresis` overflows are tolerated before a decrease)."""

    def __init__(self, scale: float = 1.0, dynamic: bool = False, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0) -> None:
        self.cur_scale, self.dynamic, self.window = float(scale), dynamic, window
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self.good_steps, self.bad_left = 0, hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:  # tolerated `hysteresis` - 1 times, then the scale halves at every overflow
            self.good_steps = 0
            if self.bad_left <= 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.bad_left -= 1
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.cur_scale *= 2
                self.bad_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


class _BufferPool:
    """Reused communication buffers on CPU. There a fresh tensor of tens of MB costs a page fault
    per 4 KiB the first time it is written (glibc hands large blocks back to the system), as much
    as the copy itself; so buffers are kept and handed out again, the smallest free one that is
    large enough (as a view of its first elements). Holds about as many buckets as are filled at
    once during the backward pass, plus one. Accelerators' caching allocators already reuse
    memory: there the pool just allocates."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.allocated = 0  # bytes held by the pool

    def get(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        fits = [i for i, t in enumerate(self.free) if t.dtype == dtype and t.device == device and t.numel() >= numel]
        if fits:
            base = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        else:
            base = torch.empty(numel, dtype=dtype, device=device)
            self.allocated += base.numel() * base.element_size()
        return base[:numel]

    def put(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            self.free.append(tensor._base if tensor._base is not None else tensor)


class _Bucket:
    """One reduce-scatter / all-gather unit of a space."""

    def __init__(self, params: list[int], runs, size: int, group_size: int, rank: int, shard_offset: int) -> None:
        self.params = params
        self.size = size
        self.shard = size // group_size
        self.shard_offset = shard_offset  # where this bucket's shard starts in the space's shard
        self.copies = merge_copies(runs)  # param -> [(start, offset, length)]
        self.mine = [r for r in runs if r.owner == rank]
        self.padding = padding(runs, size)
        self.grad: torch.Tensor | None = None  # the full bucket of gradients (reduce dtype)
        self.written: set[int] = set()  # params whose gradient is in `grad` (this accumulation)
        self.arrived: set[int] = set()  # params whose gradient arrived this micro-step
        self.complete = False
        self.work = None
        self.out: torch.Tensor | None = None
        self.received: torch.Tensor | None = None  # pairwise reduce-scatter: every rank's copy of my shard
        self.direct = False  # the reduce-scatter writes straight into the fp32 shard
        self.pending = False  # launched, not yet added to the shard
        self.launched = False  # reduced in this micro-step


class _Space:
    """Parameters reduced over one process group: the dense ones, or one EP layout's experts."""

    def __init__(self, key: str, params: list[torch.nn.Parameter], names: list[str], offsets: list[int],
                 group, chunked: bool, bucket_size: int, reduce_dtype: torch.dtype) -> None:
        self.key = key
        self.params, self.names = params, names
        self.offsets = offsets  # where each (local) parameter starts in the full parameter, flattened
        self.group = group
        self.group_size = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.reduce_dtype = reduce_dtype
        # gloo's reduce_scatter is slower than its all_reduce; a pairwise exchange (all_to_all) and a
        # local sum moves the same bytes as an ideal reduce-scatter (half an all-reduce's).
        self.pairwise = dist.get_backend(group) == "gloo"
        numels = [p.numel() for p in params]
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}
        shard_pos = 0
        for members in split_buckets(numels, bucket_size):
            make = chunked_runs if chunked else flat_runs
            runs, size = make([numels[i] for i in members], self.group_size, first=members[0])
            bucket = _Bucket(members, runs, size, self.group_size, self.rank, shard_pos)
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
        with torch.no_grad():
            for bucket in self.buckets:
                for run in bucket.mine:
                    pos = bucket.shard_offset + run.offset - run.owner * bucket.shard
                    flat = params[run.param].detach().reshape(-1)
                    self.master[pos:pos + run.length].copy_(flat[run.start:run.start + run.length])

    def own_runs(self) -> Iterable[tuple[int, int, int, int]]:
        """(param index, start in the local parameter, length, position in the shard) of this rank."""
        for bucket in self.buckets:
            for run in bucket.mine:
                yield run.param, run.start, run.length, bucket.shard_offset + run.offset - run.owner * bucket.shard


class ShardedOptimizer(ZeROOptimizerBase):
    """ZeRO-1 (`stage=1`) or ZeRO-2 (`stage=2`) over the param groups of `init_optimizer` (torch or
    DeepSpeed Adam/AdamW), with expert parameters sharded over their EDP groups."""

    def __init__(self, init_optimizer, *, param_names: dict[torch.nn.Parameter, str], stage: int,
                 dense_group=None, clip_grad: float = 0.0, bucket_size: int = 50_000_000,
                 reduce_dtype: torch.dtype | None = None, overlap_comm: bool | None = None,
                 loss_scaler: LossScaler | None = None) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ShardedOptimizerError(f"the sharded optimizer runs ZeRO stage 1 or 2, not {stage}")
        self.optimizer = init_optimizer
        self.param_groups = init_optimizer.param_groups  # shared: LR schedulers act on these dicts
        self.decoupled, self.amsgrad = _adam_kind(init_optimizer)
        if self.amsgrad:
            raise ShardedOptimizerError("the sharded optimizer does not implement amsgrad")
        self.stage = stage
        self.clip_grad = float(clip_grad or 0.0)
        self.dense_group = dense_group if dense_group is not None else dist.group.WORLD
        self.dp_process_group = self.dense_group  # what DeepSpeed's engine reads
        self.world_size = dist.get_world_size(group=self.dense_group)
        if overlap_comm is None:  # on gloo the collectives' threads would share the backward pass's cores
            overlap_comm = dist.get_backend(self.dense_group) != "gloo"
        self.overlap_comm = overlap_comm
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = bool(loss_scaler and loss_scaler.dynamic)
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        self.overflow = False
        self._global_grad_norm: float | None = None
        self.skipped_steps = 0
        self.step_filter = None  # optional callable(global grad norm) -> decision with .skip
        self._reduced_this_step = 0  # reductions added to the shard since the last step
        self._finished = True
        self._pool = _BufferPool()
        self.spaces = self._build_spaces(param_names, bucket_size, reduce_dtype)
        device = self.spaces[0].device if self.spaces else torch.device("cpu")
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # the fused kernels read it on device
        # One launch order over all spaces (latest-defined parameters first, as backward produces
        # them): every rank issues the same collectives in the same sequence, across the dense and
        # expert groups too, even when a parameter gets no gradient on some ranks.
        self._order = sorted(((s, b) for s in self.spaces for b in s.buckets),
                             key=lambda sb: -max(self._position[id(sb[0].params[i])] for i in sb[1].params))
        self._next = 0
        self._in_flight: list[tuple[_Space, _Bucket]] = []
        self._num_params = sum(len(s.params) for s in self.spaces)
        self._segments = self._adam_segments()
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, space, i))
                       for space in self.spaces for i, p in enumerate(space.params)]

    # -- construction -----------------------------------------------------------------------------

    def _build_spaces(self, param_names, bucket_size: int, reduce_dtype) -> list[_Space]:
        from ..parallel.groups import expert_parallel_groups

        self._group_of: dict[int, int] = {}
        self._position: dict[int, int] = {}
        members: dict[tuple[str, torch.dtype], list[torch.nn.Parameter]] = {}
        seen = set()
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                self._position[id(p)] = len(self._position)
                if not p.is_contiguous():
                    raise ShardedOptimizerError(f"parameter {param_names.get(p, '?')} is not contiguous")
                self._group_of[id(p)] = g
                kind = p.group_name if is_expert_param(p) else "dense"
                members.setdefault((kind, p.dtype), []).append(p)
        spaces = []
        for (kind, dtype), params in members.items():
            params = params[::-1]  # gradients arrive roughly in reverse order of definition
            names = [param_names.get(p) or f"param{i}" for i, p in enumerate(params)]
            if kind == "dense":
                group, offsets, chunked = self.dense_group, [0] * len(params), False
            else:
                ep = expert_parallel_groups(kind)
                if ep is None:
                    raise ShardedOptimizerError(f"no expert-parallel groups named {kind!r}; shard the model with "
                                                "ds_optimus.parallel.apply_expert_parallel first")
                group, chunked = ep.edp_group, True
                offsets = [ep.ep_rank * p.numel() for p in params]  # the local experts' place in the full weight
            rdtype = reduce_dtype or dtype
            spaces.append(_Space(f"{kind}:{str(dtype).removeprefix('torch.')}", params, names, offsets, group,
                                 chunked, bucket_size, rdtype))
        return spaces

    def _adam_segments(self) -> dict[int, list[tuple[_Space, int, int]]]:
        """Per param group, (space, shard position, length) runs of this rank's shard, adjacent runs
        of the same group merged: the tensors of one fused multi-tensor Adam call."""
        segments: dict[int, list[list]] = {}
        for space in self.spaces:
            for param, _, length, pos in sorted(space.own_runs(), key=lambda r: r[3]):
                g = self._group_of[id(space.params[param])]
                mine = segments.setdefault(g, [])
                if mine and mine[-1][0] is space and mine[-1][1] + mine[-1][2] == pos:
                    mine[-1][2] += length
                else:
                    mine.append([space, pos, length])
        return {g: [tuple(s) for s in segs] for g, segs in segments.items()}

    # -- gradients ----------------------------------------------------------------------------------

    def _reducing(self) -> bool:
        return self.stage == 2 or self.is_gradient_accumulation_boundary()

    def _bucket_buffer(self, space: _Space, bucket: _Bucket) -> torch.Tensor:
        if self.stage == 1:  # kept between micro-steps: its own memory
            buf = torch.empty(bucket.size, dtype=space.reduce_dtype, device=space.device)
        else:
            buf = self._pool.get(bucket.size, space.reduce_dtype, space.device)
        for offset, length in bucket.padding:
            buf[offset:offset + length].zero_()
        return buf

    @torch.no_grad()
    def _grad_ready(self, space: _Space, i: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        self._finished = False
        bucket = space.bucket_of[i]
        if bucket.launched:
            raise ShardedOptimizerError(
                f"{space.names[i]} got a second gradient in one backward pass after its bucket was reduced "
                "(a parameter used in two reentrant activation-checkpointed regions?); use non-reentrant "
                "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False})")
        if bucket.grad is None:
            bucket.grad = self._bucket_buffer(space, bucket)
        flat = grad.reshape(-1)
        first = i not in bucket.written
        for start, offset, length in bucket.copies[i]:
            dst, src = bucket.grad[offset:offset + length], flat[start:start + length]
            dst.copy_(src) if first else dst.add_(src)
        bucket.written.add(i)
        bucket.arrived.add(i)
        param.grad = None  # the bucket holds it now
        if self._reducing() and len(bucket.arrived) == len(bucket.params):
            bucket.complete = True
            self._launch_ready()
        self.update_hook_state_and_maybe_run_epilogue(self._num_params)

    def _launch_ready(self) -> None:
        """Launch complete buckets, strictly in the one launch order."""
        while self._next < len(self._order) and self._order[self._next][1].complete:
            space, bucket = self._order[self._next]
            self._launch(space, bucket)
            self._next += 1

    def _launch(self, space: _Space, bucket: _Bucket) -> None:
        if bucket.grad is None:
            bucket.grad = self._bucket_buffer(space, bucket)
        for i in bucket.params:  # parameters without a gradient contribute zeros
            if i not in bucket.written:
                for _, offset, length in bucket.copies[i]:
                    bucket.grad[offset:offset + length].zero_()
        view = space.grad[bucket.shard_offset:bucket.shard_offset + bucket.shard]
        bucket.direct = space.reduce_dtype == torch.float32 and self._reduced_this_step == 0
        bucket.out = view if bucket.direct else self._pool.get(bucket.shard, space.reduce_dtype, space.device)
        if space.group_size == 1:  # nothing to exchange
            bucket.received = bucket.grad
        elif space.pairwise:
            bucket.received = self._pool.get(bucket.size, space.reduce_dtype, space.device)
            bucket.work = dist.all_to_all_single(bucket.received, bucket.grad, group=space.group,
                                                 async_op=self.overlap_comm)
        else:
            bucket.work = _collective("reduce_scatter")(bucket.out, bucket.grad, group=space.group,
                                                        async_op=self.overlap_comm)
        bucket.pending = bucket.launched = True
        self._in_flight.append((space, bucket))
        # Without overlap it is done already; with it, at most two buckets in flight, so that ZeRO-2
        # never holds more than a few buckets of full gradients.
        while len(self._in_flight) > (2 if self.overlap_comm else 0):
            self._complete(*self._in_flight.pop(0))

    def _complete(self, space: _Space, bucket: _Bucket) -> None:
        """Wait for a bucket's reduction and add its result to the fp32 shard."""
        if bucket.work is not None:
            bucket.work.wait()
        if bucket.received is not None:
            torch.sum(bucket.received.view(space.group_size, bucket.shard), 0, out=bucket.out)
            if bucket.received is not bucket.grad:
                self._pool.put(bucket.received)
        if not bucket.direct:
            view = space.grad[bucket.shard_offset:bucket.shard_offset + bucket.shard]
            if self._reduced_this_step == 0:
                view.copy_(bucket.out)
            else:
                view.add_(bucket.out)
            self._pool.put(bucket.out)
        bucket.work = bucket.out = bucket.received = None
        bucket.written.clear()
        bucket.arrived.clear()
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
        self._reduced_this_step += 1
        self._finished = True

    def finalize_gradient_accumulation_boundary(self) -> None:
        """What DeepSpeed's engine calls at step() with unmanaged gradient accumulation."""
        self.set_gradient_accumulation_boundary(True)
        self._finish_reduction()

    # -- the calls DeepSpeed's engine makes -------------------------------------------------------

    def backward_prologue(self) -> None:
        for space in self.spaces:
            for bucket in space.buckets:
                bucket.arrived.clear()
        self._finished = False

    def backward_epilogue(self, **kwargs) -> None:
        self._finish_reduction()

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        self._finish_reduction()

    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        self._finish_reduction()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of `loss` on its own (outside DeepSpeed's engine)."""
        self.backward_prologue()
        self.enter_backward()
        self.scale_if_loss(loss).backward(retain_graph=retain_graph)
        self.backward_epilogue()
        self.exit_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for space in self.spaces:
            for p in space.params:
                p.grad = None

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    def scale_if_loss(self, value):
        if self.loss_scaler is not None and isinstance(value, torch.Tensor) and value.dim() == 0:
            return self.loss_scaler.scale_loss(value)
        return value

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Clip, update this rank's shard, and all-gather the new parameters."""
        if self._reduced_this_step == 0:
            self._finished = False  # a step whose gradients never went through the hooks
            self._finish_reduction()
        inv = 1.0 / (self.world_size * self.cur_scale)
        squares = torch.zeros((), dtype=torch.float32, device=self.spaces[0].device if self.spaces else "cpu")
        for space in self.spaces:
            squares += torch.dot(space.grad, space.grad)
        dist.all_reduce(squares, group=self.dense_group)
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
        divisor = torch.tensor(1.0 / (inv * clip), dtype=torch.float32, device=self._step.device)
        self._step += 1
        for g, segments in self._segments.items():
            group = self.param_groups[g]
            views = {key: [getattr(s, key)[pos:pos + n] for s, pos, n in segments]
                     for key in ("master", "grad", "exp_avg", "exp_avg_sq")}
            beta1, beta2 = group.get("betas", (0.9, 0.999))
            update = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
            update(views["master"], views["grad"], views["exp_avg"], views["exp_avg_sq"], [],
                   [self._step] * len(segments), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                   weight_decay=group.get("weight_decay", 0.0), eps=group.get("eps", 1e-8), amsgrad=False,
                   maximize=False, grad_scale=divisor, found_inf=None)
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Cast every shard to the parameters' dtype and all-gather it, bucket by bucket (two in
        flight), into the parameters."""
        pending = []
        for space in self.spaces:
            for bucket in space.buckets:
                buf = self._pool.get(bucket.size, space.dtype, space.device)
                own = buf[space.rank * bucket.shard:(space.rank + 1) * bucket.shard]
                own.copy_(space.master[bucket.shard_offset:bucket.shard_offset + bucket.shard])
                work = _collective("all_gather")(buf, own, group=space.group, async_op=True)
                pending.append((space, bucket, buf, work))
                if len(pending) > 1:
                    self._scatter_into_params(*pending.pop(0))
        for item in pending:
            self._scatter_into_params(*item)

    def _scatter_into_params(self, space: _Space, bucket: _Bucket, buf: torch.Tensor, work) -> None:
        work.wait()
        for i, copies in bucket.copies.items():
            flat = space.params[i].data.view(-1)
            for start, offset, length in copies:
                flat[start:start + length].copy_(buf[offset:offset + length])
        self._pool.put(buf)

    # -- state ------------------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer: fp32 master and moments, the reduced gradient
        shard, (ZeRO-1) the full-size gradient buckets kept between micro-steps, and the reused
        communication buffers (about two buckets' worth)."""
        state = sum(t.numel() * t.element_size() for s in self.spaces for t in (s.master, s.exp_avg, s.exp_avg_sq))
        grad_shard = sum(s.grad.numel() * s.grad.element_size() for s in self.spaces)
        buckets = 0
        if self.stage == 1:
            buckets = sum(b.size * torch.empty((), dtype=s.reduce_dtype).element_size()
                          for s in self.spaces for b in s.buckets)
        return {"optimizer_state": state, "gradient_shard": grad_shard, "gradient_buckets": buckets,
                "communication_buffers": self._pool.allocated}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, with each run named by its parameter and its
        element range in the full (unsharded) parameter, so any layout can load it."""
        spaces = []
        for space in self.spaces:
            pieces = [(space.names[i], space.offsets[i] + start, length, pos)
                      for i, start, length, pos in space.own_runs()]
            spaces.append({"key": space.key, "pieces": pieces, "master": space.master.cpu(),
                           "exp_avg": space.exp_avg.cpu(), "exp_avg_sq": space.exp_avg_sq.cpu()})
        return {"format": STATE_FORMAT, "step": int(self._step.item()), "skipped_steps": self.skipped_steps,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "spaces": spaces}

    def load_state_dict(self, state_dict, load_optimizer_states: bool = True, **kwargs) -> None:
        """Load one state dict of `state_dict()` (this rank's, same layout) or a list of all ranks'
        (any layout)."""
        sources = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict]
        self.load_shards(sources)

    @torch.no_grad()
    def load_shards(self, sources: Iterable[dict[str, Any]]) -> None:
        """Fill this rank's shard from the `state_dict()`s of a run on any layout (every rank's, or
        at least those holding this rank's elements), then set the parameters from it."""
        sources = list(sources)
        wanted: dict[str, list[tuple[int, int, _Space, int]]] = {}
        for space in self.spaces:
            for i, start, length, pos in space.own_runs():
                wanted.setdefault(space.names[i], []).append((space.offsets[i] + start, length, space, pos))
        covered = {name: 0 for name in wanted}
        step = None
        for source in sources:
            if source.get("format") != STATE_FORMAT:
                raise ShardedOptimizerError(f"not a sharded-optimizer state (format {source.get('format')!r})")
            if step is None:
                step, self.skipped_steps = source["step"], source.get("skipped_steps", 0)
            if source.get("loss_scaler") and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(source["loss_scaler"])
            for saved in source["spaces"]:
                for name, gstart, length, spos in saved["pieces"]:
                    for wstart, wlength, space, pos in wanted.get(name, ()):
                        lo, hi = max(gstart, wstart), min(gstart + length, wstart + wlength)
                        if lo >= hi:
                            continue
                        src = slice(spos + lo - gstart, spos + hi - gstart)
                        dst = slice(pos + lo - wstart, pos + hi - wstart)
                        for key in ("master", "exp_avg", "exp_avg_sq"):
                            getattr(space, key)[dst].copy_(saved[key][src])
                        covered[name] += hi - lo
        missing = [n for n, runs in wanted.items() if covered[n] != sum(r[1] for r in runs)]
        if missing:
            raise ShardedOptimizerError(f"the checkpoint has no optimizer state for {missing[0]} "
                                        f"(and {len(missing) - 1} more); was the model changed?")
        if step is not None:
            self._step.fill_(step)
        if sources and sources[0].get("param_groups"):
            self._restore_hyperparameters(sources[0]["param_groups"])
        self._gather_params()

    def _restore_hyperparameters(self, saved_groups: list[dict[str, Any]]) -> None:
        """As torch's `load_state_dict` does, bring back the param groups' hyper-parameters (the
        learning rate an LR scheduler last set, ...): matched by group name, else by position; a
        group the checkpoint lacks (e.g. the expert group of an EP run resuming a run without EP)
        takes the learning rate of the first saved group."""
        by_name = {g.get("name"): g for g in saved_groups if g.get("name") is not None}
        for i, group in enumerate(self.param_groups):
            saved = by_name.get(group.get("name"))
            if saved is None and len(saved_groups) == len(self.param_groups) and not by_name:
                saved = saved_groups[i]
            if saved is not None:
                group.update({k: v for k, v in saved.items() if k != "params"})
            else:
                group.update({k: saved_groups[0][k] for k in ("lr", "initial_lr") if k in saved_groups[0]})

    def refresh_master_from_params(self) -> None:
        """Set the fp32 master shard from the current parameters (after loading weights only)."""
        with torch.no_grad():
            for space in self.spaces:
                for i, start, length, pos in space.own_runs():
                    space.master[pos:pos + length].copy_(space.params[i].detach().reshape(-1)[start:start + length])

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _collective(kind: str):
    """torch.distributed's single-tensor reduce-scatter / all-gather (`*_single` from PyTorch 2.13,
    `*_tensor` before), looked up at call time."""
    fallback = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}[kind]
    return getattr(dist, f"{kind}_single", None) or getattr(dist, fallback)


def _adam_kind(optimizer) -> tuple[bool, bool]:
    """(decoupled weight decay, amsgrad) of a torch or DeepSpeed Adam/AdamW; a clear error otherwise."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.AdamW):
        return True, bool(optimizer.defaults.get("amsgrad"))
    if isinstance(optimizer, torch.optim.Adam):
        return bool(optimizer.defaults.get("decoupled_weight_decay", False)), bool(optimizer.defaults.get("amsgrad"))
    if name in ("FusedAdam", "DeepSpeedCPUAdam"):
        return bool(getattr(optimizer, "adam_w_mode", True)), bool(optimizer.defaults.get("amsgrad", False))
    raise ShardedOptimizerError(f"the sharded optimizer runs Adam or AdamW; the config's optimizer is {name}")

"""The deduplicated exchange cut into chunks whose exchanges overlap the experts' compute.

Each stage runs for all chunks before the next, on asynchronous all-to-alls, so chunk c computes while
c+1 travels; the backward mirrors it. The experts' backward replays each chunk's recorded graph; the rest
is differentiated by hand.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..moe.permute import _rowwise_dot
from .dedup import DedupDispatcher, _Pending, _sum_members, at_experts, depart, pack, plan_chunks, unpack


def dedup_dispatcher(groups, num_local_experts: int, chunks: int = 1) -> DedupDispatcher:
    """The deduplicated exchange in `chunks` (overlapped with the experts' compute where more than one)."""
    cls = OverlappedDispatcher if chunks > 1 else DedupDispatcher
    return cls(groups, num_local_experts, chunks)


class OverlappedDispatcher(DedupDispatcher):
    """`DedupDispatcher` in `chunks` > 1, each chunk's exchange overlapped with another's experts."""

    @torch.compiler.disable  # split sizes are read on the host, as in DedupDispatcher
    def __call__(self, x, ids, weights, experts, params) -> torch.Tensor:
        return overlapped(self, x, ids, weights, experts, params)


def overlapped(dispatcher: DedupDispatcher, x, ids, weights, experts, params) -> torch.Tensor:
    """The exchange of `dispatcher` (`dispatcher.chunks` > 1), overlapped."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, *params)):
        return _Overlapped.apply(dispatcher, experts, ids, x, weights, *params)
    return _Run(dispatcher, experts, ids, x, weights, (), record=False).forward()


class _Overlapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher, experts, ids, x, weights, *params):
        run = _Run(dispatcher, experts, ids, x, weights, params, record=True)
        out = run.forward()
        # The run (each chunk's recorded experts) hangs on an empty saved tensor rather than on ctx:
        # non-reentrant activation checkpointing drops saved tensors after the forward pass and hands
        # the backward pass those of its recomputation (a tensor that needs no gradient is passed on
        # as the same object), so the layer's rows are not kept in between.
        token = torch.empty(0)
        token.run = run
        ctx.save_for_backward(token)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        run = getattr(token, "run", None)
        if run is None:
            raise RuntimeError(
                "the overlapped expert-parallel exchange lost its forward state: a saved-tensor "
                "hook copied it (e.g. offloading to pinned memory) or the graph is run backward "
                "twice; use optimus.expert_parallel.chunks 1 there"
            )
        token.run = None
        grad_x, grad_w, grad_params = run.backward(grad, ctx.needs_input_grad[3], ctx.needs_input_grad[4])
        return None, None, None, grad_x, grad_w, *grad_params


class _Chunk:
    def __init__(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
        self.x, self.w, self.ids = x, w, ids  # the rows at the hop's sending end (changes as they travel)
        self.hops: list[tuple] = []  # per hop: (members, where the slots land)
        self.pending: _Pending | None = None
        # at the experts: their members, each member's slot and weight, the rows in and out
        self.members = self.index = self.weight = self.rows_in = self.rows_out = None
        self.rows = 0  # rows received at the experts
        self.id_dtype = torch.int16  # of the expert ids in flight


class _Run:
    def __init__(self, dispatcher: DedupDispatcher, experts, ids, x, weights, params, *, record: bool) -> None:
        self.d, self.experts, self.record = dispatcher, experts, record
        self.params = tuple(params)
        # Each chunk's experts run on leaves standing for the weights, so that the weights' own hooks
        # see one gradient, summed over the chunks, as with any other layer.
        self.leaves = tuple(p.detach().requires_grad_(p.requires_grad) for p in self.params)
        self.k, self.weight_dtype = ids.shape[1], weights.dtype
        # the same number of chunks on every rank (some may be empty): they exchange chunk by chunk
        self.bounds = [len(t) for t in torch.arange(x.shape[0]).tensor_split(dispatcher.chunks)]
        parts = zip(
            x.detach().split(self.bounds), weights.detach().split(self.bounds), ids.split(self.bounds), strict=True
        )
        self.chunks = [_Chunk(*part) for part in parts]
        self.plans = plan_chunks(dispatcher, [c.ids for c in self.chunks])

    def _each(self):
        return zip(self.chunks, self.plans, strict=True)

    def forward(self) -> torch.Tensor:
        hops = self.d.hops
        for level, hop in enumerate(hops):
            for c, plan in self._each():
                if level:
                    self._arrive(c)
                m, here, rows, w, local = depart(c.x, c.w, c.ids, plan, level, hop)
                c.hops.append((m, here))
                c.id_dtype = local.dtype
                c.pending = _Pending([rows, pack(w, local)], plan.send[level], plan.recv[level], hop.group)
        for c, plan in self._each():
            self._arrive(c)
            partial = self._experts(c, plan)
            c.pending = _Pending([partial], plan.recv[-1], plan.send[-1], hops[-1].group)
        outs = []
        for level in reversed(range(len(hops))):
            for c, plan in self._each():
                (back,) = c.pending.wait()
                partial = _sum_members(back, c.hops[level][0], None)
                if level:
                    c.pending = _Pending([partial], plan.recv[level - 1], plan.send[level - 1], hops[level - 1].group)
                else:
                    c.pending = None
                    outs.append(partial)
        return torch.cat(outs)

    def _arrive(self, c: _Chunk) -> None:
        rows, meta = c.pending.wait()
        c.x, (c.w, c.ids) = rows, unpack(meta, self.weight_dtype, c.id_dtype)
        c.pending = None

    def _experts(self, c: _Chunk, plan) -> torch.Tensor:
        c.members, c.index = at_experts(c.ids, plan, self.d.num_local_experts)
        rows_in = c.x.index_select(0, c.members.row_of)
        c.weight = c.w.reshape(-1).index_select(0, c.index)
        c.rows = c.ids.shape[0]
        c.x = c.w = c.ids = None
        if not self.record:
            return _sum_members(self.experts(rows_in, plan.counts, *self.params), c.members, c.weight)
        c.rows_in = rows_in.requires_grad_()
        with torch.enable_grad():
            c.rows_out = self.experts(c.rows_in, plan.counts, *self.leaves)
        return _sum_members(c.rows_out.detach(), c.members, c.weight)

    def backward(self, grad: torch.Tensor, want_x: bool = True, want_w: bool = True):
        hops = self.d.hops
        grads = grad.split(self.bounds)
        for level, hop in enumerate(hops):  # the partial sums' gradients travel out again
            for i, (c, plan) in enumerate(self._each()):
                g = grads[i] if level == 0 else c.pending.wait()[0]
                back = g.contiguous().index_select(0, c.hops[level][0].row_of)
                c.pending = _Pending([back], plan.send[level], plan.recv[level], hop.group)
        wanted = [c for c in self.leaves if c.requires_grad]
        param_grads = None
        for c, plan in self._each():  # the experts' backward, while other chunks travel
            (g,) = c.pending.wait()
            rows = g.index_select(0, c.members.row_of)
            grad_weight = _rowwise_dot(c.rows_out.detach(), rows).to(self.weight_dtype)
            grad_out = rows.mul_(c.weight.to(rows.dtype).unsqueeze(1))
            found = _grad(c.rows_out, (c.rows_in, *wanted), grad_out)
            if param_grads is None:
                param_grads = found[1:]
            else:
                for total, part in zip(param_grads, found[1:], strict=True):
                    total.add_(part)
            grad_x = _sum_members(found[0], c.members, None)
            grad_w = grad_weight.new_zeros(c.rows * self.k).index_copy_(0, c.index, grad_weight).view(c.rows, self.k)
            c.rows_in = c.rows_out = c.weight = None
            c.pending = _Pending([grad_x, grad_w], plan.recv[-1], plan.send[-1], hops[-1].group)
        grads_x, grads_w = [], []
        for level in reversed(range(len(hops))):
            for c, plan in self._each():
                g_rows, g_w = c.pending.wait()
                m, here = c.hops[level]
                grad_x, grad_w = _sum_members(g_rows, m, None), _sum_members(g_w * here, m, None)
                if level:
                    c.pending = _Pending(
                        [grad_x, grad_w], plan.recv[level - 1], plan.send[level - 1], hops[level - 1].group
                    )
                else:
                    grads_x.append(grad_x)
                    grads_w.append(grad_w)
        found = iter(param_grads or ())
        params = [next(found) if p.requires_grad else None for p in self.leaves]
        return (torch.cat(grads_x) if want_x else None), (torch.cat(grads_w) if want_w else None), params


def _grad(output: torch.Tensor, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of `inputs` through `output`'s recorded graph (zeros where it does not reach)."""
    found = (
        torch.autograd.grad(output, inputs, grad, allow_unused=True) if output.requires_grad else (None,) * len(inputs)
    )
    return [torch.zeros_like(i) if g is None else g for g, i in zip(found, inputs, strict=True)]

"""The deduplicated expert-parallel exchange: each token crosses to a rank once, whatever number of
its experts live there; optionally cut into chunks whose exchanges overlap the experts' compute.

Flat: a token goes once to each rank owning at least one of its experts, with the local expert ids
and routing weights of its slots there. The destination gathers one row per slot from the received
token, runs its experts, sums the token's weighted outputs and sends back one row per (token, rank);
the source adds those partial sums. Hierarchical (`node_size`): a token crosses between nodes once
per destination node, on the rail of ranks with its local index, and that rank fans it out inside
the node once per rank hit there; the node's partial sums are added before they cross back. The
backward pass is the reverse.

Every sum over a row's members (the slots of a token on a rank, the ranks a token reaches) visits
the rows ordered by member count, so the j-th pass adds into a prefix of them: gathers only, no
atomics, the same result on every run. One host synchronisation per layer: every split size of every
hop and chunk is exchanged up front (the source knows what each hop will carry).

Chunks: the tokens are cut into `chunks` parts; every stage (prepare and send, compute and send back,
add) runs for all chunks before the next stage, on asynchronous collectives, so the exchange of one
chunk travels while the experts compute another, in the forward and the backward pass. On GPUs NCCL
runs the collectives on its own stream; on gloo its worker threads carry them while Python computes.
The backward pass replays the recorded per-chunk graphs stage by stage with `torch.autograd.grad`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..moe.permute import _rowwise_dot
from .dispatch import all_to_all
from .groups import ExpertParallelGroups

_GLOO_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)


def _wire(x: torch.Tensor, group) -> torch.Tensor:
    # Gloo's all-to-all has no 16-bit types; the exchange is bitwise, so those travel as bytes.
    if x.dtype not in _GLOO_DTYPES and x.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return x.view(torch.uint8)
    return x


class _Pending:
    """Asynchronous all-to-alls of several tensors with the same row splits."""

    def __init__(self, tensors: list[torch.Tensor], send: list[int], recv: list[int], group) -> None:
        self.inputs = [t.contiguous() for t in tensors]  # kept alive until the exchange is done
        self.outputs = [t.new_empty(sum(recv), *t.shape[1:]) for t in self.inputs]
        self.works = [dist.all_to_all_single(_wire(o, group), _wire(i, group), recv, send, group=group, async_op=True)
                      for o, i in zip(self.outputs, self.inputs, strict=True)]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.inputs = None
        return self.outputs


@dataclass
class _Members:
    """The members of N rows given by a mask [N, C], numbered column by column: member p is
    (column `column_of[p]`, row `row_of[p]`). `order` lists the rows by member count, most first;
    `nth[j]` holds the member numbers of the j-th member of rows order[:len(nth[j])]."""

    row_of: torch.Tensor
    column_of: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    nth: list[torch.Tensor]
    rows: int


def _nonzero(flat: torch.Tensor, size: int) -> torch.Tensor:
    if flat.device.type == "cpu":
        return flat.nonzero().squeeze(1)
    return torch.nonzero_static(flat, size=size).squeeze(1)  # no host synchronisation


def _members(mask: torch.Tensor, total: int, at_least: list[int]) -> _Members:
    """`total` = members in `mask`; `at_least[j]` = rows with more than j members (known on the host)."""
    n, c = mask.shape
    flat = _nonzero(mask.t().reshape(-1), total)
    column_of, row_of = flat // n, flat % n
    order = torch.argsort(mask.sum(1), descending=True, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=mask.device)
    ordinal = (mask.cumsum(1) - 1).reshape(-1).index_select(0, row_of * c + column_of)
    depth = max(len(at_least), 1)
    table = torch.zeros(n * depth, dtype=torch.long, device=mask.device)
    table[row_of * depth + ordinal] = torch.arange(total, device=mask.device)  # every index once
    table = table.view(n, depth)
    nth = [table[order[:m], j] for j, m in enumerate(at_least) if m]
    return _Members(row_of, column_of, order, inverse, nth, n)


def _sum_members(src: torch.Tensor, m: _Members, weight: torch.Tensor | None) -> torch.Tensor:
    """out[r] = sum over the members p of row r of weight[p] * src[p]."""
    dtype = torch.float32 if src.element_size() < 4 else src.dtype
    acc = torch.zeros(m.rows, src.shape[-1], dtype=dtype, device=src.device)
    for positions in m.nth:
        part = src.index_select(0, positions)
        if weight is None:
            acc[:len(positions)] += part
        else:
            acc[:len(positions)].addcmul_(part, weight.index_select(0, positions).to(dtype).unsqueeze(1))
    return acc.index_select(0, m.inverse).to(src.dtype)


class _Spread(torch.autograd.Function):
    """Row r copied to each of its members ([N, H] -> [S, H])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, m: _Members):
        ctx.m = m
        return x.index_select(0, m.row_of)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_members(grad.contiguous(), ctx.m, None), None


class _Collect(torch.autograd.Function):
    """Each row's members summed, weighted or not ([S, H] -> [N, H])."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, weight: torch.Tensor | None, m: _Members):
        ctx.m = m
        ctx.save_for_backward(*((src, weight) if weight is not None else ()))  # src only for d weight
        return _sum_members(src, m, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no more)
        rows = grad.contiguous().index_select(0, ctx.m.row_of)
        if not saved:
            return rows, None, None
        src, weight = saved
        grad_w = _rowwise_dot(src, rows).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return rows.mul_(weight.to(rows.dtype).unsqueeze(1)), grad_w, None


def _slot_members(ids: torch.Tensor, units: int, dests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ids [N, k] (-1: none), with `units` ids per destination: (destination of each slot, with
    `dests` for none; the [N, dests] mask of destinations reached)."""
    dest = torch.where(ids >= 0, torch.div(ids, units, rounding_mode="floor"), dests)
    mask = torch.zeros(ids.shape[0], dests + 1, dtype=torch.bool, device=ids.device).scatter_(1, dest, True)
    return dest, mask[:, :dests]


def _at_least(counts: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth, *counts.shape[1:]]: how many rows have more than j members, for j < depth."""
    thresholds = torch.arange(1, depth + 1, device=counts.device).view(-1, *([1] * counts.dim()))
    return (counts.unsqueeze(0) >= thresholds).sum(1)


@dataclass
class _Hop:
    group: object
    dests: int  # ranks of the group
    units: int  # expert ids per destination at this hop


class DedupDispatcher:
    """Runs a layer's experts on tokens routed across the EP group, each token crossing once per
    destination rank (or node, then rank). Installed by `apply_expert_parallel` (`dedup`)."""

    deduplicated = True

    def __init__(self, groups: ExpertParallelGroups, num_local_experts: int, chunks: int = 1) -> None:
        self.groups, self.num_local_experts, self.chunks = groups, num_local_experts, chunks
        el, g = num_local_experts, groups
        if g.hierarchical:
            n = g.node_size
            self.hops = [_Hop(g.inter_node_group, g.ep_size // n, n * el), _Hop(g.intra_node_group, n, el)]
        else:
            self.hops = [_Hop(g.ep_group, g.ep_size, el)]

    @torch.compiler.disable  # split sizes are read on the host: a traced exchange would recompile per routing
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Experts on `x [T, H]` for expert ids `ids [T, k]` (in the EP group; -1: a dropped slot)
        with routing `weights [T, k]`: sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H].
        `experts(rows, counts)` runs this rank's experts, `params` are the tensors it uses."""
        inputs = (x, weights, *params)
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return _Exchange.apply(self, experts, ids, *inputs)
        return _Run(self, experts, ids, x, weights, record=False).forward()


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher, experts, ids, x, weights, *params):
        ctx.run = _Run(dispatcher, experts, ids, x, weights, record=True, params=params)
        return ctx.run.forward()

    @staticmethod
    def backward(ctx, grad):
        run, ctx.run = ctx.run, None
        grad_x, grad_w, grad_params = run.backward(grad)
        return None, None, None, grad_x, grad_w, *grad_params


class _Chunk:
    """One chunk's tensors, level by level (0: this rank's tokens; last: rows at their experts)."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor] = []  # rows arriving at each level (leaves when recording)
        self.w: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []
        self.members: list[_Members] = []
        self.sent: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, weights) sent at each hop
        self.back: list[torch.Tensor] = []  # partial sums received back at each hop (leaves)
        self.partial: list[torch.Tensor] = []  # partial sums each level sends back
        self.out: torch.Tensor | None = None
        self.pending: _Pending | None = None


class _Run:
    """One call: the sizes of every hop and chunk, then the staged forward and backward passes."""

    def __init__(self, dispatcher: DedupDispatcher, experts, ids, x, weights, *, record: bool, params=()) -> None:
        self.d, self.experts, self.record, self.params = dispatcher, experts, record, tuple(params)
        # the same number of chunks on every rank (some may be empty): they exchange chunk by chunk
        self.bounds = [len(t) for t in torch.arange(x.shape[0]).tensor_split(dispatcher.chunks)]
        self.chunks = []
        for xc, wc, ic in zip(x.detach().split(self.bounds), weights.detach().split(self.bounds),
                              ids.split(self.bounds), strict=True):
            chunk = _Chunk()
            chunk.x.append(self._leaf(xc))
            chunk.w.append(self._leaf(wc))
            chunk.ids.append(ic)
            self.chunks.append(chunk)
        self._sizes(ids.shape[1])

    def _leaf(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_() if self.record else t

    # -- sizes --------------------------------------------------------------------------------------

    def _sizes(self, k: int) -> None:
        """Every split size and member count, from two count exchanges and one host synchronisation.
        Each destination rank receives, per source and chunk: how many rows have more than j slots
        there (j = 0 is the row count) and the slots per local expert. Hierarchically, a node's rail
        rank receives per source the same for each rank of its node, plus how many rows reach more
        than j of its ranks, and forwards each rank its sums."""
        d, el, hops = self.d, self.d.num_local_experts, self.d.hops
        dev = self.chunks[0].ids[0].device
        depth_e = min(k, el)
        src_depth = min(k, hops[0].dests)
        local, vectors = [], []
        for chunk in self.chunks:
            ids = chunk.ids[0]
            rank = torch.where(ids >= 0, torch.div(ids, el, rounding_mode="floor"), d.groups.ep_size)
            slots = torch.zeros(ids.shape[0], d.groups.ep_size + 1, dtype=torch.long, device=dev)
            slots = slots.scatter_add_(1, rank, torch.ones_like(rank))[:, :-1]  # [T, ranks]
            experts = torch.zeros(d.groups.ep_size * el + 1, dtype=torch.long, device=dev).scatter_add_(
                0, torch.where(ids >= 0, ids, d.groups.ep_size * el).reshape(-1), torch.ones_like(ids).reshape(-1))
            per_rank = torch.cat([_at_least(slots, depth_e), experts[:-1].view(-1, el).t()]).t()  # [ranks, V]
            reached = (slots > 0).view(ids.shape[0], hops[0].dests, -1)  # [T, dests, ranks per dest]
            local.append(torch.cat([reached.any(2).sum(0), _at_least(reached.any(2).sum(1), src_depth)]))
            if len(hops) == 2:
                inner = _at_least(reached.sum(2), min(k, hops[1].dests)).t()  # [nodes, depth]
                per_rank = torch.cat([inner, per_rank.reshape(hops[0].dests, -1)], 1)
            vectors.append(per_rank.reshape(hops[0].dests, -1))
        width = vectors[0].shape[1]
        send = torch.stack(vectors, 1).reshape(-1)  # [dest, chunk, V]
        recv = all_to_all(send, [len(self.chunks) * width] * hops[0].dests, [len(self.chunks) * width] * hops[0].dests,
                          hops[0].group).view(hops[0].dests, len(self.chunks), width)
        synced = [torch.stack(local).reshape(-1), recv.reshape(-1)]
        if len(hops) == 2:
            n, w2 = hops[1].dests, depth_e + el
            inner_depth = min(k, n)
            to_ranks = recv[:, :, inner_depth:].sum(0).view(len(self.chunks), n, w2).transpose(0, 1)  # [m, chunk, V]
            recv2 = all_to_all(to_ranks.reshape(-1), [len(self.chunks) * w2] * n, [len(self.chunks) * w2] * n,
                               hops[1].group).view(n, len(self.chunks), w2)
            synced += [recv2.reshape(-1)]
            final = recv2
        else:
            final = recv
        values = torch.cat(synced).tolist()  # the one host synchronisation
        cut = len(self.chunks) * (hops[0].dests + src_depth)
        local_l = [values[i:i + hops[0].dests + src_depth] for i in range(0, cut, hops[0].dests + src_depth)]
        values = values[cut:]
        recv_l = [[values[(s * len(self.chunks) + c) * width:(s * len(self.chunks) + c + 1) * width]
                   for s in range(hops[0].dests)] for c in range(len(self.chunks))]  # [chunk][source][V]
        values = values[len(recv_l) * hops[0].dests * width:]
        self.plans = []
        for c in range(len(self.chunks)):
            plan = {"send": [local_l[c][:hops[0].dests]], "at_least": [local_l[c][hops[0].dests:]]}
            if len(hops) == 2:
                n, w2, inner_depth = hops[1].dests, depth_e + el, min(k, hops[1].dests)
                plan["recv"] = [[v[0] for v in recv_l[c]]]
                plan["at_least"].append([sum(v[j] for v in recv_l[c]) for j in range(inner_depth)])
                plan["send"].append([sum(v[inner_depth + m * w2] for v in recv_l[c]) for m in range(n)])
                rows = [values[(q * len(self.chunks) + c) * w2:(q * len(self.chunks) + c + 1) * w2] for q in range(n)]
                plan["recv"].append([r[0] for r in rows])
            else:
                rows = recv_l[c]
                plan["recv"] = [[r[0] for r in rows]]
            plan["dest_at_least"] = [sum(r[j] for r in rows) for j in range(depth_e)]
            plan["dest_total"] = sum(sum(r[depth_e:]) for r in rows)
            plan["counts"] = final[:, c, depth_e:].sum(0)  # rows per local expert, on the device
            self.plans.append(plan)

    # -- forward --------------------------------------------------------------------------------------

    def _grad_mode(self):
        return torch.enable_grad() if self.record else torch.no_grad()

    def forward(self) -> torch.Tensor:
        hops = self.d.hops
        with self._grad_mode():
            for level, hop in enumerate(hops):
                for chunk, plan in zip(self.chunks, self.plans, strict=True):
                    if level:
                        self._arrive(chunk)
                    self._depart(chunk, plan, level, hop)
            for chunk, plan in zip(self.chunks, self.plans, strict=True):
                self._arrive(chunk)
                self._compute(chunk, plan)
                chunk.pending = _Pending([chunk.partial[-1]], plan["recv"][-1], plan["send"][-1], hops[-1].group)
            for level in reversed(range(len(hops))):
                for chunk, plan in zip(self.chunks, self.plans, strict=True):
                    back = self._leaf(chunk.pending.wait()[0])
                    chunk.back.insert(0, back)
                    partial = _Collect.apply(back, None, chunk.members[level])
                    if level:
                        chunk.partial.insert(0, partial)
                        chunk.pending = _Pending([partial], plan["recv"][level - 1], plan["send"][level - 1],
                                                 hops[level - 1].group)
                    else:
                        chunk.out = partial
        return torch.cat([chunk.out.detach() for chunk in self.chunks])

    def _depart(self, chunk: _Chunk, plan: dict, level: int, hop: _Hop) -> None:
        """Send each row of this level once to each destination of the hop its slots reach."""
        ids = chunk.ids[level]
        dest, mask = _slot_members(ids, hop.units, hop.dests)
        m = _members(mask, sum(plan["send"][level]), plan["at_least"][level])
        chunk.members.append(m)
        rows = _Spread.apply(chunk.x[level], m)
        here = dest.index_select(0, m.row_of) == m.column_of.unsqueeze(1)  # [S, k]: the slots at that destination
        local_ids = torch.where(here, ids.index_select(0, m.row_of) - m.column_of.unsqueeze(1) * hop.units, -1)
        weights = chunk.w[level].index_select(0, m.row_of) * here
        chunk.sent.append((rows, weights))
        chunk.pending = _Pending([rows, weights, local_ids.to(torch.int16)], plan["send"][level],
                                 plan["recv"][level], hop.group)

    def _arrive(self, chunk: _Chunk) -> None:
        rows, weights, ids = chunk.pending.wait()
        chunk.x.append(self._leaf(rows))
        chunk.w.append(self._leaf(weights))
        chunk.ids.append(ids.long())

    def _compute(self, chunk: _Chunk, plan: dict) -> None:
        """This rank's experts on the rows it received, each row's slots summed with their weights."""
        el = self.d.num_local_experts
        x, w, ids = chunk.x[-1], chunk.w[-1], chunk.ids[-1]
        _, mask = _slot_members(ids, 1, el)
        m = _members(mask, plan["dest_total"], plan["dest_at_least"])
        chunk.members.append(m)
        y = self.experts(_Spread.apply(x, m), plan["counts"])
        k = ids.shape[1]
        # the slot j of each member: where that row's id equals the member's expert
        slot = torch.zeros(ids.shape[0], el + 1, dtype=torch.long, device=ids.device).scatter_(
            1, torch.where(ids >= 0, ids, el), torch.arange(k, device=ids.device).expand_as(ids).contiguous())
        index = m.row_of * k + slot[:, :el].reshape(-1).index_select(0, m.row_of * el + m.column_of)
        chunk.partial.append(_Collect.apply(y, w.reshape(-1).index_select(0, index), m))

    # -- backward -------------------------------------------------------------------------------------

    def backward(self, grad: torch.Tensor):
        hops, levels = self.d.hops, len(self.d.hops)
        grads_out = grad.split(self.bounds)
        param_grads: list[torch.Tensor] = []
        for level in range(levels):  # the partial sums' gradients travel out again
            for c, chunk in enumerate(self.chunks):
                if level:
                    (g,) = chunk.pending.wait()
                    (g,) = _grad(chunk.partial[level - 1], chunk.back[level], g)
                else:
                    (g,) = _grad(chunk.out, chunk.back[0], grads_out[c])
                plan = self.plans[c]
                chunk.pending = _Pending([g], plan["send"][level], plan["recv"][level], hops[level].group)
        for c, chunk in enumerate(self.chunks):  # the experts' backward, while other chunks travel
            (g,) = chunk.pending.wait()
            gx, gw, *gp = _grad(chunk.partial[-1], (chunk.x[-1], chunk.w[-1], *self.params), g)
            param_grads = [a + b for a, b in zip(param_grads, gp, strict=True)] if param_grads else gp
            plan = self.plans[c]
            chunk.pending = _Pending([gx, gw], plan["recv"][-1], plan["send"][-1], hops[-1].group)
        grads_x, grads_w = [], []
        for level in reversed(range(levels)):
            for c, chunk in enumerate(self.chunks):
                g_rows, g_w = chunk.pending.wait()
                gx, gw = _grad(chunk.sent[level], (chunk.x[level], chunk.w[level]), (g_rows, g_w))
                if level:
                    plan = self.plans[c]
                    chunk.pending = _Pending([gx, gw], plan["recv"][level - 1], plan["send"][level - 1],
                                             hops[level - 1].group)
                else:
                    grads_x.append(gx)
                    grads_w.append(gw)
        return torch.cat(grads_x), torch.cat(grads_w), param_grads


def _grad(outputs, inputs, grads) -> list[torch.Tensor]:
    """Gradients of `inputs` (zeros where unused) for `outputs` given their gradients."""
    outputs, inputs, grads = (t if isinstance(t, tuple) else (t,) for t in (outputs, inputs, grads))
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    found = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True) \
        if pairs else (None,) * len(inputs)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(found, inputs, strict=True)]

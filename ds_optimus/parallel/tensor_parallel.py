"""Tensor parallelism applied to a plain model from outside, by its family's plan (`PLANS`): each rank keeps 1/T of
each split weight under its own name (for Mula: attention by heads, the dense MLP by intermediate width, embedding
and head by vocabulary rows); what the plan does not name (norms, router, experts) stays replicated."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..hf_models.mula import parallelize as mula_plan
from ..schema import Section, need, positive_int
from .collectives import collective
from .groups import LayoutError


@dataclass(frozen=True)
class TensorParallelConfig(Section):
    """`optimus.tensor_parallel`: `size` consecutive ranks (inside a node) split attention, dense MLPs, the
    embedding and the head."""

    size: int = 1  # ranks per tensor-parallel group (innermost: consecutive ranks)
    # the norms, the residual stream and the MoE blocks between the split blocks cut along the sequence
    # over the group (Megatron-LM's sequence parallelism): activations there 1/T each, all-gathers and
    # reduce-scatters in place of the all-reduces, each MoE block routing this rank's tokens only
    sequence_parallel: bool = False

    def check(self, where: str) -> None:
        need(positive_int(self.size), f"{where}.size must be a positive integer, got {self.size!r}")
        need(
            not self.sequence_parallel or self.size > 1,
            f"{where}.sequence_parallel needs {where}.size above 1 (it cuts the sequence over the TP group)",
        )


class TensorParallelError(LayoutError):
    """A model that cannot be split over the group."""


@dataclass(frozen=True)
class Split:
    """A parameter split along `dim` of its `full` shape, this rank holding [start, stop)."""

    full: tuple[int, ...]
    dim: int
    start: int
    stop: int


class _Copy(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """All-reduce over the group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumBoth(torch.autograd.Function):
    """All-reduce forward and backward (a statistic of a split tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# the sequence collectives: along dim 1, the chunks in group rank order
def _seq_gather(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    rows = x.transpose(0, 1).contiguous()
    out = torch.empty((size * rows.shape[0], *rows.shape[1:]), dtype=x.dtype, device=x.device)
    collective("all_gather")(out, rows, group=group)
    return out.transpose(0, 1)


def _seq_chunk(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] % size:
        raise TensorParallelError(
            f"sequence parallelism: the sequence ({x.shape[1]}) does not divide over the "
            f"{size} ranks of the tensor-parallel group"
        )
    step = x.shape[1] // size
    return x.narrow(1, rank * step, step).contiguous()


def _seq_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    rows = x.transpose(0, 1).contiguous()
    out = torch.empty((rows.shape[0] // size, *rows.shape[1:]), dtype=x.dtype, device=x.device)
    collective("reduce_scatter")(out, rows, group=group)
    return out.transpose(0, 1)


def _seq_gather_contiguous(x: torch.Tensor, group) -> torch.Tensor:
    return _seq_gather(x, group).contiguous()  # sent between pipeline stages as it is


class _AlongSequence(torch.autograd.Function):
    """`there(x, group)` forward, `back(grad, group)` backward: one sequence-parallel crossing."""

    @staticmethod
    def forward(ctx, x, group, there, back):
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.group), None, None, None


# The four crossings of sequence parallelism, (forward, backward):
# into a split block's projections: the chunks joined; the gradients' sum cut to this rank's chunk
GATHER_INTO_SPLIT = (_seq_gather, _seq_reduce_scatter)
# out of a split block: the partial outputs summed, this rank keeping its chunk; the gradients joined
REDUCE_SCATTER_OUT = (_seq_reduce_scatter, _seq_gather)
# a replicated activation into the cut stream (a run's first layer): this rank's chunk; the gradients joined
SCATTER = (_seq_chunk, _seq_gather_contiguous)
# the cut stream into a replicated activation (after a run's last layer): the chunks joined; this rank's chunk
JOIN = (_seq_gather_contiguous, _seq_chunk)


def _along_sequence(x: torch.Tensor, group, crossing) -> torch.Tensor:
    return _AlongSequence.apply(x, group, *crossing)


class _Part(nn.Module):
    """Holds this rank's part of a module: `whole()` builds an empty full-size original, `take(whole)` copies the
    part from it."""

    dim = 0  # the weight's split dimension
    bias_split = True  # the bias follows the split (columns) or is kept whole (rows)
    # sequence parallelism: the input gathered along the sequence by the block (columns), the output
    # reduce-scattered along it (rows)
    sequence = False

    def _keep(self, module: nn.Module, start: int, stop: int) -> None:
        self.start, self.stop, self.whole_shape = start, stop, tuple(module.weight.shape)
        self.weight = nn.Parameter(module.weight.detach().narrow(self.dim, start, stop - start).clone())
        bias = getattr(module, "bias", None)
        if bias is not None and self.bias_split:
            bias = bias.detach()[start:stop]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    @torch.no_grad()
    def take(self, whole: nn.Module) -> None:
        self.weight.copy_(whole.weight.narrow(self.dim, self.start, self.stop - self.start))
        if self.bias is not None:
            self.bias.copy_(whole.bias[self.start : self.stop] if self.bias_split else whole.bias)


class ColumnParallelLinear(_Part):
    """`nn.Linear` keeping output features [start, stop)."""

    def __init__(self, linear: nn.Linear, group, start: int, stop: int) -> None:
        super().__init__()
        self.group, self.in_features, self.out_features = group, linear.in_features, stop - start
        self._keep(linear, start, stop)

    def whole(self) -> nn.Module:
        return nn.Linear(self.in_features, self.whole_shape[0], bias=self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under sequence parallelism the block's input is gathered once for its projections, the gather's
        # backward summing their gradients (`GATHER_INTO_SPLIT`)
        return F.linear(x if self.sequence else _Copy.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(_Part):
    """`nn.Linear` keeping input features [start, stop), its output summed over the group."""

    dim, bias_split = 1, False

    def __init__(self, linear: nn.Linear, group, start: int, stop: int) -> None:
        super().__init__()
        self.group, self.in_features, self.out_features = group, stop - start, linear.out_features
        self._keep(linear, start, stop)

    def whole(self) -> nn.Module:
        return nn.Linear(self.whole_shape[1], self.out_features, bias=self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        out = _along_sequence(out, self.group, REDUCE_SCATTER_OUT) if self.sequence else _Reduce.apply(out, self.group)
        return out if self.bias is None else out + self.bias


class SplitRMSNorm(_Part):
    """An RMSNorm (`hidden_size`, `variance_epsilon`, `weight` or None) over a width split across the group."""

    def __init__(self, norm: nn.Module, group, start: int, stop: int) -> None:
        super().__init__()
        self.group, self.hidden_size, self.variance_epsilon = group, norm.hidden_size, norm.variance_epsilon
        self.start, self.stop, self.bias, self.whole_shape = start, stop, None, (norm.hidden_size,)
        self.weight = None if norm.weight is None else nn.Parameter(norm.weight.detach()[start:stop].clone())
        self._original = (copy.deepcopy(norm).to("meta"),)  # a tuple: not registered as a submodule

    def whole(self) -> nn.Module:
        return copy.deepcopy(self._original[0])

    @torch.no_grad()
    def take(self, whole: nn.Module) -> None:
        if self.weight is not None:
            self.weight.copy_(whole.weight[self.start : self.stop])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        square = _SumBoth.apply(x.pow(2).sum(-1, keepdim=True), self.group) / self.hidden_size
        x = (x * torch.rsqrt(square + self.variance_epsilon)).to(input_dtype)
        return x if self.weight is None else self.weight * x


class VocabParallelEmbedding(_Part):
    """`nn.Embedding` keeping vocabulary rows [start, stop); the group sums the ranks' rows."""

    def __init__(self, embedding: nn.Embedding, group, start: int, stop: int) -> None:
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.whole_padding = padding = embedding.padding_idx
        self.padding_idx = padding - start if padding is not None and start <= padding < stop else None
        self._keep(embedding, start, stop)

    def whole(self) -> nn.Module:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, self.whole_padding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        rows = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight, self.padding_idx)
        return _Reduce.apply(rows.masked_fill(outside[..., None], 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of vocabulary-split logits (this rank's from `start`) against full-vocabulary ids."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~inside, 0)
        picked = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(~inside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total[:, None], local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows[inside], local[inside]] -= 1.0
        return out * grad[:, None], None, None, None


def vocab_parallel_loss(group, start: int):
    """Transformers' causal-LM `loss_function` over vocabulary-split logits, without gathering them."""

    def loss_function(
        logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
    ):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        counted = target != ignore_index
        flat = logits.reshape(-1, logits.shape[-1])
        losses = _VocabParallelCrossEntropy.apply(flat, target.masked_fill(~counted, 0), start, group)
        total = (losses * counted).sum()
        if num_items_in_batch is not None:
            return total / num_items_in_batch
        return total / counted.sum()

    return loss_function


def is_part(module: nn.Module) -> bool:
    """Whether `module` holds part of a split module's weights."""
    return isinstance(module, _Part)


def _span(size: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise TensorParallelError(f"tensor parallel size {parts} does not divide {what} ({size})")
    step = size // parts
    return rank * step, (rank + 1) * step


# each model family's plan (`model.config.model_type`), beside its modeling file
PLANS: dict[str, ModuleType] = {"mula": mula_plan}
_STYLES = {  # a plan's style: (the width it splits, the part that holds this rank's share)
    "column": (lambda m: m.out_features, ColumnParallelLinear),
    "row": (lambda m: m.in_features, RowParallelLinear),
    "norm": (lambda m: m.hidden_size, SplitRMSNorm),
    "vocab_embedding": (lambda m: m.num_embeddings, VocabParallelEmbedding),
    "vocab_head": (lambda m: m.out_features, ColumnParallelLinear),  # and the loss over split logits
}


def plan_of(model: nn.Module) -> ModuleType:
    """The tensor-parallel plan of `model`'s family: `TENSOR_PARALLEL_PLAN` and `check_tensor_parallel`."""
    family = getattr(model.config, "model_type", None)
    if family not in PLANS:
        raise TensorParallelError(f"tensor parallelism has no plan for {family!r} models (it has: {', '.join(PLANS)})")
    return PLANS[family]


def _matches(pattern: str, name: str) -> bool:
    """Whether module `name` is one `pattern` names (`*`: any one name, e.g. a layer's index)."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


def apply_tensor_parallel(
    model: nn.Module, group, size: int | None = None, rank: int | None = None
) -> dict[str, Split]:
    """Split `model` in place over `group` (`size`/`rank` before it exists) as its family's plan says; returns
    `split_parameters(model)`."""
    size = dist.get_world_size(group) if size is None else size
    rank = dist.get_rank(group) if rank is None else rank
    plan = plan_of(model)
    problem = plan.check_tensor_parallel(model.config, size)
    if problem:
        raise TensorParallelError(problem)
    named = [
        (name, module, style)
        for name, module in model.named_modules()
        for pattern, style in plan.TENSOR_PARALLEL_PLAN.items()
        if _matches(pattern, name)
    ]
    embedding, head = None, None
    for name, module, (style, what) in named:
        if style not in _STYLES:
            raise TensorParallelError(f"{name}: no tensor-parallel style {style!r} (the styles: {', '.join(_STYLES)})")
        if style == "vocab_head":  # after the embedding, whose rows a tied head shares
            head = (name, module, what)
            continue
        width, kind = _STYLES[style]
        part = kind(module, group, *_span(width(module), size, rank, what))
        _replace(model, name, part)
        embedding = part if style == "vocab_embedding" else embedding
    if head is not None:
        name, module, what = head
        start, stop = _span(module.out_features, size, rank, what)
        if model.config.tie_word_embeddings and embedding is not None:
            # the tied head: the embedding's rows, the same slice (`tie_weights` keeps them one tensor)
            whole = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            part = ColumnParallelLinear(whole, group, start, stop)
            part.weight = embedding.weight
        else:
            part = ColumnParallelLinear(module, group, start, stop)
        _replace(model, name, part)
        model.loss_function = vocab_parallel_loss(group, start)
    return split_parameters(model)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attribute, module)


def split_parameters(model: nn.Module) -> dict[str, Split]:
    """Each split parameter's Split, under every name it goes by (a tied head's too)."""
    splits = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_part(module) or module.weight is None:  # a norm without an affine weight has nothing to split
            continue
        prefix = f"{name}." if name else ""
        splits[f"{prefix}weight"] = Split(tuple(module.whole_shape), module.dim, module.start, module.stop)
        if module.bias is not None and module.bias_split:
            splits[f"{prefix}bias"] = Split((module.whole_shape[0],), 0, module.start, module.stop)
    return splits


def apply_sequence_parallel(model: nn.Module, group, chunks: list[range] | None = None) -> None:
    """Cut a tensor-parallel model's residual stream along the sequence, per run of layers (`chunks`; None: all) from
    its first layer to its last or the final norm; replicated weights' gradients become partial (summed over
    `replicated_group`)."""
    config = model.config
    layers = model.model.layers
    held = {int(k): v for k, v in layers.items()} if isinstance(layers, nn.ModuleDict) else dict(enumerate(layers))
    for run in chunks or [range(config.num_hidden_layers)]:
        if run[0] not in held:
            continue  # another stage's
        held[run[0]].register_forward_pre_hook(functools.partial(_scatter_input, group=group))
        last = model.model.norm if run[-1] == config.num_hidden_layers - 1 else held[run[-1]]
        last.register_forward_hook(functools.partial(_join_output, group=group))
        for i in run:
            for module in held[i].modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.sequence = True
                # a block whose own projections are column-split (attention, a dense MLP) reads its input
                # whole: one gather of it for them all
                if any(isinstance(child, ColumnParallelLinear) for child in module.children()):
                    module.register_forward_pre_hook(functools.partial(_gather_input, group=group))


def sequence_router_share(loss: torch.Tensor, lm_loss: torch.Tensor, size: int) -> torch.Tensor:
    """A rank's loss under sequence parallelism: the LM loss plus 1/size of its router losses."""
    return lm_loss + (loss - lm_loss) / size


def _scatter_input(module, args, group):
    return (_along_sequence(args[0], group, SCATTER), *args[1:])


def _gather_input(module, args, group):
    return (_along_sequence(args[0], group, GATHER_INTO_SPLIT), *args[1:])


def _join_output(module, args, output, group):
    if isinstance(output, tuple):
        return (_along_sequence(output[0], group, JOIN), *output[1:])
    return _along_sequence(output, group, JOIN)


def join_parts(parts: list[tuple[Split, torch.Tensor]], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) along the split dimension, joined from saved `parts` of one tensor."""
    dim = parts[0][0].dim
    pieces = [
        tensor.narrow(dim, max(a.start, start) - a.start, min(a.stop, stop) - max(a.start, start))
        for a, tensor in sorted(parts, key=lambda part: part[0].start)
        if a.start < stop and start < a.stop
    ]
    if sum(piece.shape[dim] for piece in pieces) != stop - start:
        raise TensorParallelError(f"the saved parts do not cover [{start}, {stop}) along dimension {dim}")
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim)


@torch.no_grad()
def whole_tensors(state: dict[str, torch.Tensor] | nn.Module, splits: dict[str, Split], group, dst: int = 0):
    """Yield (name, whole tensor) from `state` (state dict or model) on group rank `dst`, one gathered at a time;
    collective."""
    state = state.state_dict() if isinstance(state, nn.Module) else state
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    # a tied weight's names: gathered once, yielded under each; kept until its last name
    keys = [(tensor.data_ptr(), tuple(tensor.shape)) for tensor in state.values()]
    left = {key: keys.count(key) for key in keys}
    joined: dict[tuple, torch.Tensor | None] = {}
    for (name, tensor), key in zip(state.items(), keys, strict=True):
        split = splits.get(name)
        if split is None:
            if rank == dst:
                yield name, tensor.detach()
            continue
        if key not in joined:
            parts = [torch.empty_like(tensor) for _ in range(size)] if rank == dst else None
            dist.gather(tensor.detach().contiguous(), parts, group=group, group_dst=dst)
            joined[key] = torch.cat(parts, dim=split.dim) if rank == dst else None
            if rank == dst and tuple(joined[key].shape) != split.full:
                raise TensorParallelError(f"{name}: the parts join to {tuple(joined[key].shape)}, not {split.full}")
        whole = joined[key]
        left[key] -= 1
        if not left[key]:
            joined[key] = None  # no longer held here
        if rank == dst:
            yield name, whole


def join_for_writer(state: dict[str, torch.Tensor], splits: dict[str, Split], group, dst: int = 0):
    """`state` with split tensors whole on the host of group rank `dst`; None elsewhere."""
    rank, host = dist.get_rank(group), {}
    joined = {}
    for name, tensor in whole_tensors(state, splits, group, dst):
        if name in splits:  # a tied weight's names share one host copy
            tensor = host.setdefault(id(tensor), tensor.cpu())
        joined[name] = tensor
    return joined if rank == dst else None

"""Per-rank memory of a layout: model states, activations and buffers, in bytes.

The states follow what each optimizer path holds (see `ds_optimus/optim/sharded.py` and
DeepSpeed's ZeRO stage 0/1/2 optimizers); activations follow `ModelShape`'s count of the tensors
autograd saves. The peak is taken at the start of the backward pass, where the activations of the
whole micro-batch and the loss's vocabulary-sized gradients are alive at once, or, with activation
checkpointing, at the recomputation of a layer (or of the recomputed parts of one), whichever is larger.

With pipeline stages each stage is counted on its own: the parameters and optimizer state of its layers
(the runtime's split, `pipeline.stages`; the embedding on the first, the head on the last), the
activations of the micro-batches its schedule keeps in flight (1F1B: P - s on stage s, so P on the
first; GPipe: all m), and the head's logits and their gradients on the last; the peak is the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..parallel.stages import V_SCHEDULES
from .layout import Layout
from .model import ModelShape
from .pipeline_model import in_flight, stages, virtual_of


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    gradients: float  # gradient memory at its largest (full .grad, buckets, staging buffers)
    gradients_at_peak: float  # of which held at the start of the backward pass
    optimizer_state: float  # fp32 master weights and Adam moments, and fp32 gradient shards
    buffers: float  # the optimizer's communication buffers, held throughout
    activations: float  # saved for the backward pass, all micro-batches in flight
    transient: float  # alive only around the peak (loss gradients, a layer's recomputation)
    all_to_all: float  # one MoE layer's exchange buffers (alive inside that layer only)
    later: float  # bytes at the other candidate moment (gradients arriving, end of backward)
    moment: str  # which moment is the peak
    stage: int = 0  # with pipeline stages: the stage whose peak this is (the largest)
    stage_peaks: tuple[float, ...] = ()  # with pipeline stages: every stage's peak, first to last

    @property
    def static(self) -> float:
        """Bytes held between steps: what the layout costs before any activation."""
        return self.weights + self.gradients_at_peak + self.optimizer_state + self.buffers

    @property
    def start_of_backward(self) -> float:
        return self.static + self.activations + self.transient

    @property
    def peak(self) -> float:
        return max(self.start_of_backward, self.later)

    def as_dict(self) -> dict[str, float | str]:
        keys = (
            "weights",
            "gradients",
            "gradients_at_peak",
            "optimizer_state",
            "buffers",
            "activations",
            "transient",
            "all_to_all",
            "static",
            "peak",
            "moment",
        )
        out = {key: getattr(self, key) for key in keys}
        if self.stage_peaks:
            out.update(stage=self.stage, stage_peaks=list(self.stage_peaks))
        return out


@dataclass(frozen=True)
class _Part:
    """What one rank holds of the model: the whole model, or a pipeline stage's layers."""

    dense: float  # parameter elements
    expert: float
    saved: float  # activation bytes per token of one micro-batch (its layers, and the head's on the last)
    head: float  # of which the head's (not yet there inside the last MoE layer's forward)
    in_flight: float  # micro-batches whose activations are held at once
    loss: bool  # holds the LM head and loss: their vocabulary-sized transients
    first: bool  # holds the embedding
    moe: bool  # has MoE layers
    recompute: float = 0.0  # bytes per token the largest recomputed region rebuilds at once


def _layer_dense(model: ModelShape) -> tuple[float, float, float]:
    """Dense parameter elements of a decoder layer: (attention and norms, an MoE layer's router, a dense FFN)."""
    router, ffn = model.experts * model.hidden, 3 * model.hidden * model.intermediate
    outside = model.vocab * model.hidden * (1 if model.tied else 2) + model.hidden  # embedding, head, final norm
    layers = model.dense_params - outside
    attention = (layers - model.moe_layers * router - (model.layers - model.moe_layers) * ffn) / model.layers
    return attention, float(router), float(ffn)


def _parts(model: ModelShape, layout: Layout, imbalance: float) -> tuple[_Part, ...]:
    """The whole model (no pipeline), or each pipeline stage's part, first to last."""
    return _parts_of(
        model,
        layout.pp,
        layout.schedule,
        layout.virtual_stages,
        layout.accumulation,
        layout.ep,
        layout.checkpointing,
        layout.param_bytes,
        layout.seq_len,
        imbalance,
        layout.tp,
        layout.sp_size,
    )


def _split(dense: float, layers: int, moe_layers: int, last: bool, model: ModelShape, tp: int) -> float:
    """A rank's dense elements under tensor parallelism over `tp` ranks: the norms (two a layer, the
    final one) and the routers whole, everything else (attention, dense FFNs, embedding, head) 1/tp."""
    whole = 2 * model.hidden * layers + model.experts * model.hidden * moe_layers + (model.hidden if last else 0)
    return whole + (dense - whole) / tp


@lru_cache(maxsize=4096)  # the search asks again for every optimizer, exchange and micro-batch split
def _parts_of(
    model: ModelShape,
    pp: int,
    schedule: str,
    virtual: int,
    accumulation: int,
    ep: int,
    checkpointing: bool | tuple[str, ...],
    a: int,
    seq_len: int,
    imbalance: float,
    tp: int = 1,
    sp: int = 1,
) -> tuple[_Part, ...]:
    recompute = model.recompute_bytes_per_token(a, imbalance, checkpointing, tp, sp)
    if pp == 1:
        head = model.head_bytes(a, tp, sp)
        dense = _split(float(model.dense_params), model.layers, model.moe_layers, True, model, tp)
        return (
            _Part(
                dense=dense,
                expert=model.expert_params / ep,
                saved=model.saved_bytes_per_token(a, checkpointing, imbalance, tp, sp),
                head=head,
                in_flight=1.0,
                loss=True,
                first=True,
                moe=model.moe_layers > 0,
                recompute=recompute,
            ),
        )
    attention, router, ffn = _layer_dense(model)
    moe_layer = model.layer_saved_bytes_per_token(a, True, checkpointing, imbalance, tp, sp)
    dense_layer = model.layer_saved_bytes_per_token(a, False, checkpointing, 1.0, tp, sp)
    parts = []
    for st in stages(model, seq_len, pp, virtual_of(schedule, virtual), schedule in V_SCHEDULES):
        dense_layers = st.layers - st.moe_layers
        dense = st.layers * attention + st.moe_layers * router + dense_layers * ffn
        dense += model.vocab * model.hidden * (st.first + st.last) + (model.hidden if st.last else 0)
        dense = _split(dense, st.layers, st.moe_layers, st.last, model, tp)
        head = model.head_bytes(a, tp, sp) if st.last else 0.0
        parts.append(
            _Part(
                dense=dense,
                expert=st.moe_layers * model.expert_params_per_layer / ep,
                saved=st.moe_layers * moe_layer + dense_layers * dense_layer + head,
                head=head,
                loss=st.last,
                first=st.first,
                moe=st.moe_layers > 0,
                recompute=recompute,
                in_flight=in_flight(schedule, pp, accumulation, virtual, st.index),
            )
        )
    return tuple(parts)


def local_params(model: ModelShape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameter elements one rank holds: the whole model's, or with pipeline stages
    the stage's with the most."""
    most = max(_parts(model, layout, 1.0), key=lambda part: part.dense + part.expert)
    return most.dense, most.expert


def _buckets(elements: float, bucket_size: int) -> float:
    """Elements of the largest communication bucket of a space."""
    return min(elements, bucket_size) if elements else 0.0


def estimate_memory(model: ModelShape, layout: Layout, expert_imbalance: float = 1.0) -> MemoryEstimate:
    """Peak per-rank bytes of training `model` under `layout`; with pipeline stages, of the stage whose
    peak is the largest (every stage's in `stage_peaks`).

    `expert_imbalance`: rows the busiest rank's experts receive over the mean (1.0 balanced).
    """
    return _worst(stage_memory(model, layout, expert_imbalance))


def memory_within(
    model: ModelShape, layout: Layout, limit: float, expert_imbalance: float = 1.0
) -> MemoryEstimate | None:
    """`estimate_memory` where every stage's peak is at most `limit` bytes; None once one is above it."""
    # the search drops those, and most of its 220B layouts do not fit: their later stages go uncounted
    estimates = []
    for i, part in enumerate(_parts(model, layout, expert_imbalance)):
        estimate = _estimate(model, layout, part, expert_imbalance, i)
        if estimate.peak > limit:
            return None
        estimates.append(estimate)
    return _worst(estimates)


def _worst(estimates: list[MemoryEstimate]) -> MemoryEstimate:
    """The stage whose peak is the largest (the first of equals), with every stage's peak."""
    if len(estimates) == 1:
        return estimates[0]
    peaks = tuple(e.peak for e in estimates)
    worst = peaks.index(max(peaks))
    return replace(estimates[worst], stage=worst, stage_peaks=peaks)


def stage_memory(model: ModelShape, layout: Layout, expert_imbalance: float = 1.0) -> list[MemoryEstimate]:
    """Every pipeline stage's estimate, first to last (one, the whole model's, without a pipeline)."""
    return [
        _estimate(model, layout, part, expert_imbalance, i)
        for i, part in enumerate(_parts(model, layout, expert_imbalance))
    ]


def _estimate(model: ModelShape, layout: Layout, part: _Part, expert_imbalance: float, stage: int) -> MemoryEstimate:
    p, r = layout.param_bytes, layout.reduce_bytes
    dense, expert = part.dense, part.expert
    n_local = dense + expert
    weights = p * n_local
    # elements of this rank's shard of the optimizer state (hybrid sharding: over the shard group)
    # (under sequence parallelism the experts' state over their EDP groups of every TP position)
    shard = dense / layout.shard_size(layout.dp) + expert / layout.shard_size(layout.edp * layout.sp_size)
    shard = shard if layout.zero > 0 else n_local
    largest = max(_buckets(dense, layout.bucket_size), _buckets(expert, layout.bucket_size))
    second = (
        min(_buckets(dense, layout.bucket_size), _buckets(expert, layout.bucket_size))
        if expert
        else (_buckets(max(dense - layout.bucket_size, 0), layout.bucket_size))
    )
    two_buckets = largest + second
    # one parameter's .grad before a hook takes it: the embedding or head where the rank holds them
    grad_transient = (
        p
        * (
            model.largest_dense_param
            if part.first or part.loss
            else model.hidden * max(model.q_width, model.intermediate if model.moe_layers < model.layers else 0)
        )
        / layout.tp
    )

    tokens = layout.tokens_per_micro
    head = part.head
    # every micro-batch in flight (pipeline stages: the schedule's count, `pipeline.in_flight`)
    activations = tokens * part.saved * part.in_flight
    loss = tokens * model.loss_transient_bytes_per_token(p, layout.tp) if part.loss else 0.0  # the logits' gradients
    recompute = tokens * part.recompute
    transient = max(loss, recompute) + grad_transient
    # The all-to-all's send and receive rows (and, hierarchical, the rows between its two steps)
    # live only inside a MoE layer: at most, inside the last one's forward, with every activation
    # but the head's already saved. The allgather dispatch holds the group's gathered tokens and
    # their partial outputs instead: 2 x EP rows per token, whatever top-k is.
    all_to_all, routed = 0.0, tokens / layout.sp_size  # under sequence parallelism a rank routes its 1/T
    if layout.ep > 1 and part.moe:
        if layout.dispatch == "allgather":
            all_to_all = 2 * layout.ep * routed * model.hidden * p
        else:
            all_to_all = (3 if layout.hierarchical else 2) * routed * model.top_k * model.hidden * p * expert_imbalance

    later, moment = 0.0, "start of backward"
    if layout.sharded:
        # fp32 master, exp_avg, exp_avg_sq and the fp32 reduced-gradient shard
        optimizer_state = 16 * shard
        # ZeRO-1 keeps full-size gradient buckets from one backward pass to the next; under a pipeline
        # schedule with several chunks per rank ZeRO-2 too (the step's sum waits for the drain), while
        # with one chunk per rank it reduces each micro-batch's as without stages. Buckets that add
        # several micro-batches up do it in fp32, cast to the wire dtype only at the collective.
        keeps = not layout.reduces_each_micro_batch
        accumulates = keeps and (layout.pp > 1 or layout.accumulation > 1)
        held = 4 if accumulates and r < 4 else r
        gradients = gradients_at_peak = held * n_local if keeps else 0.0
        # the optimizer's reused buffers: the all-gather of the new weights (two buckets in flight,
        # parameter dtype; overlapped with the next forward, every bucket until that forward takes it),
        # under ZeRO-2 the gradient buckets being filled during the backward, and the wire-dtype copies
        # of fp32 buckets in flight
        gathered = n_local if layout.gather_overlap else two_buckets
        buffers = p * gathered + (r * two_buckets if layout.zero == 2 or held != r else 0.0)
        if r != p:  # the pairwise reduce-scatter's receive buffer cannot reuse a parameter-dtype one
            buffers += r * largest
    else:
        # DeepSpeed's own optimizers free .grad after every step: no gradient is held at the start
        # of the step's first backward pass, and the peak may come later, as gradients arrive. With
        # accumulation, ZeRO-0 and ZeRO-1 keep every .grad from one micro-step's backward pass to the
        # next (DeepSpeed reduces them only at the accumulation boundary: its ZeRO-1/2 optimizer's
        # gradient hook reduces each micro-step only under ZeRO-2), so the later micro-steps'
        # activations meet them (ZeRO-1: with its staging buffers, below).
        gradients_at_peak = p * n_local if layout.zero < 2 and layout.accumulation > 1 else 0.0
        buffers = 0.0
        if layout.zero == 0:
            # torch's optimizer on full states: moments, plus an fp32 master copy when the weights are
            # 16-bit, whose fp32 gradients exist only from the backward pass to the update (measured on a
            # bf16 run: 14 bytes a parameter held between steps); at the end of the backward pass every
            # .grad, flattened into a bucket for the all-reduce
            optimizer_state = 8 * n_local + (4 * n_local if p != 4 else 0.0)
            gradients = p * n_local + (4 * n_local if p != 4 else 0.0)
            flat = p * min(layout.bucket_size, n_local) if layout.dp > 1 else 0.0
            later = weights + optimizer_state + gradients + flat + grad_transient
            moment_later = "end of backward"
        else:
            # ZeRO-1/2: an fp32 partition of the weights and moments. The contiguous-gradient
            # staging buffers (reduce_bucket_size elements, two with overlap) are allocated when the
            # first gradient arrives, right after the loss's backward: the activations are still
            # there, minus the log-softmax, with the logits and their gradient.
            optimizer_state = 12 * shard
            staging = r * layout.bucket_size * (2 if layout.overlap_comm else 1)
            gradients = staging + 4 * shard + (p * n_local if layout.zero == 1 else 0.0)
            if gradients_at_peak:  # measured: a ZeRO-1 run's later micro-steps start their backward pass with
                # the staging buffers still allocated besides the .grad (tests/test_plan.py, dp2-ep1-zero1-mb4x2)
                gradients_at_peak += staging
            vocab = tokens * model.vocab if part.loss else 0.0
            first = weights + optimizer_state + staging + activations - 4 * vocab + (p + 4) * vocab + grad_transient
            # ZeRO-1 keeps every .grad until the reduction at the end of the backward pass
            end = weights + optimizer_state + gradients + grad_transient
            later, moment_later = max((first, "first gradient"), (end, "end of backward"))
        if later > 0 and later > weights + gradients_at_peak + optimizer_state + buffers + activations + transient:
            moment = moment_later
    inside_moe = weights + gradients_at_peak + optimizer_state + buffers + activations - tokens * head + all_to_all
    if inside_moe > max(later, weights + gradients_at_peak + optimizer_state + buffers + activations + transient):
        later, moment = inside_moe, "all-to-all of the last MoE layer"
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        gradients_at_peak=gradients_at_peak,
        optimizer_state=optimizer_state,
        buffers=buffers,
        activations=activations,
        transient=transient,
        all_to_all=all_to_all,
        later=later,
        moment=moment,
        stage=stage,
    )


def gib(value: float) -> float:
    return value / 2**30

"""Per-rank memory of a layout: model states, activations and buffers, in bytes.

The states follow what each optimizer path holds (see `ds_optimus/optim/sharded.py` and
DeepSpeed's ZeRO stage 0/1/2 optimizers); activations follow `ModelShape`'s count of the tensors
autograd saves. The peak is taken at the start of the backward pass, where the activations of the
whole micro-batch and the loss's vocabulary-sized gradients are alive at once, or, with activation
checkpointing, at the recomputation of a layer (or of the recomputed parts of one), whichever is larger.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout
from .model import ModelShape


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
        keys = ("weights", "gradients", "gradients_at_peak", "optimizer_state", "buffers", "activations",
                "transient", "all_to_all", "static", "peak", "moment")
        return {key: getattr(self, key) for key in keys}


def local_params(model: ModelShape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameter elements one rank holds, for the most loaded pipeline stage (the
    last: its layers plus the LM head and, untied, the embedding's share)."""
    if layout.pp == 1:
        return float(model.dense_params), model.expert_params / layout.ep
    per_layer_dense = (model.dense_params - model.vocab * model.hidden * (1 if model.tied else 2)) / model.layers
    dense = per_layer_dense * model.layers / layout.pp + model.vocab * model.hidden
    return dense, model.expert_params / layout.ep / layout.pp


def _buckets(elements: float, bucket_size: int) -> float:
    """Elements of the largest communication bucket of a space."""
    return min(elements, bucket_size) if elements else 0.0


def estimate_memory(model: ModelShape, layout: Layout, expert_imbalance: float = 1.0) -> MemoryEstimate:
    """Peak per-rank bytes of training `model` under `layout`.

    `expert_imbalance`: rows the busiest rank's experts receive over the mean (1.0 balanced).
    """
    p, r = layout.param_bytes, layout.reduce_bytes
    dense, expert = local_params(model, layout)
    n_local = dense + expert
    weights = p * n_local
    # elements of this rank's shard of the optimizer state
    shard = dense / layout.dp + expert / layout.edp if layout.zero > 0 else n_local
    largest = max(_buckets(dense, layout.bucket_size), _buckets(expert, layout.bucket_size))
    second = min(_buckets(dense, layout.bucket_size), _buckets(expert, layout.bucket_size)) if expert else (
        _buckets(max(dense - layout.bucket_size, 0), layout.bucket_size))
    two_buckets = largest + second
    grad_transient = p * model.largest_dense_param  # one parameter's .grad before a hook takes it

    tokens = layout.tokens_per_micro
    saved = model.saved_bytes_per_token(p, layout.checkpointing, expert_imbalance)
    in_flight = min(layout.pp, layout.accumulation) if layout.pp > 1 else 1  # 1F1B warm-up depth
    head = model.head_bytes(p)
    activations = tokens * ((saved - head) / layout.pp * in_flight + head)
    loss = tokens * model.loss_transient_bytes_per_token(p)
    recompute = tokens * model.recompute_bytes_per_token(p, expert_imbalance, layout.checkpointing)
    transient = max(loss, recompute) + grad_transient
    # The all-to-all's send and receive rows (and, hierarchical, the rows between its two steps)
    # live only inside a MoE layer: at most, inside the last one's forward, with every activation
    # but the head's already saved.
    all_to_all = 0.0
    if layout.ep > 1 and model.moe_layers:
        all_to_all = (3 if layout.hierarchical else 2) * tokens * model.top_k * model.hidden * p * expert_imbalance

    later, moment = 0.0, "start of backward"
    if layout.sharded:
        # fp32 master, exp_avg, exp_avg_sq and the fp32 reduced-gradient shard
        optimizer_state = 16 * shard
        # ZeRO-1 keeps full-size gradient buckets (reduce dtype) from one backward pass to the next
        gradients = gradients_at_peak = r * n_local if layout.zero == 1 else 0.0
        # the optimizer's reused buffers: the all-gather of the new weights (two buckets in flight,
        # parameter dtype), and under ZeRO-2 the gradient buckets being filled during the backward
        buffers = p * two_buckets + (r * two_buckets if layout.zero == 2 else 0.0)
        if r != p:  # the pairwise reduce-scatter's receive buffer cannot reuse a parameter-dtype one
            buffers += r * largest
    else:
        # DeepSpeed's own optimizers free .grad after every step: no gradient is held at the start
        # of the backward pass, and the peak may come later, as gradients arrive.
        gradients_at_peak = buffers = 0.0
        if layout.zero == 0:
            # torch's optimizer on full states: moments, plus an fp32 master copy and fp32
            # gradients when the weights are 16-bit; at the end of the backward pass every .grad,
            # flattened into a bucket for the all-reduce
            optimizer_state = 8 * n_local + (8 * n_local if p != 4 else 0.0)
            gradients = p * n_local
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
            vocab = tokens * model.vocab
            first = (weights + optimizer_state + staging + activations - 4 * vocab + (p + 4) * vocab
                     + grad_transient)
            # ZeRO-1 keeps every .grad until the reduction at the end of the backward pass
            end = weights + optimizer_state + gradients + grad_transient
            later, moment_later = max((first, "first gradient"), (end, "end of backward"))
        if later > 0 and later > weights + gradients_at_peak + optimizer_state + buffers + activations + transient:
            moment = moment_later
    inside_moe = weights + gradients_at_peak + optimizer_state + buffers + activations - tokens * head + all_to_all
    if inside_moe > max(later, weights + gradients_at_peak + optimizer_state + buffers + activations + transient):
        later, moment = inside_moe, "all-to-all of the last MoE layer"
    return MemoryEstimate(weights=weights, gradients=gradients, gradients_at_peak=gradients_at_peak,
                          optimizer_state=optimizer_state, buffers=buffers, activations=activations,
                          transient=transient, all_to_all=all_to_all, later=later, moment=moment)


def gib(value: float) -> float:
    return value / 2**30

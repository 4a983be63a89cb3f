"""Mula: dense and Mixture-of-Experts decoder language models as Hugging Face Transformers classes.

Imports only `torch` and `transformers`, so a checkpoint folder carrying this file loads as remote code
without ds_optimus; `import ds_optimus` registers the Auto classes and faster experts implementations.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as hf_init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_mula import MulaConfig

logger = logging.get_logger(__name__)

# Transformers 5.24 renamed the key/value cache from `past_key_values` to `cache`: in the model outputs,
# in what `generate` passes and reads back, in the mask builders and in the check the checkpointing
# layer makes. Mula's forwards take `cache`, hand it on and return it under the installed version's
# name, so this file (also loaded as remote code) runs on both sides of the rename.
CACHE_NAME = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# `past_key_values=` is renamed to `cache` by Transformers' own decorator (the one its models use for this
# rename): with its FutureWarning from 5.24 on; silently before, where it is still the name `generate` and
# the checkpointing layer pass (a deprecation version already reached keeps the decorator quiet).
accepts_past_key_values = deprecate_kwarg(
    "past_key_values", "5.40.0" if CACHE_NAME == "cache" else "5.0.0", new_name="cache", raise_if_both_names=True
)


class MulaRMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight (none without affine)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = x.to(input_dtype)
        return x if self.weight is None else self.weight * x

    def extra_repr(self) -> str:
        return f"({self.hidden_size},), eps={self.variance_epsilon}, elementwise_affine={self.weight is not None}"


class MulaLayerNorm(nn.Module):
    """LayerNorm in float32, cast back to the input's dtype; learned weight and bias only with `elementwise_affine`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if elementwise_affine else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        x = F.layer_norm(hidden_states.float(), self.normalized_shape, weight, bias, self.eps)
        return x.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"


def make_norm(config: MulaConfig, hidden_size: int) -> nn.Module:
    """The norm that `config.norm_type` and `norm_elementwise_affine` ask for."""
    norm_class = MulaLayerNorm if config.norm_type == "layer_norm" else MulaRMSNorm
    return norm_class(hidden_size, eps=config.rms_norm_eps, elementwise_affine=config.norm_elementwise_affine)


class MulaRotaryEmbedding(nn.Module):
    """Rotary position embedding: cos/sin tables for the given positions."""

    def __init__(self, config: MulaConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: MulaConfig, **kwargs) -> tuple[torch.Tensor, float]:
        """Inverse frequencies theta^(-2i/d) of plain RoPE, and a scaling of 1."""
        dim = config.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponent), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the halves (a, b) of the last dimension to (-b, a)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotate query and key states [B, heads, S, D] by the position tables cos/sin [B, S, D]."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention with grouped-query heads; returns (output [B, S, h, D], weights)."""
    groups = module.num_key_value_groups
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


class MulaAttention(nn.Module):
    """Grouped-query self-attention with optional QK-norm over the full q/k width and RoPE."""

    def __init__(self, config: MulaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = MulaRMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = MulaRMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.clip_qkv is not None:
            bound = self.config.clip_qkv
            q, k, v = q.clamp(-bound, bound), k.clamp(-bound, bound), v.clamp(-bound, bound)
        q = q.view(hidden_shape).transpose(1, 2)
        k = k.view(hidden_shape).transpose(1, 2)
        v = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = self.o_proj(out.reshape(*input_shape, -1).contiguous())
        return out, weights


class MulaMLP(nn.Module):
    """Dense SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, config: MulaConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def uniform_expert_assignment(
    num_tokens: int, num_experts: int, top_k: int, rank: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """Experts [num_tokens, top_k] of uniform routing: token t on expert-parallel rank `rank` (group token
    g = rank * num_tokens + t) gets the top_k consecutive experts from (g * top_k) mod num_experts."""
    # Slot i goes to expert i mod E: a token's k experts are distinct and N slots load each expert N // E or N // E + 1.
    token = torch.arange(num_tokens, device=device) + rank * num_tokens
    slot = token[:, None] * top_k + torch.arange(top_k, device=device)
    return slot % num_experts


class MulaTopKRouter(nn.Module):
    """Top-k router over softmax (or sigmoid) scores with an optional DeepSeek-V3 selection bias.

    Returns logits [T, E], weights [T, k] and expert indices [T, k]; the bias changes only the choice, not the weights.
    """

    def __init__(self, config: MulaConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.scoring_func = config.router_scoring_func
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.uses_bias = config.router_bias_update_rate > 0
        if self.uses_bias:
            # Persistent (training state); float32 since its updates are below bf16's resolution near typical values.
            self.expert_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))
        # Slot counts since the last bias update; not a buffer, so DDP's broadcast and dtype casts leave it alone.
        self.load_since_update: torch.Tensor | None = None
        # Benchmark mode set by ds_optimus (never saved): fixed, equally loaded experts (`uniform_expert_assignment`).
        self.force_uniform_routing = False
        self.uniform_routing_rank = 0

    def scores(self, router_logits: torch.Tensor) -> torch.Tensor:
        """Per-expert affinities in float32 from router logits."""
        if self.scoring_func == "sigmoid":
            return torch.sigmoid(router_logits.float())
        return F.softmax(router_logits, dim=-1, dtype=torch.float32)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states, self.weight)
        if self.force_uniform_routing:
            # The router still runs and learns: its scores restricted to the k assigned experts.
            top_k_index = uniform_expert_assignment(
                router_logits.shape[0], self.num_experts, self.top_k, self.uniform_routing_rank, router_logits.device
            )
            assigned = torch.zeros_like(router_logits, dtype=torch.bool).scatter_(-1, top_k_index, True)
            scores = self.scores(router_logits.masked_fill(~assigned, float("-inf")))
            top_k_weights = scores.gather(-1, top_k_index)
        else:
            scores = self.scores(router_logits)
            if self.uses_bias:
                _, top_k_index = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
                top_k_weights = scores.gather(-1, top_k_index)
            else:
                top_k_weights, top_k_index = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob or self.scoring_func == "sigmoid":
            # Sigmoid scores do not sum to one, so they are always renormalised over the chosen k.
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return router_logits, top_k_weights.to(router_logits.dtype), top_k_index

    @torch.no_grad()
    def record_load(self, top_k_index: torch.Tensor) -> None:
        """Add one forward pass's chosen experts to the load counted since the last bias update."""
        if self.load_since_update is None or self.load_since_update.device != top_k_index.device:
            self.load_since_update = torch.zeros(self.num_experts, dtype=torch.float32, device=top_k_index.device)
        flat = top_k_index.reshape(-1)
        self.load_since_update.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))

    @torch.no_grad()
    def update_bias(self, rate: float, group=None) -> None:
        """Move the selection bias by `rate` towards balance, after summing the loads over `group` if given."""
        load = self.load_since_update
        if load is None:
            return
        if group is not None:
            torch.distributed.all_reduce(load, group=group)
        self.update_bias_from(load, rate)

    @torch.no_grad()
    def update_bias_from(self, load: torch.Tensor, rate: float) -> None:
        """One bias update from the summed `load` [E] (none if empty), then reset the count; no host sync."""
        step = rate * torch.sign(load.mean() - load)
        step = torch.where(load.sum() > 0, step, torch.zeros_like(step))
        updated = self.expert_bias.float() + step.to(self.expert_bias.device)
        self.expert_bias.copy_(updated.to(self.expert_bias.dtype))
        if self.load_since_update is not None:
            self.load_since_update.zero_()


@use_experts_implementation
class MulaExperts(nn.Module):
    """One MoE layer's experts as stacked tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I].

    `forward` is the reference loop; the decorator dispatches to `config._experts_implementation` when set.
    """

    def __init__(self, config: MulaConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]
        # Set by `ds_optimus.parallel.apply_expert_parallel`. Experts held on this rank (weights' first dim):
        self.num_local_experts = self.num_experts
        # The token exchange that sends rows to the ranks owning their experts; None: all experts local.
        self.expert_parallel = None
        # The process-group layout (ds_optimus.parallel.ExpertParallelGroups); None: no expert parallelism.
        self.expert_groups = None
        # The grouped-GEMM backend of ds_optimus' experts implementation; None: chosen automatically.
        self.experts_backend: str | None = None

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # slot ids grouped by expert
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        # Under Transformers' expert parallelism `num_experts` counts this rank's experts, and slots
        # routed to other ranks carry the id `num_experts` with weight 0: they sort last and are left out.
        counts = counts[: self.num_experts]
        order = order[: sum(counts)]
        token_of_slot = order // top_k
        rows_by_expert = hidden_states[token_of_slot].split(counts)
        outputs = []
        for expert, rows in enumerate(rows_by_expert):
            if rows.shape[0] == 0:
                continue
            gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[expert]))
        final = hidden_states.new_zeros(num_tokens, self.hidden_dim, dtype=torch.float32)
        if outputs:
            weighted = torch.cat(outputs).float() * top_k_weights.reshape(-1)[order, None].float()
            final = final.index_add(0, token_of_slot, weighted)
        return final.to(hidden_states.dtype)


class MulaSparseMoeBlock(nn.Module):
    """Router plus experts; returns (output, router_logits, top_k_index)."""

    def __init__(self, config: MulaConfig):
        super().__init__()
        self.gate = MulaTopKRouter(config)
        self.experts = MulaExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        router_logits, top_k_weights, top_k_index = self.gate(flat)
        out = self.experts(flat, top_k_index, top_k_weights)
        return out.reshape(shape), router_logits, top_k_index


# The parts of a decoder layer that selective activation recomputation can recompute in the backward
# pass instead of keeping their activations (`MulaDecoderLayer.recompute`), in the order kept there.
RECOMPUTE_PARTS = ("moe", "attention", "norms")


class MulaDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer with a dense or MoE FFN; returns (hidden_states, attention_weights, router_logits,
    top_k_index), None where absent. `recompute` picks sub-blocks to recompute (whole-layer checkpointing wins)."""

    def __init__(self, config: MulaConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MulaAttention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = MulaSparseMoeBlock(config) if self.is_moe else MulaMLP(config)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self._recompute: tuple[str, ...] = ()

    @property
    def recompute(self) -> tuple[str, ...]:
        """Sub-blocks recomputed in backward: "moe" (the FFN, dense or MoE), "attention", "norms" (both norms)."""
        return self._recompute

    @recompute.setter
    def recompute(self, parts) -> None:
        parts = (parts,) if isinstance(parts, str) else tuple(parts)
        wrong = [p for p in parts if p not in RECOMPUTE_PARTS] + [p for i, p in enumerate(parts) if p in parts[:i]]
        if wrong:
            raise ValueError(f"recompute: {wrong[0]!r} is not one of {', '.join(RECOMPUTE_PARTS)} or is repeated")
        self._recompute = tuple(p for p in RECOMPUTE_PARTS if p in parts)

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        parts = self._recomputed_parts()
        if "attention" in parts and cache is not None:
            # As Transformers' whole-layer checkpointing does: the replay would write the cache twice.
            logger.warning_once(
                "Caching is incompatible with recomputing the attention in MulaDecoderLayer; "
                "setting `cache=None`, `use_cache=False`."
            )
            cache, use_cache = None, False
        residual = hidden_states
        attn_out, attn_weights = self._sub_block(
            self.input_layernorm,
            self.self_attn,
            hidden_states,
            "attention" in parts,
            "norms" in parts,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = residual + attn_out
        residual = hidden_states
        ffn = self._sub_block(self.post_attention_layernorm, self.mlp, hidden_states, "moe" in parts, "norms" in parts)
        ffn_out, router_logits, top_k_index = ffn if self.is_moe else (ffn, None, None)
        return residual + ffn_out, attn_weights, router_logits, top_k_index

    def _recomputed_parts(self) -> tuple[str, ...]:
        """Sub-blocks to recompute now: none without a backward pass or while the whole layer is checkpointed."""
        if not self._recompute or not (self.training and torch.is_grad_enabled()) or self.gradient_checkpointing:
            return ()
        return self._recompute

    @staticmethod
    def _sub_block(
        norm: nn.Module, block: nn.Module, x: torch.Tensor, recompute_block: bool, recompute_norm: bool, **kwargs
    ):
        """`block(norm(x), **kwargs)`, the parts asked for under non-reentrant checkpointing."""
        # Side effects (load and token counts) are made by the callers, outside the replay. The MoE all-to-all
        # replays at the same point on every rank; early_stop=False so no rank skips a collective another runs.
        if recompute_block and recompute_norm:
            return checkpoint(_norm_then, norm, block, x, use_reentrant=False, early_stop=False, **kwargs)
        normed = checkpoint(norm, x, use_reentrant=False) if recompute_norm else norm(x)
        if recompute_block:
            return checkpoint(block, normed, use_reentrant=False, early_stop=False, **kwargs)
        return block(normed, **kwargs)


def _norm_then(norm: nn.Module, block: nn.Module, x: torch.Tensor, **kwargs):
    """`block(norm(x), **kwargs)`: a norm and the block after it, recomputed as one."""
    return block(norm(x), **kwargs)


class MulaPreTrainedModel(PreTrainedModel):
    config_class = MulaConfig
    config: MulaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MulaDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # With Transformers' experts functions ("grouped_mm", "batched_mm"); the `eager` reference path reads
    # the per-expert token counts on the host, so it graph-breaks, as the reference loops of
    # Transformers' own MoE models do.
    _can_compile_fullgraph = True
    # Honoured by from_pretrained and DeepSpeed's engine; emptied in `post_init` where no router has a bias.
    _keep_in_fp32_modules_strict = ["expert_bias"]
    # Recorded from the decoder layer's return value: hooks outside the checkpointed forward keep the router
    # logits' gradients, and no hook runs inside a layer compiled on its own.
    _can_record_outputs = {
        "hidden_states": OutputRecorder(MulaDecoderLayer, index=0),
        "attentions": OutputRecorder(MulaDecoderLayer, index=1),
        "router_logits": OutputRecorder(MulaDecoderLayer, index=2),
    }

    def post_init(self) -> None:
        # The list names only tensors that exist: the selection bias is there when its update rate is set.
        if not (self.config.num_experts > 0 and self.config.router_bias_update_rate > 0):
            self._keep_in_fp32_modules_strict = []
        super().post_init()

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Default to ds_optimus' dropless experts once `import ds_optimus` registers them, else Transformers'."""
        if requested_experts is None:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            if "ds_optimus" in ALL_EXPERTS_FUNCTIONS:
                requested_experts = "ds_optimus"
        return super().get_correct_experts_implementation(requested_experts)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save; registered Auto classes also put the base model in `auto_map`. Experts sharded over ranks are
        refused unless `state_dict` holds every expert (an empty `state_dict` writes only the config)."""
        state = kwargs.get("state_dict")
        for name, module in self.named_modules() if state is None or state else ():
            if not isinstance(module, MulaExperts) or module.num_local_experts == module.num_experts:
                continue
            weights = [state.get(f"{name}.{w}") if state is not None else None for w in ("gate_up_proj", "down_proj")]
            if any(w is None or w.shape[0] != module.num_experts for w in weights):
                raise ValueError(
                    f"save_pretrained: {name} holds {module.num_local_experts} of its {module.num_experts} experts "
                    "(expert-parallel); export on every rank with ds_optimus.parallel.export_pretrained(model, folder)"
                )
        if getattr(self, "_auto_class", None) is not None:
            auto_map = dict(getattr(self.config, "auto_map", None) or {})
            auto_map.setdefault("AutoModel", "modeling_mula.MulaModel")
            self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # `transformers.initialization` functions skip tensors already loaded from a checkpoint.
        PreTrainedModel._init_weights(self, module)
        std = self.config.initializer_range
        if isinstance(module, MulaExperts):
            hf_init.normal_(module.gate_up_proj, mean=0.0, std=std)
            hf_init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, MulaTopKRouter):
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if module.uses_bias:
                hf_init.zeros_(module.expert_bias)
        elif isinstance(module, (MulaRMSNorm, MulaLayerNorm)):
            if module.weight is not None:
                hf_init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                hf_init.zeros_(module.bias)
        elif isinstance(module, MulaRotaryEmbedding):
            inv_freq, _ = (
                module.compute_default_rope_parameters(module.config)
                if module.rope_type == "default"
                else ROPE_INIT_FUNCTIONS[module.rope_type](module.config)
            )
            hf_init.copy_(module.inv_freq, inv_freq)
            hf_init.copy_(module.original_inv_freq, inv_freq)


@dataclass
class MulaModelOutputWithPast(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` plus the experts each MoE layer chose (`router_indices`, [T, k] each)."""

    router_indices: tuple[torch.Tensor, ...] | None = None


@dataclass
class MulaCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` with the loss split into its parts.

    With labels: loss = lm_loss + router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss in training, else
    lm_loss. `tokens_per_expert` [moe_layers, E] counts token slots.
    """

    lm_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None


class MulaModel(MulaPreTrainedModel):
    """The Mula decoder stack without a language-model head."""

    def __init__(self, config: MulaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([MulaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = make_norm(config, config.hidden_size)
        self.rotary_emb = MulaRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MulaModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # Only positions the caller gives can describe packed sequences; the mask builder checks them
        # for that on the host, which would stall every training step for positions made here.
        given_position_ids = position_ids
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=given_position_ids,
            **{CACHE_NAME: cache},
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        # `capture_outputs` records the router logits when they are asked for (the same test as its own);
        # the experts each layer chose come with them.
        with_router = kwargs.get("output_router_logits", self.config.output_router_logits)
        router_indices = []
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, _, _, layer_index = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **{CACHE_NAME: cache},  # the name the checkpointing layer looks for, to drop it
                **kwargs,
            )
            if layer_index is not None:
                if with_router:
                    router_indices.append(layer_index)
                if self.training and layer.mlp.gate.uses_bias:
                    layer.mlp.gate.record_load(layer_index)  # here, so a recomputation does not count twice
        hidden_states = self.norm(hidden_states)
        return MulaModelOutputWithPast(
            last_hidden_state=hidden_states,
            router_indices=tuple(router_indices) or None,
            **{CACHE_NAME: cache},
        )


def router_losses(
    router_logits: tuple[torch.Tensor, ...],
    router_indices: tuple[torch.Tensor, ...],
    num_experts: int,
    scoring_func: str = "softmax",
    token_mask: torch.Tensor | None = None,
    group=None,
    form: str = "mula",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load-balancing loss, router z-loss (both averaged over layers) and token-slot counts per layer.

    `form="mula"`: per layer E * sum_e f_e * p_e (f_e: fraction of slots to expert e, p_e: its mean probability),
    1.0 at balance. `form="transformers"`: Transformers' `load_balancing_loss_func`, all layers pooled, f_e slots
    per token, k at balance. Z-loss: mean of logsumexp(logits)^2. `token_mask` [T] (1 = real) excludes padding.
    With `group`, f_e counts the whole group's tokens (global-batch balancing); p_e stays local.
    """
    stats = [
        router_layer_stats(logits, index, num_experts, scoring_func, token_mask)
        for logits, index in zip(router_logits, router_indices, strict=True)
    ]
    mean_probs, zloss, counts, tokens = (list(part) for part in zip(*stats, strict=True))
    return combine_router_stats(mean_probs, zloss, counts, tokens, router_indices[0].shape[-1], group, form)


def router_layer_stats(
    logits: torch.Tensor,
    index: torch.Tensor,
    num_experts: int,
    scoring_func: str = "softmax",
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's part of `router_losses`: mean probability per expert [E] and z-loss (with gradients),
    slots per expert [E] and token count [1] (detached)."""
    logits = logits.float()
    if scoring_func == "sigmoid":
        probs = torch.sigmoid(logits)
        probs = probs / probs.sum(-1, keepdim=True)
    else:
        probs = torch.softmax(logits, dim=-1)
    # slots per token and expert [T, E]; a scatter, since one_hot checks the ids' range on the host
    one_hot_slots = torch.zeros(index.shape[0], num_experts, dtype=torch.float32, device=index.device)
    one_hot_slots.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=index.device))
    lse_sq = torch.logsumexp(logits, dim=-1).pow(2)
    if token_mask is None:
        mask = torch.ones(logits.shape[0], device=logits.device)
    else:
        mask = token_mask.to(logits.device, torch.float32)
    real = mask.sum()
    denom = real.clamp_min(1.0)
    return (
        (probs * mask[:, None]).sum(0) / denom,
        (lse_sq * mask).sum() / denom,
        (one_hot_slots * mask[:, None]).sum(0).detach(),
        real.detach().reshape(1),
    )


def combine_router_stats(
    mean_probs: list[torch.Tensor],
    zloss: list[torch.Tensor],
    counts: list[torch.Tensor],
    tokens: list[torch.Tensor],
    top_k: int,
    group=None,
    form: str = "mula",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router_losses` from every MoE layer's `router_layer_stats` (also those of earlier pipeline stages)."""
    num_experts = counts[0].shape[-1]
    # Slot and token counts of every layer: summed over the group in one all-reduce when balancing
    # the global batch, and unclamped until then, so ranks without real tokens add nothing.
    loads = [torch.cat([c, t]) for c, t in zip(counts, tokens, strict=True)]
    if group is not None:
        flat = torch.cat([load.to(loads[0].device) for load in loads])
        torch.distributed.all_reduce(flat, group=group)
        loads = [part.to(load.device) for part, load in zip(flat.split(num_experts + 1), loads, strict=True)]
    device = mean_probs[0].device  # layers may sit on different devices under a device_map
    if form == "transformers":
        # Every layer covers the same tokens, so pooling them is the sum of the layers' slot counts over
        # the sum of their token counts, and the mean of the layers' mean probabilities.
        pooled = torch.stack([load.to(device) for load in loads]).sum(0)
        mean_prob = torch.stack([p.to(device) for p in mean_probs]).mean(0)
        balance = [num_experts * (pooled[:-1] / pooled[-1].clamp_min(1.0) * mean_prob).sum()]
    else:
        balance = [
            num_experts * (load[:-1] / (load[-1].clamp_min(1.0) * top_k) * p).sum()
            for load, p in zip(loads, mean_probs, strict=True)
        ]
    return (
        torch.stack([t.to(device) for t in balance]).mean(),
        torch.stack([t.to(device) for t in zloss]).mean(),
        torch.stack([t.to(device) for t in counts]),
    )


class MulaForCausalLM(MulaPreTrainedModel, GenerationMixin):
    """Mula decoder with a language-model head; adds the router losses to the LM loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: MulaConfig):
        super().__init__(config)
        self.model = MulaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The process group over which global-batch load balancing sums expert loads; None: every rank.
        # Set by a trainer whose data parallelism is not the whole world.
        self.router_loss_group = None
        self.post_init()

    @accepts_past_key_values
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MulaCausalLMOutputWithPast | tuple:
        config = self.config
        output_router_logits = config.output_router_logits if output_router_logits is None else output_router_logits
        # The router losses need the routers' logits and choices whenever there are labels.
        with_router = bool(output_router_logits) or (labels is not None and config.num_experts > 0)
        outputs: MulaModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=with_router,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:, :]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep, :]
        logits = self.lm_head(hidden_states)

        loss = lm_loss = aux_loss = z_loss = tokens_per_expert = None
        if labels is not None:
            lm_loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
            loss = lm_loss
        if outputs.router_logits:  # recorded only when asked for, or for the losses
            token_mask = None
            if attention_mask is not None and attention_mask.numel() == outputs.router_logits[0].shape[0]:
                token_mask = attention_mask.reshape(-1)  # padding-aware only when the mask covers these tokens
            aux_loss, z_loss, tokens_per_expert = router_losses(
                outputs.router_logits,
                outputs.router_indices,
                config.num_experts,
                config.router_scoring_func,
                token_mask,
                self._router_loss_group(),
                getattr(config, "router_aux_loss_type", "mula"),
            )
            if loss is not None and self.training:
                # Evaluation reports the LM loss alone, so eval loss and perplexity stay comparable.
                router_loss = config.router_aux_loss_coef * aux_loss + config.router_z_loss_coef * z_loss
                num_items = kwargs.get("num_items_in_batch")
                if num_items is not None:
                    # The LM loss is then a sum over this micro-batch divided by the label count of the
                    # whole (accumulated, all-rank) batch, and the Trainer neither averages micro-batches
                    # nor ranks; weight the per-micro-batch router means by this micro-batch's share.
                    shifted = kwargs.get("shift_labels")
                    shifted = labels[..., 1:] if shifted is None else shifted
                    router_loss = router_loss * ((shifted != -100).sum() / num_items)
                loss = loss + router_loss.to(loss.device)

        result = MulaCausalLMOutputWithPast(
            loss=loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            z_loss=z_loss,
            tokens_per_expert=tokens_per_expert,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits if output_router_logits else None,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )
        return_dict = config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()

    def _router_loss_group(self):
        """The group over which expert loads are summed for the load-balancing loss, or None."""
        if getattr(self.config, "router_aux_loss_scope", "micro_batch") != "global_batch" or not self.training:
            return None
        if self.router_loss_group is not None:
            return self.router_loss_group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.group.WORLD
        return None

    @torch.no_grad()
    def update_router_bias(self, group=None) -> None:
        """One auxiliary-loss-free bias update of every MoE router (once per optimizer step), from the loads
        summed over `group` (default: every rank)."""
        rate = self.config.router_bias_update_rate
        if rate <= 0:
            raise ValueError("update_router_bias needs config.router_bias_update_rate > 0")
        if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            group = torch.distributed.group.WORLD  # replicated routers must see the same global load
        routers = [m for m in self.modules() if isinstance(m, MulaTopKRouter) and m.uses_bias]
        if not routers:
            return
        # A router that counted nothing yet (e.g. this rank ran no forward pass) adds an empty load,
        # so that every rank sends the same all-reduce.
        loads = [
            r.load_since_update
            if r.load_since_update is not None
            else torch.zeros(r.num_experts, dtype=torch.float32, device=r.expert_bias.device)
            for r in routers
        ]
        if group is not None:
            flat = torch.cat([load.to(loads[0].device) for load in loads])
            torch.distributed.all_reduce(flat, group=group)
            parts = flat.split([load.numel() for load in loads])
            loads = [part.to(load.device) for part, load in zip(parts, loads, strict=True)]
        for router, load in zip(routers, loads, strict=True):
            router.update_bias_from(load, rate)

    @torch.no_grad()
    def discard_router_loads(self) -> None:
        """Forget the expert loads counted since the last bias update (for a skipped step)."""
        for module in self.modules():
            if isinstance(module, MulaTopKRouter) and module.load_since_update is not None:
                module.load_since_update.zero_()


__all__ = [
    "MulaForCausalLM",
    "MulaModel",
    "MulaPreTrainedModel",
    "MulaCausalLMOutputWithPast",
    "MulaModelOutputWithPast",
    "router_losses",
    "router_layer_stats",
    "combine_router_stats",
]

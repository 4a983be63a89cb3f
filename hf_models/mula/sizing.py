"""Parameter counts and training FLOPs of a Mula config, without building the model."""

from __future__ import annotations

from .configuration_mula import MulaConfig


def count_parameters(config: MulaConfig) -> tuple[int, int]:
    """Return (total, active) parameter counts of `MulaForCausalLM(config)`.

    Active parameters are those one token uses in a forward pass: everything except the
    (num_experts - num_experts_per_tok) experts a token is not routed to in each MoE layer.
    Embeddings and the LM head count (once when tied), as in the OLMoE and OLMo papers.
    """
    h, v = config.hidden_size, config.vocab_size
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    bias = config.attention_bias
    attention = h * (2 * q_width + 2 * kv_width) + (q_width + 2 * kv_width + h if bias else 0)
    if config.qk_norm:
        attention += q_width + kv_width
    norm = norm_parameters(config)
    layer_norms = 2 * norm

    total = active = 0
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            expert = 3 * h * config.moe_intermediate_size
            router = config.num_experts * h
            total += attention + layer_norms + router + config.num_experts * expert
            active += attention + layer_norms + router + config.num_experts_per_tok * expert
        else:
            dense_ffn = 3 * h * config.intermediate_size
            total += attention + layer_norms + dense_ffn
            active += attention + layer_norms + dense_ffn
    embeddings = v * h * (1 if config.tie_word_embeddings else 2) + norm  # + final norm
    return total + embeddings, active + embeddings


def norm_parameters(config: MulaConfig) -> int:
    """Parameters of one input, post-attention or final norm: a weight (RMSNorm) or a weight and a bias
    (LayerNorm) with `norm_elementwise_affine`, none without (OLMo's LayerNorm)."""
    if not config.norm_elementwise_affine:
        return 0
    return config.hidden_size * (2 if config.norm_type == "layer_norm" else 1)


def matmul_flops_per_token(matmul_params: int, layers: int, attention_width: int, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward): 6 x the parameters a token multiplies with,
    plus 12 x layers x attention width x sequence length for the attention scores and values."""
    return 6.0 * matmul_params + 12.0 * layers * attention_width * seq_len


def flops_per_token(config: MulaConfig, seq_len: int) -> float:
    """Training FLOPs per token of `MulaForCausalLM(config)` at `seq_len`: its active parameters less
    the input embedding (a lookup, not a matmul, unless tied to the LM head), through
    `matmul_flops_per_token`. The trainer's MFU and the layout planner both use this figure."""
    _, active = count_parameters(config)
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    width = config.num_attention_heads * config.head_dim
    return matmul_flops_per_token(active - embedding, config.num_hidden_layers, width, seq_len)

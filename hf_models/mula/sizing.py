"""Parameter counts and training FLOPs of a Mula config, without building the model."""

from __future__ import annotations

from .configuration_mula import MulaConfig


def count_parameters(config: MulaConfig) -> tuple[int, int]:
    """(total, active) parameters, embeddings and head included (once if tied); active skips unrouted experts."""
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
    """Parameters of one non-QK norm: its weight (and LayerNorm's bias) if `norm_elementwise_affine`."""
    if not config.norm_elementwise_affine:
        return 0
    return config.hidden_size * (2 if config.norm_type == "layer_norm" else 1)


def matmul_flops_per_token(matmul_params: int, layers: int, attention_width: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + 12 x layers x attention width x seq_len."""
    return 6.0 * matmul_params + 12.0 * layers * attention_width * seq_len


def flops_per_token(config: MulaConfig, seq_len: int) -> float:
    """Training FLOPs per token at `seq_len`: active parameters less the input embedding (unless tied)."""
    _, active = count_parameters(config)
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    width = config.num_attention_heads * config.head_dim
    return matmul_flops_per_token(active - embedding, config.num_hidden_layers, width, seq_len)

"""How ds_optimus' tensor parallelism splits a Mula model (`ds_optimus.parallel.tensor_parallel` applies it).

Data only, so the model package still loads without ds_optimus. A pattern names modules of
`MulaForCausalLM` (`*` is one name: a layer's index); a pattern that names nothing in a model (a dense
layer's MLP in an MoE model, the embedding on a later pipeline stage) is skipped. Norms, routers and
experts are not named: they stay whole on every rank.
"""

# style: "column" splits a Linear's output features, "row" its input features (the outputs summed over the
# group); "norm" an RMSNorm over a split width; "vocab_embedding" and "vocab_head" the vocabulary rows.
# The text names what is split, for the error when the size does not divide it.
TENSOR_PARALLEL_PLAN: dict[str, tuple[str, str]] = {
    "model.layers.*.self_attn.q_proj": ("column", "the query width"),
    "model.layers.*.self_attn.k_proj": ("column", "the key/value width"),
    "model.layers.*.self_attn.v_proj": ("column", "the key/value width"),
    "model.layers.*.self_attn.o_proj": ("row", "the query width"),
    # full-width QK-norm: over the split q and k widths, the sum of squares taken over the group
    "model.layers.*.self_attn.q_norm": ("norm", "the query width"),
    "model.layers.*.self_attn.k_norm": ("norm", "the key/value width"),
    "model.layers.*.mlp.gate_proj": ("column", "the MLP's intermediate width"),
    "model.layers.*.mlp.up_proj": ("column", "the MLP's intermediate width"),
    "model.layers.*.mlp.down_proj": ("row", "the MLP's intermediate width"),
    "model.embed_tokens": ("vocab_embedding", "the vocabulary"),
    "lm_head": ("vocab_head", "the vocabulary"),
}


def check_tensor_parallel(config, size: int) -> str | None:
    """Why `size` ranks cannot split a model of `config` by whole heads; None when they can."""
    if config.num_key_value_heads % size:  # the query heads are a multiple of them
        return f"tensor parallel size {size} does not divide the key/value heads ({config.num_key_value_heads})"
    return None

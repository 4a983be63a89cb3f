"""What the planner needs to know about a Mula model: parameter counts split into dense and expert
parts, training FLOPs per token, and the bytes each token's activations hold for the backward pass.

The activation figures count the tensors autograd saves in `MulaForCausalLM` as written (eager
PyTorch, SDPA attention, the grouped-GEMM experts path), tensor by tensor; `tests/test_plan.py`
checks them against the saved tensors of a real forward pass in float32 and bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# bytes of the int64 index tensors the router and the token permutation save, per routed slot
_INDEX_BYTES_PER_SLOT = 32


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Mula model that memory and time depend on."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense FFN
    experts: int  # 0: dense model
    top_k: int
    expert_intermediate: int
    moe_layers: int
    qk_norm: bool
    tied: bool
    total_params: int  # from hf_models.mula.count_parameters
    active_params: int  # parameters one token uses (its top-k experts, not all of them)
    moe_layer_freq: int = 1  # layer i is an MoE layer when (i + 1) % moe_layer_freq == 0 (`MulaConfig.is_moe_layer`)

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a `MulaConfig`."""
        from ..hf_models.mula import count_parameters

        total, active = count_parameters(config)
        moe_layers = sum(1 for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
        return cls(
            name=name or getattr(config, "name_or_path", "") or "mula",
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            experts=config.num_experts if moe_layers else 0,
            top_k=config.num_experts_per_tok if moe_layers else 0,
            expert_intermediate=config.moe_intermediate_size,
            moe_layers=moe_layers,
            qk_norm=bool(config.qk_norm),
            tied=bool(config.tie_word_embeddings),
            total_params=total,
            active_params=active,
            moe_layer_freq=int(getattr(config, "moe_layer_freq", 1) or 1),
        )

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> ModelShape:
        """From a Mula preset name (`mula-7b-a1b`, ...)."""
        from ..hf_models.mula import MulaConfig

        return cls.from_config(MulaConfig.from_preset(preset, **overrides), name=preset)

    # -- parameters -------------------------------------------------------------------------------

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def expert_params_per_layer(self) -> int:
        """All experts of one MoE layer (gate, up and down of each)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def expert_params(self) -> int:
        return self.moe_layers * self.expert_params_per_layer

    @property
    def dense_params(self) -> int:
        """Everything that is not an expert weight: attention, norms, routers, dense FFNs, embeddings."""
        return self.total_params - self.expert_params

    @property
    def largest_dense_param(self) -> int:
        """Elements of the largest dense parameter (the embedding or the LM head)."""
        dense_ffn = self.hidden * self.intermediate if self.moe_layers < self.layers else 0  # gate, up or down
        return max(self.vocab * self.hidden, dense_ffn)

    # -- FLOPs ------------------------------------------------------------------------------------

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward), the trainer's MFU figure
        (`hf_models.mula.sizing`): the active matmul parameters and the attention products."""
        from ..hf_models.mula.sizing import matmul_flops_per_token

        embedding = 0 if self.tied else self.vocab * self.hidden  # a lookup, not a matmul
        return matmul_flops_per_token(self.active_params - embedding, self.layers, self.q_width, seq_len)

    # -- activations ------------------------------------------------------------------------------

    def _norm(self, width: int, a: int) -> int:
        # RMSNorm computes in float32: saves its float32 input, the normalised value in the input's
        # dtype (for the weight's gradient; the same tensor in float32) and one float32 scale a row
        return width * (4 + a) + 4

    def _attention_inner(self, a: int, tp: int = 1) -> float:
        """What the attention saves besides its input (the input norm's output): QK-norms, SDPA; with
        tensor parallelism over `tp` ranks, this rank's heads."""
        q, kv = self.q_width, self.kv_width
        qk = self._norm(q, a) + self._norm(kv, a) if self.qk_norm else 0
        return (qk + a * (2 * q + 2 * kv) + 4 * self.heads) / tp  # q, k, v, output; float32 log-sum-exp per head

    def _ffn_inner(self, a: int, moe: bool, imbalance: float = 1.0, tp: int = 1) -> float:
        """What the feed-forward block saves besides its input (the post-attention norm's output);
        `imbalance` scales the routed part (the most loaded rank receives that many times the mean rows).
        A dense FFN's is this rank's columns under tensor parallelism (`tp`); the MoE block is whole."""
        if not moe:
            return 4 * a * self.intermediate / tp  # gate and up outputs, SiLU(gate), the down input
        k, i = self.top_k, self.expert_intermediate
        router = 4 * self.experts + a * k  # float32 logits, routing weights
        # Per routed slot: the permuted input row, gate|up, and the expert's output row, which the
        # weighted combine keeps for the routing weights' gradient; the SwiGLU output is recomputed
        # from gate|up in the backward pass (measured: benchmarks/recompute_memory.py, exact).
        routed = k * (a * (2 * self.hidden + 2 * i) + _INDEX_BYTES_PER_SLOT)
        return router + imbalance * routed

    def _side(self, a: int, inner: float, block: bool, norm: bool, sp: int = 1, gathered: bool = True) -> float:
        """Bytes per token of a norm and the block after it, either recomputed or not. Recomputed
        (non-reentrant checkpointing), a region keeps only its input: the norm's input (the residual
        stream), or the block's input (the norm's output) where the norm is not in the region. Under
        sequence parallelism (`sp` ranks) the residual stream and the norm hold 1/sp of the tokens; the
        block's input is gathered whole for its projections, which keep it (an MoE block, not `gathered`,
        keeps this rank's tokens)."""
        x = a * self.hidden
        kept_by_norm = x / sp if norm else self._norm(self.hidden, a) / sp
        block_input = x if gathered else x / sp
        if block:
            return x / sp if norm else kept_by_norm + block_input
        return kept_by_norm + block_input + inner

    def layer_saved_bytes_per_token(
        self,
        a: int,
        moe: bool,
        recompute: bool | tuple[str, ...] = False,
        imbalance: float = 1.0,
        tp: int = 1,
        sp: int = 1,
    ) -> float:
        """Bytes one token's decoder layer saves for the backward pass under activation recomputation
        `recompute`: False (none), True (the whole layer: its input only) or the parts recomputed,
        any of "moe" (the FFN after the post-attention norm), "attention", "norms"; on one of `tp`
        tensor-parallel ranks (`sp`: the ranks the sequence is cut over, 1 without sequence parallelism)."""
        if recompute is True:
            return a * self.hidden / sp
        parts = recompute or ()
        norm = "norms" in parts
        # under sequence parallelism an MoE block routes this rank's tokens: 1/sp of its rows
        ffn = self._ffn_inner(a, moe, imbalance, tp) / (sp if moe else 1)
        return self._side(a, self._attention_inner(a, tp), "attention" in parts, norm, sp) + self._side(
            a, ffn, "moe" in parts, norm, sp, gathered=not moe
        )

    def layer_bytes(self, a: int, moe: bool, imbalance: float = 1.0) -> float:
        """Bytes one token's decoder layer saves without recomputation."""
        return self.layer_saved_bytes_per_token(a, moe, False, imbalance)

    def head_bytes(self, a: int, tp: int = 1, sp: int = 1) -> float:
        """The final norm, the LM head's input, the float32 log-softmax over the vocabulary (this rank's
        slice under tensor parallelism), the labels, and the router logits the auxiliary losses keep."""
        aux = self.moe_layers * 4 * (2 * self.experts + 2)
        return self._norm(self.hidden, a) / sp + a * self.hidden + 4 * self.vocab / tp + 8 + aux + 8  # + input ids

    def saved_bytes_per_token(
        self, a: int, checkpointing: bool | tuple[str, ...] = False, imbalance: float = 1.0, tp: int = 1, sp: int = 1
    ) -> float:
        """Activation bytes per token held from the end of the forward pass into the backward pass,
        under activation recomputation `checkpointing` (see `layer_saved_bytes_per_token`)."""
        moe_layers = self.moe_layers
        return (
            moe_layers * self.layer_saved_bytes_per_token(a, True, checkpointing, imbalance, tp, sp)
            + (self.layers - moe_layers) * self.layer_saved_bytes_per_token(a, False, checkpointing, 1.0, tp, sp)
            + self.head_bytes(a, tp, sp)
        )

    def loss_transient_bytes_per_token(self, a: int, tp: int = 1) -> float:
        """Extra bytes at the start of the backward pass, the usual peak: the logits the output still
        holds, and the float32 gradients of the log-softmax and of the logits (this rank's vocabulary
        slice under tensor parallelism)."""
        return self.vocab * (a + 8) / tp

    def recompute_bytes_per_token(
        self, a: int, imbalance: float = 1.0, checkpointing: bool | tuple[str, ...] = True, tp: int = 1, sp: int = 1
    ) -> float:
        """With activation recomputation, the most one recomputed region rebuilds at once during the
        backward pass: a whole layer, or the larger of its recomputed attention and FFN sides."""
        moe = self.moe_layers > 0
        if not checkpointing:
            return 0.0
        if checkpointing is True:
            return self.layer_saved_bytes_per_token(a, moe, False, imbalance, tp, sp)
        norm = "norms" in checkpointing
        sides = [(self._attention_inner(a, tp), "attention"), (self._ffn_inner(a, moe, imbalance, tp), "moe")]
        return max(
            self._side(a, inner, False, False, sp) - self._side(a, inner, part in checkpointing, norm, sp)
            for inner, part in sides
        )

    # -- recomputation's cost -----------------------------------------------------------------------

    def recompute_flops_per_token(self, checkpointing: bool | tuple[str, ...], seq_len: int) -> tuple[float, float]:
        """Forward FLOPs per token run again by activation recomputation `checkpointing`: (everything
        but the experts' grouped GEMMs, the experts'). The norms' are negligible (no matmul)."""
        experts = 2.0 * self.moe_layers * self.top_k * 3 * self.hidden * self.expert_intermediate
        if not checkpointing:
            return 0.0, 0.0
        if checkpointing is True:  # every layer's forward: a third of the layers' training FLOPs
            layers = (self.flops_per_token(seq_len) - 6.0 * self.vocab * self.hidden) / 3
            return layers - experts, experts
        dense = 0.0
        if "attention" in checkpointing:
            projections = 2.0 * self.hidden * (2 * self.q_width + 2 * self.kv_width)
            dense += self.layers * (projections + 4.0 * self.q_width * seq_len)
        if "moe" not in checkpointing:
            return dense, 0.0
        dense += self.moe_layers * 2.0 * self.experts * self.hidden  # the routers
        dense += (self.layers - self.moe_layers) * 2.0 * 3 * self.hidden * self.intermediate  # dense FFNs
        return dense, experts

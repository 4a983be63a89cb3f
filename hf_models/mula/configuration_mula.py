"""Configuration of the Mula model family (dense and Mixture-of-Experts decoders).

This file imports only `transformers` (and the standard library) so that a saved checkpoint folder
carrying it loads with `trust_remote_code=True` where ds_optimus is not installed.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from transformers.configuration_utils import PreTrainedConfig

# ---------------------------------------------------------------------------------------------
# Presets.
#
# Optimus, the library of the Mula runs on Aurora (IntelLabs/Optimus-LM, README "Paper variants"), builds its
# family from OLMoE-1B-7B by scaling tags: SA scales the query and key/value heads (head_dim stays 128), SH the
# hidden size, SE the expert count, SI the expert FFN size, L sets the layers. These presets take those shapes;
# every MoE preset keeps OLMoE's recipe (vocab 50304, QK-norm, RoPE 10000, untied embeddings,
# softmax top-8 without renormalisation, no shared experts):
#   mula-7b-a1b    = OLMoE-1B-7B                        16 layers, 2048 wide, 16 heads,  64 x 1024
#   mula-20b-a2b   = SE1.5-L32                          32 layers, 2048 wide, 16 heads,  96 x 1024
#   mula-100b-a7b  = SA1.5-SH1.5-SE2.25-SI1.5-L48       48 layers, 3072 wide, 24 heads, 144 x 1536
#   mula-220b-a10b = SA1.5-SH1.5-SE3.75-SI1.5-L64       64 layers, 3072 wide, 24 heads, 240 x 1536
# mula-1b is OLMo-1B (dense SwiGLU 8192, non-parametric LayerNorm, no QK-norm, 2048 positions) with untied
# embeddings; `convert_olmo` converts OLMo checkpoints (tied or not) both ways.
# Counts (`count_parameters` in ds_optimus.hf_models.mula, embeddings included): 6.92B / 1.28B active,
# 20.08B / 2.36B, 99.99B / 7.58B, 220.21B / 10.02B; mula-1b 1.28B. The names round these as Optimus
# does. Expert counts and Optimus' EP size 12 (one Aurora node): 96, 144 and 240 all divide by 12.
# ---------------------------------------------------------------------------------------------

NORM_TYPES = ("rms_norm", "layer_norm")
_OLMO_VOCAB = dict(vocab_size=50304, pad_token_id=1, eos_token_id=50279, bos_token_id=None)

PRESETS: dict[str, dict[str, Any]] = {
    "mula-1b": dict(
        **_OLMO_VOCAB,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        intermediate_size=8192,
        num_experts=0,
        qk_norm=False,
        tie_word_embeddings=False,
        norm_type="layer_norm",
        norm_elementwise_affine=False,
        max_position_embeddings=2048,
    ),
    "mula-7b-a1b": dict(
        **_OLMO_VOCAB,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=1024,
    ),
    "mula-20b-a2b": dict(
        **_OLMO_VOCAB,
        hidden_size=2048,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_experts=96,
        num_experts_per_tok=8,
        moe_intermediate_size=1024,
    ),
    "mula-100b-a7b": dict(
        **_OLMO_VOCAB,
        hidden_size=3072,
        num_hidden_layers=48,
        num_attention_heads=24,
        num_experts=144,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
    ),
    "mula-220b-a10b": dict(
        **_OLMO_VOCAB,
        hidden_size=3072,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_experts=240,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
    ),
    # The dense GPT-style models of the Frontier study (Dash et al., "Optimizing Distributed Training on
    # Frontier for Large Language Models", ISC 2024, arXiv 2312.12705): layers, width and heads as its
    # authors' Megatron-DeepSpeed launch scripts give them (22B: 48 x 6144, 48 heads; 175B: 96 x 12288,
    # 96 heads; 1T: 128 x 25600, 200 heads), as Mula blocks: full multi-head attention, a SwiGLU FFN of
    # the GELU MLP's parameters (8h/3, to a multiple of 64), no QK-norm, untied embeddings (pipeline
    # stages), the 50304-entry vocabulary. 22.36B, 175.18B and 1,009.4B parameters.
    "frontier-22b": dict(
        **_OLMO_VOCAB,
        hidden_size=6144,
        num_hidden_layers=48,
        num_attention_heads=48,
        intermediate_size=16384,
        num_experts=0,
        qk_norm=False,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "frontier-175b": dict(
        **_OLMO_VOCAB,
        hidden_size=12288,
        num_hidden_layers=96,
        num_attention_heads=96,
        intermediate_size=32768,
        num_experts=0,
        qk_norm=False,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "frontier-1t": dict(
        **_OLMO_VOCAB,
        hidden_size=25600,
        num_hidden_layers=128,
        num_attention_heads=200,
        intermediate_size=68288,
        num_experts=0,
        qk_norm=False,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    # CPU-sized models for tests, examples and the tiny pretraining run.
    "mula-tiny-dense": dict(
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        num_experts=0,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "mula-tiny-moe": dict(
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
    ),
}


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid MulaConfig: {message}")


class MulaConfig(PreTrainedConfig):
    r"""Configuration of a Mula decoder: dense when `num_experts == 0`, Mixture-of-Experts otherwise.

    Pre-norm layers, full-width QK-norm (optional), RoPE, GQA, SwiGLU; stacked experts (gate rows first).

    Args:
        norm_type: the non-QK norms, "rms_norm" (default; OLMoE) or "layer_norm" (OLMo); QK-norm is RMSNorm.
        norm_elementwise_affine: those norms learn a weight (LayerNorm also a bias); False: parameter-free.
        rms_norm_eps: the epsilon of every norm, LayerNorm included.
        num_experts: routed experts per MoE layer; 0 makes every layer dense.
        num_experts_per_tok: top-k.
        moe_intermediate_size: intermediate size of one expert.
        moe_layer_freq: layer i is MoE when `(i + 1) % moe_layer_freq == 0`; the others use `intermediate_size`.
        router_scoring_func: "softmax" (OLMoE, Mixtral) or "sigmoid" (DeepSeek-V3).
        norm_topk_prob: renormalise the k selected routing weights to sum to 1.
        router_aux_loss_coef: weight of the load-balancing loss added to the LM loss.
        router_z_loss_coef: weight of the router z-loss, likewise.
        router_aux_loss_scope: expert loads per rank's "micro_batch", or summed over DP ranks ("global_batch").
        router_aux_loss_type: "mula" (per layer, averaged; 1 at balance) or "transformers" (pooled; k at balance).
        moe_capacity_factor: None: dropless; else ceil(factor * tokens * k / experts) slots per expert and rank.
        router_bias_update_rate: > 0: DeepSeek-V3 loss-free balancing bias, moved by `update_router_bias()`.
    """

    model_type: ClassVar[str] = "mula"
    # Outputs the Trainer leaves out of predictions, so compute_metrics sees the logits first.
    keys_to_ignore_at_inference: ClassVar[list[str]] = [
        "cache",
        "past_key_values",
        "lm_loss",
        "aux_loss",
        "z_loss",
        "tokens_per_expert",
        "router_logits",
    ]
    attribute_map: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}
    # How Transformers' own tensor and expert parallelism (`from_pretrained(distributed_config=...)`)
    # shard the decoder. QK-norm normalises over the full q/k width, so q, k and v are gathered before
    # it; dense layers split their FFN as usual; experts split their intermediate size under TP
    # (`gate_up_proj` packs gate then up) and are dealt out whole under EP.
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "layers.*.self_attn.q_proj": "colwise_gather_output",
        "layers.*.self_attn.k_proj": "colwise_gather_output",
        "layers.*.self_attn.v_proj": "colwise_gather_output",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    base_model_ep_plan: ClassVar[dict[str, str]] = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    qk_norm: bool = True
    clip_qkv: float | None = None
    norm_type: str = "rms_norm"
    norm_elementwise_affine: bool = True
    # Mixture of Experts
    num_experts: int = 64
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1024
    moe_layer_freq: int = 1
    router_scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    router_bias_update_rate: float = 0.0
    router_aux_loss_scope: str = "micro_batch"
    router_aux_loss_type: str = "mula"
    moe_capacity_factor: float | None = None
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if (
            self.head_dim is None
            and all(isinstance(v, int) and v > 0 for v in (self.hidden_size, self.num_attention_heads))
            and self.hidden_size % self.num_attention_heads == 0
        ):
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)
        self.check()

    # -- validation --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise `ValueError` with a one-line message naming the first invalid field."""
        need = _need
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(
            self.hidden_size % self.num_attention_heads == 0 or self.head_dim is not None,
            f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
            f"({self.num_attention_heads}); set head_dim explicitly",
        )
        need(
            isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim must be a positive even integer (RoPE rotates pairs), got {self.head_dim!r}",
        )
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        need(
            isinstance(self.num_experts, int) and self.num_experts >= 0,
            f"num_experts must be an integer >= 0, got {self.num_experts!r}",
        )
        rate = self.router_bias_update_rate
        need(
            self.num_experts > 0 or not (_is_number(rate) and rate > 0),
            f"router_bias_update_rate {rate!r} needs MoE layers, but num_experts is 0 (nothing has a router bias)",
        )
        dense_layers = self.num_experts == 0 or not isinstance(self.moe_layer_freq, int) or self.moe_layer_freq > 1
        if dense_layers:
            need(
                isinstance(self.intermediate_size, int) and self.intermediate_size > 0,
                f"intermediate_size must be a positive integer, got {self.intermediate_size!r}",
            )
        if self.num_experts > 0:
            self._check_experts()
        need(
            self.hidden_act == "silu" or self.hidden_act in _known_activations(),
            f"hidden_act {self.hidden_act!r} is not a known activation",
        )
        need(
            _is_number(self.rms_norm_eps) and self.rms_norm_eps > 0,
            f"rms_norm_eps must be a number > 0, got {self.rms_norm_eps!r}",
        )
        need(
            self.norm_type in NORM_TYPES,
            f"norm_type must be one of {', '.join(map(repr, NORM_TYPES))}, got {self.norm_type!r}",
        )
        need(
            isinstance(self.norm_elementwise_affine, bool),
            f"norm_elementwise_affine must be true or false, got {self.norm_elementwise_affine!r}",
        )
        need(
            self.clip_qkv is None or (_is_number(self.clip_qkv) and self.clip_qkv > 0),
            f"clip_qkv must be None or a number > 0, got {self.clip_qkv!r}",
        )
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            need(
                value is None or (isinstance(value, int) and 0 <= value < self.vocab_size),
                f"{name} must be None or a token id below vocab_size ({self.vocab_size}), got {value!r}",
            )
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        need(rope_type in _known_rope_types(), f"rope_parameters: unknown rope_type {rope_type!r}")
        try:
            self.validate_rope()
        except (KeyError, ValueError, TypeError) as err:
            need(False, f"rope_parameters: {str(err).strip(chr(34)).splitlines()[0]}")

    def _check_experts(self) -> None:
        """The MoE fields' part of `check`."""
        need = _need
        need(
            isinstance(self.num_experts_per_tok, int) and self.num_experts_per_tok >= 1,
            f"num_experts_per_tok must be >= 1, got {self.num_experts_per_tok!r}",
        )
        need(
            self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok ({self.num_experts_per_tok}) is larger than num_experts ({self.num_experts})",
        )
        need(
            isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size > 0,
            f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size!r}",
        )
        need(
            isinstance(self.moe_layer_freq, int) and 1 <= self.moe_layer_freq <= self.num_hidden_layers,
            f"moe_layer_freq must be an integer in [1, num_hidden_layers={self.num_hidden_layers}], "
            f"got {self.moe_layer_freq!r}",
        )
        need(
            self.router_scoring_func in ("softmax", "sigmoid"),
            f"router_scoring_func must be 'softmax' or 'sigmoid', got {self.router_scoring_func!r}",
        )
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            value = getattr(self, name)
            need(_is_number(value) and value >= 0, f"{name} must be a number >= 0, got {value!r}")
        need(
            self.router_aux_loss_scope in ("micro_batch", "global_batch"),
            f"router_aux_loss_scope must be 'micro_batch' or 'global_batch', got {self.router_aux_loss_scope!r}",
        )
        need(
            self.router_aux_loss_type in ("mula", "transformers"),
            f"router_aux_loss_type must be 'mula' or 'transformers', got {self.router_aux_loss_type!r}",
        )
        factor = self.moe_capacity_factor
        need(
            factor is None or (_is_number(factor) and factor > 0),
            f"moe_capacity_factor must be None (dropless) or a number > 0, got {self.moe_capacity_factor!r}",
        )

    # -- derived -----------------------------------------------------------------------------
    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` uses routed experts (else the dense SwiGLU FFN)."""
        return self.num_experts > 0 and (layer_idx + 1) % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE decoder layers."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> MulaConfig:
        """Build the config of a named preset (see `PRESETS`), with keyword overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown Mula preset {name!r}; choose one of: {', '.join(PRESETS)}")
        values = copy.deepcopy(PRESETS[name])
        values.update(overrides)
        return cls(**values)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _known_rope_types() -> set[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return {"default", *ROPE_INIT_FUNCTIONS}


def _known_activations() -> set[str]:
    from transformers.activations import ACT2CLS

    return set(ACT2CLS)


__all__ = ["MulaConfig", "PRESETS"]

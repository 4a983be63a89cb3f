"""The dropless MoE layer: permute, grouped experts (optionally across ranks), combine.

`moe_experts_forward` is Transformers' ``"ds_optimus"`` experts implementation, Mula's default after `import
ds_optimus`; experts modules of Mula's layout (OLMoE, Qwen-MoE, Mixtral in Transformers 5) can use it too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..hf_models.mula.modeling_mula import MulaExperts
from .experts import get_backend, grouped_swiglu, select_backend
from .permute import RoutingPlan, permute_tokens, plan_routing, unpermute_combine

IMPLEMENTATION_NAME = "ds_optimus"


def uses_router_bias(model: nn.Module) -> bool:
    """Whether `model` (Mula) has a router bias to update once per optimizer step (`update_router_bias`)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "num_experts", 0)) and getattr(config, "router_bias_update_rate", 0.0) > 0


def declare_expert_attributes(module: nn.Module) -> nn.Module:
    """Give an experts module the attributes expert parallelism sets, at their defaults unless set; returns it."""
    state = vars(module)
    state.setdefault("num_local_experts", module.num_experts)
    state.setdefault("expert_parallel", None)
    state.setdefault("expert_groups", None)
    state.setdefault("experts_backend", None)
    return module


def _within_capacity(plan: RoutingPlan, top_k_index: torch.Tensor, capacity_factor: float):
    """Which sorted positions fit their expert's capacity (first come), and the clamped counts."""
    num_experts = plan.counts.numel()
    capacity = max(1, math.ceil(capacity_factor * plan.num_slots / num_experts))
    expert_of_sorted = top_k_index.reshape(-1).index_select(0, plan.order)
    starts = torch.cumsum(plan.counts, 0) - plan.counts
    position_in_expert = torch.arange(plan.num_slots, device=plan.order.device) - starts[expert_of_sorted]
    return position_in_expert < capacity, plan.counts.clamp(max=capacity)


def moe_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts of one MoE layer on `hidden_states [T, H]` routed by `top_k_index`/`top_k_weights [T, k]`.

    Dropless unless `config.moe_capacity_factor` is set; when sharded by `apply_expert_parallel`, tokens travel
    to their experts' ranks (all-to-all), once per destination rank with the deduplicated dispatcher.
    """
    config = self.config
    layout = {
        "has_gate": True,
        "is_concatenated": True,
        "is_transposed": False,
        "has_bias": False,
        "has_post_expert_norm": False,
    }
    wrong = [k for k, v in layout.items() if getattr(self, k, v) != v]
    if wrong:
        raise ValueError(
            f"the ds_optimus experts implementation does not support {type(self).__name__} "
            f"({', '.join(f'{k}={getattr(self, k)}' for k in wrong)})"
        )
    act = getattr(config, "hidden_act", "silu")
    if not isinstance(self, MulaExperts):
        declare_expert_attributes(self)  # e.g. OLMoE's experts, never seen by ds_optimus.parallel
    backend = self.experts_backend
    capacity_factor = getattr(config, "moe_capacity_factor", None)
    dispatcher = self.expert_parallel

    def experts(rows: torch.Tensor, rows_per_expert: torch.Tensor, gate_up=None, down=None) -> torch.Tensor:
        gate_up = self.gate_up_proj if gate_up is None else gate_up
        return grouped_swiglu(rows, gate_up, self.down_proj if down is None else down, rows_per_expert, act, backend)

    if dispatcher is not None and dispatcher.deduplicated:  # tokens travel, once per destination
        ids = top_k_index
        if capacity_factor is not None:  # the slots past an expert's capacity, as below, are dropped
            plan = plan_routing(top_k_index, self.num_experts)
            fits, _ = _within_capacity(plan, top_k_index, capacity_factor)
            kept = torch.empty_like(fits).index_put_((plan.order,), fits)  # by slot; no host synchronisation
            ids = ids.masked_fill(~kept.view_as(ids), -1)
        out = dispatcher(hidden_states, ids, top_k_weights, experts, (self.gate_up_proj, self.down_proj))
        return out.to(hidden_states.dtype)
    plan = plan_routing(top_k_index, self.num_experts)
    if dispatcher is None and capacity_factor is None:
        # A backend with a fused form does gather, experts and combine in one go.
        fused = get_backend(select_backend(hidden_states.device, hidden_states.dtype, backend)).fused
        out = fused(hidden_states, self.gate_up_proj, self.down_proj, plan, top_k_weights, act) if fused else None
        if out is not None:
            return out.to(hidden_states.dtype)
    x_sorted = permute_tokens(hidden_states, plan)
    counts = plan.counts
    keep = None
    if capacity_factor is not None:
        fits, counts = _within_capacity(plan, top_k_index, capacity_factor)
        keep = torch.nonzero(fits).squeeze(1)
        x_sorted = x_sorted.index_select(0, keep)

    y_sorted = experts(x_sorted, counts) if dispatcher is None else dispatcher(x_sorted, counts, experts)
    if keep is not None:  # dropped slots contribute nothing
        y_sorted = y_sorted.new_zeros(plan.num_slots, y_sorted.shape[-1]).index_copy(0, keep, y_sorted)
    return unpermute_combine(y_sorted, top_k_weights, plan).to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register `moe_experts_forward` with Transformers' experts interface as "ds_optimus"."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, moe_experts_forward)


class MoELayer(nn.Module):
    """A standalone MoE feed-forward layer: a Mula MoE block built from keyword arguments.

    `forward(x [..., H])` returns `(out, aux)`, `aux` holding router logits, chosen experts, losses and token counts.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring_func: str = "softmax",
        norm_topk_prob: bool = False,
        hidden_act: str = "silu",
        capacity_factor: float | None = None,
        initializer_range: float = 0.02,
        experts_backend: str | None = None,
        force_uniform_routing: bool = False,
    ) -> None:
        super().__init__()
        from ..hf_models.mula import MulaConfig
        from ..hf_models.mula.modeling_mula import MulaSparseMoeBlock

        config = MulaConfig(
            vocab_size=1,
            pad_token_id=None,
            eos_token_id=None,
            hidden_size=hidden_size,
            num_hidden_layers=1,
            num_attention_heads=1,
            head_dim=2,
            hidden_act=hidden_act,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=intermediate_size,
            router_scoring_func=scoring_func,
            norm_topk_prob=norm_topk_prob,
            moe_capacity_factor=capacity_factor,
        )
        config._experts_implementation = IMPLEMENTATION_NAME
        self.config = config
        self.block = MulaSparseMoeBlock(config)
        self.block.experts.experts_backend = experts_backend
        self.block.gate.force_uniform_routing = force_uniform_routing  # a benchmark mode: fixed, balanced experts
        with torch.no_grad():
            for p in (self.block.gate.weight, self.block.experts.gate_up_proj, self.block.experts.down_proj):
                p.normal_(0.0, initializer_range)

    @property
    def gate(self) -> nn.Module:
        return self.block.gate

    @property
    def experts(self) -> nn.Module:
        return self.block.experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from ..hf_models.mula.modeling_mula import router_losses

        out, router_logits, top_k_index = self.block(hidden_states)
        aux_loss, z_loss, counts = router_losses(
            (router_logits,), (top_k_index,), self.config.num_experts, self.config.router_scoring_func
        )
        return out, {
            "router_logits": router_logits,
            "top_k_index": top_k_index,
            "aux_loss": aux_loss,
            "z_loss": z_loss,
            "tokens_per_expert": counts[0],
        }

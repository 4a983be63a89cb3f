"""The dropless MoE layer: routing plans, token permutation, grouped experts backends, the layer; the router and its
losses come from the Mula model code.
"""

from ..hf_models.mula.modeling_mula import MulaTopKRouter as TopKRouter
from ..hf_models.mula.modeling_mula import router_losses
from .experts import available_backends, grouped_swiglu, register_backend, select_backend
from .layer import MoELayer, moe_experts_forward, register_experts_implementation
from .permute import RoutingPlan, permute_tokens, plan_routing, unpermute_combine

__all__ = [
    "MoELayer",
    "RoutingPlan",
    "TopKRouter",
    "available_backends",
    "grouped_swiglu",
    "moe_experts_forward",
    "permute_tokens",
    "plan_routing",
    "register_backend",
    "register_experts_implementation",
    "router_losses",
    "select_backend",
    "unpermute_combine",
]

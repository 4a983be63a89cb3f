"""Expert parallelism: DP/EP/EDP process groups, all-to-all dispatch/combine (flat and
hierarchical), sharding a model's experts, exporting a sharded model as one Hugging Face folder, and
DeepSpeed-ready param groups. Imports nothing of `ds_optimus.optim` (nor DeepSpeed)."""

from .dispatch import ExpertParallelDispatcher, all_to_all, all_to_all_autograd
from .expert_parallel import (
    apply_expert_parallel,
    expert_groups_of,
    expert_layouts,
    expert_parallel_modules,
    export_pretrained,
    full_state_dict,
    is_expert_param,
    moe_param_groups,
    setup_moe,
)
from .groups import (
    ExpertParallelGroups,
    LayoutError,
    check_layout,
    destroy_expert_parallel_groups,
    init_expert_parallel_groups,
)

__all__ = [
    "ExpertParallelDispatcher",
    "ExpertParallelGroups",
    "LayoutError",
    "all_to_all",
    "all_to_all_autograd",
    "apply_expert_parallel",
    "check_layout",
    "destroy_expert_parallel_groups",
    "expert_groups_of",
    "expert_layouts",
    "expert_parallel_modules",
    "export_pretrained",
    "full_state_dict",
    "init_expert_parallel_groups",
    "is_expert_param",
    "moe_param_groups",
    "setup_moe",
]

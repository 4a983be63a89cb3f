"""Expert, pipeline and tensor parallelism: building a model that holds only this rank's experts,
pipeline stage and part of each split weight (on the meta device first), TP/DP/EP/EDP and pipeline-stage
process groups (`groups`), the stages' split and schedules (`stages`, `pipeline`), the Megatron-style
split of a Mula model (`tensor_parallel`), all-to-all dispatch/combine (flat and hierarchical), sharding a model's
experts, exporting a sharded model as one Hugging Face folder, and DeepSpeed-ready param groups.
Imports nothing of `ds_optimus.optim` (nor DeepSpeed); names are imported on first use."""

from .._lazy import lazy_exports

__all__ = [
    "ExpertParallelDispatcher",
    "ExpertParallelGroups",
    "LayoutError",
    "all_to_all",
    "all_to_all_autograd",
    "apply_expert_parallel",
    "build_model",
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
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "build_model": ".build",
        **dict.fromkeys(("ExpertParallelDispatcher", "all_to_all", "all_to_all_autograd"), ".dispatch"),
        **dict.fromkeys(
            (
                "apply_expert_parallel",
                "expert_groups_of",
                "expert_layouts",
                "expert_parallel_modules",
                "export_pretrained",
                "full_state_dict",
                "is_expert_param",
                "moe_param_groups",
                "setup_moe",
            ),
            ".expert_parallel",
        ),
        **dict.fromkeys(
            (
                "ExpertParallelGroups",
                "LayoutError",
                "check_layout",
                "destroy_expert_parallel_groups",
                "init_expert_parallel_groups",
            ),
            ".groups",
        ),
    },
)

"""Expert, pipeline and tensor parallelism: rank-local model building (`build`), process groups (`groups`), pipeline
stages and schedules (`stages`, `pipeline`), `tensor_parallel`, expert dispatch (`dispatch`), and sharding and export
(`expert_parallel`). Imports nothing of `ds_optimus.optim` (nor DeepSpeed); names load on first use."""

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

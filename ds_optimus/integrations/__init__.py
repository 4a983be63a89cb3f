"""Every change ds_optimus makes to DeepSpeed, accelerate, Transformers and PyTorch, in one place.

`import ds_optimus` installs them as each library is imported, so that a config with an `optimus` section works under
`deepspeed.initialize`, the Hugging Face Trainer and `accelerate launch` alike. `PATCHES` lists each replaced
upstream callable with why and the signature it had; `tests/test_integrations.py` fails when one differs. A replaced
DeepSpeed method runs DeepSpeed's own code for an engine whose config has no `optimus` section and whose model holds
nothing of ds_optimus.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    target: str  # "module:Class.method" of the upstream callable that is replaced or wrapped
    signature: str  # its signature (inspect.signature) when the replacement was written
    written_against: str  # the upstream version
    why: str


DS = "deepspeed 0.19.8"
ACCELERATE = "accelerate 1.x"
ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"

PATCHES = (
    Patch(
        f"{ENGINE}._configure_expert_parallel",
        "(self, model, collect_sources=None)",
        DS,
        "apply optimus.moe / optimus.expert_parallel to the model the engine is given, reported as a module "
        "replacement so parameter lists and a client optimizer built before are re-pointed at the shards",
    ),
    Patch(
        f"{ENGINE}._configure_optimizer",
        "(self, client_optimizer, model_parameters)",
        DS,
        "split expert parameters of a client optimizer (the HF Trainer's) into DeepSpeed's moe param groups",
    ),
    Patch(
        f"{ENGINE}._take_model_step",
        "(self, lr_kwargs)",
        DS,
        "move a Mula router's bias after each optimizer step (auxiliary-loss-free balancing)",
    ),
    Patch(
        f"{ENGINE}._configure_distributed_model",
        "(self, model)",
        DS,
        "register the EP/EDP groups ds_optimus' experts declare and enable DeepSpeed's MoE gradient handling",
    ),
    Patch(
        f"{ENGINE}._configure_zero_optimizer",
        "(self, optimizer)",
        DS,
        "build the EP-aware sharded optimizer where ZeRO-1/2 would be built (optimus.sharded_optimizer)",
    ),
    Patch(
        f"{ENGINE}._configure_bf16_optimizer",
        "(self, optimizer)",
        DS,
        "build the EP-aware sharded optimizer where the BF16 optimizer would be built",
    ),
    Patch(
        f"{ENGINE}.save_checkpoint",
        "(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False)",
        DS,
        "write layout-independent checkpoints with the sharded optimizer; refuse DeepSpeed's own for "
        "expert-parallel models (they would hold one rank's experts for all)",
    ),
    Patch(
        f"{ENGINE}.load_checkpoint",
        "(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, "
        "load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None)",
        DS,
        "read them, on any layout",
    ),
    Patch(
        "deepspeed.ops.op_builder.builder:OpBuilder.jit_load",
        "(self, verbose=True)",
        DS,
        "say a JIT build in one line before its minutes start; ops kept per Python environment",
    ),
    Patch(
        "torch.utils.cpp_extension:FileBaton",
        "(lock_file_path, wait_seconds=0.1, warn_after_seconds=None) -> None",
        "torch 2.13",
        "record who holds an op's build lock, so that a lock left by a builder that died is taken "
        "over rather than waited on forever",
    ),
    *(
        Patch(
            f"deepspeed.accelerator.{cls}.get_op_builder",
            "(self, class_name)",
            DS,
            "find ds_optimus' op builders (MoERoutingBuilder) by class name, as DeepSpeed's own are found",
        )
        for cls in (
            "cpu_accelerator:CPU_Accelerator",
            "cuda_accelerator:CUDA_Accelerator",
            "xpu_accelerator:XPU_Accelerator",
        )
    ),
    Patch(
        "accelerate.utils.dataclasses:DeepSpeedPlugin.deepspeed_config_process",
        "(self, prefix='', mismatches=None, config=None, must_match=True, **kwargs)",
        ACCELERATE,
        'leave the optimus section out of accelerate\'s "auto" filling (it stops at values it has none for)',
    ),
    Patch(
        "accelerate.accelerator:Accelerator.get_state_dict",
        "(self, model, unwrap=True)",
        ACCELERATE,
        "gather every expert of an expert-parallel model (Trainer.save_model calls it on every rank)",
    ),
)

# Private state of DeepSpeed and PyTorch read or written (not replaced), each checked by the same test.
PRIVATE_STATE = (
    ("deepspeed.utils.groups", "_EXPERT_PARALLEL_GROUP", "register ds_optimus' expert groups by name"),
    ("deepspeed.utils.groups", "_EXPERT_PARALLEL_GROUP_RANKS", "register ds_optimus' expert groups by name"),
    ("deepspeed.utils.groups", "_EXPERT_DATA_PARALLEL_GROUP", "register ds_optimus' expert groups by name"),
    ("deepspeed.utils.groups", "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "register ds_optimus' expert groups by name"),
    ("deepspeed.ops.op_builder.all_ops", "ALL_OPS", "list ds_optimus' moe_routing op in ds_report"),
    ("deepspeed.git_version_info", "installed_ops", "report the moe_routing op installed where it was prebuilt"),
    ("deepspeed.runtime.config:DeepSpeedConfig", "gradient_clipping", "switch clipping after the warm-up"),
    (
        "torch.utils.cpp_extension:JIT_EXTENSION_VERSIONER",
        "entries",
        "build again an op whose first build attempt found a stale lock",
    ),
)

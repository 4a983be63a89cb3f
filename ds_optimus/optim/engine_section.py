"""`optimus.sharded_optimizer` settings, and `EngineSection`: the part of `optimus` DeepSpeed's engine applies."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..moe.experts import MoEConfig
from ..parallel.expert_parallel import ExpertParallelConfig
from ..schema import Section, need, positive_int


@dataclass(frozen=True)
class ShardedOptimizerConfig(Section):
    """The EP-aware sharded optimizer, in place of DeepSpeed's ZeRO-1/2 one (stage: `zero_optimization.stage`)."""

    enabled: bool = False  # the EP-aware sharded optimizer in place of DeepSpeed's ZeRO-1/2 optimizer
    bucket_size: int = 50_000_000  # elements per reduce-scatter / all-gather bucket
    # the gradient reduction's dtype on the wire (fp32 | bf16 | fp16; null: DeepSpeed's communication or
    # grad accumulation dtype); micro-batches add up in fp32 buckets whatever it is, cast only at the collective
    reduce_dtype: str | None = None
    # reduce buckets while the backward pass goes on; null: yes, except on gloo (CPU), where the
    # collectives' threads compete with the backward pass for the same cores
    overlap_comm: bool | None = None
    # hybrid sharding: ranks per shard group (state sharded inside one, replicated across them; dense
    # and expert state alike, a group of at most this many ranks stays whole); null: the whole group
    shard_group_size: int | None = None
    # all-gather the updated parameters while the next forward pass runs, each module waiting for its
    # own (holds a copy of the rank's weights until that forward takes it); false: at the step's end
    overlap_param_gather: bool = False

    def check(self, where: str) -> None:
        need(
            positive_int(self.bucket_size), f"{where}.bucket_size must be a positive integer, got {self.bucket_size!r}"
        )
        need(
            self.reduce_dtype in (None, "fp32", "bf16", "fp16"),
            f"{where}.reduce_dtype must be fp32, bf16, fp16 or null, got {self.reduce_dtype!r}",
        )
        need(
            self.shard_group_size is None or positive_int(self.shard_group_size),
            f"{where}.shard_group_size must be a positive integer or null, got {self.shard_group_size!r}",
        )
        unused = [k for k in ("shard_group_size", "overlap_param_gather") if getattr(self, k) not in (None, False)]
        need(
            self.enabled or not unused,
            f"{where}.{(unused or [''])[0]} is set but {where}.enabled is false: "
            "DeepSpeed's ZeRO optimizer would run without it; enable the sharded optimizer or drop the setting",
        )


# What `python -m ds_optimus.train` reads and `deepspeed.initialize` cannot apply: such a key in a config
# that reaches the engine another way (the Hugging Face Trainer, accelerate, a script) is refused.
ENTRY_POINT_KEYS = (
    "model",
    "data",
    "train",
    "checkpoint",
    "wandb",
    "guards",
    "watchdog",
    "eval",
    "pipeline_parallel",
    "tensor_parallel",
    "profile",
)


@dataclass(frozen=True)
class EngineSection(Section):
    """The part of `optimus` that DeepSpeed's engine applies itself, however `deepspeed.initialize` is reached."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    sharded_optimizer: ShardedOptimizerConfig = field(default_factory=ShardedOptimizerConfig)

    @classmethod
    def of(cls, section: Any) -> EngineSection:
        """The engine's part of an `optimus` dict; a key only the training entry point reads is a ConfigError."""
        need(isinstance(section, dict), f"optimus must be a JSON object, got {type(section).__name__}")
        for key in section:
            need(
                key not in ENTRY_POINT_KEYS,
                f"optimus.{key} is read by `python -m ds_optimus.train` only; deepspeed.initialize (the "
                f"Hugging Face Trainer, accelerate) applies optimus.{', optimus.'.join(f.name for f in fields(cls))}: "
                "remove the others (ds_optimus.train.hf_trainer.trainer_ds_config does)",
            )
        return cls.parse(section, "optimus")


def engine_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `ds_config` whose `optimus` keeps only what the engine applies."""
    config = dict(ds_config)
    section = config.get("optimus")
    if isinstance(section, dict):
        config["optimus"] = {k: v for k, v in section.items() if k not in ENTRY_POINT_KEYS}
    return config

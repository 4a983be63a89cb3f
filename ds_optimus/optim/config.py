"""`optimus.sharded_optimizer`: the settings of the EP-aware sharded optimizer (`sharded.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import Section, check_flags, need, positive_int


@dataclass(frozen=True)
class ShardedOptimizerConfig(Section):
    """The EP-aware sharded optimizer (`ds_optimus.optim`), in place of DeepSpeed's ZeRO stage 1/2
    optimizer; the stage is DeepSpeed's `zero_optimization.stage`."""

    enabled: bool = False
    bucket_size: int = 50_000_000  # elements per reduce-scatter / all-gather bucket
    reduce_dtype: str | None = None  # fp32 | bf16 | fp16; null: DeepSpeed's grad accumulation dtype
    # reduce buckets while the backward pass goes on; null: yes, except on gloo (CPU), where the
    # collectives' threads compete with the backward pass for the same cores
    overlap_comm: bool | None = None

    def check(self, where: str) -> None:
        check_flags(self, where, "enabled")
        need(positive_int(self.bucket_size),
             f"{where}.bucket_size must be a positive integer, got {self.bucket_size!r}")
        need(self.reduce_dtype in (None, "fp32", "bf16", "fp16"),
             f"{where}.reduce_dtype must be fp32, bf16, fp16 or null, got {self.reduce_dtype!r}")
        need(self.overlap_comm is None or isinstance(self.overlap_comm, bool),
             f"{where}.overlap_comm must be true, false or null, got {self.overlap_comm!r}")

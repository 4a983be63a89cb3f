"""The trainer's pipeline-parallel path (`optimus.pipeline_parallel.size` > 1): each rank builds its
stage's part of the model, DeepSpeed's engine runs its optimizer over the stage's data-parallel ranks,
and a step is one run of PyTorch's pipeline schedule over the step's micro-batches, during whose drain
the sharded optimizer reduces each stage's gradients, then steps (`ds_optimus.parallel.pipeline`).

Why PyTorch's pipelining and not DeepSpeed's pipeline engine: it takes the model's own modules as
stages (DeepSpeed's wants the network re-expressed as a `PipelineModule` of layer specs, a second
model definition), it has the interleaved and looped schedules besides 1F1B, and it leaves the
optimizer to the caller, so the EP-aware sharded optimizer stays DeepSpeed's ZeRO optimizer as
without stages (DeepSpeed's pipeline engine refuses ZeRO-2 and knows nothing of expert groups).
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.stages import check_pipeline  # noqa: F401  (the trainer's: one-line errors, as --check's)


class PipelineRunner:
    """This rank's chunks of the model and the schedule that runs them; `step` trains one step's
    micro-batches, `evaluate` gives the LM loss of a batch (on the rank with the last chunk)."""

    def __init__(self, opt, groups, model, split: list[range], micro: int, accumulation: int) -> None:
        from ..parallel.pipeline import StageChunk

        pipeline, self.dp_group = groups.pipeline, groups.dp_group
        self.tensor, self.sequence = opt.tensor_parallel.size, opt.tensor_parallel.sequence_parallel
        self.config, self.pipeline, self.accumulation, self.split = opt.pipeline_parallel, pipeline, accumulation, split
        self.micro, self.seq_len = micro, opt.data.seq_len
        self.total = len(split)
        self.chunks = [
            (c, StageChunk(model, layers, c == 0, c == self.total - 1))
            for c, layers in enumerate(split)
            if self.config.stage_of(c) == pipeline.stage
        ]
        # the rank with the first chunk feeds the inputs, the one with the last scores them (both the first
        # stage under the V-shaped schedules)
        self.first, self.last = any(c == 0 for c, _ in self.chunks), any(c == self.total - 1 for c, _ in self.chunks)
        self.schedule = self.loss = None

    @staticmethod
    def stage_part(opt, split: list[range], stage: int) -> tuple[list[int], bool, bool]:
        """(decoder layers, has the embedding, has the head) of pipeline stage `stage`."""
        mine = [c for c in range(len(split)) if opt.pipeline_parallel.stage_of(c) == stage]
        return [i for c in mine for i in split[c]], 0 in mine, len(split) - 1 in mine

    def describe(self) -> str:
        """One line for the run's log: stages, schedule, micro-batches and the layers of each chunk."""
        config = self.config
        chunks = f" x {config.virtual_stages} chunks" if config.virtual_stages > 1 else ""
        return (
            f"pipeline: {config.size} stages{chunks}, {config.schedule} over {self.accumulation} micro-batches; "
            f"decoder layers per chunk {'/'.join(str(len(r)) for r in self.split)} (the first chunk also "
            "embeds, the last has the head)"
        )

    def attach(self, engine) -> None:
        """Build the schedule over the engine's module (after DeepSpeed has cast and placed it)."""
        from ..parallel.pipeline import PipelineLoss, build_schedule, each_micro_batch_reduction

        self.engine = engine
        sequence = self.tensor if self.sequence else 1  # each TP rank's router losses are its tokens'
        self.loss = PipelineLoss(engine.module, self.accumulation, group=self.dp_group, router_share=1 / sequence)
        # the step's gradients add up in fp32 buckets, reduced in the drain; ZeRO-2 over one chunk per rank
        # reduces each micro-batch's instead
        engine.optimizer.defer_reduction = not each_micro_batch_reduction(engine.optimizer, self.config)
        self.schedule = build_schedule(
            self.chunks,
            self.config,
            self.pipeline,
            self.accumulation,
            self.loss,
            engine.device,
            self.micro,
            self.seq_len,
            optimizer=engine.optimizer,
        )

    def step(self, batch: torch.Tensor, parts: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward passes of the step's micro-batches (`batch`: all of them, in order), their
        gradients reduced into the optimizer's shards. Adds the mean of the micro-batches' loss parts
        (`LOSS_PARTS`; the last chunk's rank's, zero on the others) to `parts`, and returns the step's token slots
        per MoE layer and expert (zero except on the last chunk's rank; None for a dense model)."""
        from ..parallel.pipeline import run_schedule
        from .metrics import LOSS_PARTS

        optimizer = self.engine.optimizer
        self.loss.records.clear()
        optimizer.set_gradient_accumulation_boundary(False)
        run_schedule(self.schedule, batch, self.first, self.last)
        optimizer.finalize_gradient_accumulation_boundary()
        config, loads = self.engine.module.config, None
        if config.num_experts:  # the same shape on every rank: the step's one all-reduce adds them
            loads = torch.zeros(len(config.moe_layers), config.num_experts, device=parts.device)
        for record in self.loss.records:
            zero = torch.zeros((), dtype=parts.dtype, device=parts.device)
            parts += (
                torch.stack([zero if record[k] is None else record[k].to(parts.dtype) for k in LOSS_PARTS])
                / self.accumulation
            )
            if record["tokens_per_expert"] is not None:
                loads += record["tokens_per_expert"].float()
        return loads

    def evaluate(self, batch: torch.Tensor) -> torch.Tensor | None:
        """The LM loss of `batch` (the last chunk's rank's; None on the others). Collective over the pipeline."""
        from ..parallel.pipeline import forward_only

        self.loss.records.clear()
        return forward_only(self.chunks, self.pipeline, self.config, batch, self.loss)


def engine_batch_config(ds_config: dict[str, Any], micro: int, accumulation: int) -> dict[str, Any]:
    """The engine's view of the batch: the schedule feeds it the step's micro-batches at once, so one
    "micro-batch" of micro x accumulation sequences and no accumulation of its own."""
    return {**ds_config, "train_micro_batch_size_per_gpu": micro * accumulation, "gradient_accumulation_steps": 1}

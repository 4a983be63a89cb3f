"""The pipeline's train module: a step is one run of PyTorch's pipeline schedule over this rank's chunks."""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.stages import check_pipeline  # noqa: F401  (the trainer's: one-line errors, as --check's)


# PyTorch's pipelining, not DeepSpeed's pipeline engine: it takes the model's own modules as stages, has the
# interleaved schedules, and leaves us the optimizer (DeepSpeed's refuses ZeRO-2 and knows no expert groups)
class PipelineTrainModule:
    """This rank's chunks of the model and the schedule that runs them (`train_module.TrainModule`'s methods)."""

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
        """One line for the run's log."""
        config = self.config
        chunks = f" x {config.virtual_stages} chunks" if config.virtual_stages > 1 else ""
        return (
            f"pipeline: {config.size} stages{chunks}, {config.schedule} over {self.accumulation} micro-batches; "
            f"decoder layers per chunk {'/'.join(str(len(r)) for r in self.split)} (the first chunk also "
            "embeds, the last has the head)"
        )

    def engine_config(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """The engine's batch config: the step's micro-batches as one, no accumulation."""
        return {
            **ds_config,
            "train_micro_batch_size_per_gpu": self.micro * self.accumulation,
            "gradient_accumulation_steps": 1,
        }

    def attach(self, engine) -> None:
        """Build the schedule over the engine's module (once DeepSpeed has placed it)."""
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

    def forward_backward(self, batches: list[torch.Tensor], parts: torch.Tensor, phase) -> torch.Tensor | None:
        """The step's micro-batches through the schedule (the update left to the trainer); add their mean
        `LOSS_PARTS` to `parts`, return token slots per MoE layer and expert (None if dense); both zero but
        on the last chunk's rank."""
        from ..parallel.pipeline import run_schedule
        from .metrics import LOSS_PARTS

        with phase("pipeline"):  # the schedule, the drain's reductions, the records: one phase
            optimizer = self.engine.optimizer
            self.loss.records.clear()
            optimizer.set_gradient_accumulation_boundary(False)
            run_schedule(self.schedule, torch.cat(batches), self.first, self.last)
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

    def eval_loss(self, batch: torch.Tensor) -> torch.Tensor | float:
        """The LM loss of `batch` on the last chunk's rank (0.0 elsewhere); collective over the pipeline."""
        from ..parallel.pipeline import forward_only

        self.loss.records.clear()
        loss = forward_only(self.chunks, self.pipeline, self.config, batch, self.loss)
        return loss.float() if loss is not None else 0.0

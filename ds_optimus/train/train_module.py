"""What trains the model on a rank: the engine, a step's forward and backward passes, and the held-out loss.

The trainer keeps the loop, the data and the step's one reduction; the train module keeps the model.
`TrainModule` runs the micro-batches one after another; with pipeline stages the trainer takes
`pipelined.PipelineTrainModule` instead, which runs them through the schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.tensor_parallel import sequence_router_share
from .metrics import LOSS_PARTS


class TrainModule:
    """The micro-batches one after another: forward, backward and the engine's step for each."""

    chunks = None  # the pipeline's: this rank's (index, chunk of layers) pairs

    def __init__(self, sequence: bool = False, tp: int = 1) -> None:
        self.sequence, self.tp = sequence, tp  # under sequence parallelism a rank's router losses are 1/T
        self.engine = None

    def engine_config(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """The DeepSpeed config the engine is built from."""
        return ds_config

    def attach(self, engine) -> None:
        self.engine = engine

    def describe(self) -> str | None:
        """A line for the run's log, or None."""
        return None

    def forward_backward(self, batches: list[torch.Tensor], parts: torch.Tensor, phase) -> torch.Tensor | None:
        """Forward and backward of every micro-batch, the engine's step after each but the last (the
        update, which the trainer calls after the step's reduction); adds their mean `LOSS_PARTS` to
        `parts`, returns token slots per MoE layer and expert (None if dense)."""
        engine, loads = self.engine, None
        for micro, batch in enumerate(batches):
            with phase("forward"):
                out = engine(input_ids=batch, labels=batch, use_cache=False)  # training keeps no KV cache
            parts += torch.stack([_loss_part(out, key, parts.dtype) for key in LOSS_PARTS]) / len(batches)
            if out.tokens_per_expert is not None:
                counts = out.tokens_per_expert.detach().float()
                loads = counts if loads is None else loads + counts
            loss = out.loss
            if self.sequence and out.aux_loss is not None:  # this rank's tokens' router losses: 1/T of them
                loss = sequence_router_share(out.loss, out.lm_loss, self.tp)
            with phase("backward"):
                engine.backward(loss)
            if micro < len(batches) - 1:
                with phase("optimizer"):  # before the last micro-batch's, next to nothing
                    engine.step()
        return loads

    def eval_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's held-out LM loss of `batch`."""
        return self.engine(input_ids=batch, labels=batch, use_cache=False).lm_loss.float()


def _loss_part(out, key: str, dtype: torch.dtype) -> torch.Tensor:
    value = getattr(out, key, None)
    if value is None:  # a dense model has no router losses
        return torch.zeros((), dtype=dtype, device=out.loss.device)
    return value.detach().to(dtype)

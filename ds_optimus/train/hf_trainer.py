"""What the Hugging Face `Trainer` needs beyond `import ds_optimus`, which hooks DeepSpeed's engine
(docs/hf-trainer.md)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainerCallback


def trainer_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a `ds_optimus.train` DeepSpeed config (a dict or a path) for `TrainingArguments(deepspeed=...)`, its
    optimizer, scheduler and batch sizes left to the Trainer."""
    from ..config import load_json_config
    from ..optim.engine_section import engine_ds_config

    config = engine_ds_config(load_json_config(ds_config))
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config.update(
        train_batch_size="auto",
        train_micro_batch_size_per_gpu="auto",
        gradient_accumulation_steps="auto",
        gradient_clipping="auto",
    )
    if "bf16" in config:
        config["bf16"]["enabled"] = "auto"
    return config


class RouterBiasUpdate(TrainerCallback):
    """Moves each MoE router's bias towards balance after every optimizer step under the Trainer without DeepSpeed
    (with it, the engine does)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedType

        from ..moe.layer import uses_router_bias

        if getattr(AcceleratorState(), "distributed_type", None) == DistributedType.DEEPSPEED:
            return  # DeepSpeed's engine, hooked by ds_optimus, updates the bias in its step
        model = getattr(model, "module", model)  # DDP wraps the model
        if model is not None and uses_router_bias(model):
            model.update_router_bias()


class MulaTrainer(Trainer):
    """`transformers.Trainer` with `RouterBiasUpdate`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not any(isinstance(c, RouterBiasUpdate) for c in self.callback_handler.callbacks):
            self.add_callback(RouterBiasUpdate())


class PackedSequences(torch.utils.data.Dataset):
    """The run's sequences as Trainer examples (`input_ids`, `labels`): example i is the loader's i-th global sample."""

    def __init__(self, data, seq_len: int, seed: int = 0) -> None:
        from ..data.loader import TokenBatches

        self.loader = TokenBatches(data, seq_len, 1, seed=seed, shuffle=False)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.loader.num_sequences

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.loader.sample(index)
        return {"input_ids": ids, "labels": ids}

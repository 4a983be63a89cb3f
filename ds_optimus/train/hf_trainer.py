"""What the Hugging Face `Trainer` still needs from ds_optimus beyond `import ds_optimus`.

With DeepSpeed on (`TrainingArguments(deepspeed=...)`), a plain `transformers.Trainer` needs
nothing from here: `import ds_optimus` hooks DeepSpeed's engine, which applies the config's
`optimus` section (`moe`, `expert_parallel`, `sharded_optimizer`) to the model it is given, puts
expert parameters in DeepSpeed's `moe` param groups (from the Trainer's own optimizer or from the
flat parameter list it passes with an "optimizer" section), moves a Mula router's bias after each
optimizer step, and makes `Trainer.save_model` gather every expert (see
`ds_optimus.integrations.deepspeed_engine`). What is left here:

- `trainer_ds_config(ds_config)`: a config of `python -m ds_optimus.train` made fit for the Trainer
  (its training-only `optimus` keys, "optimizer" and "scheduler" dropped, batch sizes "auto");
- `RouterBiasUpdate`: the router-bias update for runs without DeepSpeed (single process, DDP),
  which `MulaTrainer` adds itself;
- `PackedSequences`: a packed token file as Trainer examples.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainerCallback


def trainer_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a `ds_optimus.train` DeepSpeed config (a dict or a path) for
    `TrainingArguments(deepspeed=...)`: the `optimus` keys the engine applies stay (`moe`,
    `expert_parallel`, `sharded_optimizer`), the Trainer's arguments fill the optimizer, scheduler
    and batch sizes ("auto")."""
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
    """Auxiliary-loss-free balancing under the Hugging Face `Trainer` without DeepSpeed: after every
    optimizer step, each MoE router's bias moves towards balance from the loads counted since the
    last step, summed over all ranks (`MulaForCausalLM.update_router_bias`: one all-reduce, no host
    sync). With DeepSpeed the engine does it (this callback then does nothing), and models without a
    router bias are left alone."""

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
    """`transformers.Trainer` that moves a Mula router's bias after each optimizer step also without
    DeepSpeed (`RouterBiasUpdate`). With DeepSpeed a plain `Trainer` does the same."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not any(isinstance(c, RouterBiasUpdate) for c in self.callback_handler.callbacks):
            self.add_callback(RouterBiasUpdate())


class PackedSequences(torch.utils.data.Dataset):
    """The run's sequences as Trainer examples (`input_ids`, `labels`): example i is the loader's
    i-th global sample, drawn from the sources by their weights (the Trainer's sampler then
    shuffles the indices); one epoch is as many samples as the sources hold sequences."""

    def __init__(self, data, seq_len: int, seed: int = 0) -> None:
        from ..data.loader import TokenBatches

        self.loader = TokenBatches(data, seq_len, 1, seed=seed, shuffle=False)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.loader.num_sequences

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.loader.sample(index)
        return {"input_ids": ids, "labels": ids}

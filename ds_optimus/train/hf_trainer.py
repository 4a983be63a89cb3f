"""The Mula model, expert parallelism and MoE param groups under the Hugging Face `Trainer`.

With DeepSpeed on, the Trainer discards an optimizer instance passed to it and builds DeepSpeed's
optimizer from a flat parameter list when the DeepSpeed config has an "optimizer" section, which
breaks expert parallelism (DeepSpeed needs expert parameters in their own `moe` groups). So:

- `trainer_ds_config(ds_config)` drops the "optimizer", "scheduler" and "optimus" sections and
  lets the Trainer fill batch sizes ("auto");
- `MulaTrainer.create_optimizer` builds AdamW over `moe_param_groups` (what the Trainer's
  DeepSpeed integration calls when the config has no optimizer), with the Trainer's lr, betas,
  eps and weight decay (none on norms and biases);
- `prepare_model(model, ds_config)` applies the `optimus` MoE settings and expert parallelism;
  call it after creating `TrainingArguments` (which initialises torch.distributed);
- `RouterBiasUpdate` moves a Mula model's router bias (auxiliary-loss-free balancing,
  `router_bias_update_rate > 0`) once per optimizer step; `MulaTrainer` adds it itself, a plain
  `Trainer` takes it in `callbacks=[...]`.

With `optimus.sharded_optimizer` enabled in the config, DeepSpeed's engine runs ds_optimus' EP-aware
sharded optimizer (nothing to call: `import ds_optimus` hooks the engine), and the Trainer's
checkpoints go through it (`checkpoint-N/global_stepN/`, loadable on another layout). With expert
parallelism, `MulaTrainer.save_model` gathers the experts from their ranks (collective, as the
Trainer calls it on every rank); DeepSpeed's own optimizers cannot checkpoint an EP model, so use
the sharded optimizer or `save_strategy="no"` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback


def trainer_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ds_optimus DeepSpeed config for `TrainingArguments(deepspeed=...)` (the `optimus`
    section stays: DeepSpeed's engine reads `optimus.sharded_optimizer` from it)."""
    from ..config import load_json_config

    config = load_json_config(ds_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto",
                  gradient_accumulation_steps="auto", gradient_clipping="auto")
    if "bf16" in config:
        config["bf16"]["enabled"] = "auto"
    return config


def prepare_model(model: torch.nn.Module, ds_config):
    """Apply the config's `optimus.moe` and `optimus.expert_parallel` settings to `model` (a
    DeepSpeed config as a dict or path, or its already parsed `OptimusConfig`); returns the EP groups
    (None without expert parallelism)."""
    from ..config import OptimusConfig
    from ..parallel.expert_parallel import setup_moe

    opt = ds_config if isinstance(ds_config, OptimusConfig) else OptimusConfig.from_ds_config(ds_config)
    return setup_moe(model, opt)


class MulaTrainer(Trainer):
    """`transformers.Trainer` whose optimizer keeps expert parameters in DeepSpeed's MoE groups and
    whose saved models hold every expert."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(_ReleaseSharedMemory())
        if not any(isinstance(c, RouterBiasUpdate) for c in self.callback_handler.callbacks):
            self.add_callback(RouterBiasUpdate())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        from ..parallel.expert_parallel import expert_groups_of

        groups = expert_groups_of(self.model)
        if groups is None:
            return super().save_model(output_dir, _internal_call)
        from .components import export

        export(self.accelerator.unwrap_model(self.model_wrapped), self.processing_class,
               Path(output_dir or self.args.output_dir), groups)

    def create_optimizer(self, model=None):
        from ..parallel.expert_parallel import moe_param_groups

        if self.optimizer is None:
            args = self.args
            groups = moe_param_groups(model or self.model, weight_decay=args.weight_decay)
            self.optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                               eps=args.adam_epsilon)
        return self.optimizer


class _ReleaseSharedMemory(TrainerCallback):
    """Once DeepSpeed's engine exists, drop the name of its CPU shared-memory workspace (see
    `release_shm_workspace`), so that runs do not fill /dev/shm."""

    def on_train_begin(self, args, state, control, **kwargs):
        from .components import release_shm_workspace

        release_shm_workspace()


class RouterBiasUpdate(TrainerCallback):
    """Auxiliary-loss-free balancing under the Hugging Face `Trainer`: after every optimizer step,
    each MoE router's bias moves towards balance from the loads counted since the last step, summed
    over all ranks (`MulaForCausalLM.update_router_bias`: one all-reduce, no host sync). Does
    nothing for models without a router bias."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from .callbacks.router_bias import uses_router_bias

        model = getattr(model, "module", model)  # the DeepSpeed engine wraps the model
        if model is not None and uses_router_bias(model):
            model.update_router_bias()


class PackedSequences(torch.utils.data.Dataset):
    """Fixed-length sequences of a packed token file as Trainer examples (`input_ids`, `labels`)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from ..data.loader import sequence

        ids = sequence(self.tokens, self.seq_len, index)
        return {"input_ids": ids, "labels": ids}


def save_model(trainer: Trainer, folder: str | Path, groups=None, tokenizer=None) -> None:
    """Save the trained model (and `tokenizer`) as an HF folder. With expert parallelism (`groups`
    from `prepare_model`) it is collective: every rank calls it, the experts are gathered."""
    from .components import export

    export(trainer.accelerator.unwrap_model(trainer.model_wrapped), tokenizer, Path(folder), groups)

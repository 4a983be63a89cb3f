"""The baseline of train_throughput.py, run on every rank by the deepspeed launcher: Transformers'
`Trainer` training `OlmoeForCausalLM` (Transformers' own MoE, its default experts implementation)
with a DeepSpeed config, on the same packed tokens. Writes per-step times to --out (rank 0)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import OlmoeConfig, OlmoeForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ds_optimus.data.shards import folder_stream
from ds_optimus.train.hf_trainer import PackedSequences, trainer_ds_config


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = []
        self.began = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True, help="OlmoeConfig as JSON")
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--experts-implementation", default=None, help="default: Transformers' choice")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    config = json.loads(open(args.config).read())
    optimizer = config["optimizer"]["params"]
    training_args = TrainingArguments(
        output_dir=args.out + ".run",
        deepspeed=trainer_ds_config(config),
        max_steps=args.steps,
        per_device_train_batch_size=config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=config.get("gradient_accumulation_steps", 1),
        learning_rate=optimizer["lr"],
        weight_decay=optimizer.get("weight_decay", 0.0),
        max_grad_norm=config.get("gradient_clipping", 1.0),
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        disable_tqdm=True,
        seed=0,
        bf16=bool(config.get("bf16", {}).get("enabled")),  # must agree with the DeepSpeed config's
    )
    torch.manual_seed(0)
    # Initialised on this rank's GPU where there is one (billions of parameters drawn on the CPU take
    # minutes); the Trainer would move it there anyway, so its steps are the same either way.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = OlmoeForCausalLM(OlmoeConfig(**json.loads(args.model)))
    if args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)
    timer = StepTimes()
    trainer = Trainer(
        model=model,
        args=training_args,
        callbacks=[timer],
        train_dataset=PackedSequences(folder_stream(args.data), args.seq_len),
    )
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        impl = getattr(model.config, "_experts_implementation", None)
        json.dump({"step_seconds": timer.times, "losses": losses, "experts_implementation": impl}, open(args.out, "w"))
    # Joined here rather than at interpreter exit: a gloo worker thread that frees the last reference to
    # an asynchronous work while Python finalizes aborts the process ("terminate called without an
    # active exception"), as the sharded optimizer once did.
    del trainer
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain `transformers.Trainer` script with one added `import ds_optimus`, run by
tests/test_hf_engine.py through the `deepspeed` launcher and `accelerate launch`: the DeepSpeed
config's `optimus` section alone gives expert parallelism, the MoE param groups, the sharded
optimizer and a complete saved folder.

    python hf_trainer_script.py OUT_DIR [DS_CONFIG_JSON]   (no DS_CONFIG_JSON: accelerate's plugin)
    python hf_trainer_script.py OUT_DIR --one-process      (the reference: no DeepSpeed, one process)

Each rank writes OUT_DIR/rank<R>.json (what it saw during training) and OUT_DIR/rank<R>.pt (its
expert weights after training). The reference trains the same batches: the two ranks' batches of 4
are its two micro-batches of 4 (the sampler's one permutation, dealt out batch by batch), each with
its own router losses as each rank has, and the router bias moved after each optimizer step, as the
engine moves it."""

import json
import os
import pydoc_data.topics
import sys

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import ds_optimus  # noqa: F401  (the one line a Transformers script adds)
from ds_optimus.data import load_tokenizer
from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
from ds_optimus.train.hf_trainer import PackedSequences

given = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
one_process = "--one-process" in given
given = [a for a in given if a != "--one-process"]
out, ds_config = given[0], (given[1] if len(given) > 1 else None)
rank = int(os.environ.get("RANK", "0"))
tokenizer = load_tokenizer()
text = "\n".join(pydoc_data.topics.topics.values())[:40_000]
tokens = np.asarray(tokenizer(text)["input_ids"], dtype=np.uint16)
torch.manual_seed(0)  # the same initial weights on every rank
model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", router_bias_update_rate=0.01))
seen = {"expert_rows": [], "optimizer": None, "moe_groups": 0, "bias": [], "pending": []}
if one_process:  # where training starts from, to measure how far it went
    os.makedirs(out, exist_ok=True)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}, f"{out}/init.pt")


class Watch(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        experts = model.model.layers[0].mlp.experts
        seen["expert_rows"].append(experts.gate_up_proj.shape[0])
        gate = model.model.layers[0].mlp.gate  # the engine moves the bias (no callback here)
        seen["bias"].append(float(gate.expert_bias.abs().sum()))
        seen["pending"].append(float(gate.load_since_update.sum()))
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the engine's
        seen["optimizer"] = type(inner).__name__
        seen["moe_groups"] = sum(1 for g in inner.param_groups if g.get("moe"))

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if one_process:  # without DeepSpeed's engine nothing moves the bias: as the engine does, here
            model.update_router_bias()


args = TrainingArguments(
    output_dir=f"{out}/run",
    deepspeed=ds_config,
    use_cpu=True,
    max_steps=12,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2 if one_process else 1,
    learning_rate=3e-3,
    warmup_steps=2,
    logging_steps=1,
    report_to=[],
    save_strategy="steps",
    save_steps=12,
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=PackedSequences(tokens, 64), callbacks=[Watch()])
trainer.train()
trainer.save_model(f"{out}/hf")  # every rank, as the Trainer itself does
seen["losses"] = [r["loss"] for r in trainer.state.log_history if "loss" in r]
seen["world"] = int(os.environ.get("WORLD_SIZE", "1"))
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(seen, f)
torch.save({n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}, f"{out}/rank{rank}.pt")

"""Pretrain a Mula model with a plain Hugging Face `Trainer` and DeepSpeed, from the same config as
the `ds_optimus.train` entry point (its `optimus` section gives the model, data, steps, seed and
output folder; DeepSpeed's engine applies its expert parallelism and sharded optimizer; the
optimizer settings come from its "optimizer" section):

    deepspeed --num_gpus 2 --module ds_optimus.train.hf_example --config ds_configs/mula-tiny-moe-cpu.json

Writes `<output_dir>/hf-trainer/` (the model and tokenizer) and `trainer_summary.json` (losses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

NAME = "ds_optimus.train.hf_example"


def main(argv: list[str] | None = None) -> int:
    from ds_optimus.command_line import ArgumentParser, fail

    parser = ArgumentParser(
        NAME,
        launched=True,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pretrain a Mula model with a plain Hugging Face Trainer and DeepSpeed, from the same config as\n"
        "`python -m ds_optimus.train` (its optimus section gives the model, data, steps, seed and output\n"
        "folder; DeepSpeed's engine applies expert parallelism and the sharded optimizer).",
        epilog="example:\n  deepspeed --num_gpus 2 --module ds_optimus.train.hf_example --config "
        "ds_configs/mula-tiny-moe-cpu.json\n\nwrites <output_dir>/hf-trainer/ (model and tokenizer) and "
        "<output_dir>/trainer_summary.json (losses)",
    )
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config with an optimus section")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, dotted (repeatable)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="let DeepSpeed, Transformers and wandb print what they print (default: their errors only)",
    )
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from ds_optimus.verbosity import quiet_libraries

    quiet_libraries(args.verbose)

    import torch
    from transformers import Trainer, TrainingArguments, default_data_collator

    import ds_optimus  # noqa: F401
    from ds_optimus.config import OptimusConfig, resolve_batch_sizes, resolve_schedule
    from ds_optimus.data import DataError, load_tokenizer
    from ds_optimus.launch import adopt
    from ds_optimus.schema import ConfigError, apply_overrides, load_json_config
    from ds_optimus.train.data_setup import prepare_everywhere
    from ds_optimus.train.hf_trainer import PackedSequences, trainer_ds_config

    try:
        config = apply_overrides(load_json_config(args.config), args.overrides)
        opt = OptimusConfig.from_ds_config(config)
        from ds_optimus.integrations.deepspeed_config import check_config_keys
        from ds_optimus.integrations.deepspeed_ops import prepare_op_builds

        check_config_keys(config)
        prepare_op_builds()  # before the Trainer's accelerate starts DeepSpeed's communication
        world = adopt().size  # torch's variables from any launcher (mpiexec, srun, ...), which accelerate reads
        micro, accumulation = resolve_batch_sizes(config, world)
        opt = resolve_schedule(opt, micro * accumulation * world * opt.data.seq_len)  # train.tokens: its steps
        tokenizer = load_tokenizer(opt.data.tokenizer)
        out = Path(opt.train.output_dir)
        optimizer = config.get("optimizer", {}).get("params", {})
        betas = optimizer.get("betas", [0.9, 0.999])
        training_args = TrainingArguments(
            output_dir=str(out / "hf-trainer-run"),
            deepspeed=trainer_ds_config(config),
            max_steps=opt.train.steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            learning_rate=optimizer.get("lr", 1e-3),
            weight_decay=optimizer.get("weight_decay", 0.0),
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_epsilon=optimizer.get("eps", 1e-8),
            max_grad_norm=config.get("gradient_clipping", 1.0),
            lr_scheduler_type="cosine",
            warmup_steps=opt.train.warmup_steps,
            logging_steps=1,
            report_to=[],
            save_strategy="steps" if opt.checkpoint.interval and opt.checkpoint.enabled else "no",
            save_steps=opt.checkpoint.interval or 500,
            save_total_limit=opt.checkpoint.keep_last,
            save_only_model=False,
            seed=opt.train.seed,
            bf16=bool(config.get("bf16", {}).get("enabled", False)),
            use_cpu=not torch.cuda.is_available(),
            dataloader_drop_last=True,
            disable_tqdm=False,
        )
        ep = opt.expert_parallel.size  # applied with DeepSpeed's engine; EP groups are consecutive ranks
        opt.model.mula_config(tokenizer, opt.data.seq_len)  # a seq_len beyond the model's positions: one line
        model = opt.model.build(
            tokenizer, ep_size=ep, ep_rank=int(os.environ.get("RANK", "0")) % ep, seed=opt.train.seed
        )

        packed = prepare_everywhere(opt.data, tokenizer)
    except (ConfigError, DataError, ValueError) as err:
        return fail(NAME, err, launched=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        train_dataset=PackedSequences(packed, opt.data.seq_len, seed=opt.train.seed),
    )
    try:
        trainer.train()  # DeepSpeed's engine is built here: it applies the optimus section
    except ConfigError as err:
        return fail(NAME, err, launched=True)
    if opt.train.export:
        trainer.save_model(str(out / "hf-trainer"))  # every rank: the experts are gathered
    if trainer.is_world_process_zero():
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        summary = {"losses": losses, "optimizer": type(trainer.model_wrapped.optimizer).__name__}
        (out / "trainer_summary.json").write_text(json.dumps(summary, indent=2))
        saved = f"; model saved to {out / 'hf-trainer'}" if opt.train.export else ""
        print(f"Trainer: loss {losses[0]:.4f} -> {losses[-1]:.4f}{saved}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

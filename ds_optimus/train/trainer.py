"""The pretraining loop behind `deepspeed --module ds_optimus.train --config ds_configs/NAME.json`.

One function, `pretrain(ds_config)`: build the model (a preset or an HF folder), apply the MoE
settings and expert parallelism of the `optimus` section, tokenize and pack the data (rank 0, once,
cached), initialise DeepSpeed (ZeRO, bf16, accumulation, clipping, optimizer and LR schedule from
the config), resume from the latest checkpoint, train with metrics every step, evaluate on the
held-out split, checkpoint, and export a Hugging Face folder that `AutoModelForCausalLM` loads.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError, OptimusConfig, load_json_config
from ..reliability import faults
from ..reliability.checkpoint import write_text_atomic
from ..reliability.signals import EXIT_PREEMPTED, PreemptionHandler
from ..reliability.watchdog import Watchdog
from .memory import MemoryMeter
from .metrics import MetricsSink, expert_imbalance, model_flops_per_token, reduce_mean, reduce_sum_tensor


def init_distributed() -> None:
    """torch.distributed through DeepSpeed: from the launcher's environment, or as a single
    process when run without a launcher. gloo on CPU unless oneCCL is installed."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python -m ds_optimus.train`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    accelerator = get_accelerator()
    backend = accelerator.communication_backend_name()
    if accelerator.device_name() == "cpu" and backend == "ccl":
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            backend = "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    if accelerator.device_name() == "cpu":
        cpu_threads_per_rank()


def release_shm_workspace() -> None:
    """Remove the name of this rank's shared-memory workspace that DeepSpeed's CPU communication
    backend creates when all ranks share a host (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_
    <port>_<rank>, 69 MB) and never removes: every run on a new port would leave one per rank behind,
    until /dev/shm (RAM) is full. Every rank maps every other rank's workspace while the backend
    starts, so after a barrier the names can go; the mappings stay valid. Collective; CPU only."""
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() or get_accelerator().device_name() != "cpu":
        return
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    dist.barrier()
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def cpu_threads_per_rank() -> int:
    """On CPU, give each local rank its share of the cores (the deepspeed launcher leaves every rank
    at all cores, so N ranks run N x cores threads and slow each other down). OMP_NUM_THREADS, when
    set, wins. Returns the thread count."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or _local_world_size())
    threads = max(1, cores // max(1, local))
    torch.set_num_threads(threads)
    return threads


def _local_world_size() -> int:
    # ranks on this host: those sharing its hostname (one small all-gather at start-up)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names.count(socket.gethostname())


def resolve_batch_sizes(ds_config: dict[str, Any], world_size: int) -> tuple[int, int]:
    """(micro-batch per rank, accumulation steps), made consistent with train_batch_size; a
    one-line ConfigError when they cannot be."""
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps")
    total = ds_config.get("train_batch_size")
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accumulation),
                       ("train_batch_size", total)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if micro is None and total is None:
        raise ConfigError("the config needs train_micro_batch_size_per_gpu or train_batch_size")
    if accumulation is None and micro is not None and total is not None:
        if total % (micro * world_size):
            raise ConfigError(f"train_batch_size {total} does not divide by train_micro_batch_size_per_gpu "
                              f"{micro} x {world_size} ranks")
        accumulation = total // (micro * world_size)
    accumulation = accumulation or 1
    if micro is None:
        if total % (accumulation * world_size):
            raise ConfigError(f"train_batch_size {total} does not divide by gradient_accumulation_steps "
                              f"{accumulation} x {world_size} ranks")
        micro = total // (accumulation * world_size)
    if total is not None and total != micro * accumulation * world_size:
        raise ConfigError(f"train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {accumulation} x {world_size} ranks")
    ds_config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
                     train_batch_size=micro * accumulation * world_size)
    return micro, accumulation


def build_model(opt: OptimusConfig, tokenizer):
    """The Mula model of the config (random weights from the seed, or an HF folder's weights)."""
    return opt.model.build(tokenizer)


def _scheduler_defaults(ds_config: dict[str, Any], steps: int) -> None:
    scheduler = ds_config.get("scheduler")
    if scheduler and scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        scheduler.setdefault("params", {}).setdefault("total_num_steps", steps)


def warmup_cosine(steps: int, warmup_steps: int, min_lr_ratio: float):
    """`optimizer -> LambdaLR`: linear warm-up over `warmup_steps` optimizer steps (the first step
    already at lr/warmup, not 0), then cosine decay to `min_lr_ratio` x lr at step `steps`."""

    def factor(done: int) -> float:  # `done` optimizer steps taken before this one
        if done < warmup_steps:
            return (done + 1) / warmup_steps
        span = max(1, steps - warmup_steps - 1)
        progress = min(1.0, (done - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def prepare_on_rank_zero(sources, tokenizer, cache_dir, val_fraction):
    """Tokenize and pack on rank 0 (with progress) while the others wait, then open the cache on
    every rank. A data error on rank 0 is raised on every rank, so none is left waiting."""
    from ..data import DataError, prepare

    if not dist.is_initialized():
        return prepare(sources, tokenizer, cache_dir, val_fraction, progress=True)
    failure = [None]
    if dist.get_rank() == 0:
        try:
            prepare(sources, tokenizer, cache_dir, val_fraction, progress=True)
        except Exception as err:  # any failure must reach the ranks waiting below
            failure[0] = (isinstance(err, DataError), f"{err}" if isinstance(err, DataError)
                          else f"preparing the data failed: {type(err).__name__}: {err}")
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        is_data_error, message = failure[0]
        raise DataError(message) if is_data_error else RuntimeError(message)
    return prepare(sources, tokenizer, cache_dir, val_fraction, progress=False)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward pass, non-reentrant (the sharded optimizer's
    gradient hooks then fire once per parameter)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since Transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def pretrain(ds_config: dict[str, Any] | str | Path, *, log_every_rank: bool = False) -> dict[str, Any]:
    """Run the pretraining job of a DeepSpeed config with an `optimus` section; returns a summary
    (first and last loss, evaluations, the exported folder) on every rank."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ..data import DataError, eval_batches, load_tokenizer, parse_source
    from ..data.loader import TokenBatches
    from ..parallel.expert_parallel import moe_param_groups, setup_moe
    from ..parallel.groups import check_layout
    from ..reliability import CheckpointManager

    ds_config = load_json_config(ds_config)
    opt = OptimusConfig.from_ds_config(ds_config)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(f"zero_optimization.stage {stage!r} is not supported by ds_optimus.train (use 0, 1 or 2)")
    if "optimizer" not in ds_config:
        raise ConfigError("the config needs an optimizer section (e.g. {\"type\": \"AdamW\", \"params\": {...}})")
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accumulation = resolve_batch_sizes(ds_config, world)
    _scheduler_defaults(ds_config, opt.train.steps)
    _seed_everything(opt.train.seed)  # the same initial weights on every rank

    try:
        tokenizer = load_tokenizer(opt.data.tokenizer)
    except ValueError as err:
        raise ConfigError(f"optimus.data.tokenizer: {err}") from None
    meter = MemoryMeter(get_accelerator().current_device_name()) if opt.train.measure_memory_steps else None
    if meter is not None:
        meter.start()
    model = build_model(opt, tokenizer)
    if opt.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if model.config.num_experts:
        check_layout(world, opt.expert_parallel.size, model.config.num_experts, opt.expert_parallel.node_size)
    elif opt.expert_parallel.size > 1:
        raise ConfigError("optimus.expert_parallel.size > 1 needs an MoE model (num_experts > 0)")
    groups = setup_moe(model, opt)

    output_dir = Path(opt.train.output_dir)
    sources = [parse_source(s) for s in opt.data.sources]
    seq_len = opt.data.seq_len
    packed = prepare_on_rank_zero(sources, tokenizer, opt.data.cache_dir, opt.data.val_fraction)
    train_loader = TokenBatches(packed.tokens("train"), seq_len, micro, rank, world, seed=opt.train.seed)
    try:
        held_out = eval_batches(packed.tokens("val"), seq_len, micro, rank, world, opt.train.eval_batches)
    except DataError:
        held_out = []

    weight_decay = ds_config["optimizer"].get("params", {}).get("weight_decay", 0.0)
    schedule = None
    if "scheduler" not in ds_config:
        schedule = warmup_cosine(opt.train.steps, opt.train.warmup_steps, opt.train.min_lr_ratio)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=moe_param_groups(model, weight_decay=weight_decay), lr_scheduler=schedule,
        config=ds_config)  # the "optimus" section reaches the engine: optimus.sharded_optimizer
    release_shm_workspace()
    device = engine.device
    if meter is not None:
        meter.mark("initialized")

    checkpoints = CheckpointManager(opt.checkpoint.dir or output_dir / "checkpoints", opt.checkpoint.keep_last, groups)
    start = 0
    resumed_from = None
    if not opt.checkpoint.resume and checkpoints.has_checkpoints():
        raise ConfigError(f"checkpoint.resume is false but {checkpoints.directory} holds checkpoints of an earlier "
                          "run; remove them or point checkpoint.dir elsewhere")
    notes: list[str] = []  # shown once the metrics sink exists
    latest = checkpoints.latest_good(report=notes.append)
    if latest is not None:
        start, extra = checkpoints.load(latest, engine)
        train_loader.load_state_dict(extra["loader"])
        resumed_from = str(latest)

    sink = MetricsSink(output_dir, opt.train.steps, start, opt.wandb, ds_config, enabled=rank == 0 or log_every_rank)
    if packed.documents and rank == 0:
        sink.message(f"data: {packed.train_tokens:,} train / {packed.val_tokens:,} held-out tokens "
                     f"from {packed.documents:,} documents ({packed.root})")
    for note in notes:
        sink.message(note)
    if resumed_from:
        sink.message(f"resumed from {resumed_from} at step {start}")
    if not held_out:
        sink.message("held-out split too small for one evaluation batch on every rank: evaluation skipped")

    flops_per_token = model_flops_per_token(model.config, seq_len)
    tokens_per_step = micro * accumulation * world * seq_len
    summary: dict[str, Any] = {"rank": rank, "start_step": start, "resumed_from": resumed_from,
                               "losses": {}, "evals": {}, "step_seconds": {}}

    def evaluate() -> float | None:
        if not held_out:
            return None
        engine.eval()
        total = torch.zeros(())
        with torch.no_grad():
            for batch in held_out:
                batch = batch.to(device)
                total += engine(input_ids=batch, labels=batch).lm_loss.float().cpu()
        engine.train()
        return reduce_mean({"loss": total.item() / len(held_out)})["loss"]

    engine.train()
    end = opt.train.steps
    if opt.train.stop_after_steps is not None:
        end = min(end, start + opt.train.stop_after_steps)
    summary["finished"] = end == opt.train.steps
    guard = _install_guard(opt, engine, sink)
    if guard is not None and latest is not None:
        guard.load_state_dict(extra.get("guard", {}))
    preemption = PreemptionHandler()
    timeouts = opt.watchdog
    watchdog = Watchdog(rank)
    progress = output_dir / "progress.json"
    rollbacks = 0
    step = start
    try:
        while step < end:
            step += 1
            watchdog.beat(timeouts.first_step_timeout_s if step == start + 1 else timeouts.step_timeout_s,
                          f"step {step}")
            faults.at_step_start(step)
            began = time.perf_counter()
            lr = engine.get_lr()[0]
            sums = {"loss": 0.0, "lm_loss": 0.0, "aux_loss": 0.0, "z_loss": 0.0}
            loads = None
            for micro in range(accumulation):
                batch = train_loader.next_batch().to(device)
                out = engine(input_ids=batch, labels=batch)
                loss = out.loss * faults.loss_factor(step) if micro == 0 else out.loss
                for key in sums:
                    value = loss if key == "loss" else getattr(out, key, None)
                    if value is not None:
                        sums[key] += float(value.detach()) / accumulation
                if out.tokens_per_expert is not None:
                    counts = out.tokens_per_expert.detach().float().cpu()
                    loads = counts if loads is None else loads + counts
                if micro == accumulation - 1:
                    # One all-reduce before the update: the loss the guard judges, and whether a rank
                    # was asked to stop (a signal may reach only some ranks).
                    sums["preempt"] = 1.0 if preemption.received else 0.0
                    metrics = reduce_mean(sums)
                    if guard is not None:
                        guard.observe_loss(metrics["loss"])
                faults.inside_step(step)
                engine.backward(loss)
                engine.step()
            preempt = metrics.pop("preempt") > 0
            seconds = time.perf_counter() - began
            summary["step_seconds"][step] = seconds
            if meter is not None and meter.running and step >= start + opt.train.measure_memory_steps:
                per_rank = [None] * world
                dist.all_gather_object(per_rank, meter.stop())
                summary["memory"] = per_rank  # every rank's {"peak_bytes", "marks"}
                peaks = [m["peak_bytes"] / 2**20 for m in per_rank]
                sink.message(f"memory: peak tensor memory per rank over steps {start + 1}-{step}: "
                             f"max {max(peaks):.1f} MiB, min {min(peaks):.1f} MiB")
            grad_norm = engine.get_global_grad_norm()
            metrics.update(lr=lr, grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                           tokens_per_s=tokens_per_step / seconds, step_seconds=seconds,
                           tokens=step * tokens_per_step, skipped_steps=engine.skipped_steps)
            if opt.train.peak_tflops:
                metrics["mfu"] = flops_per_token * tokens_per_step / seconds / (opt.train.peak_tflops * 1e12 * world)
            if loads is not None:
                per_layer = expert_imbalance(reduce_sum_tensor(loads))
                metrics["expert_imbalance_max"] = max(per_layer)
                metrics.update({f"expert_imbalance/layer_{i}": v for i, v in enumerate(per_layer)})
            if not model.config.num_experts:
                for key in ("aux_loss", "z_loss"):
                    metrics.pop(key, None)
            if guard is not None and guard.last.skip:
                sink.message(f"step {step}: update skipped on every rank ({guard.last.reason})")
            elif not math.isfinite(metrics["loss"]):
                sink.message(f"step {step}: loss is {metrics['loss']}")
            summary["losses"][step] = metrics["loss"]
            if step % opt.train.log_interval == 0 or step == opt.train.steps:
                sink.log(step, metrics)
            if rank == 0:
                write_text_atomic(progress, json.dumps({"step": step, "time": time.time()}), fsync=False)
            if guard is not None and guard.wants_rollback:
                step = _roll_back(checkpoints, engine, train_loader, guard, step, sink)
                rollbacks += 1
                continue
            last = step == opt.train.steps
            if (opt.train.eval_interval and step % opt.train.eval_interval == 0) or last:
                watchdog.beat(timeouts.checkpoint_timeout_s, f"evaluation after step {step}")
                held_out_loss = evaluate()
                if held_out_loss is not None:
                    summary["evals"][step] = held_out_loss
                    sink.log(step, {"eval_loss": held_out_loss}, progress=False)
                    sink.message(f"step {step}: held-out loss {held_out_loss:.4f}")
            if (opt.checkpoint.interval and step % opt.checkpoint.interval == 0) or step == end or preempt:
                watchdog.beat(timeouts.checkpoint_timeout_s, f"checkpoint of step {step}")
                # The last save of a run is waited for anyway; so is one before exiting on a signal.
                background = opt.checkpoint.async_save and step != end and not preempt
                state = {"loader": train_loader.state_dict(), "guard": guard.state_dict() if guard else {}}
                path = checkpoints.save(step, engine, state, background=background)
                sink.message(f"step {step}: checkpoint {path}" + (" (writing in the background)" if background else ""))
            if preempt:
                sink.message(f"step {step}: {preemption.received or 'a signal on another rank'}: checkpoint written, "
                             f"exiting with status {EXIT_PREEMPTED} (run again to resume)")
                summary.update(finished=False, preempted=True)
                break
        watchdog.beat(timeouts.checkpoint_timeout_s, "the end of the run")
        checkpoints.wait()
    except BaseException:
        watchdog.close()  # the process may live on (a notebook, a test): no dump later
        sink.close()  # ends the progress bar's line, so an error message starts on its own
        raise
    finally:
        preemption.close()
    summary.update(skipped_steps=engine.skipped_steps, rollbacks=rollbacks,
                   weights_fingerprint=_dense_fingerprint(engine.module))

    if not summary["finished"]:
        if not summary.get("preempted"):
            sink.message(f"stopped after step {end} of {opt.train.steps} (train.stop_after_steps); "
                         "run again to resume")
        sink.close()
        dist.barrier()
        watchdog.close()
        if summary.get("preempted"):
            raise Preempted(summary)
        return summary
    hf_dir = output_dir / "hf"
    export(engine.module, tokenizer, hf_dir, groups)
    summary["hf_dir"] = str(hf_dir)
    if rank == 0 and opt.train.sample_tokens:
        summary["sample"] = sample(hf_dir, opt.train.sample_prompt, opt.train.sample_tokens)
        sink.message(f"sample from {hf_dir}:\n{summary['sample']}")
    if rank == 0:
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    sink.close()
    dist.barrier()
    watchdog.close()
    return summary


class Preempted(SystemExit):
    """Raised by `pretrain` after the checkpoint a SIGTERM/SIGUSR1 asked for: the process exits with
    `EXIT_PREEMPTED`; `.summary` holds the run's summary."""

    def __init__(self, summary: dict[str, Any]) -> None:
        from ..reliability.signals import EXIT_PREEMPTED

        super().__init__(EXIT_PREEMPTED)
        self.summary = summary


def _install_guard(opt: OptimusConfig, engine, sink):
    """The run's numerical guard, plugged into the sharded optimizer's step (None when off)."""
    from ..optim.sharded import ShardedOptimizer
    from ..reliability.guards import StepGuard

    if not opt.guards.enabled:
        return None
    if not isinstance(engine.optimizer, ShardedOptimizer):
        sink.message("numerical guards act through the sharded optimizer (optimus.sharded_optimizer.enabled); "
                     "they are off for this run")
        return None
    g = opt.guards
    guard = StepGuard(g.window, g.min_window, g.sigmas, g.rollback_after, g.skip_spikes)
    engine.optimizer.step_filter = guard.decide
    return guard


def _roll_back(checkpoints, engine, train_loader, guard, step: int, sink) -> int:
    """Load the last intact checkpoint after `guard.rollback_after` bad steps in a row, keeping the data
    loader where it is (the batches since the checkpoint, those that went wrong, are not seen again);
    returns the step to continue after."""
    from ..reliability import CheckpointError

    checkpoints.wait()  # a save in flight finishes first
    target = checkpoints.latest_good(report=sink.message)
    if target is None:
        raise CheckpointError(f"step {step}: {guard.bad_in_a_row} bad steps in a row and no checkpoint to roll "
                              "back to (set optimus.checkpoint.interval)")
    position = train_loader.state_dict()
    resumed, _ = checkpoints.load(target, engine)
    train_loader.load_state_dict(position)
    sink.message(f"step {step}: {guard.bad_in_a_row} bad steps in a row ({guard.last.reason}); rolled back to "
                 f"{target.name} and skipping the data read since")
    guard.reset_after_rollback()
    return resumed


def _dense_fingerprint(model) -> float:
    """The sum of every replicated (non-expert) weight: equal on every rank unless replicas diverged."""
    from ..parallel.expert_parallel import is_expert_param

    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in model.parameters() if not is_expert_param(p)))


def export(model, tokenizer, folder: Path, groups) -> None:
    """Write an HF folder, with the tokenizer when given (full experts gathered under expert
    parallelism; collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if groups is not None:
        model.save_pretrained(folder)  # gathers every expert; rank 0 writes
    elif rank == 0:
        model.save_pretrained(folder)
    if rank == 0 and tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()


def sample(folder: Path, prompt: str, new_tokens: int, seed: int = 0) -> str:
    """A continuation of `prompt` by the model loaded back from `folder` with the Auto classes
    (top-k sampling at temperature 0.8 with a repetition penalty, from a fixed seed: a small model
    decoded greedily mostly repeats one token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             repetition_penalty=1.3, pad_token_id=tokenizer.pad_token_id)
    torch.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=True)

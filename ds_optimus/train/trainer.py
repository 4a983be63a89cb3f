"""The pretraining loop behind `deepspeed --module ds_optimus.train --config ds_configs/NAME.json`.

`Trainer` builds and resumes the run, `train()` loops and exports; everything around the step is a callback.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.manager import trained_without_checkpoint
from ..command_line import said_by_every_rank
from ..config import batch_keys, check_run_config, load_json_config, resolve_batch_sizes, resolve_schedule
from ..parallel.dims import ParallelDims
from ..reliability.heartbeat import waiting_for_peers
from ..reliability.signals import EXIT_PREEMPTED
from ..schema import ConfigError
from .callbacks import Callback, default_callbacks
from .data_setup import data_prompt, describe_data, prepare_everywhere
from .end_of_run import export, sample
from .lr import lr_schedule, with_scheduler_length
from .metrics import LOSS_PARTS, MetricsSink, append_log
from .model_setup import compile_layers, dense_fingerprint, enable_activation_checkpointing
from .pipelined import PipelineTrainModule, check_pipeline
from .resume import finished_already, last_step, resume_changes
from .startup import init_distributed, seed_everything
from .train_module import TrainModule

_NO_PHASE = contextlib.nullcontext()  # `Trainer._phase` of a step that is not profiled: nothing at all


@contextlib.contextmanager
def every_rank_alike():
    """Errors raised inside are raised alike by every rank (checks of the same config): printed once."""
    try:
        yield
    except (ConfigError, ValueError) as err:
        raise said_by_every_rank(err) from None


class Preempted(SystemExit):
    """Raised after a preemption's checkpoint: exits with `EXIT_PREEMPTED`; `.summary` holds the summary."""

    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.summary = summary


class Trainer:
    """One pretraining run of a DeepSpeed config with an `optimus` section (collective); `callbacks` run after the
    guards, before evaluation, preemption and checkpoints."""

    def __init__(
        self, ds_config: dict[str, Any] | str | Path, *, callbacks: list[Callback] = (), log_every_rank: bool = False
    ) -> None:
        self.ds_config = load_json_config(ds_config)
        with every_rank_alike():  # the same config and code on every rank: the same error
            self.opt = opt = check_run_config(self.ds_config)
        self.launch_line = init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        with every_rank_alike():  # the layout, checked once: built from, and passed to, all that follows
            self.dims = ParallelDims.from_config(opt, self.world)
            self.dp_world = self.dims.dp  # data parallelism: the ranks of one pipeline stage and TP position
            self.micro_batch, self.accumulation = resolve_batch_sizes(
                self.ds_config, self.dp_world, opt.pipeline_parallel.size, opt.tensor_parallel.size
            )
        self.tp, self.sequence = self.dims.tp, self.dims.sp
        self.sequence_group = None  # under sequence parallelism: every TP position's data-parallel ranks
        self.position = self.dims.position(self.rank)
        self.dp_rank, self.train_module = self.position.dp_rank, None
        self.tokens_per_step = self.micro_batch * self.accumulation * self.dp_world * opt.data.seq_len
        self.opt = opt = resolve_schedule(opt, self.tokens_per_step)  # train.tokens: the steps they take
        self.last_step = last_step(opt, self.tokens_per_step)  # train.steps, or the step of stop_after_tokens
        # the engine's config: the batch keys agreeing and the scheduler's length (a copy; the caller's stays)
        batch = batch_keys(self.micro_batch, self.accumulation, self.dp_world)
        self.ds_config = with_scheduler_length({**self.ds_config, **batch}, opt.train.steps)
        seed_everything(opt.train.seed)  # the same initial weights on every rank
        self.output_dir = Path(opt.train.output_dir)
        self.log_every_rank = log_every_rank
        self.sink: MetricsSink | None = None
        self.finished_at = finished_already(opt, self.output_dir, self.last_step)  # launched again after the end
        if self.finished_at is not None:
            self.callbacks = []  # nothing is built: train() says so and returns
            return
        self.callbacks = default_callbacks(opt, list(callbacks))
        for callback in self.callbacks:
            callback.trainer = self
        try:
            self._call("setup")
            self._build_model()
            self._build_data()
            self._build_engine()
            self.checkpoints = opt.checkpoint.build(self.output_dir, self.groups)
            if self.rank == 0:  # each checkpoint exports on its own (python -m ds_optimus.evaluate)
                from ..checkpoint.manager import model_record

                self.checkpoints.model_record = model_record(self.model.config, self.tokenizer)
            self.step = self.start_step = self._resume()
        except BaseException as err:
            self.close(err)
            raise
        self.end_step = self.last_step
        if opt.train.stop_after_steps is not None:
            self.end_step = min(self.end_step, self.start_step + opt.train.stop_after_steps)
        self.summary: dict[str, Any] = {
            "rank": self.rank,
            "start_step": self.start_step,
            "resumed_from": self.resumed_from,
            "losses": {},
            "evals": {},
            "step_seconds": {},
            "finished": self.end_step == self.last_step,
            "rollbacks": 0,
        }
        self.stop_reason: str | None = None  # set by a callback to end the run after this step
        self.metrics: dict[str, float] = {}  # the current step's numbers, reduced over ranks
        self.expert_loads: torch.Tensor | None = None  # token slots per MoE layer and expert since the last log
        self.step_loads: list[list[float]] | None = None  # those loads summed over ranks, on log steps
        self.phases = None  # a profiled step's phase timer (optimus.profile: PhaseProfileCallback sets it)
        self._rewound = False

    # -- assembly ---------------------------------------------------------------------------------

    def _build_model(self) -> None:
        from ..data import load_tokenizer
        from ..parallel.expert_parallel import setup_moe
        from ..parallel.groups import init_layout_groups

        opt = self.opt
        try:
            self.tokenizer = load_tokenizer(opt.data.tokenizer)
        except ValueError as err:
            raise ConfigError(f"optimus.data.tokenizer: {err}") from None
        ep = opt.expert_parallel
        with every_rank_alike():  # the model's config once, for the layout's checks (`--check` makes the same)
            model_config = opt.model.mula_config(self.tokenizer, opt.data.seq_len)
            self.dims.check_experts(model_config.num_experts)
        self.groups = init_layout_groups(self.dims)  # every process group of the layout, made here once
        stage = split = tensor = None
        if self.tp > 1:
            made = self.groups.tensor
            tensor = (made.group, made.size, made.rank)
        if self.dims.pp > 1:  # this rank's stage only: its layers, embedding or head
            with every_rank_alike():
                split = check_pipeline(opt, self.ds_config, model_config, self.accumulation)
            stage = PipelineTrainModule.stage_part(opt, split, self.groups.pipeline.stage)
        # Built on the meta device, holding only this rank's experts and its part of each split weight.
        with every_rank_alike():  # a width the TP size does not divide: one line
            model = opt.model.build(
                self.tokenizer,
                ep_size=ep.size,
                ep_rank=self.position.ep_rank,
                seed=opt.train.seed,
                stage=stage,
                tensor_parallel=tensor,
            )
        if opt.tensor_parallel.sequence_parallel:  # the residual stream cut along the sequence over the TP group
            from ..parallel.tensor_parallel import apply_sequence_parallel

            with every_rank_alike():
                apply_sequence_parallel(model, tensor[0], split)
        if opt.train.activation_checkpointing:  # true: whole layers; a list: those parts of each
            enable_activation_checkpointing(model, opt.train.recompute)
        self.groups = setup_moe(model, opt, groups=self.groups) or self.groups  # EP over the groups made above
        self.train_module = (  # the pipeline's runs the schedule; without stages, the micro-batches in turn
            PipelineTrainModule(opt, self.groups, model, split, self.micro_batch, self.accumulation)
            if split is not None
            else TrainModule(self.sequence, self.tp)
        )
        if opt.train.compile:
            compile_layers(model)
        self.model = model

    def _build_data(self) -> None:
        from ..data import DataError, TokenBatches, eval_batches

        data = self.opt.data
        seed = self.opt.train.seed
        self.packed = prepare_everywhere(data, self.tokenizer)  # every rank tokenizes its share, if need be
        # every stage of a pipeline reads the same batches: the first feeds them, the last scores them
        with every_rank_alike():
            self.train_loader = TokenBatches(
                self.packed,
                data.seq_len,
                self.micro_batch,
                self.dp_rank,
                self.dp_world,
                seed=seed,
                vocab_size=self.model.config.vocab_size,
            )
        try:
            self.held_out = eval_batches(
                self.packed, data.seq_len, self.micro_batch, self.dp_rank, self.dp_world, self.opt.train.eval_batches
            )
        except DataError:
            self.held_out = []

    def _build_engine(self) -> None:
        import deepspeed

        from ..optim.engine_section import engine_ds_config
        from ..parallel.expert_parallel import moe_param_groups

        opt = self.opt
        config = self.ds_config
        weight_decay = config["optimizer"].get("params", {}).get("weight_decay", 0.0)
        schedule = None
        if "scheduler" not in config:
            schedule = lr_schedule(opt.train, config["optimizer"].get("params", {}).get("lr", 1e-3))
        # The engine applies the optimus section's moe, expert_parallel (done already: the model is
        # expert-parallel) and sharded_optimizer; the rest is this trainer's.
        mpu = None
        config = self.train_module.engine_config(config)
        if self.dims.pp > 1 or self.tp > 1:  # a stage's ranks of one TP position: the engine's data parallelism
            from ..parallel.groups import EngineParallelism

            mpu = EngineParallelism(self.groups, self.sequence)
            self.sequence_group = mpu.replicated_group
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.model,
            lr_scheduler=schedule,
            config=engine_ds_config(config),
            mpu=mpu,
            model_parameters=moe_param_groups(
                self.model, weight_decay=weight_decay, decay_all=opt.train.decay_all_params
            ),
        )
        if opt.train.decay_after_update:  # the seed's order: the decay shrinks the updated weights
            from ..optim.decay_after import apply_decay_after_update

            apply_decay_after_update(self.engine)
        self.train_module.attach(self.engine)
        self.engine.drives_router_bias = False  # RouterBiasCallback does it, leaving out the skipped steps
        self.device = self.engine.device
        self.sum_dtype = _sum_dtype(torch.device(self.device))

    def _resume(self) -> int:
        """Load the newest intact checkpoint and open the metrics sink; returns its step (0 without one)."""
        checkpoints = self.checkpoints
        notes: list[str] = [self.launch_line]
        if not self.opt.checkpoint.resume and checkpoints.has_checkpoints():
            raise said_by_every_rank(
                ConfigError(  # has_checkpoints: rank 0's view, on every rank
                    f"checkpoint.resume is false but {checkpoints.directory} holds checkpoints of an earlier run; "
                    "remove them or point checkpoint.dir elsewhere"
                )
            )
        latest = checkpoints.latest_good(report=notes.append) if self.opt.checkpoint.resume else None
        if latest is None and self.opt.checkpoint.resume and self.opt.checkpoint.enabled:
            refused = [trained_without_checkpoint(self.output_dir, checkpoints.directory) if self.rank == 0 else None]
            if self.world > 1:
                dist.broadcast_object_list(refused, src=0)
            if refused[0]:
                raise said_by_every_rank(ConfigError(refused[0]))
        start = 0
        self.resumed_from = None
        if latest is not None:
            start, extra = checkpoints.load(latest, self.engine)
            with every_rank_alike():  # the same checkpoint and data on every rank
                notes += [
                    f"data changed since the checkpoint (optimus.data.allow_change): {change}"
                    for change in self.train_loader.load_state_dict(extra["loader"], self.opt.data.allow_change)
                ]
            notes += [checkpoints.layout_note, *resume_changes(extra, self)]
            for callback in (c for c in self.callbacks if c.state_key is not None):
                callback.load_state_dict(extra.get(callback.state_key, {}))
            self.resumed_from = str(latest)
        # stop_after_tokens: from the tokens the data has given so far (the batch may have changed at a resume)
        self.last_step = last_step(self.opt, self.tokens_per_step, start, self.train_loader.tokens_consumed)
        self.sink = MetricsSink(
            self.output_dir,
            self.last_step,
            start,
            self.opt.wandb,
            self.ds_config,
            enabled=self.rank == 0 or self.log_every_rank,
        )
        if self.rank == 0:
            self.message(describe_data(self.packed, self.train_loader))
        if self.tp > 1:
            ep = self.opt.expert_parallel.size
            notes.append(
                f"tensor parallel: groups of {self.tp} consecutive ranks split attention, the dense MLPs, the "
                f"embedding and the head; data parallel {self.dp_world} over each TP position's ranks"
                + (f", whose experts are split in expert-parallel groups of {ep}" if ep > 1 else "")
            )
        for note in [n for n in [*notes, self.train_module.describe()] if n]:
            self.message(note)
        if self.resumed_from:
            self.message(f"resumed from {self.resumed_from} at step {start}")
        if not self.held_out:
            self.message("held-out split too small for one evaluation batch on every rank: evaluation skipped")
        return start

    # -- the step and the loop --------------------------------------------------------------------

    def train_step(self) -> None:
        """One optimizer step over `accumulation` micro-batches; one all-reduce and one host read precede the update."""
        engine = self.engine
        began = time.perf_counter()
        skipped_before = engine.skipped_steps
        self.lr = engine.get_lr()[0]
        parts = torch.zeros(len(LOSS_PARTS), dtype=self.sum_dtype, device=self.device)
        with self._phase("data"):
            batches = [
                self.train_loader.next_batch().to(self.device, non_blocking=True) for _ in range(self.accumulation)
            ]
        loads = self.train_module.forward_backward(batches, parts, self._phase)
        if loads is not None:
            self.expert_loads = loads if self.expert_loads is None else self.expert_loads + loads
        self._reduce_step(parts)
        with self._phase("optimizer"):
            engine.step()
        self.step_seconds = time.perf_counter() - began
        self.update_skipped = engine.skipped_steps > skipped_before

    def _reduce_step(self, parts: torch.Tensor) -> None:
        """One all-reduce of the loss parts, callbacks' flags and (log steps) expert loads; one host read."""
        flags = [item for callback in self.callbacks for item in callback.step_flags().items()]
        self.reduce_arrival = time.time()  # when this rank came to the step's reduction (stragglers: the last)
        if len({name for name, _ in flags}) != len(flags):
            raise RuntimeError(f"two callbacks give the same step flag ({', '.join(name for name, _ in flags)})")
        # each flag made on the device by a fill: a copy from the host would wait for the backward pass
        pieces = [parts, *(torch.full((1,), value, dtype=parts.dtype, device=self.device) for _, value in flags)]
        # this rank's own loss not finite: counted over the ranks in the same reduction (which ranks
        # it was is asked only when the count is not 0, by a callback)
        self.local_nonfinite = (~torch.isfinite(parts)).any().reshape(1)
        pieces.append(self.local_nonfinite.to(parts.dtype))
        loads = self.expert_loads if self.is_log_step(self.step) else None
        if loads is not None:
            pieces.append(loads.reshape(-1).to(parts.dtype))
        packed = torch.cat(pieces)
        # a rank stuck here waits for another (the heartbeats say which); its wait is its jitter (the profiler's)
        with waiting_for_peers(), self._phase("reduce"):
            if self.world > 1:
                dist.all_reduce(packed)
                # with pipeline stages, the last chunk's ranks add them; every rank of a TP group has the same
                packed[: len(LOSS_PARTS)] /= self.dp_world * self.tp
            values = packed.tolist()  # the step's one host sync
        self.metrics = dict(zip(LOSS_PARTS, values, strict=False))
        self.metrics.update(zip((name for name, _ in flags), values[len(LOSS_PARTS) :], strict=False))
        self.nonfinite_ranks = int(values[len(LOSS_PARTS) + len(flags)])
        self.step_loads = None
        if loads is not None:
            flat = values[len(LOSS_PARTS) + len(flags) + 1 :]
            experts = loads.shape[-1]
            if not self.sequence:  # each rank of a TP group routes the same tokens (with SP, its own)
                flat = [count / self.tp for count in flat]
            self.step_loads = [flat[i : i + experts] for i in range(0, len(flat), experts)]
            self.expert_loads = None

    def _phase(self, name: str):
        """A timer for phase `name` of a profiled step, else a no-op."""
        return _NO_PHASE if self.phases is None else self.phases.phase(name)

    def is_log_step(self, step: int) -> bool:
        """Every `log_interval`-th step, and the last."""
        return step % self.opt.train.log_interval == 0 or step in (self.end_step, self.last_step)

    def train(self) -> dict[str, Any]:
        """Run to the last step or a callback's stop, export, and return the summary on every rank."""
        if self.finished_at is not None:
            text = (
                f"the run was already trained to step {self.finished_at}: nothing to do ({self._further()}; or "
                f"remove {self.output_dir} to start over)"
            )
            self.message(text)
            if self.rank == 0:
                append_log(self.output_dir, text)
            return {
                "rank": self.rank,
                "start_step": self.finished_at,
                "resumed_from": None,
                "losses": {},
                "finished": True,
                "nothing_to_do": True,
            }
        try:
            self._call("pre_train")
            self.engine.train()
            while self.step < self.end_step and self.stop_reason is None:
                self.step += 1
                self._call("pre_step", self.step)
                self.train_step()
                self._call("post_step", self.step)
            self._call("post_train")
            self._finish()
        except BaseException as err:
            self.close(err)
            raise
        self.close()
        if self.stop_reason == "preempted":
            raise Preempted(self.summary)
        return self.summary

    def _finish(self) -> None:
        self.sink.end_progress()  # the export and the sample print below it, not through it
        self.summary.update(
            skipped_steps=self.engine.skipped_steps, weights_fingerprint=dense_fingerprint(self.engine.module)
        )
        if self.step >= self.last_step:  # the last step is done, in this invocation or an earlier one
            self.stop_reason = None  # a stop asked for at the last step leaves nothing to come back for
            self.summary["finished"] = True
            if self.start_step >= self.last_step and self._summary_written():
                self.message(
                    f"the run was already trained to step {self.start_step}: nothing to do "
                    f"({self._further()}; or remove {self.output_dir} to start over)"
                )
            else:
                self._export()
        elif self.stop_reason is not None:
            self.summary.update(finished=False, preempted=self.stop_reason == "preempted")
            if self.stop_reason != "preempted":  # a callback of the user's asked for it
                self.message(f"stopped after step {self.step} ({self.stop_reason}); run again to resume")
        else:
            self.message(
                f"stopped after step {self.end_step} of {self.last_step} (train.stop_after_steps); run again to resume"
            )
        self.sink.close()
        dist.barrier()

    def _further(self) -> str:
        """How to train a finished run further."""
        if self.last_step < self.opt.train.steps:
            return "raise optimus.train.stop_after_tokens to train further, along the same LR schedule"
        return "raise optimus.train.steps past it to train further: the LR schedule then stretches to the new length"

    def _summary_written(self) -> bool:
        """Whether `summary.json` (written last) exists: rank 0's view, on every rank."""
        found = [(self.output_dir / "summary.json").exists() if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(found, src=0)
        return bool(found[0])

    def _export(self) -> None:
        """The HF folder and a sample from it (unless `train.export` is false); summary.json last."""
        hf_dir = self.output_dir / "hf"
        sampled = self.rank == 0 and self.opt.train.sample_tokens
        if self.opt.train.export:
            self.begin_long_work("the export")
            from .model_card import training_record

            export(self.engine.module, self.tokenizer, hf_dir, self.groups, record=training_record(self))
            self.summary["hf_dir"] = str(hf_dir)
        if self.opt.train.export and sampled:
            prompt = self.opt.train.sample_prompt or data_prompt(self.packed, self.tokenizer)
            self.summary.update(sample_prompt=prompt, sample=sample(hf_dir, prompt, self.opt.train.sample_tokens))
            self.message(f"sample from {hf_dir}:\n{self.summary['sample']}")
        if self.rank == 0:
            (self.output_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))

    def close(self, error: BaseException | None = None) -> None:
        """The one clean-up path (success, error, preemption): callbacks in reverse, then the metrics sink; errors go
        to `log.txt`."""
        failures = []
        for callback in self.callbacks:
            try:
                callback.on_exit(error)
            except Exception as err:  # noqa: BLE001 - a user's hook: the closes below still run
                failures.append(err)
        for callback in reversed(self.callbacks):
            try:
                callback.close(error)
            except Exception as err:  # every callback must get its turn
                failures.append(err)
        if error is not None and (self.rank == 0 or self.log_every_rank):
            first = (str(error).strip().splitlines() or [""])[0]
            append_log(self.output_dir, f"the run stopped on an error: {type(error).__name__}: {first}")
        if self.sink is not None:
            self.sink.close()  # ends the progress bar's line, so an error message starts on its own
        # the optimizers' gradient hooks live on the parameters' autograd nodes (C++), which the garbage
        # collector cannot see through: left in place they keep the engine, the model and its process
        # groups' threads alive for as long as the process lives on (a notebook, a second run). Not after
        # an error: destroy waits for in-flight gathers (and a device sync), which a dead peer never ends
        engine = getattr(self, "engine", None)
        if engine is not None and error is None:
            try:
                engine.destroy()
            except Exception as err:  # noqa: BLE001 - the run's own error comes first
                failures.append(err)
        if failures and error is None:
            raise failures[0]

    # -- what callbacks use -----------------------------------------------------------------------

    def message(self, text: str) -> None:
        """Show `text` (rank 0) and keep it in the run's `log.txt`."""
        if self.sink is not None:
            self.sink.message(text)
        elif self.rank == 0 or self.log_every_rank:
            print(text, file=sys.stderr, flush=True)

    def request_stop(self, reason: str) -> None:
        """End the run after this step (its checkpoint is still written); every rank must ask alike."""
        if self.stop_reason != "preempted":  # its exit status tells the scheduler to requeue
            self.stop_reason = reason

    def rewind(self, step: int) -> None:
        """Continue after `step` (a rollback restored it), skipping this step's remaining `post_step` callbacks."""
        self.step = step
        self._rewound = True

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the engine: loader position, batch, steps, callbacks' state."""
        state = {
            "loader": self.train_loader.state_dict(),
            "tokens_per_step": self.tokens_per_step,
            "steps": self.opt.train.steps,
        }
        return {**state, **{c.state_key: c.state_dict() for c in self.callbacks if c.state_key is not None}}

    def notify_checkpoint(self, step: int, path: Path) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint(step, path)

    def begin_long_work(self, what: str) -> None:
        """Possibly long work starts now (the watchdog allows it its longer time-out)."""
        for callback in self.callbacks:
            callback.on_long_work(what)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out LM loss over ranks; None without held-out data."""
        if not self.held_out:
            return None
        self.engine.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for batch in self.held_out:
            total += self.train_module.eval_loss(batch.to(self.device))
        self.engine.train()
        total = total.double() / len(self.held_out)
        if self.world > 1:
            dist.all_reduce(total)
            total /= self.dp_world * self.tp
        return total.item()

    def _call(self, hook: str, *args) -> None:
        self._rewound = False
        for callback in self.callbacks:
            getattr(callback, hook)(*args)
            if self._rewound:
                break


def _sum_dtype(device: torch.device) -> torch.dtype:
    """float64 for the step's sums where the device has it, else float32."""
    if device.type == "mps":
        return torch.float32
    if device.type == "xpu" and not getattr(torch.xpu.get_device_properties(device), "has_fp64", True):
        return torch.float32
    return torch.float64


def pretrain(ds_config: dict[str, Any] | str | Path, *, log_every_rank: bool = False) -> dict[str, Any]:
    """Run `Trainer(ds_config)`; returns the summary on every rank."""
    return Trainer(ds_config, log_every_rank=log_every_rank).train()

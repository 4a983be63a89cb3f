"""The training loop as components: host syncs per step, the router-bias update, compiled layers,
callbacks around a short step, and the config's one-line refusals."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
from distributed import run_distributed
from train_workers import (
    compiled_losses_worker,
    count_syncs_worker,
    counting_worker,
    metrics_worker,
    pretrain_worker,
    tiny_config,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def test_train_step_fits_on_a_screen_and_knows_nothing_of_faults():
    from ds_optimus.train import Trainer, default_callbacks
    from ds_optimus.train.callbacks import FaultInjectionCallback

    source = inspect.getsource(Trainer.train_step)
    assert len(source.splitlines()) <= 60
    assert not re.search(r"\bfault", inspect.getsource(Trainer).lower())  # (default_callbacks aside)
    from ds_optimus.config import OptimusConfig

    callbacks = default_callbacks(OptimusConfig.from_ds_config({}))
    assert not any(isinstance(c, FaultInjectionCallback) for c in callbacks)  # DS_OPTIMUS_FAULTS is unset


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 8])
def test_a_step_makes_at_most_two_host_syncs(tmp_path, cache, accumulation):
    """One read of the step's all-reduced numbers (losses, the guards' loss, the preemption flag,
    expert loads on log steps) and the sharded optimizer's gradient norm; none per micro-batch."""
    config = tiny_config(
        tmp_path,
        cache,
        train={"steps": 5, "eval_interval": 0, "log_interval": 1},
        checkpoint={"interval": 0},
        sharded_optimizer={"enabled": True},
        model={"preset": "mula-tiny-moe", "overrides": {"router_bias_update_rate": 0.001}},
    )
    config["train_micro_batch_size_per_gpu"] = 2
    config["gradient_accumulation_steps"] = accumulation
    config["zero_optimization"] = {"stage": 1}
    per_step = run_distributed(count_syncs_worker, 1, config)[0]
    assert sorted(per_step) == [1, 2, 3, 4, 5]
    for step in (1, 2, 3, 4):  # the last step also evaluates, checkpoints and exports
        assert len(per_step[step]) <= 2, (step, per_step[step])
    assert len(per_step[2]) >= 1  # the counter sees the step's own read


@pytest.mark.slow
def test_router_bias_balances_experts_without_the_auxiliary_loss(tmp_path, cache):
    """Two processes, no load-balancing loss: without balancing the tiny model's routers collapse
    onto a few experts; with the router bias updated after every step (by the entry point, nothing
    else) the experts end up far less imbalanced, per metrics.jsonl."""

    def late_imbalance(name: str, rate: float) -> float:
        config = tiny_config(
            tmp_path / name,
            cache,
            train={"steps": 150, "eval_interval": 0, "warmup_steps": 2},
            checkpoint={"interval": 0},
            model={
                "preset": "mula-tiny-moe",
                "overrides": {"router_aux_loss_coef": 0.0, "router_bias_update_rate": rate},
            },
        )
        steps = [r for r in run_distributed(metrics_worker, 2, config)[0] if "loss" in r]
        assert len(steps) == 150
        layers = [k for k in steps[0] if k.startswith("expert_imbalance/layer_")]
        assert len(layers) == 4
        return sum(r[k] for r in steps[-20:] for k in layers) / (20 * len(layers))  # max/mean tokens, 1 = balanced

    off, on = late_imbalance("off", 0.0), late_imbalance("on", 0.01)
    assert on < off - 1.0 and on < 2.3, (on, off)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2], ids=["1proc", "2proc-ep2"])
def test_compiled_layers_train_like_eager(tmp_path, cache, world):
    """`train.compile` compiles every decoder layer (the experts' grouped GEMM is a custom op with a
    fake implementation, so float32 on the CPU traces too; the expert-parallel exchange stays eager);
    no step recompiles, and 12 steps match eager as closely as float32 rounding allows.

    Compiling changes only the order of float32 operations (fused kernels sum in another order), so
    compiled and eager differ by roundings, which 12 steps of Adam then amplify by a factor that
    depends on the machine's kernels (1.26e-5 relative was seen on one, under 1e-5 on another). The
    bound is measured, not guessed: the same eager run started from weights changed by one float32
    rounding (x (1 +- 2**-24)) drifts from eager by D; compiled may drift by at most 10 D (a few
    roundings per operation, and their amplification alike), and at step 1 (before any update) by
    at most 1e-5 (a forward pass of a few hundred float32 additions per output: ~1e-6)."""

    def run(name: str, compile_: bool, perturb: bool = False) -> tuple[list[float], int]:
        config = tiny_config(
            tmp_path / name,
            cache,
            train={"steps": 12, "eval_interval": 0, "compile": compile_},
            checkpoint={"interval": 0},
            expert_parallel={"size": world},
        )
        return run_distributed(compiled_losses_worker, world, config, perturb)[0]

    def drift(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))

    (eager, no_graphs), (compiled, graphs) = run("eager", False), run("compiled", True)
    rounded, _ = run("rounded", False, perturb=True)
    assert no_graphs == 0 and graphs > 0
    assert len(eager) == len(compiled) == len(rounded) == 12
    assert 0 < drift(rounded, eager) < 1e-4  # the perturbation is felt, and stays small
    assert drift(compiled, eager) <= 10 * drift(rounded, eager), (drift(compiled, eager), drift(rounded, eager))
    assert abs(compiled[0] - eager[0]) / abs(eager[0]) < 1e-5


def test_a_model_path_alone_wins_over_the_default_preset(tmp_path):
    from ds_optimus.config import ConfigError, OptimusConfig
    from ds_optimus.hf_models.mula import MulaConfig

    MulaConfig.from_preset("mula-tiny-dense").save_pretrained(tmp_path / "mine")
    opt = OptimusConfig.from_ds_config({"optimus": {"model": {"path": str(tmp_path / "mine")}}})
    assert opt.model.preset is None and opt.model.build().config.num_experts == 0
    assert OptimusConfig.from_ds_config({}).model.preset == "mula-tiny-moe"  # nothing given: the default
    shipped = {"optimus": {"model": {"preset": "mula-tiny-moe", "path": str(tmp_path / "mine")}}}
    assert OptimusConfig.from_ds_config(shipped).model.build().config.num_experts == 0  # --set model.path on one
    with pytest.raises(ConfigError, match=r"^optimus\.model\.path '.*nowhere' is not a folder$"):
        OptimusConfig.from_ds_config({"optimus": {"model": {"path": str(tmp_path / "nowhere")}}}).model.build()


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lr": 0}, r"^optimizer\.params\.lr must be a positive number, got 0$"),
        ({"lr": -3e-4}, r"^optimizer\.params\.lr must be a positive number"),
        ({"lr": "fast"}, r"^optimizer\.params\.lr must be a positive number"),
        ({"lr": 1e-3, "betas": [0.9, 1.0]}, r"^optimizer\.params\.betas must be two numbers in \[0, 1\)"),
        ({"lr": 1e-3, "betas": [-0.1, 0.95]}, r"^optimizer\.params\.betas must be two numbers in \[0, 1\)"),
        ({"lr": 1e-3, "betas": [0.9]}, r"^optimizer\.params\.betas must be two numbers in \[0, 1\)"),
        ({"lr": 1e-3, "eps": 0}, r"^optimizer\.params\.eps must be a positive number"),
        ({"lr": 1e-3, "weight_decay": -0.1}, r"^optimizer\.params\.weight_decay must be a number >= 0"),
    ],
)
def test_optimizer_hyperparameters_that_would_train_silently_wrong_are_refused(params, message):
    from ds_optimus.config import ConfigError, check_optimizer_section

    with pytest.raises(ConfigError, match=message):
        check_optimizer_section({"optimizer": {"type": "AdamW", "params": params}})
    check_optimizer_section({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}})


@pytest.mark.slow
def test_metrics_reach_the_log_once_per_log_interval(tmp_path, cache):
    config = tiny_config(
        tmp_path, cache, train={"steps": 7, "eval_interval": 0, "log_interval": 3}, checkpoint={"interval": 0}
    )
    records = [r for r in run_distributed(metrics_worker, 1, config)[0] if "loss" in r]
    assert [r["step"] for r in records] == [3, 6, 7]  # and the last step
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sorted(map(int, summary["losses"])) == list(range(1, 8))  # every step's loss is still kept
    assert [summary["losses"][str(r["step"])] for r in records] == [r["loss"] for r in records]


def test_mula_trainer_moves_the_router_bias_once_per_optimizer_step(tmp_path):
    """Under the Hugging Face Trainer (no DeepSpeed here), `MulaTrainer` drives the auxiliary-loss-
    free balancing: one bias update per optimizer step, not per micro-batch."""
    import numpy as np
    import torch
    from transformers import TrainingArguments

    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
    from ds_optimus.train.hf_trainer import MulaTrainer, PackedSequences, RouterBiasUpdate

    model = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe", router_bias_update_rate=0.01))
    calls = []
    update = model.update_router_bias
    model.update_router_bias = lambda *a, **k: (calls.append(1), update(*a, **k))  # counting, test only
    tokens = np.random.default_rng(0).integers(2, 4096, 64 * 33).astype(np.uint16)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = MulaTrainer(model=model, args=args, train_dataset=PackedSequences(tokens, 32))
    assert sum(isinstance(c, RouterBiasUpdate) for c in trainer.callback_handler.callbacks) == 1
    trainer.train()
    assert len(calls) == 3  # 3 optimizer steps of 2 micro-batches each
    biases = torch.stack([layer.mlp.gate.expert_bias for layer in model.model.layers])
    assert biases.abs().sum() > 0 and torch.all(biases.abs() <= 3 * 0.01 + 1e-6)
    assert all(layer.mlp.gate.load_since_update.sum() == 0 for layer in model.model.layers)


@pytest.mark.slow
def test_guards_off_a_finished_run_launched_again_and_an_error_on_record(tmp_path, cache):
    config = tiny_config(
        tmp_path,
        cache,
        train={"steps": 4, "eval_interval": 0},
        checkpoint={"interval": 2},
        guards={"enabled": False},
        sharded_optimizer={"enabled": True},
    )
    config["zero_optimization"] = {"stage": 1}
    first = run_distributed(pretrain_worker, 1, config)[0]  # the guards off under the sharded optimizer
    assert sorted(first["losses"]) == [1, 2, 3, 4] and first["finished"]
    run = tmp_path / "run"
    summary = (run / "summary.json").read_text()

    again = run_distributed(pretrain_worker, 1, config)[0]
    assert again["start_step"] == 4 and again["losses"] == {} and "hf_dir" not in again
    assert (run / "summary.json").read_text() == summary  # the finished run's record stays
    log = (run / "log.txt").read_text()
    assert "the run was already trained to step 4: nothing to do" in log
    # launched again with fewer steps: the same, said before anything is built (no data, no schedule note)
    fewer = {**config, "optimus": {**config["optimus"], "train": {**config["optimus"]["train"], "steps": 3}}}
    assert run_distributed(pretrain_worker, 1, fewer)[0]["start_step"] == 4
    added = (run / "log.txt").read_text()[len(log) :]
    said = [line[len("2026-01-01 00:00:00 ") :] for line in added.strip().splitlines()]  # after the time stamp
    assert said == [
        "the run was already trained to step 4: nothing to do (raise optimus.train.steps past it to train "
        f"further: the LR schedule then stretches to the new length; or remove {run} to start over)"
    ], added

    refused = {**config, "optimus": {**config["optimus"], "checkpoint": {"interval": 2, "resume": False}}}
    with pytest.raises(Exception, match="checkpoint.resume is false"):
        run_distributed(pretrain_worker, 1, refused)
    last = (run / "log.txt").read_text().splitlines()[-1]
    assert last.endswith(
        "the run stopped on an error: ConfigError: checkpoint.resume is false but "
        f"{run / 'checkpoints'} holds checkpoints of an earlier run; remove them or point "
        "checkpoint.dir elsewhere"
    )


class _StubTrainer:
    """What the guard callback's rollback reads of a trainer, without one."""

    def __init__(self, interval: int) -> None:
        from ds_optimus.config import OptimusConfig

        self.opt = OptimusConfig.from_ds_config({"optimus": {"checkpoint": {"interval": interval}}})
        self.messages: list[str] = []
        self.checkpoints = self
        self.rewound = None

    def wait(self) -> None:
        pass

    def latest_good(self, report):
        return None  # no checkpoint written yet

    def message(self, text: str) -> None:
        self.messages.append(text)

    def rewind(self, step: int) -> None:
        self.rewound = step


def test_lasting_spikes_before_the_first_checkpoint_become_the_new_level():
    from ds_optimus.checkpoint import CheckpointError
    from ds_optimus.reliability.guards import GuardsConfig
    from ds_optimus.train.callbacks import GuardCallback

    callback = GuardCallback(GuardsConfig(window=20, min_window=5, sigmas=3.0, rollback_after=3))
    callback.trainer = trainer = _StubTrainer(interval=100)
    guard = callback.guard
    for norm in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]:
        assert not guard.decide(norm).skip
    for norm in [25.0, 24.0, 26.0]:  # a lasting jump of the gradient norm
        assert guard.decide(norm).skip and guard.last.spike
    assert guard.wants_rollback and guard.spikes_only
    callback.post_step(9)
    assert trainer.rewound is None and not guard.wants_rollback
    assert "3 spikes in a row" in trainer.messages[-1] and "taking them as the new level" in trainer.messages[-1]
    assert not guard.decide(25.0).skip  # judged afresh once min_window steps are in again

    for value in [float("nan")] * 3:  # non-finite steps are never taken as a level
        guard.observe_loss(value)
        assert guard.decide(1.0).skip
    assert not guard.spikes_only
    with pytest.raises(
        CheckpointError,
        match=r"3 bad steps in a row \(loss is nan\) and no checkpoint to roll back "
        r"to \(the first checkpoint is due at step 100\)$",
    ):
        callback.post_step(12)


class _StubTrainerWithCheckpoint(_StubTrainer):
    """A stub trainer with one checkpoint (of step 4) to roll back to."""

    def __init__(self) -> None:
        super().__init__(interval=4)
        self.callbacks, self.engine, self.summary, self.tokens_per_step = [], None, {"rollbacks": 0}, 256
        self.train_loader = self

    def latest_good(self, report):
        return Path("step_00000004")

    def load(self, target, engine):
        return 4, {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_rollbacks_to_one_checkpoint_stop_at_max_rollbacks():
    """Spikes that outlast `max_rollbacks` rollbacks to one checkpoint become the new level (rolling
    back again would only throw data away); non-finite steps that do stop the run."""
    from ds_optimus.checkpoint import CheckpointError
    from ds_optimus.reliability.guards import GuardsConfig
    from ds_optimus.train.callbacks import GuardCallback

    callback = GuardCallback(GuardsConfig(window=20, min_window=5, sigmas=3.0, rollback_after=2, max_rollbacks=2))
    callback.trainer = trainer = _StubTrainerWithCheckpoint()
    guard = callback.guard

    def bad_row(values, nan=False):
        for value in values:
            guard.observe_loss(float("nan") if nan else 1.0)
            assert guard.decide(value).skip

    for norm in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]:
        assert not guard.decide(norm).skip
    for attempt in (1, 2):  # rolled back twice to step 4
        bad_row([25.0, 24.0])
        callback.post_step(6)
        assert trainer.rewound == 4 and trainer.summary["rollbacks"] == attempt
        assert trainer.messages[-1].startswith("step 6: 2 bad steps in a row (gradient norm 24 is")
    trainer.rewound = None
    bad_row([25.0, 24.0])
    callback.post_step(6)
    assert trainer.rewound is None and trainer.summary["rollbacks"] == 2 and not guard.wants_rollback
    assert trainer.messages[-1].startswith("step 6: 2 spikes in a row (gradient norm 24 is") and trainer.messages[
        -1
    ].endswith("after 2 rollbacks to step_00000004; taking them as the new level (the guards' statistics start afresh)")
    bad_row([1.0, 1.0], nan=True)
    with pytest.raises(
        CheckpointError,
        match=r"^step 8: 2 bad steps in a row \(loss is nan\) after 2 rollbacks to "
        r"step_00000004: the run does not get past them; look at the learning "
        r"rate and the data$",
    ):
        callback.post_step(8)


def test_a_resume_with_another_global_batch_starts_the_guards_statistics_afresh():
    from ds_optimus.reliability.guards import GuardsConfig
    from ds_optimus.train.callbacks import GuardCallback

    saver = GuardCallback(GuardsConfig())
    saver.trainer = _StubTrainerWithCheckpoint()
    for norm in [1.0, 1.1, 0.9]:
        saver.guard.decide(norm)
    saver.guard.skipped = 2  # the count of skipped updates is the run's, kept either way
    state = saver.state_dict()
    assert state["norms"] == [1.0, 1.1, 0.9] and state["tokens_per_step"] == 256
    for tokens, kept in [(256, [1.0, 1.1, 0.9]), (128, [])]:
        resumed = GuardCallback(GuardsConfig())
        resumed.trainer = _StubTrainerWithCheckpoint()
        resumed.trainer.tokens_per_step = tokens
        resumed.load_state_dict(state)
        assert list(resumed.guard.norms) == kept and resumed.guard.skipped == 2
        assert resumed.note == (
            None if kept else "the numerical guards' statistics start afresh: they were measured at 256 tokens a step"
        )


@pytest.mark.slow
def test_a_users_callback_state_resumes_exactly_and_a_stop_at_the_last_step_still_exports(tmp_path, cache):
    config = tiny_config(
        tmp_path, cache, train={"steps": 6, "eval_interval": 0, "stop_after_steps": 4}, checkpoint={"interval": 0}
    )
    first, seen = run_distributed(counting_worker, 1, config, None)[0]
    assert (first["start_step"], seen, first["finished"]) == (0, 4, False)
    config["optimus"]["train"]["stop_after_steps"] = None
    second, seen = run_distributed(counting_worker, 1, config, 6)[0]  # it asks for a stop at the last step
    assert (second["start_step"], seen) == (4, 6)  # its count was saved with step 4's checkpoint
    assert second["finished"] and (tmp_path / "run" / "hf" / "config.json").exists()


class _Closing:
    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def on_exit(self, error) -> None:  # the last word, said before any callback closes
        self.log.append(("exit", self))

    def close(self, error) -> None:
        self.log.append(self)
        if self.fail:
            raise RuntimeError("could not close")


def test_close_reaches_every_callback_and_keeps_the_error(tmp_path):
    from types import SimpleNamespace

    from ds_optimus.train import Trainer

    log: list = []
    first, failing = _Closing(log), _Closing(log, fail=True)
    stub = SimpleNamespace(callbacks=[first, failing], rank=0, log_every_rank=False, output_dir=tmp_path, sink=None)
    with pytest.raises(RuntimeError, match="could not close"):
        Trainer.close(stub)  # a clean end: the callback's failure is raised, after every callback closed
    assert log == [("exit", first), ("exit", failing), failing, first]
    log.clear()
    Trainer.close(stub, ValueError("bad batch\nmore lines"))  # an error already on its way wins
    assert log == [("exit", first), ("exit", failing), failing, first]
    assert (tmp_path / "log.txt").read_text().endswith("the run stopped on an error: ValueError: bad batch\n")


def test_the_watchdog_allows_long_work_its_own_time_out_and_nothing_else():
    from types import SimpleNamespace

    from ds_optimus.reliability.watchdog import WatchdogConfig
    from ds_optimus.train.callbacks import WatchdogCallback

    beats = []
    callback = WatchdogCallback(WatchdogConfig(step_timeout_s=10, first_step_timeout_s=60, checkpoint_timeout_s=300))
    callback.trainer = SimpleNamespace(start_step=4)
    callback.watchdog = SimpleNamespace(beat=lambda timeout, what: beats.append((timeout, what)))
    callback.pre_step(5)
    callback.post_step(5)
    callback.on_long_work("the checkpoint of step 5")
    callback.pre_step(6)
    assert beats == [(60, "step 5"), (10, "the work after step 5"), (300, "the checkpoint of step 5"), (10, "step 6")]


def test_the_watchdog_writes_each_line_whole_and_marked_with_its_rank():
    """Every rank waiting on the hung one fires at once into the launcher's pipe: each line of a dump
    goes out by one write of at most PIPE_BUF bytes, prefixed with the rank, so dumps mix by line only."""
    import os
    import threading

    from ds_optimus.reliability.watchdog import Watchdog

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as log:
        watchdogs = [Watchdog(rank, log=log) for rank in (0, 1)]
        stacks = "".join(f'  File "f.py", line {i}, in frame_{i}\n' for i in range(200)) + "x" * 9000
        writers = [threading.Thread(target=w._write, args=(stacks,)) for w in watchdogs]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        for watchdog in watchdogs:
            watchdog.close()
    with os.fdopen(read_end) as pipe:
        lines = [line for line in pipe.read().splitlines() if line]  # each dump starts on a fresh line
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert [line.removeprefix(f"[rank {rank}] ") for line in mine[:200]] == stacks.splitlines()[:200]
        assert len(mine) == 201 and len(mine[-1]) == 4095  # the over-long line cut to fit one pipe write
    assert len(lines) == 402


def test_the_watchdogs_stack_dump_names_every_thread_and_its_frames():
    import threading

    from ds_optimus.reliability.watchdog import thread_stacks

    release = threading.Event()

    def parked_in_a_collective():
        release.wait()

    thread = threading.Thread(target=parked_in_a_collective, name="worker")
    thread.start()
    try:
        text = thread_stacks()
    finally:
        release.set()
        thread.join()
    assert '"worker"' in text and "in parked_in_a_collective" in text
    assert '"MainThread"' in text and "in test_the_watchdogs_stack_dump_names_every_thread_and_its_frames" in text


def test_setup_moe_says_what_it_takes():
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM
    from ds_optimus.parallel import setup_moe

    with pytest.raises(TypeError, match=r"^setup_moe takes a parsed optimus section, not dict: "):
        setup_moe(MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe")), {"optimus": {}})

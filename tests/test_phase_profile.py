"""The phase profiler (`optimus.profile`): its arithmetic on a clock that counts, the collectives it
counts through every caller (torch.distributed, DeepSpeed's comm layer, ds_optimus' exchanges and
optimizer, PyTorch's batched point-to-point), and profiled training runs whose metrics.jsonl holds
phase times that add up to the step, collective bytes equal to what the expert exchange and the
sharded optimizer send, the ranks' jitter from the step's own reduction, and a plot; off by default."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from train_workers import tiny_config

from ds_optimus.config import OptimusConfig
from ds_optimus.schema import ConfigError
from ds_optimus.train import Callback, Trainer
from ds_optimus.train.callbacks import GuardCallback, PhaseProfileCallback, default_callbacks
from ds_optimus.train.phase_profile import (
    COLLECTIVES,
    CollectiveRecorder,
    HostClock,
    ProfileWindow,
    StepTimer,
)

PHASES = ("data", "forward", "backward", "reduce", "optimizer")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


# -- config -------------------------------------------------------------------------------------------


def test_off_by_default_and_placed_before_the_guards_when_on():
    assert OptimusConfig().profile.enabled is False
    assert not any(isinstance(c, PhaseProfileCallback) for c in default_callbacks(OptimusConfig()))
    callbacks = default_callbacks(OptimusConfig.from_ds_config({"optimus": {"profile": {"enabled": True}}}))
    kinds = [type(c) for c in callbacks]
    # its post_step must run even when the guards roll the step back (which skips the later ones)
    assert kinds.index(PhaseProfileCallback) < kinds.index(GuardCallback)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"enabled": "yes"}, "optimus.profile.enabled must be true or false, got 'yes'"),
        ({"interval": 0}, "optimus.profile.interval must be a positive integer, got 0"),
        ({"interval": 2.5}, "optimus.profile.interval must be a positive integer, got 2.5"),
        ({"interval": True}, "optimus.profile.interval must be a positive integer, got True"),
        ({"collectives": None}, "optimus.profile.collectives must be true or false, got None"),
        ({"plot": True}, "optimus.profile: unknown key 'plot' (known: enabled, interval, collectives)"),
    ],
)
def test_bad_values_are_one_line_errors(values, message):
    with pytest.raises(ConfigError) as err:
        OptimusConfig.from_ds_config({"optimus": {"profile": values}})
    assert str(err.value) == message and "\n" not in str(err.value)


# -- the arithmetic -----------------------------------------------------------------------------------


class CountingClock(HostClock):
    """Each mark one second after the previous: every interval is known exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        self.now += 1.0
        return self.now


def test_phases_add_up_over_micro_batches_and_the_rest_is_the_step_outside_them():
    """On a clock whose every mark is one second after the previous, each phase lasts 1 s and so does
    each gap between two phases: the rest is the step's gaps."""
    timer = StepTimer(CountingClock())
    for micro in range(2):
        for name in ["data", "forward", "backward"] + (["reduce"] if micro == 1 else []) + ["optimizer"]:
            with timer.phase(name):
                pass
    profile = timer.finish()
    # marks 1-2 data, 3-4 forward, 5-6 backward, 7-8 optimizer, 9-10 data, ... 15-16 reduce, 17-18 optimizer
    assert profile.phases == {"data": 2.0, "forward": 2.0, "backward": 2.0, "optimizer": 2.0, "reduce": 1.0}
    assert profile.step_s == 17.0
    assert profile.metrics()["profile/rest_s"] == 17.0 - 9.0  # the 8 one-second gaps between the 9 phases
    assert (profile.before_reduce_s, profile.reduce_s) == (14.0, 1.0)
    assert StepTimer(CountingClock()).finish() is None  # no phase ran: nothing to report


def test_a_log_interval_reports_means_and_the_ranks_spread():
    window = ProfileWindow()
    assert not window
    window.add({"profile/forward_s": 1.0, "profile/comm/all_reduce_bytes": 8, "profile/comm/all_reduce_ranks": 2})
    window.add({"profile/forward_s": 3.0, "profile/comm/all_reduce_bytes": 8, "profile/comm/all_reduce_ranks": 4})
    # two ranks, the previous profiled step: compute times 1 and 3, waits 2 and 2
    window.add_ranks(
        {
            "profile/ranks": 2,
            "profile/compute": 4.0,
            "profile/compute_sq": 10.0,
            "profile/wait": 4.0,
            "profile/wait_sq": 8.0,
        },
        step=7,
    )
    record = window.take()
    assert record == {
        "profile/forward_s": 2.0,
        "profile/comm/all_reduce_bytes": 8,
        "profile/comm/all_reduce_ranks": 4,
        "profile/compute_s": 2.0,
        "profile/compute_std_s": 1.0,
        "profile/jitter_s": 2.0,
        "profile/jitter_std_s": 0.0,
        "profile/ranks_step": 7,
    }
    assert isinstance(record["profile/comm/all_reduce_bytes"], int)
    assert not window and window.take() == {}


def test_every_wrapped_function_has_the_arguments_it_reads():
    import inspect

    import torch.distributed as dist

    found = 0
    for name, (_, sent) in COLLECTIVES.items():
        function = getattr(dist, name, None)
        if function is None:
            continue
        found += 1
        parameters = inspect.signature(function).parameters
        assert sent is None or sent in parameters, (name, sent, list(parameters))
    assert found >= 20
    from torch.distributed import distributed_c10d

    recorder, before, isend = CollectiveRecorder(), dist.all_reduce, dist.isend
    recorder.install(StepTimer(HostClock()))
    try:
        assert dist.all_reduce is not before and dist.all_reduce.__wrapped__ is before
        # P2POp compares its operation with distributed_c10d's own: the same wrapper there
        assert dist.isend is distributed_c10d.isend is not isend and dist.irecv is distributed_c10d.irecv
    finally:
        recorder.uninstall()
    assert dist.all_reduce is before and dist.isend is distributed_c10d.isend is isend


# -- the collectives ------------------------------------------------------------------------------------


def collectives_worker(rank: int, world: int) -> dict:
    """Inside a phase, one call through each way the step's collectives are made; returns the counts."""
    import deepspeed
    import deepspeed.comm as ds_comm
    import deepspeed.comm.comm as ds_backend
    import torch.distributed as dist

    from ds_optimus.parallel.collectives import collective
    from ds_optimus.parallel.dispatch import all_to_all

    deepspeed.init_distributed(dist_backend="gloo")
    originals = {name: getattr(dist, name) for name in ("all_reduce", "batch_isend_irecv", "isend")}
    bound = ds_backend.cdb.all_gather_function
    made_before = dist.P2POp(dist.isend, torch.ones(5), 1 - rank)
    timer, recorder = StepTimer(HostClock()), CollectiveRecorder()
    recorder.install(timer)
    x = torch.ones(6, dtype=torch.float32)  # 24 bytes
    dist.all_reduce(x)  # outside any phase: not counted
    with timer.phase("work"):
        dist.all_reduce(x)  # the module's function
        ds_comm.all_reduce(x)  # DeepSpeed's comm layer, which looks it up on the module at call time
        ds_comm.allgather_fn(torch.zeros(12), x)  # ZeRO's all-gather: DeepSpeed's backend kept the function
        ds_comm.reduce_scatter_fn(torch.zeros(3), x)  # ZeRO's reduce-scatter: likewise
        collective("all_gather")(torch.zeros(12), x, async_op=True).wait()  # the sharded optimizer's
        all_to_all(torch.ones(4, 2, dtype=torch.float64), [2, 2], [2, 2], None)  # the expert exchange: 64 bytes
        peer = 1 - rank
        # PyTorch's pipeline schedules: a mixed batch (a P2POp made before the wrappers went in, one after),
        # then lone isend/irecv (for a batch of sends only, or of receives only)
        ops = [made_before, dist.P2POp(dist.irecv, torch.zeros(5), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        made_during = dist.P2POp(dist.isend, torch.ones(3), peer)
        works = [dist.isend(torch.ones(7), peer), dist.irecv(torch.zeros(7), peer)]
        for work in works:
            work.wait()
        gathered = [None] * world
        dist.all_gather_object(gathered, rank)  # once, not also as the all-gathers inside it
    recorder.uninstall()
    restored = (
        all(getattr(dist, name) is function for name, function in originals.items())
        and ds_backend.cdb.all_gather_function is bound
    )
    # a P2POp made while the wrappers were in, run by the original batch_isend_irecv after
    for work in dist.batch_isend_irecv([made_during, dist.P2POp(dist.irecv, torch.zeros(3), peer)]):
        work.wait()
    return {
        "comm": timer.finish().comm,
        "restored": restored,
        "gathered": gathered,
        "phases": [call[1] for call in timer.calls],
    }


@pytest.mark.slow
def test_collectives_are_counted_once_through_every_caller():
    for got in run_distributed(collectives_worker, 2):
        comm = got["comm"]
        assert got["restored"] and got["gathered"] == [0, 1] and set(got["phases"]) == {"work"}
        assert {kind: entry["calls"] for kind, entry in comm.items()} == {
            "all_reduce": 2,
            "all_gather": 2,
            "reduce_scatter": 1,
            "all_to_all": 1,
            "send": 2,
            "recv": 2,
            "all_gather_object": 1,
        }
        assert {kind: entry["bytes"] for kind, entry in comm.items()} == {
            "all_reduce": 2 * 24,
            "all_gather": 2 * 24,
            "reduce_scatter": 24,
            "all_to_all": 64,
            "send": 20 + 28,
            "recv": 20 + 28,
            "all_gather_object": 0,
        }
        assert comm["all_reduce"]["ranks"] == 2 and comm["send"]["ranks"] == 2
        assert all(entry["s"] >= 0 for entry in comm.values())


# -- profiled training runs ----------------------------------------------------------------------------


class Collector(Callback):
    """Every profiled step's `StepProfile` of this rank (runs after the profiler)."""

    def __init__(self) -> None:
        self.profiles: dict[int, dict] = {}

    def post_step(self, step: int) -> None:
        profiler = next(c for c in self.trainer.callbacks if isinstance(c, PhaseProfileCallback))
        last = profiler.last
        if last is not None and step % profiler.interval == 0:
            self.profiles[step] = {**last.metrics(), "before_reduce_s": last.before_reduce_s}


def profiled_run_worker(rank: int, world: int, config: dict) -> dict:
    """Train `config` with a `Collector`; returns this rank's profiles, what its sharded optimizer sent,
    the model's exchange shapes, and rank 0's metrics.jsonl records."""
    collector = Collector()
    trainer = Trainer(config, callbacks=[collector])
    phases_while_built = trainer.phases
    trainer.train()
    path = Path(config["optimus"]["train"]["output_dir"]) / "metrics.jsonl"
    model = trainer.engine.module.config
    optimizer = trainer.engine.optimizer
    return {
        "profiles": collector.profiles,
        "comm_bytes": dict(getattr(optimizer, "comm_bytes", {})),
        "moe_layers": len(model.moe_layers),
        "experts": model.num_experts,
        "top_k": model.num_experts_per_tok,
        "hidden": model.hidden_size,
        "tokens": trainer.micro_batch * trainer.opt.data.seq_len,
        "accumulation": trainer.accumulation,
        "phases_while_built": phases_while_built,
        # a pipeline stage's router statistics received with the activations, float32 [rows, width]
        "stats": [chunk.num_rows * chunk.width * 4 for _, chunk in trainer.train_module.chunks or []],
        "records": [json.loads(line) for line in path.read_text().splitlines()] if rank == 0 else [],
    }


def _by_step(records: list[dict]) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return merged


def _check_phases_add_up(record: dict, phases) -> None:
    """Each phase took time; the phases and the rest make the profiled span, which lies inside the
    trainer's own step time (the same host clock, read before and after it)."""
    assert all(record[f"profile/{name}_s"] > 0 for name in phases), record
    inside = sum(record[f"profile/{name}_s"] for name in phases)
    span = record["profile/step_s"]
    # sums of a handful of differences of the same clock: float64 rounding only (~1e-15), far below 1e-12
    assert record["profile/rest_s"] >= 0 and inside <= span * (1 + 1e-12)
    assert math.isclose(inside + record["profile/rest_s"], span, rel_tol=1e-12)
    assert span <= record["step_seconds"]  # exact: perf_counter differences of nearby readings round to none


@pytest.mark.slow
def test_an_ep2_run_reports_phases_collective_bytes_jitter_and_a_plot(tmp_path, cache):
    config = tiny_config(
        tmp_path,
        cache,
        train={"steps": 4, "eval_interval": 0, "log_interval": 1, "export": False, "plots": True},
        checkpoint={"interval": 0},
        sharded_optimizer={"enabled": True},
        expert_parallel={"size": 2, "dedup": False},  # one row a routed slot: sized by the shapes
        profile={"enabled": True},
    )
    ranks = run_distributed(profiled_run_worker, 2, config)
    steps = [1, 2, 3, 4]
    assert all(sorted(r["profiles"]) == steps and r["phases_while_built"] is None for r in ranks)
    logged = _by_step(ranks[0]["records"])
    for step in steps:
        record = logged[step]
        _check_phases_add_up(record, PHASES)
        own = ranks[0]["profiles"][step]  # what rank 0 measured is what it logged
        assert {k: record[k] for k in own if k in record} == {k: v for k, v in own.items() if k in record}
    # what the expert exchange sends, from the shapes: per MoE layer and micro-batch, each rank's token
    # counts per (rank, expert) as int64, then every routed slot's row of the hidden size out and back,
    # and again in the backward pass; the slots a rank receives, summed over ranks, are the ones sent
    shape = ranks[0]
    ep, slots = 2, shape["tokens"] * shape["top_k"]  # float32 rows; counts: ep ranks x E/ep experts each
    exchange = (
        shape["moe_layers"] * shape["accumulation"] * ep * (shape["experts"] * 8 + 4 * slots * shape["hidden"] * 4)
    )
    # gloo has no reduce-scatter the sharded optimizer can add fp32 shards with: it sends them pairwise
    sent = sum(r["profiles"][s]["profile/comm/all_to_all_bytes"] for r in ranks for s in steps)
    optimizer = sum(r["comm_bytes"]["reduce_scatter"] for r in ranks)
    assert optimizer > 0 and sent == len(steps) * exchange + optimizer
    assert all(r["profiles"][s]["profile/comm/all_gather_bytes"] > 0 for r in ranks for s in steps)  # the update
    # the ranks' jitter: step s's reduction carries step s-1's own numbers of each rank
    assert not any(key.startswith(("profile/jitter", "profile/compute")) for key in logged[1])
    for step in steps[1:]:
        record, before = logged[step], [r["profiles"][step - 1] for r in ranks]
        assert record["profile/ranks_step"] == step - 1
        for name, key in (("jitter", "profile/reduce_s"), ("compute", "before_reduce_s")):
            a, b = (p[key] for p in before)
            assert math.isclose(record[f"profile/{name}_s"], (a + b) / 2, rel_tol=1e-12)
            # the spread from the sums of squares: cancellation costs about sqrt(machine epsilon) of the values
            assert math.isclose(record[f"profile/{name}_std_s"], abs(a - b) / 2, abs_tol=1e-7 * max(a, b))
    plot = Path(config["optimus"]["train"]["output_dir"]) / "plots" / "profile.png"
    assert plot.stat().st_size > 10_000  # the run's end drew the report, the phases' plot with it


@pytest.mark.slow
def test_a_pipeline_step_is_one_phase_and_its_sends_are_the_activations(tmp_path, cache):
    """Two stages, every second step profiled: the schedule is the `pipeline` phase; the first stage
    (rank 0) sends each micro-batch's activations with the routers' statistics so far, and receives
    their gradients, of the same size."""
    config = tiny_config(
        tmp_path,
        cache,
        train={"steps": 4, "eval_interval": 0, "log_interval": 1, "export": False},
        checkpoint={"interval": 0},
        pipeline_parallel={"size": 2},
        sharded_optimizer={"enabled": True},
        profile={"enabled": True, "interval": 2},
    )
    config["gradient_accumulation_steps"] = 2
    ranks = run_distributed(profiled_run_worker, 2, config)
    logged = _by_step(ranks[0]["records"])
    assert not any(k.startswith("profile/") for k in logged[1])  # not profiled
    # step 3 is not profiled either; its reduction carried step 2's numbers of each rank
    assert {k for k in logged[3] if k.startswith("profile/")} == {
        "profile/compute_s",
        "profile/compute_std_s",
        "profile/jitter_s",
        "profile/jitter_std_s",
        "profile/ranks_step",
    }
    assert logged[3]["profile/ranks_step"] == 2 and "profile/jitter_s" not in logged[4]
    shape = ranks[0]
    activations = shape["accumulation"] * (shape["tokens"] * shape["hidden"] * 4 + ranks[1]["stats"][0])
    for step in (2, 4):
        record = logged[step]
        _check_phases_add_up(record, ("data", "pipeline", "reduce", "optimizer"))
        assert "profile/forward_s" not in record
        assert record["profile/comm/send_bytes"] == record["profile/comm/recv_bytes"] == activations


@pytest.mark.slow
def test_without_the_section_a_run_has_no_profile_fields(tmp_path, cache):
    config = tiny_config(
        tmp_path,
        cache,
        train={"steps": 2, "eval_interval": 0, "log_interval": 1, "export": False, "plots": True},
        checkpoint={"interval": 0},
    )
    got = run_distributed(plain_run_worker, 1, config)[0]
    assert got["phases"] is None and len(got["records"]) >= 2
    assert not any(key.startswith("profile") for record in got["records"] for key in record)
    assert got["plots"] and "profile.png" not in got["plots"]


def plain_run_worker(rank: int, world: int, config: dict) -> dict:
    trainer = Trainer(config)
    trainer.train()
    out = Path(config["optimus"]["train"]["output_dir"])
    return {
        "phases": trainer.phases,
        "records": [json.loads(line) for line in (out / "metrics.jsonl").open()],
        "plots": sorted(p.name for p in (out / "plots").glob("*.png")),
    }

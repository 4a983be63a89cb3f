"""The pretraining entry point: exact resume, checkpoints, metrics, export, errors, the launcher."""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from train_workers import (
    ROOT,
    child_pythonpath,
    cli_errors_worker,
    deepspeed_launcher,
    left_alive_worker,
    pretrain_worker,
    tiny_config,
)

from ds_optimus.plan.measure import free_port
from ds_optimus.train.resume import resume_changes


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def _losses(summary: dict) -> list[float]:
    return [summary["losses"][s] for s in sorted(summary["losses"])]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,ep,zero", [(1, 1, 0), (2, 2, 1), (2, 1, 2)], ids=["1proc", "2proc-ep2-zero1", "2proc-zero2"]
)
def test_stopped_and_resumed_run_has_the_same_losses_bitwise(tmp_path, cache, world, ep, zero):
    # stage 0 takes DeepSpeed's own optimizer (and the per-rank checkpoint format); 1 and 2 the sharded one
    whole = tiny_config(
        tmp_path / "whole", cache, expert_parallel={"size": ep}, sharded_optimizer={"enabled": zero > 0}
    )
    whole["zero_optimization"] = {"stage": zero}
    straight = run_distributed(pretrain_worker, world, whole)[0]

    parts = copy.deepcopy(whole)
    parts["optimus"]["train"]["output_dir"] = str(tmp_path / "parts" / "run")
    parts["optimus"]["train"]["stop_after_steps"] = 3  # stops at 3, then at 6 (resuming twice), then 8
    first = run_distributed(pretrain_worker, world, parts)[0]
    second = run_distributed(pretrain_worker, world, parts)[0]
    third = run_distributed(pretrain_worker, world, parts)[0]
    assert (first["start_step"], second["start_step"], third["start_step"]) == (0, 3, 6)
    assert not first["finished"] and third["finished"] and second["resumed_from"].endswith("step_00000003")
    resumed = _losses(first) + _losses(second) + _losses(third)
    assert resumed == _losses(straight)  # bitwise: float32 on CPU
    assert {**second["evals"], **third["evals"]} == straight["evals"]
    records = (tmp_path / "parts" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records if "loss" in json.loads(r)] == list(range(1, 9))
    assert _losses(straight)[-1] < _losses(straight)[0]


@pytest.mark.slow
def test_run_with_the_sharded_optimizer_resumes_on_another_layout(tmp_path, cache):
    """Stopped at step 4 by 2 processes at EP=2, resumed by 1 process with twice the accumulation
    (the same global batch): steps 5-8 give the losses of the run that never stopped."""
    whole = tiny_config(tmp_path / "whole", cache, expert_parallel={"size": 2})
    straight = run_distributed(pretrain_worker, 2, whole)[0]
    parts = copy.deepcopy(whole)
    parts["optimus"]["train"]["output_dir"] = str(tmp_path / "parts" / "run")
    parts["optimus"]["train"]["stop_after_steps"] = 4
    first = run_distributed(pretrain_worker, 2, parts)[0]
    one = copy.deepcopy(parts)
    one["optimus"]["expert_parallel"] = {"size": 1}
    one["optimus"]["train"]["stop_after_steps"] = None
    one["gradient_accumulation_steps"] = 2
    halved = copy.deepcopy(one)  # the same checkpoint resumed with half the global batch, for one step
    halved["optimus"]["train"].update(output_dir=str(tmp_path / "halved" / "run"), stop_after_steps=1)
    halved["gradient_accumulation_steps"] = 1
    shutil.copytree(tmp_path / "parts" / "run", tmp_path / "halved" / "run")
    second = run_distributed(pretrain_worker, 1, one)[0]
    assert (first["start_step"], second["start_step"]) == (0, 4) and second["finished"]
    expected, got = _losses(straight)[4:], _losses(second)
    assert len(got) == 4 and max(abs(a - b) / b for a, b in zip(got, expected, strict=True)) < 1e-5
    # a resume says when the global batch changed since the checkpoint, and only then
    log = (tmp_path / "parts" / "run" / "log.txt").read_text()
    assert "global batch changed" not in log
    assert (
        "the checkpoint was saved by 2 ranks (EP 2); resumed by 1 rank, its state resharded; the random "
        "generators start from the run's seed (dropout and sampling draw other numbers than before)"
    ) in log
    assert run_distributed(pretrain_worker, 1, halved)[0]["start_step"] == 4
    tokens = 2 * whole["optimus"]["data"]["seq_len"] * whole["train_micro_batch_size_per_gpu"]  # 2 ranks, gas 1
    log = (tmp_path / "halved" / "run" / "log.txt").read_text()
    assert (
        f"the global batch changed since the checkpoint: {tokens:,} -> {tokens // 2:,} tokens a step; the LR "
        "schedule and train.steps count steps, so each remaining step takes 0.5x the tokens"
    ) in log
    # the guards' statistics describe the old batch's noise: they start afresh rather than judge the new one
    assert f"the numerical guards' statistics start afresh: they were measured at {tokens:,} tokens a step" in log
    logged = [json.loads(line) for line in (tmp_path / "halved" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in logged if r.get("step") == 5 and "tokens" in r] == [4 * tokens + tokens // 2]


@pytest.mark.slow
def test_a_finished_run_leaves_nothing_alive_in_its_process(tmp_path, cache):
    """A process that lives on after a run (a notebook, a second run, the tests' pool of ranks) keeps
    none of it: the optimizer's gradient hooks on the parameters' autograd nodes, which the garbage
    collector cannot see through, are removed, and the watchdog's thread ends, so the engine, the model
    and, once the process group is destroyed, the groups (whose gloo threads poll while they live) are freed."""
    config = tiny_config(tmp_path, cache, expert_parallel={"size": 2}, sharded_optimizer={"enabled": True})
    config["zero_optimization"] = {"stage": 1}
    deepspeed_zero = tiny_config(tmp_path / "ds", cache, sharded_optimizer={"enabled": False})
    deepspeed_zero["zero_optimization"] = {"stage": 2}
    for run in (config, deepspeed_zero):
        for left in run_distributed(left_alive_worker, 2, run):
            assert left == {"engines": 0, "optimizers": 0, "watchdogs": []}, left


def test_a_resume_says_what_changed_since_the_checkpoint_only():
    from types import SimpleNamespace

    def trainer(tokens, steps, scheduler=None):
        return SimpleNamespace(
            tokens_per_step=tokens,
            opt=SimpleNamespace(train=SimpleNamespace(steps=steps)),
            ds_config={"scheduler": scheduler} if scheduler else {},
        )

    same = {"tokens_per_step": 4096, "steps": 200}
    assert resume_changes({}, trainer(4096, 200)) == resume_changes(same, trainer(4096, 200)) == []  # older: nothing
    assert resume_changes(same, trainer(8192, 220)) == [
        "the global batch changed since the checkpoint: 4,096 -> 8,192 tokens a step; the LR schedule and "
        "train.steps count steps, so each remaining step takes 2x the tokens",
        "train.steps changed since the checkpoint: 200 -> 220; the LR schedule stretches to the new length from "
        "here on",
    ]
    assert resume_changes(same, trainer(4096, 150))[0].endswith(
        "200 -> 150; the LR schedule shrinks to the new length from here on"
    )
    # a schedule whose length the config sets itself does not follow train.steps: nothing to say of it
    fixed = {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000}}
    assert resume_changes(same, trainer(4096, 220, fixed)) == []
    follows = {"type": "WarmupCosineLR", "params": {"total_num_steps": 220}}  # filled in from train.steps
    assert len(resume_changes(same, trainer(4096, 220, follows))) == 1


@pytest.mark.slow
def test_checkpoints_metrics_wandb_and_export(tmp_path, cache):
    config = tiny_config(
        tmp_path,
        cache,
        train={"steps": 8, "peak_tflops": 0.05, "sample_tokens": 8},
        checkpoint={"interval": 2, "keep_last": 2},
        wandb={"mode": "offline"},
        expert_parallel={"size": 2},
    )
    summary = run_distributed(pretrain_worker, 2, config)[0]
    run = Path(config["optimus"]["train"]["output_dir"])

    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_00000006", "step_00000008"]  # keep_last 2, nothing half-written
    assert (run / "checkpoints" / "latest").read_text() == "step_00000008"
    meta = json.loads((run / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["ep_size"] == 2 and meta["step"] == 8
    for name, record in meta["files"].items():  # the manifest: every file's size and checksum, and
        data = (run / "checkpoints" / "step_00000008" / name).read_bytes()  # the ranges an optimizer file holds
        assert record.pop("bytes") == len(data) and record.pop("crc32") == f"{zlib.crc32(data):08x}"
        assert set(record) == ({"holds"} if name.startswith("optim_") else set()), name
    assert {
        "model_dense.pt",
        "model_experts_ep000.pt",
        "model_experts_ep001.pt",
        "optim_rank00000.pt",
        "optim_rank00001.pt",
        "client_rank00001.pt",
        "engine.pt",
    } <= set(meta["files"])

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for key in (
        "loss",
        "lm_loss",
        "aux_loss",
        "z_loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
        "expert_imbalance_max",
        "expert_imbalance/layer_3",
    ):
        assert all(key in r for r in steps), key
    assert all(r["expert_imbalance_max"] >= 1.0 and 0 < r["mfu"] < 1 for r in steps)
    assert steps[0]["lr"] == pytest.approx(3e-3 / 2)  # warm-up: the first step is not at lr 0
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 8]

    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(run / "hf")
    assert model.config.num_experts == 8 and model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8
    ids = tokenizer(["The with statement is used to wrap the execution of a block"], return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).lm_loss.item()
    assert loss < 8.0  # trained (random weights give ln(4096) = 8.3)
    prompt = summary["sample_prompt"]  # the run's own data: the first words of its first held-out document
    from ds_optimus.data import load_tokenizer, parse_source, prepare_data

    data = config["optimus"]["data"]
    packed = prepare_data([parse_source("embedded")], load_tokenizer(), data["cache_dir"], data["val_fraction"])
    first = load_tokenizer().decode(packed.tokens("val").head(200).tolist())
    assert first.startswith(prompt) and summary["sample"].startswith(prompt) and len(summary["sample"]) > len(prompt)
    assert tokenizer.model_max_length == model.config.max_position_embeddings  # was 1e30


@pytest.mark.slow
def test_a_throughput_run_writes_no_checkpoint_no_export_and_a_profile_of_the_steps_asked_for(tmp_path, cache):
    """checkpoint.enabled false and train.export false: nothing but the metrics, the summary and the
    profiler's table of steps 5-6 (train.profile_steps) in the output folder."""
    config = tiny_config(
        tmp_path, cache, checkpoint={"enabled": False}, train={"export": False, "steps": 6, "profile_steps": [5, 6]}
    )
    summary = run_distributed(pretrain_worker, 1, config)[0]
    run = tmp_path / "run"
    assert summary["finished"] and "hf_dir" not in summary and len(summary["losses"]) == 6
    assert not (run / "checkpoints").exists() and not (run / "hf").exists()
    assert json.loads((run / "summary.json").read_text())["finished"]
    profile = (run / "profile.txt").read_text()
    assert profile.startswith("steps 5-6, rank 0, sorted by self_cpu_time_total")
    assert "aten::mm" in profile  # the model's matmuls are in the table


def test_bad_input_fails_with_one_line(tmp_path, cache):
    good = tiny_config(tmp_path, cache)
    cases = [
        (good, ["optimus.train.stepz=3"], "optimus.train: unknown key 'stepz'"),
        (good, [f'optimus.data.sources=["{tmp_path}/nope.jsonl"]'], "does not exist"),
        (good, ["train_batch_size=7"], "train_batch_size 7 is not train_micro_batch_size_per_gpu 4"),
        (good, ["optimus.expert_parallel.size=3"], "expert parallel size 3 does not divide the world size 1"),
        (good, ['optimus.model.overrides={"vocab_size": 1000}'], "the tokenizer has 4096 tokens"),
        (good, ['optimus.model.preset="mula-3b"'], "optimus.model.preset 'mula-3b' is not one of"),
        (
            good,
            [f'optimus.data.tokenizer="{tmp_path}/no-tokenizer"'],
            f"optimus.data.tokenizer: tokenizer folder '{tmp_path}/no-tokenizer' does not exist",
        ),
        (
            good,
            ["gradient_clippng=1.0"],  # DeepSpeed itself would train on without clipping
            "unknown DeepSpeed config key 'gradient_clippng' (did you mean 'gradient_clipping'?)",
        ),
        (
            good,
            ["zero_optimization.stagee=1"],
            "unknown DeepSpeed config key 'zero_optimization.stagee' (did you mean 'stage'?)",
        ),
        (good, ["zero_optimization.stage=3"], "zero_optimization.stage 3 is not supported"),
        (
            good,
            [f'optimus.train.output_dir="{tmp_path}/old"', "optimus.checkpoint.resume=false"],
            "checkpoint.resume is false but",
        ),
        (good, [f'optimus.train.output_dir="{tmp_path}/old"'], "was saved without the sharded optimizer; set"),
        ({k: v for k, v in good.items() if k != "optimizer"}, [], "needs an optimizer section"),
        (good, ["optimizer.params.lr=0"], "optimizer.params.lr must be a positive number, got 0"),
        (good, ["optimizer.params.betas=[0.9, 1.0]"], "optimizer.params.betas must be two numbers in [0, 1)"),
        (
            good,
            ['optimus.model.overrides={"num_experts": 0, "router_bias_update_rate": 0.01}'],
            "router_bias_update_rate 0.01 needs MoE layers",
        ),
        (good, ["optimus.train.profile_steps=[3, 2]"], "optimus.train.profile_steps must be null or [first, last]"),
        (good, ["optimus.train.profile_steps=4"], "optimus.train.profile_steps must be null or [first, last]"),
        (good, ['optimus.checkpoint.enabled="no"'], "optimus.checkpoint.enabled must be"),
        (good, ["optimus.train.export=1"], "optimus.train.export must be"),
    ]
    old_checkpoint = tmp_path / "old" / "checkpoints" / "step_00000004"
    old_checkpoint.mkdir(parents=True)
    from ds_optimus.checkpoint.files import atomic_save

    record = atomic_save({"step": 4}, old_checkpoint / "rank00000.pt")  # an intact per-rank checkpoint
    (old_checkpoint / "meta.json").write_text(
        json.dumps({"files": {"rank00000.pt": record}, "step": 4, "world_size": 1, "ep_size": 1})
    )
    results = run_distributed(cli_errors_worker, 1, [(c, o) for c, o, _ in cases], str(tmp_path))[0]
    for (_, overrides, message), (status, stderr) in zip(cases, results, strict=True):
        assert status == 2, (overrides, stderr)
        lines = [line for line in stderr.splitlines() if line.startswith("ds_optimus.train: error:")]
        assert len(lines) == 1 and message in lines[0], (overrides, stderr)
        assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_data_error_on_rank_zero_stops_every_rank_and_every_error_is_said_once(tmp_path, cache):
    """Rank 0 looks at the data sources for every rank; its error must reach the others instead of
    leaving them waiting. An error every rank raises (a layout that does not fit, a checkpoint of
    another model in the run's folder) is printed by rank 0 alone, not once per rank among a
    launcher's lines."""
    config = tiny_config(tmp_path, cache)
    other = tiny_config(tmp_path / "other", cache, train={"steps": 2}, checkpoint={"interval": 2})
    run_distributed(pretrain_worker, 2, other)  # a checkpoint of the MoE model, which a dense model meets next
    dense = ["optimus.model.preset=mula-tiny-dense", "optimus.expert_parallel.size=1"]
    cases = [
        (config, [f'optimus.data.sources=["{tmp_path}/gone/"]']),
        (config, ["optimus.expert_parallel.size=3"]),
        (other, dense),
    ]
    first, second = run_distributed(cli_errors_worker, 2, cases, str(tmp_path))
    assert [status for status, _ in first] == [status for status, _ in second] == [2, 2, 2]
    assert "does not exist" in first[0][1] and [err for _, err in second] == ["", "", ""]
    assert first[1][1].splitlines()[-1] == (
        "ds_optimus.train: error: expert parallel size 3 does not divide the world size 2"
    )
    assert (
        first[2][1]
        .splitlines()[-1]
        .endswith(
            "it is a checkpoint of another model: start in another "
            "optimus.train.output_dir, or set optimus.checkpoint.resume=false"
        )
    )


@pytest.mark.slow
def test_a_run_whose_checkpoints_are_gone_is_refused_not_started_over(tmp_path, cache):
    """A run folder whose progress.json names a checkpoint while the checkpoint folder has none (removed,
    or optimus.checkpoint.dir misspelt): the launch and `--check` refuse in one line, and the run's
    metrics are left as they were. A run that crashed before its first checkpoint starts over."""
    import shutil

    config = tiny_config(
        tmp_path, cache, train={"steps": 4, "eval_interval": 0, "export": False}, checkpoint={"interval": 2}
    )
    run_distributed(pretrain_worker, 1, config)
    run = tmp_path / "run"
    assert json.loads((run / "progress.json").read_text())["checkpoint"] == str(run / "checkpoints" / "step_00000004")
    shutil.rmtree(run / "checkpoints")
    metrics = (run / "metrics.jsonl").read_text()
    misspelt = json.loads(json.dumps(config))
    misspelt["optimus"]["checkpoint"]["dir"] = str(tmp_path / "chekpoints")
    (tmp_path / "check").mkdir()
    results = run_distributed(
        cli_errors_worker, 1, [(config, []), (misspelt, []), (config, ["--check"])], str(tmp_path / "check")
    )[0]
    for (status, stderr), folder in zip(results, ["run/checkpoints", "chekpoints", "run/checkpoints"], strict=True):
        assert status == 2 and stderr.strip().splitlines()[-1] == (
            f"ds_optimus.train: error: {run} holds a run trained to step 4, its last checkpoint {run}/checkpoints/"
            f"step_00000004, but {tmp_path}/{folder} has no complete checkpoint to resume from; refusing to start "
            "over (its metrics would be rewritten): point optimus.checkpoint.dir at its checkpoints, give another "
            "optimus.train.output_dir, or remove the folder to start over"
        ), stderr
    assert (run / "metrics.jsonl").read_text() == metrics
    # killed before its first checkpoint: nothing to resume, nothing lost by starting over
    (run / "progress.json").write_text(json.dumps({"step": 1, "time": 0.0, "checkpoint": None}))
    assert run_distributed(pretrain_worker, 1, config)[0]["start_step"] == 0


@pytest.mark.slow
def test_deepspeed_launcher_runs_the_tiny_moe_job(tmp_path, cache):
    """The README's main job, shortened: the real `deepspeed` launcher, 2 processes, EP=2; quiet: what
    it prints is its own (DeepSpeed's launcher aside), not the libraries' INFO lines, bars and tables."""
    config = tiny_config(
        tmp_path, cache, expert_parallel={"size": 2}, wandb={"mode": "offline"}, train={"sample_tokens": 8}
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    launcher = deepspeed_launcher()
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "WANDB_MODE": "offline"}
    port = free_port()
    proc = subprocess.run(
        [
            str(launcher),
            "--num_gpus",
            "2",
            "--master_port",
            str(port),
            "--module",
            "ds_optimus.train",
            "--config",
            str(path),
            "--set",
            "optimus.train.steps=6",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # DeepSpeed's CPU backend creates a 69 MB shared-memory workspace per rank; none may outlive the run
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    run = Path(config["optimus"]["train"]["output_dir"])
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(map(int, summary["losses"])) == list(range(1, 7))
    assert (run / "hf" / "config.json").exists() and (run / "hf" / "tokenizer.json").exists()
    assert proc.stdout.count("trained steps 1-6") == 1  # printed by rank 0 only
    assert "deepspeed_shm_comm" not in proc.stdout + proc.stderr  # an inference op: not built, not loaded
    lines = (proc.stdout + proc.stderr).splitlines()
    launcher_lines = [
        line for line in lines if "[launch.py:" in line or "[runner.py:" in line or "[real_accelerator.py:" in line
    ]  # the launcher's process: DeepSpeed's own
    ours = [line for line in lines if line not in launcher_lines]
    assert len([line for line in launcher_lines if "real_accelerator" in line]) == 2  # runner and launch, not ranks
    assert not [line for line in ours if "wandb:" in line or "Loading weights" in line or "] [INFO] [" in line], ours
    assert any(line.startswith("data: ") for line in ours) and len(ours) <= 16, ours
    assert list((run / "wandb").glob("offline-run-*")), "wandb ran, silently"


@pytest.mark.parametrize("path", sorted((ROOT / "ds_configs").glob("*.json")), ids=lambda p: p.stem)
def test_shipped_configs_are_valid_for_the_world_size_they_assume(path):
    from ds_optimus.config import OptimusConfig, check_optimizer_section
    from ds_optimus.hf_models.mula import MulaConfig
    from ds_optimus.parallel.groups import check_layout
    from ds_optimus.train import resolve_batch_sizes

    config = json.loads(path.read_text())
    opt = OptimusConfig.from_ds_config(config)
    check_optimizer_section(config)
    world = config["train_batch_size"] // (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
    )
    assert resolve_batch_sizes(dict(config), world) == (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    )
    model = MulaConfig.from_preset(opt.model.preset)
    if model.num_experts:
        check_layout(world, opt.expert_parallel.size, model.num_experts, opt.expert_parallel.node_size)
    assert path.stem.startswith(opt.model.preset)


@pytest.mark.slow
def test_hf_trainer_example_with_expert_parallelism_through_the_launcher(tmp_path, cache):
    """The example's plain Trainer with EP=2 from the config on 2 processes: the loss falls and the
    saved folder holds every expert."""
    config = tiny_config(
        tmp_path,
        cache,
        expert_parallel={"size": 2},
        train={"steps": 12, "warmup_steps": 2},
        checkpoint={"interval": 6, "keep_last": 2},
        sharded_optimizer={"enabled": True},
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    launcher = deepspeed_launcher()
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    # a free port: the launcher's default 29500 may be another run's beside (DeepSpeed's own tests take it)
    proc = subprocess.run(
        [
            str(launcher),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "ds_optimus.train.hf_example",
            "--config",
            str(path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = Path(config["optimus"]["train"]["output_dir"])
    summary = json.loads((run / "trainer_summary.json").read_text())
    losses = summary["losses"]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0] - 0.5
    assert summary["optimizer"] == "ShardedOptimizer"  # from the config alone, through accelerate
    # The Trainer's checkpoints go through engine.save_checkpoint, and its saved models hold all experts.
    for step in (6, 12):
        saved = run / "hf-trainer-run" / f"checkpoint-{step}"
        meta = json.loads((saved / f"global_step{step}" / "meta.json").read_text())
        assert (meta["world_size"], meta["ep_size"]) == (2, 2)
        assert json.loads((saved / "config.json").read_text())["num_experts"] == 8

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "hf-trainer")
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # gathered from both EP ranks


def test_model_from_an_hf_folder_with_and_without_weights(tmp_path):
    from ds_optimus.config import OptimusConfig
    from ds_optimus.data import load_tokenizer
    from ds_optimus.hf_models.mula import MulaConfig, MulaForCausalLM

    tokenizer = load_tokenizer()
    torch.manual_seed(1)
    trained = MulaForCausalLM(MulaConfig.from_preset("mula-tiny-moe"))
    trained.save_pretrained(tmp_path / "weights")
    MulaConfig.from_preset("mula-tiny-moe", num_hidden_layers=1).save_pretrained(tmp_path / "config-only")

    def build(path, **overrides):
        opt = OptimusConfig.from_ds_config(
            {"optimus": {"model": {"preset": None, "path": str(path), "overrides": overrides}}}
        )
        return opt.model.build(tokenizer)

    loaded = build(tmp_path / "weights")
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trained.state_dict().values(), strict=True)
    )
    fresh = build(tmp_path / "config-only", num_experts=4)
    assert fresh.config.num_hidden_layers == 1 and fresh.config.num_experts == 4
    from ds_optimus.config import ConfigError

    with pytest.raises(ConfigError, match="is not a folder"):
        build(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        build(tmp_path / "empty")


def test_an_olmoe_folder_is_converted_on_the_fly_and_incomplete_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from ds_optimus.config import ConfigError, OptimusConfig

    def build(path, **overrides):
        opt = OptimusConfig.from_ds_config({"optimus": {"model": {"path": str(path), "overrides": overrides}}})
        return opt.model.build()

    torch.manual_seed(0)
    olmoe = OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).eval()
    olmoe.to(torch.bfloat16).save_pretrained(tmp_path / "olmoe", save_original_format=True)  # as on the Hub
    olmoe.float()
    model = build(tmp_path / "olmoe")  # before: every weight but the experts loaded, the experts random
    assert type(model).__name__ == "MulaForCausalLM" and model.dtype == torch.float32
    ids = torch.randint(2, 96, (2, 12))
    want = OlmoeForCausalLM.from_pretrained(tmp_path / "olmoe", dtype=torch.float32).eval()(ids).logits
    assert torch.allclose(model.eval()(ids).logits, want, atol=1e-4)

    with pytest.raises(ConfigError, match="an OLMoE checkpoint, converted on the fly.*missing experts"):
        build(tmp_path / "olmoe", num_experts=8)

    mula = tmp_path / "mula"
    build(tmp_path / "olmoe").save_pretrained(mula)
    tensors = load_file(mula / "model.safetensors")
    for name in [n for n in tensors if "layers.1.mlp.experts" in n]:
        del tensors[name]
    save_file(tensors, mula / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"^optimus.model.path '.*mula' has no weights for model.layers.1.mlp.experts."
        r"down_proj, model.layers.1.mlp.experts.gate_up_proj: they would train from "
        r"random values",
    ):
        build(mula)

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"holds a 'llama' model, not a Mula, OLMoE or OLMo one"):
        build(tmp_path / "llama")


def test_op_builds_are_said_before_they_start_kept_per_environment_and_skipped_where_unneeded(tmp_path, monkeypatch):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    from ds_optimus.integrations.deepspeed_ops import UNNEEDED_OPS, extensions_dir, prepare_op_builds

    calls = []
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: calls.append((self.name, verbose)) or "op")
    for name in UNNEEDED_OPS:
        monkeypatch.setitem(deepspeed.ops.__compatible_ops__, name, True)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    said = []
    prepare_op_builds(say=said.append)
    prepare_op_builds(say=said.append)  # idempotent: one wrapper
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(extensions_dir())
    assert str(extensions_dir()).startswith(str(Path.home() / ".cache" / "torch_extensions" / "ds_optimus-"))
    assert not any(deepspeed.ops.__compatible_ops__[name] for name in UNNEEDED_OPS)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    assert builder.jit_load() == "op" and calls == [("fused_adam", False)]
    assert said[0] == (
        f"ds_optimus: compiling DeepSpeed's fused_adam op (DeepSpeed's Adam on this device; "
        f"optimizer.params.torch_adam: true uses PyTorch's, unbuilt): a few minutes, once per "
        f"environment, kept in {tmp_path}"
    )
    assert said[1].startswith("ds_optimus: DeepSpeed's fused_adam op is ready (")
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").write_bytes(b"")
    said.clear()
    builder.jit_load()
    assert said == [] and len(calls) == 2  # built before: loaded without a word


def test_a_busy_rendezvous_port_is_one_line(tmp_path):
    """Another job holding the launcher's port: one line that says how to pick another, not torch's traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {
            **os.environ,
            "PYTHONPATH": child_pythonpath(),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "ds_optimus.train", "--config", str(ROOT / "ds_configs" / "mula-tiny-moe-cpu.json")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ds_optimus.train: error: port {port} on 127.0.0.1 is in use (another job on this machine?): set "
        "MASTER_PORT to a free port (the deepspeed launcher: --master_port N)"
    )


def test_overrides_parse_json_values_and_reject_bad_assignments():
    from ds_optimus.config import ConfigError, apply_overrides

    config = apply_overrides(
        {"optimus": {"train": {"steps": 1}}},
        ["optimus.train.steps=20", 'optimus.data.sources=["a.txt"]', "optimus.wandb.name=run 7", "bf16.enabled=true"],
    )
    assert config["optimus"]["train"]["steps"] == 20 and config["optimus"]["data"]["sources"] == ["a.txt"]
    assert config["optimus"]["wandb"]["name"] == "run 7" and config["bf16"] == {"enabled": True}
    for bad in ["steps", "=3", "optimus..steps=1", "optimus.train.steps.x=1"]:
        with pytest.raises(ConfigError):
            apply_overrides({"optimus": {"train": {"steps": 1}}}, [bad])
    listed = {"optimus": {"data": {"sources": [{"path": "a", "weight": 1}, "embedded"]}}}
    assert apply_overrides(listed, ["optimus.data.sources.0.weight=3"])["optimus"]["data"]["sources"][0] == {
        "path": "a",
        "weight": 3,
    }  # a list's item by its index
    with pytest.raises(ConfigError, match=r"optimus.data.sources is a list of 2; give an index from 0 to 1, not '2'"):
        apply_overrides(listed, ["optimus.data.sources.2.weight=1"])


def test_cpu_ranks_share_the_cores(monkeypatch):
    from ds_optimus.train.startup import cpu_threads_per_rank

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
        assert cpu_threads_per_rank() == 4 and torch.get_num_threads() == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
        assert cpu_threads_per_rank() == 1
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
        assert cpu_threads_per_rank() == 3
    finally:
        torch.set_num_threads(before)


def test_the_engines_scheduler_gets_the_runs_length_in_a_copy():
    from ds_optimus.train.lr import with_scheduler_length

    config = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}, "steps": 1}
    filled = with_scheduler_length(config, 220)
    assert filled["scheduler"]["params"] == {"warmup_num_steps": 5, "total_num_steps": 220}
    assert config["scheduler"]["params"] == {"warmup_num_steps": 5}  # the caller's config as it was
    fixed = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}}
    assert with_scheduler_length(fixed, 220) is fixed  # a length of its own is kept
    other = {"scheduler": {"type": "WarmupLR", "params": {}}}
    assert with_scheduler_length(other, 220) is other and with_scheduler_length({}, 220) == {}


def test_batch_sizes_are_completed_the_way_deepspeed_does():
    from ds_optimus.config import ConfigError
    from ds_optimus.train import resolve_batch_sizes

    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}
    assert resolve_batch_sizes(config, 2) == (8, 4) and "gradient_accumulation_steps" not in config  # left as given
    assert resolve_batch_sizes({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4) == (8, 2)
    assert resolve_batch_sizes({"train_micro_batch_size_per_gpu": 3}, 5) == (3, 1)
    bad = [
        ({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8}, 2, "does not divide"),
        ({"train_batch_size": 7, "gradient_accumulation_steps": 2}, 2, "does not divide"),
        ({"gradient_accumulation_steps": 2}, 2, "needs train_micro_batch_size_per_gpu"),
        ({"train_micro_batch_size_per_gpu": 0}, 1, "positive integer"),
    ]
    for config, world, message in bad:
        with pytest.raises(ConfigError, match=message):
            resolve_batch_sizes(config, world)

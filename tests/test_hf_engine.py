"""Config-driven integration: with `import ds_optimus`, `deepspeed.initialize` (which the Hugging
Face Trainer reaches through accelerate) applies the config's `optimus` section to the model it
is given; a plain `Trainer` script trains Mula with expert parallelism through the `deepspeed`
launcher and through `accelerate launch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from engine_workers import client_optimizer_worker, engine_refusals_worker, engine_router_bias_worker
from train_workers import child_pythonpath, deepspeed_launcher

from ds_optimus.plan.measure import free_port  # a port of each launch's own: 29500 may be taken beside

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "hf_trainer_script.py"
STEPS, EXPERTS = 12, 8  # as the script trains: mula-tiny-moe


def test_what_the_engine_cannot_apply_is_one_line_on_every_rank():
    cases = [
        ("mula-tiny-dense", {}, {"expert_parallel": {"size": 2}}),
        ("mula-tiny-moe", {"num_experts": 3}, {"expert_parallel": {"size": 2}}),
        ("mula-tiny-moe", {}, {"expert_parallel": {"size": 4}}),
        ("mula-tiny-moe", {}, {"train": {"steps": 3}}),
        ("mula-tiny-moe", {}, {"expert_parallel": {"size": 2, "nodes": 1}}),
        ("mula-tiny-moe", {}, {"already_ep": True, "expert_parallel": {"size": 1}}),
        ("mula-tiny-moe", {}, {"already_ep": True, "moe": {"experts_backend": "looped"}}),
    ]
    first, second = run_distributed(engine_refusals_worker, 2, cases)
    assert first == second  # every rank says the same
    assert first == [
        "ConfigError: optimus.expert_parallel.size is 2, but MulaForCausalLM has no experts to shard (expert "
        "parallelism needs stacked gate_up_proj/down_proj experts, as Mula's)",
        "ConfigError: optimus.expert_parallel: expert parallel size 2 does not divide the number of experts 3",
        "ConfigError: optimus.expert_parallel: expert parallel size 4 does not divide the world size 2",
        "ConfigError: optimus.train is read by `python -m ds_optimus.train` only; deepspeed.initialize (the Hugging "
        "Face Trainer, accelerate) applies optimus.moe, optimus.expert_parallel, optimus.sharded_optimizer: remove "
        "the others (ds_optimus.train.hf_trainer.trainer_ds_config does)",
        "ConfigError: optimus.expert_parallel: unknown key 'nodes' (known: size, node_size, dedup, chunks, dispatch)",
        "ConfigError: the model is already expert-parallel at size 2, but optimus.expert_parallel.size is 1",
        "no error",  # expert-parallel already, the config sets only the backend
    ]
    assert all("\n" not in m for m in first)


def test_an_optimizer_built_before_the_engine_is_pointed_at_the_expert_shards():
    results = run_distributed(client_optimizer_worker, 2)
    for result in results:
        assert result["rows"] == EXPERTS // 2 and result["stale"] == 0
        # the shards sit in one moe group per source group, keeping its weight decay, and nothing is lost
        assert result["moe"] == [("ep_size_2", 0.1, 2)]
        assert result["counted"] == result["params"] and result["moved"] > 0 and result["same_optimizer"]


def test_the_engine_moves_the_router_bias_once_per_optimizer_step():
    first, second = run_distributed(engine_router_bias_worker, 2)
    for seen in (first, second):
        assert all(s["drives"] for s in seen)
        # micro-batches 1 and 3 only count loads; 2 and 4 end an optimizer step: the bias moves and
        # the counts start over
        assert seen[0]["bias_moved"] == 0 and seen[0]["pending"] > 0
        assert 0 < seen[1]["bias_moved"] <= 8 * 0.01 + 1e-6 and seen[1]["pending"] == 0
        assert seen[2]["bias_moved"] == seen[1]["bias_moved"] and seen[2]["pending"] > 0
        assert seen[3]["bias_moved"] != seen[1]["bias_moved"] and seen[3]["pending"] == 0
    assert first[3]["bias_moved"] == second[3]["bias_moved"]  # loads summed over ranks: the same bias


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The same Trainer script in one process without DeepSpeed, on the same global batches: its losses
    and final expert weights, what both launches must reproduce."""
    out = tmp_path_factory.mktemp("one_process")
    _launch([sys.executable, str(SCRIPT), str(out / "out"), "--one-process"], out)
    seen = json.loads((out / "out" / "rank0.json").read_text())
    assert seen["world"] == 1 and len(seen["losses"]) == STEPS
    return {
        "losses": seen["losses"],
        "experts": torch.load(out / "out" / "rank0.pt"),
        "initial": torch.load(out / "out" / "init.pt"),
    }


def _check_run(out: Path, one_process: dict, world: int = 2) -> None:
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for rank in seen:  # asserted from inside the run, at every step, on each rank
        assert rank["world"] == world and rank["expert_rows"] == [EXPERTS // world] * STEPS
        assert rank["optimizer"] == "ShardedOptimizer" and rank["moe_groups"] == 1
        # the router bias moved by the engine after every optimizer step, from loads counted since
        assert rank["pending"] == [0.0] * STEPS and 0 < rank["bias"][0] < rank["bias"][-1] <= 8 * 0.01 * STEPS
    losses = seen[0]["losses"]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.5
    # as one process trains (float32): the same batches' losses and weights, to the rounding of other
    # summation orders (the expert exchange's sums, the average over 2 ranks, the sharded update),
    # a few float32 ulps a step that 12 Adam steps carry to about 1e-6 relative
    assert losses == pytest.approx(one_process["losses"], rel=1e-5), (losses, one_process["losses"])
    meta = json.loads((out / "run" / f"checkpoint-{STEPS}" / f"global_step{STEPS}" / "meta.json").read_text())
    assert (meta["world_size"], meta["ep_size"]) == (world, world)  # the Trainer's checkpoint, through ours

    from transformers import AutoModelForCausalLM

    import ds_optimus  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    shards = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    weights = dict(model.named_parameters())
    assert len(shards[0]) == 2 * model.config.num_hidden_layers
    # every expert, as the ranks held them after training, and as one process trained them: the two runs'
    # updates agree to 1 % (measured: 1e-5 to 1e-3, the most where a routing decision near a tie went the
    # other way at some step; a lost shard or a wrong reduction differs by the whole update)
    for name in shards[0]:
        whole = torch.cat([s[name] for s in shards])
        assert torch.equal(weights[name], whole), name
        reference, initial = one_process["experts"][name], one_process["initial"][name]
        assert ((whole - reference).norm() / (reference - initial).norm()).item() < 1e-2, name


def _launch(command: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


DS_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 1},
    "optimus": {"expert_parallel": {"size": 2}, "sharded_optimizer": {"enabled": True}},
}


@pytest.mark.slow
def test_a_plain_trainer_script_through_the_deepspeed_launcher(tmp_path, one_process):
    """`TrainingArguments(deepspeed=<json with EP 2>)`, no optimizer section: the Trainer's own
    optimizer is re-pointed at the expert shards."""
    (tmp_path / "ds.json").write_text(json.dumps(DS_CONFIG))
    launcher = deepspeed_launcher()
    _launch(
        [
            str(launcher),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPT),
            str(tmp_path / "out"),
            str(tmp_path / "ds.json"),
        ],
        tmp_path,
    )
    _check_run(tmp_path / "out", one_process)


@pytest.mark.slow
def test_a_plain_trainer_script_through_accelerate_launch(tmp_path, one_process):
    """accelerate's DeepSpeed plugin with a config file that has an optimizer section: DeepSpeed
    builds it from the flat parameter list the Trainer passes, re-pointed and split into moe groups."""
    config = {
        **DS_CONFIG,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto", "torch_adam": True},
        },
    }  # no op to compile
    (tmp_path / "ds.json").write_text(json.dumps(config))
    (tmp_path / "accelerate.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nuse_cpu: true\n"
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false\n"
        f"num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nmain_process_port: {free_port()}\n"
    )
    launcher = Path(sys.executable).with_name("accelerate")
    _launch(
        [
            str(launcher),
            "launch",
            "--config_file",
            str(tmp_path / "accelerate.yaml"),
            str(SCRIPT),
            str(tmp_path / "out"),
        ],
        tmp_path,
    )
    _check_run(tmp_path / "out", one_process)

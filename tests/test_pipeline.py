"""Pipeline parallelism: stage splits, the stage build, and training runs on gloo that must equal the
one-process run (losses per step, final weights), for 1F1B and interleaved 1F1B, with expert and data
parallelism inside the stages; resume across pipeline sizes; an error or a kill on one stage ends all."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from test_fault_tolerance import launch, write_config
from train_workers import HANG_TIMEOUT_S, pretrain_worker, tiny_config

from ds_optimus.config import OptimusConfig
from ds_optimus.hf_models.mula import PRESETS, MulaConfig
from ds_optimus.parallel.build import build_model
from ds_optimus.parallel.stages import PipelineParallelConfig, layer_costs, split_layers
from ds_optimus.schema import ConfigError

STEPS = 10


# -- the pieces ----------------------------------------------------------------------------------------


def test_split_balances_layer_cost_with_the_head_on_the_last_chunk():
    costs = [1.0] * 10
    assert [len(r) for r in split_layers(costs, 0.0, 0.0, 5)] == [2] * 5
    assert [len(r) for r in split_layers(costs, 0.0, 3.0, 4)] == [3, 3, 3, 1]  # the head weighs three layers
    assert [len(r) for r in split_layers(costs, 2.0, 0.0, 4)] == [1, 3, 3, 3]
    uneven = [3.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    ranges = split_layers(uneven, 0.0, 0.0, 3)
    assert [r.start for r in ranges] == [0, 1, ranges[2].start] and ranges[-1].stop == 6
    assert max(sum(uneven[i] for i in r) for r in ranges) == 4.0  # the least possible
    with pytest.raises(ValueError):
        split_layers(costs, 0.0, 0.0, 11)
    # the seed's 220B shape over 8 stages: the last stage's head costs about one MoE layer
    config = MulaConfig(**PRESETS["mula-220b-a10b"])
    layers, embedding, head = layer_costs(config, 2048)
    assert 0.8 < head / layers[0] < 1.2
    split = PipelineParallelConfig(size=8).split(config, 2048)
    assert sum(len(r) for r in split) == 64 and max(len(r) for r in split) <= 9


def test_v_shaped_schedules_place_two_chunks_a_rank_down_and_back():
    """ZB-V and DualPipeV: rank r runs chunk r and chunk 2P - 1 - r, so the first rank holds the embedding
    and the head; the loop order of the interleaved schedules puts chunk c on rank c mod P."""
    from types import SimpleNamespace

    from ds_optimus.parallel.pipeline import stage_chunks
    from ds_optimus.parallel.stages import check_pipeline

    v = PipelineParallelConfig(size=4, schedule="zbv", virtual_stages=2)
    assert [v.stage_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    loop = PipelineParallelConfig(size=4, schedule="interleaved_zb", virtual_stages=2)
    assert [loop.stage_of(c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    config = MulaConfig(**{**PRESETS["mula-tiny-moe"], "num_hidden_layers": 8})
    held = {s: [c for c, _ in stage_chunks(v, config, 64, s)] for s in range(4)}
    assert held == {0: [0, 7], 1: [1, 6], 2: [2, 5], 3: [3, 4]}
    # DualPipeV wants at least as many micro-batches as chunks (PyTorch's own condition)
    opt = OptimusConfig.parse(
        {
            "pipeline_parallel": {"size": 4, "schedule": "dualpipev", "virtual_stages": 2},
            "sharded_optimizer": {"enabled": True},
            "model": {"preset": "mula-tiny-moe"},
        },
        "optimus",
    )
    model = SimpleNamespace(tie_word_embeddings=False)
    with pytest.raises(
        ConfigError,
        match=r"dualpipev needs at least as many micro-batches \(gradient_accumulation_"
        r"steps, 4\) as chunks of layers \(2 x 4 = 8\)",
    ):
        check_pipeline(opt, {}, model, accumulation=4)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"size": 0}, "optimus.pipeline_parallel.size must be a positive integer"),
        ({"schedule": "zb"}, "optimus.pipeline_parallel.schedule must be one of gpipe, 1f1b, interleaved_1f1b"),
        ({"size": 2, "virtual_stages": 2}, "virtual_stages 2 needs a schedule with several stages per rank"),
        ({"size": 2, "layers": [1, 1, 1]}, "optimus.pipeline_parallel.layers has 3 entries; size 2 x virtual_stages 1"),
        ({"virtual_stages": 2, "schedule": "looped_bfs"}, "and optimus.pipeline_parallel.layers need pipeline stages"),
        ({"size": 2, "schedule": "interleaved_1f1b"}, "interleaved_1f1b runs several chunks of layers per rank"),
        (
            {"size": 2, "schedule": "zbv", "virtual_stages": 3},
            "schedule zbv runs exactly two chunks of layers per rank",
        ),
    ],
)
def test_bad_pipeline_sections_are_one_line_errors(section, message):
    with pytest.raises(ConfigError) as err:
        OptimusConfig.parse({"pipeline_parallel": section}, "optimus")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_stage_builds_only_its_layers_with_the_whole_models_values():
    config = MulaConfig(**PRESETS["mula-tiny-moe"], tie_word_embeddings=False)
    whole = build_model(config, seed=3).state_dict()
    parts = [
        build_model(config, seed=3, ep_size=2, ep_rank=1, stage=([0, 1], True, False)),
        build_model(config, seed=3, stage=([2, 3], False, True)),
    ]
    first, last = (part.state_dict() for part in parts)
    assert all(
        k.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.", "model.rotary")) for k in first
    )
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    assert not any(k.startswith(("model.layers.0.", "model.layers.1.")) for k in last)
    for name, value in last.items():
        assert torch.equal(value, whole[name]), name
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(first[experts], whole[experts][4:])  # EP rank 1 of 2: experts 4..7
    assert torch.equal(first["model.layers.0.self_attn.q_proj.weight"], whole["model.layers.0.self_attn.q_proj.weight"])


def test_stage_chunks_compute_the_models_loss_and_gradients():
    """Chunks run one after the other in one process: loss, router losses and every gradient equal
    the model's own forward and backward bitwise (the router statistics carry the router losses'
    gradients back to every stage)."""
    from ds_optimus.parallel.pipeline import PipelineLoss, StageChunk, keep_stage

    config = MulaConfig(**PRESETS["mula-tiny-moe"], tie_word_embeddings=False)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    whole = build_model(config, seed=1).train()
    out = whole(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    staged = build_model(config, seed=1).train()
    keep_stage(staged, [0, 1, 2, 3], True, True)
    chunks = [
        StageChunk(staged, range(0, 1), True, False),
        StageChunk(staged, range(1, 3), False, False),
        StageChunk(staged, range(3, 4), False, True),
    ]
    loss_fn = PipelineLoss(staged, micro_batches=1)
    hidden = chunks[0](ids)
    for chunk in chunks[1:]:
        hidden = chunk(*hidden)
    loss = loss_fn(hidden, ids)
    loss.backward()
    # evaluation (the model in eval mode; a chunk's own flag is not the model's) counts no router loads
    biased = MulaConfig(**PRESETS["mula-tiny-moe"], tie_word_embeddings=False, router_bias_update_rate=1e-3)
    model = build_model(biased, seed=1).eval()
    keep_stage(model, [0, 1, 2, 3], True, True)
    with torch.no_grad():
        StageChunk(model, range(0, 4), True, True)(ids)
    assert all(
        m.load_since_update is None or not m.load_since_update.any()
        for m in model.modules()
        if hasattr(m, "load_since_update")
    )
    record = loss_fn.records[0]
    assert loss.item() == out.loss.item() and record["aux_loss"].item() == out.aux_loss.item()
    assert record["z_loss"].item() == out.z_loss.item()
    assert torch.equal(record["tokens_per_expert"], out.tokens_per_expert)
    grads = dict(whole.named_parameters())
    for name, param in staged.named_parameters():
        assert torch.equal(param.grad, grads[name].grad), name


# -- training runs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline-data")


def run_config(tmp: Path, cache: Path, name: str, micro: int, **optimus) -> dict:
    """10 steps of 8 sequences (global micro-batches of 2, 4 micro-steps), global-batch load balancing
    (so that how the micro-batch is spread over ranks does not change the aux loss) and the aux-free
    router bias besides it (each stage moves its routers' biases from its own layers' loads), fp32."""
    overrides = {"router_aux_loss_scope": "global_batch", "router_bias_update_rate": 1e-3}
    sections = {
        "train": {"steps": STEPS, "eval_interval": 5, "eval_batches": 1, "warmup_steps": 2},
        "checkpoint": {"interval": 0},
        "model": {"preset": "mula-tiny-moe", "overrides": overrides},
    }
    for section, values in optimus.items():
        if section == "model":  # the model's overrides add to these
            values = {**values, "overrides": {**overrides, **values.get("overrides", {})}}
        sections[section] = {**sections.get(section, {}), **values}
    config = tiny_config(tmp / name, cache, **sections)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=4)
    # a learning rate at which ten steps flip few near-tied routing choices: a flip turns rounding into
    # a visible difference, and processes add in other orders than one process does
    config["optimizer"]["params"]["lr"] = 1e-3
    return config


def hf_weights(config: dict) -> dict[str, torch.Tensor]:
    """The exported folder's weights: one file, or the shards its index names (each stage's own)."""
    from safetensors.torch import load_file

    folder = Path(config["optimus"]["train"]["output_dir"]) / "hf"
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(str(folder / "model.safetensors"))
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {name: value for file in files for name, value in load_file(str(folder / file)).items()}


def step_metrics(config: dict) -> dict[int, dict]:
    metrics = Path(config["optimus"]["train"]["output_dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r for r in records if "grad_norm" in r}


def assert_same_run(summary: dict, weights: dict, reference: dict, rtol: float = 1e-5, config=None) -> None:
    summary_ref, weights_ref = reference["summary"], reference["weights"]
    assert sorted(summary["losses"]) == list(range(1, STEPS + 1))
    if config is not None:
        first, first_ref = step_metrics(config)[1], reference["metrics"][1]
        # the gradient norm is every stage's (one stage's would be far smaller)
        assert first["grad_norm"] == pytest.approx(first_ref["grad_norm"], rel=1e-4)
        # every layer's expert loads, counted on the last stage from the statistics the others sent
        imbalance = {k: v for k, v in first_ref.items() if k.startswith("expert_imbalance")}
        assert len(imbalance) > 4 and {k: first[k] for k in imbalance} == pytest.approx(imbalance, rel=1e-6)
    for step, loss in summary_ref["losses"].items():
        assert summary["losses"][step] == pytest.approx(loss, rel=rtol), step
    for step, loss in summary_ref["evals"].items():  # held-out losses: after the weights' rounding (below)
        assert summary["evals"][step] == pytest.approx(loss, rel=10 * rtol), step
    # The stages' gradients equal the whole model's bitwise (test_stage_chunks_compute_the_models_loss_
    # and_gradients); across processes the gradient norm is a float32 sum in another order, and Adam
    # divides each update by the gradient's running size, so an element whose gradient is near zero
    # turns that rounding into up to one learning-rate step (3e-3) after ten steps. The mean difference
    # must stay at rounding level and no element may move more than about one step apart.
    assert weights.keys() == weights_ref.keys()
    differences = torch.cat([(weights[k] - v).abs().reshape(-1) for k, v in weights_ref.items()])
    assert differences.max() < 4e-3 and differences.mean() < 1e-5, (differences.max(), differences.mean())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """The one-process run every pipelined run must reproduce."""
    config = run_config(tmp_path_factory.mktemp("one"), cache, "one", micro=2)
    summary = run_distributed(pretrain_worker, 1, config)[0]
    return {
        "summary": summary,
        "weights": hf_weights(config),
        "metrics": step_metrics(config),
        "weight_files": list((Path(config["optimus"]["train"]["output_dir"]) / "hf").glob("*.safetensors")),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, recompute",
    [
        ({"size": 2}, True),
        ({"size": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}, ["moe", "attention", "norms"]),
        ({"size": 2, "schedule": "interleaved_zb", "virtual_stages": 2}, ["moe"]),
        ({"size": 2, "schedule": "zbv", "virtual_stages": 2}, ["norms"]),
        ({"size": 2, "schedule": "dualpipev", "virtual_stages": 2}, True),
    ],
    ids=["1f1b", "interleaved", "zero-bubble", "zbv", "dualpipev"],
)
def test_two_stages_train_as_one_process(tmp_path, cache, reference, schedule, recompute):
    """Also with activation recomputation: whole layers, or the parts of each. The export replaces the
    weights an earlier one left in the folder (from_pretrained would read those first)."""
    config = run_config(
        tmp_path, cache, "pp2", micro=2, pipeline_parallel=schedule, train={"activation_checkpointing": recompute}
    )
    stale = Path(config["optimus"]["train"]["output_dir"]) / "hf" / "model.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier export")
    summaries = run_distributed(pretrain_worker, 2, config)
    assert summaries[0]["losses"] == summaries[1]["losses"]  # every stage reports the step's loss
    assert_same_run(summaries[0], hf_weights(config), reference, config=config)
    hf = Path(config["optimus"]["train"]["output_dir"]) / "hf"
    assert sorted(p.name for p in hf.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    config_mode = (hf / "config.json").stat().st_mode & 0o777  # weights as readable as the rest (umask)
    assert {p.stat().st_mode & 0o777 for p in [*hf.glob("*.safetensors"), *reference["weight_files"]]} == {config_mode}
    from transformers import AutoModelForCausalLM  # each stage wrote its shard; the index joins them

    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    assert torch.equal(loaded["lm_head.weight"], hf_weights(config)["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [{"size": 2}, {"size": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}],
    ids=["1f1b", "interleaved"],
)
@pytest.mark.parametrize("inside", [{"expert_parallel": {"size": 2}}, {}], ids=["pp2-ep2", "pp2-dp2"])
def test_two_stages_with_expert_or_data_parallelism_inside_train_as_one_process(
    tmp_path, cache, reference, inside, schedule
):
    """Also with the sharded optimizer's state replicated over the stage's two data-parallel ranks
    (shard groups of one rank) and each stage's parameters gathered while its next forward runs: the
    export at the end has every stage's last update."""
    hybrid = {"shard_group_size": 1, "overlap_param_gather": True}
    config = run_config(
        tmp_path, cache, "pp2x2", micro=1, pipeline_parallel=schedule, sharded_optimizer=hybrid, **inside
    )
    summaries = run_distributed(pretrain_worker, 4, config)
    assert_same_run(summaries[0], hf_weights(config), reference, config=config)


@pytest.mark.slow
def test_a_checkpoint_of_two_stages_resumes_on_one_stage_and_on_four(tmp_path, cache):
    """Saved at PP 2 x EP 2 after step 5, resumed at PP 1 x EP 4, at PP 4, and at PP 2 x EP 2 under ZB-V
    (whose first rank holds the first and the last layers, read from both stages' files): the losses go on as the
    uninterrupted PP 2 x EP 2 run's (router losses off, so that how a step's sequences are grouped
    into micro-batches does not matter)."""
    quiet = {"overrides": {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}}
    seed_exchange = {"size": 2, "dispatch": "allgather"}  # inside the stages, by all-gather and reduce-scatter
    whole = run_config(
        tmp_path, cache, "whole", micro=1, pipeline_parallel={"size": 2}, expert_parallel=seed_exchange, model=quiet
    )
    expected = run_distributed(pretrain_worker, 4, whole)[0]["losses"]
    first = run_config(
        tmp_path,
        cache,
        "first",
        micro=1,
        pipeline_parallel={"size": 2},
        expert_parallel=seed_exchange,
        model=quiet,
        checkpoint={"interval": 5},
        train={"stop_after_steps": 5},
        sharded_optimizer={"shard_group_size": 1},
    )  # saved replicated, resumed sharded
    assert sorted(run_distributed(pretrain_worker, 4, first)[0]["losses"]) == [1, 2, 3, 4, 5]
    zbv = {"size": 2, "schedule": "zbv", "virtual_stages": 2}  # the same ranks, the chunks placed down and back
    for name, layout, micro, accumulation in (
        ("pp1-ep4", {"expert_parallel": {"size": 4}}, 1, 2),
        ("pp4", {"pipeline_parallel": {"size": 4}}, 2, 4),
        ("pp2-zbv", {"pipeline_parallel": zbv, "expert_parallel": seed_exchange}, 1, 4),
    ):
        config = json.loads(json.dumps(first))
        config["optimus"]["train"].update(stop_after_steps=None, output_dir=str(tmp_path / name))
        shutil.copytree(tmp_path / "first" / "run" / "checkpoints", tmp_path / name / "checkpoints")
        config["optimus"]["checkpoint"]["dir"] = str(tmp_path / name / "checkpoints")
        config["optimus"]["pipeline_parallel"] = layout.get("pipeline_parallel", {"size": 1})
        config["optimus"]["expert_parallel"] = layout.get("expert_parallel", {"size": 1})
        config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)
        now = {"pp1-ep4": "4 ranks (EP 4)", "pp4": "4 ranks (PP 4)", "pp2-zbv": None}[name]
        from ds_optimus.train.preflight import check_run  # --check says the reshard before the launch

        if now is not None:
            assert check_run(config, 4)[-1].endswith(f", saved by 4 ranks (PP 2 x EP 2): its state resharded to {now}")
        summary = run_distributed(pretrain_worker, 4, config)[0]
        assert summary["start_step"] == 5, name
        log = (tmp_path / name / "log.txt").read_text()  # and the run, with the pipeline stages on both sides
        if now is not None:
            assert f"the checkpoint was saved by 4 ranks (PP 2 x EP 2); resumed by {now}, its state resharded" in log
        for step in range(6, STEPS + 1):
            assert summary["losses"][step] == pytest.approx(expected[step], rel=1e-5), (name, step)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault", [{"kind": "raise", "step": 3, "rank": 1}, {"kind": "kill", "step": 3, "rank": 1}], ids=["error", "kill"]
)
def test_an_error_or_a_kill_on_one_stage_ends_every_stage(tmp_path, cache, fault):
    """The failing stage's error is printed; the stage that lost its peer says so in one line, without
    a traceback of its own, and nobody is left waiting."""
    config = run_config(tmp_path, cache, "fault", micro=2, pipeline_parallel={"size": 2})
    try:
        proc = launch(write_config(tmp_path, config), faults=[fault], timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("a stage was left waiting after the other failed")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "[rank0]: Traceback" not in output, output[-3000:]
    if fault["kind"] == "raise":
        assert "RuntimeError: fault injected on rank 1 at step 3" in output, output[-3000:]
        lost = [line for line in output.splitlines() if "rank 0: stopped, another rank failed first" in line]
        assert len(lost) == 1, output[-3000:]


@pytest.mark.slow
def test_what_a_pipeline_cannot_run_is_one_line_from_rank_zero(tmp_path, cache):
    from train_workers import cli_errors_worker

    config = run_config(tmp_path, cache, "bad", micro=2, pipeline_parallel={"size": 2})
    pp = ["optimus.pipeline_parallel.size=2"]
    cases = [
        (config, ["optimus.sharded_optimizer.enabled=false"]),
        (config, ["optimus.model.overrides.tie_word_embeddings=true"]),
        (config, ["optimus.pipeline_parallel.size=4"]),
        (config, [*pp, "optimus.pipeline_parallel.layers=[3,2]"]),
        (config, ["optimus.pipeline_parallel.virtual_stages=4", "optimus.pipeline_parallel.schedule=looped_bfs"]),
        (config, ["gradient_accumulation_steps=1", "train_micro_batch_size_per_gpu=8"]),
        (config, ['fp16={"enabled": true}']),
        (config, ["optimus.expert_parallel.size=2"]),
    ]
    first, second = run_distributed(cli_errors_worker, 2, cases, str(tmp_path))
    assert [status for status, _ in first] == [2] * len(cases) and [err for _, err in second] == [""] * len(cases)
    said = [err.strip().splitlines()[-1] for _, err in first]
    assert said[0].startswith("ds_optimus.train: error: optimus.pipeline_parallel needs optimus.sharded_optimizer")
    assert "ties its embedding and head" in said[1]
    assert said[2] == "ds_optimus.train: error: optimus.pipeline_parallel.size 4 does not divide the 2 ranks"
    assert said[3].endswith("optimus.pipeline_parallel.layers adds up to 5 layers; the model has 4")
    assert "8 chunks of layers (size 2 x virtual_stages 4) need at least as many decoder layers" in said[4]
    assert said[5].endswith(
        "1f1b needs at least as many micro-batches (gradient_accumulation_steps, 1) as stages "
        '(2); raise it, or use schedule "gpipe"'
    )
    assert "runs in bf16 or fp32" in said[6]
    assert said[7].endswith("expert parallel size 2 does not divide the 1 ranks of each of the 2 pipeline stages")
    # --check says the same as the run, before it starts
    from ds_optimus.schema import ConfigError as Refused
    from ds_optimus.train.preflight import check_run

    for (bad, overrides), line in zip(cases[5:7], said[5:7], strict=True):
        bad = json.loads(json.dumps(bad))
        for override in overrides:
            key, value = override.split("=", 1)
            bad[key] = json.loads(value) if key == "fp16" else int(value)
        with pytest.raises(Refused) as err:
            check_run(bad, world=2)
        assert line.endswith(str(err.value)), (line, str(err.value))


def test_only_a_communication_backends_lost_peer_is_another_ranks_failure():
    from ds_optimus.train.cli import lost_a_peer

    assert lost_a_peer(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert lost_a_peer(RuntimeError("NCCL communicator was aborted on rank 3"))
    assert not lost_a_peer(BrokenPipeError("[Errno 32] Broken pipe"))
    assert not lost_a_peer(ConnectionResetError("Connection reset by peer (wandb)"))


@pytest.mark.slow
def test_guards_skip_and_roll_back_a_pipelined_run(tmp_path, cache, monkeypatch):
    """A NaN on either stage is skipped on every rank; two in a row roll every stage back (bf16)."""
    faults = [
        {"kind": "nan_loss", "step": 3, "rank": 0},
        {"kind": "nan_loss", "step": 5, "rank": 1},
        {"kind": "nan_loss", "step": 6, "rank": 0},
    ]
    monkeypatch.setenv("DS_OPTIMUS_FAULTS", json.dumps(faults))
    config = run_config(
        tmp_path,
        cache,
        "guards",
        micro=2,
        pipeline_parallel={"size": 2},
        checkpoint={"interval": 2},
        guards={"rollback_after": 2},
        train={"steps": 8},
        sharded_optimizer={"overlap_param_gather": True},
    )  # a skipped step gathers nothing
    config["bf16"] = {"enabled": True}  # in bf16, as pipelined runs train
    summaries = run_distributed(pretrain_worker, 2, config)
    log = (Path(config["optimus"]["train"]["output_dir"]) / "log.txt").read_text()
    assert "step 3: update skipped on every rank (loss is nan)" in log
    assert "step 6: 2 bad steps in a row (loss is nan); rolled back to step_00000004" in log
    assert summaries[0]["rollbacks"] == summaries[1]["rollbacks"] == 1
    losses = [{step: loss for step, loss in summary["losses"].items() if step != 3} for summary in summaries]
    assert losses[0] == losses[1] and sorted(losses[0]) == [1, 2, 4, 5, 6, 7, 8]
    assert all(loss == loss for loss in losses[0].values())  # finite after the rollback (no NaN)


@pytest.mark.slow
def test_watchdog_stops_a_hung_stage(tmp_path, cache):
    from ds_optimus.reliability.watchdog import EXIT_HUNG

    config = run_config(
        tmp_path,
        cache,
        "hung",
        micro=2,
        pipeline_parallel={"size": 2},
        watchdog={"step_timeout_s": HANG_TIMEOUT_S, "first_step_timeout_s": 600},
    )
    proc = launch(
        write_config(tmp_path, config), faults=[{"kind": "sleep", "step": 3, "rank": 0, "seconds": 3600}], timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_HUNG, output[-3000:]
    assert f"rank 0: step 3 exceeded its {HANG_TIMEOUT_S} s time-out" in output, output[-3000:]
    hung = "\n".join(line for line in output.splitlines() if line.startswith("[rank 0] "))
    assert "in sleep_inside_step" in hung, output[-3000:]


@pytest.mark.slow
def test_bf16_gradient_communication_under_pipeline_stages(tmp_path, cache):
    """PP 2 x DP 2, 10 steps of 4 micro-batches: the deferred buckets add the micro-batches up in
    fp32, the reduce-scatter carries bf16 (half the bytes, counted), and the losses stay within the
    2e-2 that a run with bf16 weights and activations keeps to fp32 over as many steps
    (test_sharded_optimizer.py::test_bf16_weights_with_fp32_master_track_fp32: the wire alone rounds less)."""
    from train_workers import communication_worker

    runs = {}
    for wire in ("fp32", "bf16"):
        config = run_config(
            tmp_path,
            cache,
            wire,
            micro=1,
            pipeline_parallel={"size": 2},
            train={"steps": 10, "eval_interval": 0},
            sharded_optimizer={"reduce_dtype": wire},
        )
        runs[wire] = run_distributed(communication_worker, 4, config)[0]
    assert runs["bf16"]["bucket_dtypes"] == ["torch.float32"]
    assert 2 * runs["bf16"]["comm_bytes"]["reduce_scatter"] == runs["fp32"]["comm_bytes"]["reduce_scatter"] > 0
    fp32, bf16 = runs["fp32"]["losses"], runs["bf16"]["losses"]
    assert len(fp32) == 10 and 0 < max(abs(bf16[k] - fp32[k]) / abs(fp32[k]) for k in fp32) < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        {"size": 2},
        {"size": 2, "schedule": "interleaved_zb", "virtual_stages": 2},
        {"size": 2, "schedule": "zbv", "virtual_stages": 2},
    ],
    ids=["1f1b", "zero-bubble", "zbv"],
)
def test_each_stage_reduces_its_gradients_inside_the_schedules_drain(tmp_path, cache, schedule):
    """PP 2 x DP 2: by the time the schedule returns, every gradient bucket of every rank has been
    launched (each as its parameters' last backward pass produced them), so the optimizer's boundary only
    waits; the losses are those of test_two_stages_with_expert_or_data_parallelism_inside_train_as_one_process."""
    from train_workers import drain_worker

    config = run_config(tmp_path, cache, "drain", micro=1, pipeline_parallel=schedule, train={"eval_interval": 0})
    results = run_distributed(drain_worker, 4, config)
    for result in results:
        assert len(result["launched"]) == STEPS
        assert all(done == total > 0 for done, total in result["launched"]), result["launched"]
    assert results[0]["losses"] == results[1]["losses"] == results[3]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [{"size": 2}, {"size": 2, "schedule": "interleaved_zb", "virtual_stages": 2}],
    ids=["1f1b", "zero-bubble"],
)
def test_zero2_over_one_chunk_per_rank_reduces_every_micro_batch_and_keeps_no_full_gradients(
    tmp_path, cache, reference, schedule
):
    """PP 2 x DP 2 under ZeRO-2 with small buckets: 1F1B reduces each micro-batch's gradients as its
    backward pass goes, so no bucket holds gradients when a forward pass comes between two backward
    passes; the zero-bubble schedule, whose chunks' backward passes interleave, adds the step's
    gradients up in its buckets until the drain. Both runs are the one-process run."""
    from train_workers import drain_worker

    config = run_config(
        tmp_path, cache, "zero2", micro=1, pipeline_parallel=schedule, sharded_optimizer={"bucket_size": 20_000}
    )
    config["zero_optimization"] = {"stage": 2}
    results = run_distributed(drain_worker, 4, config)
    assert all(r["buckets"] >= 4 for r in results)
    held = [r["held_at_forward"] for r in results]
    assert held == [0] * 4 if "schedule" not in schedule else all(h > 0 for h in held), held
    assert_same_run(results[0], hf_weights(config), reference, config=config)

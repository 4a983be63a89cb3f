"""Tensor parallelism in the trainer (`optimus.tensor_parallel`): runs on gloo that must equal the
one-process run (losses per step, the first step's gradient norm, final weights), alone and composed
with pipeline, expert and data parallelism, for a dense and an MoE preset; a checkpoint saved at one
TP size resumes at others (and with PP and EP changed); bad TP settings are one line each."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from distributed import run_distributed
from test_pipeline import STEPS, assert_same_run, hf_weights, run_config, step_metrics
from train_workers import cli_errors_worker, pretrain_worker

# the dense preset (tied embeddings), without the MoE router settings `run_config` gives; untied under stages
DENSE = {"preset": "mula-tiny-dense", "overrides": {"router_bias_update_rate": 0.0}}
SP = {"size": 2, "sequence_parallel": True}
# the MoE preset with the router losses off: under sequence parallelism they are each rank's tokens'
# statistics, which the one-process run does not form (the aux-free bias stays on)
QUIET = {"preset": "mula-tiny-moe", "overrides": {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}}
UNTIED = {"preset": "mula-tiny-dense", "overrides": {"router_bias_update_rate": 0.0, "tie_word_embeddings": False}}


@pytest.fixture(scope="module", autouse=True)
def _fresh_workers():
    """These runs grow the kept worker processes (one pool per world size); they start from fresh workers
    and stop theirs at the module's end, so that no later test shares the 24 GB of a CI machine with
    workers every earlier test has grown (a 2-process run after this module was killed for memory)."""
    from distributed import close_pools

    close_pools()
    yield
    close_pools()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-cache")


def _reference(tmp: Path, cache: Path, **sections) -> dict:
    config = run_config(tmp, cache, "one", micro=2, sharded_optimizer={"enabled": True}, **sections)
    summary = run_distributed(pretrain_worker, 1, config)[0]
    return {"summary": summary, "weights": hf_weights(config), "metrics": step_metrics(config)}


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache):
    """The one-process runs (the MoE preset, the dense one) every tensor-parallel run must reproduce."""
    return {
        "moe": _reference(tmp_path_factory.mktemp("one-moe"), cache),
        "dense": _reference(tmp_path_factory.mktemp("one-dense"), cache, model=DENSE),
        "untied": _reference(tmp_path_factory.mktemp("one-untied"), cache, model=UNTIED),
        "quiet": _reference(tmp_path_factory.mktemp("one-quiet"), cache, model=QUIET),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, world, micro, layout",
    [
        ("dense", 2, 2, {}),
        ("untied", 4, 2, {"pipeline_parallel": {"size": 2}}),
        ("moe", 2, 2, {"train": {"activation_checkpointing": ["attention", "norms"]}}),
        ("moe", 4, 2, {"pipeline_parallel": {"size": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}}),
        ("moe", 4, 1, {"expert_parallel": {"size": 2}}),
        ("moe", 4, 1, {"sharded_optimizer": {"enabled": True, "shard_group_size": 1}}),
        ("untied", 2, 2, {"tensor_parallel": SP}),
        (
            "untied",
            4,
            2,
            {
                "tensor_parallel": SP,
                "pipeline_parallel": {"size": 2},
                "train": {"activation_checkpointing": ["attention", "norms"]},
            },
        ),
        ("untied", 4, 1, {"tensor_parallel": SP}),
        ("quiet", 2, 2, {"tensor_parallel": SP}),
        ("quiet", 4, 1, {"tensor_parallel": SP, "expert_parallel": {"size": 2}}),
        (
            "quiet",
            4,
            2,
            {
                "tensor_parallel": SP,
                "pipeline_parallel": {"size": 2, "schedule": "zbv", "virtual_stages": 2},
                "train": {"activation_checkpointing": True},
            },
        ),
    ],
    ids=[
        "dense-tp2",
        "dense-tp2-pp2",
        "moe-tp2-recompute",
        "moe-tp2-pp2-interleaved",
        "moe-tp2-ep2",
        "moe-tp2-dp2",
        "dense-tp2-sp",
        "dense-tp2-sp-pp2-recompute",
        "dense-tp2-sp-dp2",
        "moe-tp2-sp",
        "moe-tp2-sp-ep2",
        "moe-tp2-sp-pp2-zbv-recompute",
    ],
)
def test_two_tensor_parallel_ranks_train_as_one_process(tmp_path, cache, references, model, world, micro, layout):
    """Sequence parallelism: the norms, the residual stream and the MoE blocks cut along the sequence, the
    norms', routers' and experts' gradients summed over every TP position's ranks that hold them, the
    aux-free bias moved by every rank's loads.
    fp32, 10 steps of 8 sequences: the split matmuls add their products in two halves, so losses agree
    to a few float32 roundings (rel 1e-5), the gradient norm (split parts counted on every TP rank,
    replicated weights once) to 1e-6, and the weights as `assert_same_run` allows (Adam turns the
    rounding of a near-zero gradient into up to one learning-rate step)."""
    sections = {
        "tensor_parallel": {"size": 2},
        **layout,
        "sharded_optimizer": {"enabled": True, **layout.get("sharded_optimizer", {})},
    }
    if model != "moe":
        sections["model"] = {"dense": DENSE, "untied": UNTIED, "quiet": QUIET}[model]
    config = run_config(tmp_path, cache, "tp", micro=micro, **sections)
    summaries = run_distributed(pretrain_worker, world, config)
    assert all(s["losses"] == summaries[0]["losses"] for s in summaries)  # every rank reports the step's loss
    reference = references[model]
    assert_same_run(summaries[0], hf_weights(config), reference)
    first, first_ref = step_metrics(config)[1], reference["metrics"][1]
    assert first["grad_norm"] == pytest.approx(first_ref["grad_norm"], rel=1e-6)
    if model in ("moe", "quiet"):  # expert loads counted once (with SP: each rank its own tokens')
        loads = {k: v for k, v in first_ref.items() if k.startswith("expert_imbalance")}
        assert len(loads) > 4 and {k: first[k] for k in loads} == pytest.approx(loads, rel=1e-6)
    log = (Path(config["optimus"]["train"]["output_dir"]) / "log.txt").read_text()
    assert "world:" in log and "tensor parallel: groups of 2 consecutive ranks" in log
    ep = layout.get("expert_parallel", {}).get("size", 1)
    assert ("expert-parallel groups of 2" in log) == (ep == 2)  # the log names every dimension of the layout


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_at_other_tensor_pipeline_and_expert_sizes(tmp_path, cache):
    """Saved at TP 2 x EP 2 after step 5 (each TP position's part of every split weight, and optimizer
    pieces in the whole tensors' coordinates), resumed at TP 4, at TP 1 x PP 2 and at TP 1 x EP 2 (to
    step 7, whose checkpoint then resumes at TP 2 again, from whole tensors): the losses go on as the
    uninterrupted run's (router losses off and four key/value heads, so that TP 4
    divides them and how a step's sequences are grouped into micro-batches does not matter)."""
    model = {
        "preset": "mula-tiny-moe",
        "overrides": {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0, "num_key_value_heads": 4},
    }
    saved = {
        "tensor_parallel": {"size": 2},
        "expert_parallel": {"size": 2},
        "model": model,
        "sharded_optimizer": {"enabled": True},
    }
    whole = run_config(tmp_path, cache, "whole", micro=1, **saved)
    expected = run_distributed(pretrain_worker, 4, whole)[0]["losses"]
    first = run_config(
        tmp_path, cache, "first", micro=1, checkpoint={"interval": 5}, train={"stop_after_steps": 5}, **saved
    )
    assert sorted(run_distributed(pretrain_worker, 4, first)[0]["losses"]) == [1, 2, 3, 4, 5]
    runs = (
        ("tp4", "first", 4, {"tensor_parallel": {"size": 4}}, 2, "4 ranks (TP 4)", None),
        ("pp2", "first", 2, {"pipeline_parallel": {"size": 2}}, 2, "2 ranks (PP 2)", None),
        ("ep2", "first", 2, {"expert_parallel": {"size": 2}}, 1, "2 ranks (EP 2)", 2),  # to step 7, then
        ("tp2", "ep2", 2, {"tensor_parallel": {"size": 2}}, 2, "2 ranks (TP 2)", None),
    )  # from TP 1 to TP 2
    for name, source, world, layout, micro, note, stop in runs:
        config = json.loads(json.dumps(first))
        config["optimus"]["train"].update(stop_after_steps=stop, output_dir=str(tmp_path / name))
        saved_in = tmp_path / ("first/run" if source == "first" else source) / "checkpoints"
        shutil.copytree(saved_in, tmp_path / name / "checkpoints")
        config["optimus"]["checkpoint"]["dir"] = str(tmp_path / name / "checkpoints")
        for section in ("tensor_parallel", "pipeline_parallel", "expert_parallel"):
            config["optimus"][section] = layout.get(section, {"size": 1})
        config["train_micro_batch_size_per_gpu"] = micro
        summary = run_distributed(pretrain_worker, world, config)[0]
        start = 5 if source == "first" else 7
        assert summary["start_step"] == start, name
        saved_by = "4 ranks (TP 2 x EP 2)" if source == "first" else "2 ranks (EP 2)"
        log = (tmp_path / name / "log.txt").read_text()
        assert f"the checkpoint was saved by {saved_by}; resumed by {note}, its state resharded" in log
        for step in range(start + 1, start + 1 + (stop or STEPS - start)):
            assert summary["losses"][step] == pytest.approx(expected[step], rel=1e-5), (name, step)


@pytest.mark.slow
def test_what_tensor_parallelism_cannot_run_is_one_line_from_rank_zero(tmp_path, cache):
    """A TP size that does not divide the ranks, heads it does not divide, TP without the sharded
    optimizer, a bad size, sequence parallelism without TP: one line each, printed
    once; `--check` says the same before a launch."""
    base = run_config(tmp_path, cache, "bad", micro=2, sharded_optimizer={"enabled": True})
    cases = [
        (["optimus.tensor_parallel.size=4"], "optimus.tensor_parallel.size 4 does not divide the 2 ranks"),
        (
            ["optimus.tensor_parallel.size=2", "optimus.model.overrides.num_key_value_heads=1"],
            "tensor parallel size 2 does not divide the key/value heads (1)",
        ),
        (
            ["optimus.tensor_parallel.size=2", "optimus.sharded_optimizer.enabled=false"],
            "optimus.tensor_parallel needs optimus.sharded_optimizer.enabled true",
        ),
        (["optimus.tensor_parallel.size=0"], "optimus.tensor_parallel.size must be a positive integer, got 0"),
        (
            ["optimus.tensor_parallel.sequence_parallel=true"],
            "optimus.tensor_parallel.sequence_parallel needs optimus.tensor_parallel.size above 1",
        ),
    ]
    first, second = run_distributed(cli_errors_worker, 2, [(base, o) for o, _ in cases], str(tmp_path))
    assert [status for status, _ in first] == [2] * len(cases) and [err for _, err in second] == [""] * len(cases)
    for (_, err), (_, message) in zip(first, cases, strict=True):
        assert "Traceback" not in err and message in err.strip().splitlines()[-1], err[-2000:]
    from ds_optimus.train.preflight import check_run

    for overrides, message in cases[:2]:
        bad = json.loads(json.dumps(base))
        for override in overrides:
            key, value = override.split("=", 1)
            *path, last = key.split(".")
            node = bad
            for part in path:
                node = node.setdefault(part, {})
            node[last] = int(value)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_run(bad, world=2)


@pytest.mark.slow
def test_tensor_parallelism_in_bf16_trains_as_one_process_does(tmp_path, cache):
    """bf16 weights and activations: the split matmuls round their halves' sums to bf16 apart, so the
    runs agree to one bf16 rounding (2**-8 relative) in every step's loss and the first gradient norm."""
    runs = {}
    for name, world, layout in (("one", 1, {}), ("tp2", 2, {"tensor_parallel": {"size": 2}})):
        config = run_config(tmp_path, cache, name, micro=2, sharded_optimizer={"enabled": True}, **layout)
        config["bf16"] = {"enabled": True}
        runs[name] = run_distributed(pretrain_worker, world, config)[0], step_metrics(config)[1]["grad_norm"]
    (one, norm), (tp2, tp_norm) = runs["one"], runs["tp2"]
    assert sorted(tp2["losses"]) == list(range(1, STEPS + 1))
    for step, loss in one["losses"].items():
        assert tp2["losses"][step] == pytest.approx(loss, rel=2**-8), step
    assert tp_norm == pytest.approx(norm, rel=2**-8)


@pytest.mark.slow
def test_the_guards_skip_and_roll_back_a_tensor_parallel_run(tmp_path, cache, monkeypatch):
    """A non-finite loss on one rank of a TP group is skipped on both (the TP collectives carry it into the
    other's gradients; the norm is the world's); two in a row roll the run back to its last checkpoint,
    whose parts both ranks load, and the run ends with finite losses."""
    faults = [
        {"kind": "nan_loss", "step": 3, "rank": 1},
        {"kind": "nan_loss", "step": 5, "rank": 0},
        {"kind": "nan_loss", "step": 6, "rank": 1},
    ]
    monkeypatch.setenv("DS_OPTIMUS_FAULTS", json.dumps(faults))
    config = run_config(
        tmp_path,
        cache,
        "guarded",
        micro=2,
        tensor_parallel={"size": 2},
        sharded_optimizer={"enabled": True},
        guards={"rollback_after": 2},
        checkpoint={"interval": 2, "keep_last": 2},
        train={"steps": 8, "eval_interval": 0},
    )
    summaries = run_distributed(pretrain_worker, 2, config)
    assert summaries[0]["rollbacks"] == summaries[1]["rollbacks"] == 1
    losses = summaries[0]["losses"]
    assert repr(losses) == repr(summaries[1]["losses"]) and sorted(losses) == list(range(1, 9))  # nan == nan
    log = (Path(config["optimus"]["train"]["output_dir"]) / "log.txt").read_text()
    assert "step 3: update skipped on every rank (loss is nan)" in log
    assert "step 6: 2 bad steps in a row (loss is nan); rolled back to step_00000004" in log
    assert all(math.isfinite(losses[step]) for step in (5, 6, 7, 8))  # the last run of each step

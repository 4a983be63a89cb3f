"""Staggered checkpoint writes (each model file written in parts by the ranks that replicate it) and
the model-only "cold" checkpoints kept for good (`optimus.checkpoint.stagger_writes`, `keep_every`)."""

from __future__ import annotations

import json

import pytest
import torch
from distributed import run_distributed
from doc_blocks import doc_commands, ran
from train_workers import pretrain_worker, tiny_config

from ds_optimus.checkpoint.files import CheckpointError
from ds_optimus.checkpoint.manager import cold_name, consolidated_state
from ds_optimus.checkpoint.model_files import (
    compact,
    cut,
    first_writer,
    part_count,
    read_weights,
    this_ranks_parts,
    writer_of,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(37, 5, generator=g),
        "b": torch.randn(3, generator=g),
        "c": torch.tensor(2.5),
        "d": torch.randn(101, 3, 2, generator=g).bfloat16(),
        "e": torch.randn(1, 64, generator=g),
    }


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 16])
def test_parts_cut_between_rows_hold_a_share_each_and_join_back(tmp_path, parts):
    weights = _weights()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    pieces = cut(weights, parts)
    widest_row = max(t.numel() * t.element_size() // max(1, t.shape[0] if t.dim() else 1) for t in weights.values())
    share = -(-total // parts)
    for held, _ in pieces:  # no part holds more than its share and one row (a cut falls between rows)
        assert sum(t.numel() * t.element_size() for t in held.values()) <= share + widest_row
    replicas = list(range(10, 10 + max(parts, 4)))
    files, about = {}, {}
    for rank in replicas:
        written, told = this_ranks_parts("model_x", weights, {"kind": "x"}, replicas, rank, min_part_bytes=1)
        files.update(written)
        about.update(told)
    wrote = {rank: len(this_ranks_parts("model_x", weights, None, replicas, rank, 1)[0]) for rank in replicas}
    assert max(wrote.values()) == 1 and sum(wrote.values()) == min(len(replicas), total)  # one part per replica
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    joined, extra = read_weights(tmp_path, sorted(files))
    assert extra == {"kind": "x"} and joined.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(joined[name], tensor), name
    # a reader wanting some weights opens only the parts the manifest says hold them
    wanted = {"c", "e"}
    holding = {f for f, record in about.items() if wanted & set(record["names"])}
    for name in set(files) - holding:
        (tmp_path / name).rename(tmp_path / (name + ".away"))
    some, _ = read_weights(tmp_path, sorted(files), wanted.__contains__, about)
    assert all(torch.equal(some[name], weights[name]) for name in wanted)
    for name in set(files) - holding:
        (tmp_path / (name + ".away")).rename(tmp_path / name)
    (tmp_path / sorted(files)[1]).unlink()  # a part lost: one line naming it
    with pytest.raises(CheckpointError, match=r"model_x is written in \d+ parts but part 1 is not among the files"):
        read_weights(tmp_path, sorted(files)[:1] + sorted(files)[2:])


def test_a_small_file_stays_whole_and_the_parts_spread_over_the_replicas():
    assert part_count(100 * 2**20, 128, 256 * 2**20) == 1  # under a part: written whole by the first replica
    assert part_count(4400 * 2**20, 128, 256 * 2**20) == 17  # the 220B run's expert file per (stage, EP rank)
    assert part_count(4400 * 2**20, 8, 256 * 2**20) == 8  # one per replica at most
    assert [writer_of(j, 4, 128) for j in range(4)] == [0, 32, 64, 96]  # spread over the replicas' nodes
    assert [writer_of(j, 4, 128, 100) for j in range(4)] == [100, 4, 36, 68]  # from a file's own offset
    assert first_writer("model_dense_pp000", 128) != first_writer("model_experts_ep000_pp000", 128)
    assert this_ranks_parts("m", {"w": torch.zeros(4)}, None, [3, 5], 5, 2**20) == ({}, {})  # whole: the first's
    assert list(this_ranks_parts("m", {"w": torch.zeros(4)}, None, [3, 5], 3, None)[0]) == ["m.pt"]


def test_what_is_written_holds_its_own_elements_only(tmp_path):
    """A slice, or a parameter that views an optimizer's flat buffer (DeepSpeed's ZeRO and bf16
    optimizers), is written as its own elements, not the buffer's; an empty tensor survives the cut."""
    flat = torch.arange(1_000_000, dtype=torch.float32)
    view = flat[1000:1100].view(10, 10)
    assert compact(view).untyped_storage().nbytes() == 400 and torch.equal(compact(view), view)
    owned = torch.ones(3)
    assert compact(owned) is owned
    weights = {"w": flat[:4000].view(40, 100), "empty": torch.zeros(0, 5), "b": flat[4000:4100]}
    files = {}
    for rank in range(4):
        files.update(this_ranks_parts("model_y", weights, None, list(range(4)), rank, 1)[0])
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
        assert (tmp_path / name).stat().st_size < 40_000  # a quarter of 16 KB, not the 4 MB buffer
    joined, _ = read_weights(tmp_path, sorted(files))
    assert joined.keys() == weights.keys() and all(torch.equal(joined[k], v) for k, v in weights.items())


def test_cold_checkpoints_are_named_as_the_seed_named_them():
    assert cold_name(1000, 6_291_456_000) == "step1000-tokens6B"  # 1,000 steps of 3,072 x 2,048 tokens
    assert cold_name(250, 1_572_864_000) == "step250-tokens2B"
    assert cold_name(3, 1_536) == "step3-tokens2K" and cold_name(1, 512) == "step1-tokens512"


def _config(tmp_path, cache, name, stagger: bool) -> dict:
    config = tiny_config(
        tmp_path / name,
        cache,
        expert_parallel={"size": 2},
        sharded_optimizer={"enabled": True},
        train={"steps": 2, "eval_interval": 0, "export": False},
        checkpoint={"interval": 2, "keep_every": 1, "stagger_writes": stagger, "min_part_mib": 1},
    )
    return config


@pytest.mark.slow
def test_staggered_checkpoints_hold_the_same_weights_resume_and_keep_cold_copies(tmp_path, cache):
    """4 ranks, EP 2: the dense file (4.8 MiB) in 4 parts, one by each rank, and each EP rank's experts
    (3 MiB) in 2 parts by its 2 replicas; the weights are those of the same run written whole, bitwise,
    a resume on 2 ranks reads them, and the cold checkpoints of steps 1 and 2 hold the model alone
    and export on their own."""
    from ds_optimus.evaluate.export import main as export

    staggered, whole = _config(tmp_path, cache, "staggered", True), _config(tmp_path, cache, "whole", False)
    run_distributed(pretrain_worker, 4, staggered)
    run_distributed(pretrain_worker, 4, whole)
    hot = tmp_path / "staggered" / "run" / "checkpoints" / "step_00000002"
    files = json.loads((hot / "meta.json").read_text())["files"]
    dense = sorted(f for f in files if f.startswith("model_dense"))
    experts = sorted(f for f in files if f.startswith("model_experts"))
    assert dense == [f"model_dense_part{j:04d}.pt" for j in range(4)]
    assert experts == [f"model_experts_ep{q:03d}_part{j:04d}.pt" for q in range(2) for j in range(2)]
    sizes = [files[f]["bytes"] for f in dense]
    assert max(sizes) < 1.5 * 2**20  # a quarter of 4.8 MiB, and a row's and the file's overhead
    plain = tmp_path / "whole" / "run" / "checkpoints" / "step_00000002"
    assert not any("_part" in f for f in json.loads((plain / "meta.json").read_text())["files"])
    ours, reference = consolidated_state(hot), consolidated_state(plain)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)

    cold = sorted(p.name for p in (tmp_path / "staggered" / "run" / "checkpoints" / "cold").iterdir())
    assert cold == ["step1-tokens512", "step2-tokens1K"]  # 4 ranks x 4 sequences x 32 tokens a step
    kept = tmp_path / "staggered" / "run" / "checkpoints" / "cold" / "step2-tokens1K"
    meta = json.loads((kept / "meta.json").read_text())
    assert meta["model_only"] is True and meta["tokens"] == 1024
    assert not any(f.startswith("optim") for f in meta["files"])
    cold_state = consolidated_state(kept)
    assert all(torch.equal(cold_state[k], ours[k]) for k in ours)
    # the docs' command, on this run's cold checkpoint
    written = next(c for c in doc_commands() if c.text.startswith("python -m ds_optimus.evaluate.export "))
    _, _, _, cold_arg, out_arg = written.argv()
    assert cold_arg.endswith("/checkpoints/cold/step250-tokens2B") and out_arg == "hf-step250"
    ran(written.text)
    assert export([str(kept), str(tmp_path / out_arg)]) == 0
    assert export([str(tmp_path), str(tmp_path / "x")]) == 2  # not a checkpoint folder: one line
    from ds_optimus.hf_models.mula import MulaForCausalLM

    model = MulaForCausalLM.from_pretrained(tmp_path / out_arg)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], ours["model.embed_tokens.weight"])

    from ds_optimus.evaluate import resolve

    assert resolve(kept) == [(kept, tmp_path / "staggered" / "run", 2)]  # ds_optimus.evaluate scores it too
    resumed = json.loads(json.dumps(staggered))
    resumed["optimus"]["train"]["steps"] = 3
    summary = run_distributed(pretrain_worker, 2, resumed)[0]  # 2 ranks: each reads the parts of its weights
    assert summary["start_step"] == 2 and sorted(summary["losses"]) == [3]


@pytest.mark.slow
def test_cold_checkpoints_of_deepspeeds_own_optimizer_hold_the_weights_alone(tmp_path, cache):
    """2 ranks, ZeRO-1 without the sharded optimizer: the parameters view DeepSpeed's flat buffers,
    yet each of the dense file's 2 parts holds its half of the 11 MiB of weights, not the buffers; the
    cold checkpoint exports as the run's own export at the same step."""
    config = tiny_config(
        tmp_path / "zero1",
        cache,
        sharded_optimizer={"enabled": False},
        train={"steps": 1, "eval_interval": 0, "sample_tokens": 0},
        checkpoint={"interval": 0, "keep_every": 1, "min_part_mib": 1},
    )
    config["zero_optimization"] = {"stage": 1}
    run_distributed(pretrain_worker, 2, config)
    kept = tmp_path / "zero1" / "run" / "checkpoints" / "cold" / "step1-tokens256"
    files = json.loads((kept / "meta.json").read_text())["files"]
    parts = sorted(f for f in files if f.startswith("model_dense"))
    assert parts == ["model_dense_part0000.pt", "model_dense_part0001.pt"]
    assert all(files[f]["bytes"] < 7 * 2**20 for f in parts)  # about half of 11 MiB each
    from ds_optimus.hf_models.mula import MulaForCausalLM

    exported = MulaForCausalLM.from_pretrained(tmp_path / "zero1" / "run" / "hf").state_dict()
    cold = consolidated_state(kept)
    assert all(torch.equal(cold[k], exported[k]) for k in cold)

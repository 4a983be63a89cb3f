"""The EP-aware sharded optimizer: layouts, agreement with a single-process AdamW reference and with
DeepSpeed's ZeRO, checkpoints resumed on other layouts, mixed precision, guards and errors."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import optim_workers as W
import pytest
import torch
from distributed import run_distributed

from ds_optimus.checkpoint.optimizer_state import optimizer_files
from ds_optimus.optim.bucket_layout import chunked_runs, flat_runs, merge_copies, padding, split_buckets
from ds_optimus.optim.shard_state import files_holding

WORLD = 4
ROOT = Path(__file__).resolve().parents[1]


def _covered(runs, numels):
    seen = [torch.zeros(n, dtype=torch.int) for n in numels]
    for r in runs:
        seen[r.param][r.start : r.start + r.length] += 1
    return seen


@pytest.mark.parametrize("make", [flat_runs, chunked_runs])
@pytest.mark.parametrize("numels,group", [([10, 3, 7], 4), ([1], 3), ([12, 12], 2), ([5, 100, 1, 64], 8)])
def test_layouts_hold_every_element_exactly_once_in_equal_shards(make, numels, group):
    runs, size = make(numels, group)
    assert size % group == 0
    assert all((s == 1).all() for s in _covered(runs, numels))
    shard = size // group
    for r in runs:  # a run lies inside its owner's shard
        assert r.owner * shard <= r.offset and r.offset + r.length <= (r.owner + 1) * shard
    holes = sum(n for _, n in padding(runs, size))
    assert holes == size - sum(numels)
    assert sum(n for copies in merge_copies(runs).values() for _, _, n in copies) == sum(numels)


def test_chunked_layout_gives_each_rank_whole_experts():
    local_experts, rows = 8, 6  # a stacked [8, 6] expert weight and a [8, 3] one, over 4 EDP ranks
    runs, _ = chunked_runs([local_experts * rows, local_experts * 3], 4)
    for r in runs:
        per_expert = rows if r.param == 0 else 3
        assert r.start % per_expert == 0 and r.length == 2 * per_expert  # two whole experts each


def test_buckets_close_at_their_size_and_never_split_a_parameter():
    assert split_buckets([5, 5, 5, 20, 1], 10) == [[0, 1], [2, 3], [4]]


def _rel(a: dict, b: dict) -> float:
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


SPECS = {
    "EP=2 ZeRO-2": dict(ep=2, stage=2, micro=1, gas=1),
    "EP=4 ZeRO-2": dict(ep=4, stage=2, micro=1, gas=1),
    "EP=2 ZeRO-1, accumulation 2, clipping": dict(ep=2, stage=1, micro=1, gas=2, clip=0.5),
    "EP=4 ZeRO-2, accumulation 2, clipping, small buckets": dict(ep=4, stage=2, micro=1, gas=2, clip=0.5, bucket=3000),
    "EP=2 ZeRO-2, accumulation 2, overlapped reduction": dict(
        ep=2, stage=2, micro=1, gas=2, bucket=3000, sharded_options={"overlap_comm": True}
    ),
    # the norm's partial sums over rows of 97 elements: rows and a tail shorter than a row
    "EP=2 ZeRO-1, clipping, the gradient norm in rows": dict(ep=2, stage=1, micro=1, gas=1, clip=0.5, squares_row=97),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_tracks_a_single_process_adamw_reference(name):
    """4 processes, 20 steps: the per-step global loss and the gradient norm agree with one process
    running torch AdamW on the whole batch (losses within 1e-5 relative in float32)."""
    spec = dict(SPECS[name], sharded=True, steps=20)
    ours = run_distributed(W.train, WORLD, spec)
    ref = W.reference(spec, WORLD)
    assert {r["optimizer"] for r in ours} == {"ShardedOptimizer"}
    assert ref["losses"][20] < ref["losses"][1] - 0.5  # the run learns: the comparison means something
    assert _rel(ours[0]["losses"], ref["losses"]) < 1e-5
    assert _rel(ours[0]["norms"], ref["norms"]) < 1e-4
    for r in ours[1:]:  # dense weights agree on every rank
        for n, p in r["params"].items():
            if "experts" not in n:
                assert torch.equal(p, ours[0]["params"][n]), n


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_tracks_deepspeed_zero_with_moe_param_groups(stage):
    spec = dict(ep=2, stage=stage, micro=1, gas=2, clip=0.5, steps=20)
    ours = run_distributed(W.train, WORLD, dict(spec, sharded=True))[0]
    theirs = run_distributed(W.train, WORLD, dict(spec, sharded=False))[0]
    assert theirs["optimizer"] == "DeepSpeedZeroOptimizer"
    assert _rel(ours["losses"], theirs["losses"]) < 1e-5
    norms = {k: float(v) for k, v in theirs["norms"].items()}
    assert _rel(ours["norms"], norms) < 1e-4


@pytest.mark.slow
def test_pytorch_style_backward_drives_it_as_it_drives_deepspeeds_zero():
    """`loss.backward()` instead of `engine.backward(loss)`: the engine's hooks run our reduction.
    (The engine scales the gradient of every output tensor by 1/accumulation, and Mula's outputs
    include the loss's own parts, so this path differs slightly from engine.backward, for
    DeepSpeed's ZeRO exactly as for ours.)"""
    spec = dict(ep=2, stage=1, micro=1, gas=2, steps=6, torch_backward=True)
    ours = run_distributed(W.train, WORLD, dict(spec, sharded=True))[0]
    theirs = run_distributed(W.train, WORLD, dict(spec, sharded=False))[0]
    assert ours["optimizer"] == "ShardedOptimizer"
    assert _rel(ours["losses"], theirs["losses"]) < 1e-6 and ours["losses"][6] < ours["losses"][1] - 0.3


@pytest.mark.slow
def test_checkpoint_resumes_on_other_layouts(tmp_path):
    """Saved by 4 ranks at EP=2 (ZeRO-2) at step 5; resumed by 2 ranks at EP=2 (twice the
    accumulation), by 4 ranks at EP=4 in ZeRO-1 mode, and by 1 process: steps 6-10 give the losses of
    the run that never stopped (with an LR schedule that changes the rate every step)."""
    save = tmp_path / "ckpt"
    full = run_distributed(
        W.train,
        WORLD,
        dict(ep=2, stage=2, sharded=True, micro=1, gas=1, steps=10, scheduler=True, save_at=5, save_dir=str(save)),
    )[0]["losses"]
    assert (save / "latest").read_text() == "global_step5"
    meta = json.loads((save / "global_step5" / "meta.json").read_text())
    assert (meta["world_size"], meta["ep_size"]) == (4, 2)
    assert {
        "model_dense.pt",
        "model_experts_ep000.pt",
        "model_experts_ep001.pt",
        "optim_rank00003.pt",
        "engine.pt",
    } <= set(meta["files"])
    _assert_the_manifest_holds_every_element_once(meta)
    # benchmarks/checkpoint_index.py, which sizes the index at the seed's scale, lays the state out as
    # the optimizer does: for this layout (EP 2 on 4 ranks, buckets of 20,000) its runs are the manifest's
    found = importlib.util.spec_from_file_location("checkpoint_index", ROOT / "benchmarks" / "checkpoint_index.py")
    bench = importlib.util.module_from_spec(found)
    found.loader.exec_module(bench)
    model = W.tiny_model()
    laid = bench.spaces(model, model.config, pp=1, ep=2, dp=4, shard=None, bucket_size=20000)
    assert sorted(tuple(run) for owners in laid.values() for runs in owners.values() for run in runs) == sorted(
        tuple(run) for name, record in meta["files"].items() if name.startswith("optim_") for run in record["holds"]
    )
    for world, spec in [
        (4, dict(ep=2, stage=2, gas=1)),
        (2, dict(ep=2, stage=2, gas=2)),
        (4, dict(ep=4, stage=1, gas=1)),
        (1, dict(ep=1, stage=2, gas=4)),
    ]:
        resumed = run_distributed(
            W.train, world, dict(spec, sharded=True, micro=1, steps=10, scheduler=True, load=str(save))
        )
        losses = resumed[0]["losses"]
        assert sorted(losses) == [6, 7, 8, 9, 10]
        assert _rel(losses, {k: full[k] for k in losses}) < 1e-6, (world, spec)
        # A rank opens only the optimizer files its elements were saved in (the manifest says which
        # file holds what), and only the expert files of the saved EP ranks whose experts it holds.
        optim = [[f for f in r["opened"] if f.startswith("optim_")] for r in resumed]
        experts = [[f for f in r["opened"] if f.startswith("model_experts_")] for r in resumed]
        if world == 4 and spec["ep"] == 2:  # the saved layout: its own file
            assert optim == [[f"optim_rank{r:05d}.pt"] for r in range(4)], optim
        elif world == 2:  # a rank's shards span two saved ranks' dense and expert shards
            assert optim == [[f"optim_rank{q:05d}.pt" for q in qs] for qs in ((0, 1, 2), (1, 2, 3))], optim
        elif world == 4:  # EP 4, ZeRO-1: the ranks in the middle take elements from two saved ranks
            assert optim == [[f"optim_rank{q:05d}.pt" for q in qs] for qs in ((0,), (1, 2), (1, 2), (3,))], optim
        else:
            assert optim == [[f"optim_rank{r:05d}.pt" for r in range(4)]], optim
        assert all(len(e) == (2 if world == 1 else 1) for e in experts), experts


def _assert_the_manifest_holds_every_element_once(meta: dict) -> None:
    """The manifest's index of optimizer files covers every element of every parameter exactly once."""
    held: dict[str, list[tuple[int, int]]] = {}
    for name, record in meta["files"].items():
        if name.startswith("optim_"):
            for param, start, length in record["holds"]:
                held.setdefault(param, []).append((start, start + length))
    numels = {n: p.numel() for n, p in W.tiny_model().named_parameters()}
    assert held.keys() == numels.keys()
    for param, runs in held.items():
        runs.sort()
        assert runs[0][0] == 0 and runs[-1][1] == numels[param], param
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs)), param  # no gap, no overlap


def test_a_rank_opens_the_optimizer_files_that_hold_its_elements_or_all_without_an_index():
    from ds_optimus.optim.spaces import Space as Spaces

    class Space:  # this rank's runs: elements [10, 30) of "w" and [0, 5) of "b"
        names, offsets, columns = ["w", "b"], [0, 0], [None, None]
        pieces = Spaces.pieces

        def own_runs(self):
            return [(0, 10, 20, 0), (1, 0, 5, 20)]

    held = {
        "f0": [["w", 0, 10], ["b", 0, 2]],
        "f1": [["w", 10, 10]],
        "f2": [["w", 20, 20]],
        "f3": [["w", 40, 9]],
        "f4": [],
        "f5": [["b", 5, 3]],
        "f6": [["w", 0, 10]],
        "f7": [["w", 30, 10]],
        "f8": [["w", 29, 1]],
    }
    # f6 ends where this rank's run of w starts, f7 starts where it ends: neither holds any of it
    assert files_holding(held, [Space()]) == ["f0", "f1", "f2", "f8"]
    assert files_holding({**held, "f9": None}, [Space()]) == [*held, "f9"]  # a manifest from before the index
    meta = {
        "world_size": 3,
        "files": {
            "optim_rank00000.pt": {"holds": [["x", 0, 4]]},
            "optim_rank00001.pt": {"holds": []},
            "optim_rank00002.pt": {"holds": []},
        },
    }
    assert optimizer_files(meta, [Space()]) == ["optim_rank00000.pt"]  # none holds its elements: still a step
    meta["files"]["optim_rank00002.pt"] = {"holds": [["b", 3, 1]]}
    assert optimizer_files(meta, [Space()]) == ["optim_rank00002.pt"]
    assert optimizer_files({"world_size": 2, "files": ["optim_rank00000.pt", "optim_rank00001.pt"]}, [Space()]) == [
        "optim_rank00000.pt",
        "optim_rank00001.pt",
    ]  # names-only manifest


@pytest.mark.slow
def test_optimizer_state_is_sharded_exactly():
    """fp32 master + two moments: dense elements split over 4 ranks, expert elements over the EDP
    group of 2 (EP=2), and nothing else."""
    ours = run_distributed(W.train, WORLD, dict(ep=2, stage=2, sharded=True, micro=1, gas=1, steps=1))
    model = W.tiny_model()
    expert = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    dense = sum(p.numel() for p in model.parameters()) - expert
    per_rank = [r["state_bytes"]["optimizer_state"] for r in ours]
    assert sum(per_rank) == 12 * (dense + expert)  # every element once, no padding at these sizes
    assert max(per_rank) - min(per_rank) <= 12 * 64  # balanced up to a few rows
    assert all(r["state_bytes"]["gradient_buckets"] == 0 for r in ours)  # ZeRO-2 keeps no full buckets


@pytest.mark.slow
def test_bf16_weights_with_fp32_master_track_fp32():
    spec = dict(ep=2, stage=2, sharded=True, micro=1, gas=1, steps=10)
    fp32 = run_distributed(W.train, WORLD, spec)[0]["losses"]
    bf16 = run_distributed(W.train, WORLD, dict(spec, dtype="bf16"))
    assert {r["optimizer"] for r in bf16} == {"ShardedOptimizer"}
    losses = bf16[0]["losses"]
    assert _rel(losses, fp32) < 2e-2 and losses[10] < losses[1] - 0.3
    # ZeRO-1, bf16 weights, fp32 accumulation: where DeepSpeed builds its BF16 optimizer, ours is built
    zero1 = run_distributed(W.train, WORLD, dict(spec, stage=1, gas=2, dtype="bf16", grad_accum_dtype="fp32"))
    assert {r["optimizer"] for r in zero1} == {"ShardedOptimizer"}
    assert zero1[0]["losses"][10] < zero1[0]["losses"][1] - 0.3


@pytest.mark.slow
def test_bf16_gradient_communication_accumulates_in_fp32_and_halves_the_bytes():
    """reduce_dtype bf16 is the wire only: ZeRO-1's buckets add the 4 micro-steps up in fp32, the cast
    happens at the collective, each rank adds its received parts into its fp32 shard. Over 10 steps
    the losses stay closer to the fp32-wire run than a run whose weights and activations are bf16 too
    (every matmul rounded at 2^-9, not only the reduced gradient) does: measured 7.1e-5 against 3.2e-4.
    10 steps, not more: later, training amplifies either rounding to the same few 1e-3 (50 steps:
    6.5e-3 against 7.5e-3, with the order flipping at steps 15, 20, 30 and 40), which compares nothing."""
    spec = dict(ep=2, stage=1, sharded=True, micro=1, gas=4, steps=10, exchange={"dedup": False})
    fp32 = run_distributed(W.train, WORLD, dict(spec, sharded_options={"reduce_dtype": "fp32"}))[0]
    bf16 = run_distributed(W.train, WORLD, dict(spec, sharded_options={"reduce_dtype": "bf16"}))[0]
    everything = run_distributed(W.train, WORLD, dict(spec, dtype="bf16", sharded_options={"reduce_dtype": "fp32"}))[0]
    # DeepSpeed's own communication_data_type sets the same wire where reduce_dtype is unset
    deepspeeds = run_distributed(W.train, WORLD, dict(spec, deepspeed={"communication_data_type": "bf16"}))[0]
    assert bf16["bucket_dtypes"] == ["torch.float32"]  # the buckets add up in fp32
    assert 2 * bf16["comm_bytes"]["reduce_scatter"] == fp32["comm_bytes"]["reduce_scatter"] > 0  # counted
    assert deepspeeds["comm_bytes"] == bf16["comm_bytes"] and deepspeeds["losses"] == bf16["losses"]
    wire = _rel(bf16["losses"], fp32["losses"])
    assert 0 < wire <= _rel(everything["losses"], fp32["losses"]), (wire, _rel(everything["losses"], fp32["losses"]))
    assert bf16["losses"][10] < bf16["losses"][1] - 0.3


@pytest.mark.slow
def test_fp16_overflow_is_skipped_on_every_rank_and_the_scale_halves():
    runs = run_distributed(W.fp16_direct, 2)
    assert [r["skipped"] for r in runs] == [1, 1]
    scales = runs[0]["scales"]
    assert scales[3] == scales[2] / 2 and scales[8] > scales[3]  # halved at the overflow, grown after
    assert runs[0]["losses"][8] < runs[0]["losses"][1]
    for n, p in runs[1]["params"].items():
        assert torch.isfinite(p).all(), n
        if "experts" not in n:
            assert torch.equal(p, runs[0]["params"][n]), n


def test_loss_scaler_window_and_hysteresis():
    from ds_optimus.optim.sharded import LossScaler

    scaler = LossScaler(2.0**8, dynamic=True, window=3, hysteresis=2)
    for overflow, expected in [(False, 256), (True, 256), (True, 128), (False, 128), (False, 128), (False, 256)]:
        scaler.update(overflow)
        assert scaler.cur_scale == expected
    static = LossScaler(4.0)
    static.update(True)
    assert static.cur_scale == 4.0 and static.scale_loss(torch.tensor(2.0)).item() == 8.0


@pytest.mark.slow
def test_a_non_finite_gradient_skips_the_step_on_every_rank():
    spec = dict(ep=2, stage=1, sharded=True, micro=1, gas=2, steps=6, nan_at=3, nan_rank=2)
    runs = run_distributed(W.train, WORLD, spec)
    assert [r["skipped_steps"] for r in runs] == [1] * WORLD
    assert all(torch.isfinite(p).all() for r in runs for p in r["params"].values())


@pytest.mark.slow
def test_bad_settings_are_one_line_errors():
    errors = run_distributed(W.bad_settings, 2)
    assert errors[0] == errors[1]
    stage0, stage3, sgd, bucket, unused, unused_overlap = errors[0]
    assert stage0 == "optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, got 0"
    assert stage3 == "optimus.sharded_optimizer needs zero_optimization.stage 1 or 2, got 3"
    assert sgd == "the sharded optimizer runs Adam or AdamW; the config's optimizer is SGD"
    assert bucket.startswith("optimus.sharded_optimizer.bucket_size must be a positive integer")
    assert unused == (
        "optimus.sharded_optimizer.shard_group_size is set but optimus.sharded_optimizer.enabled is "
        "false: DeepSpeed's ZeRO optimizer would run without it; enable the sharded optimizer or drop "
        "the setting"
    )
    assert unused_overlap.startswith("optimus.sharded_optimizer.overlap_param_gather is set but")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_two_backward_passes_before_a_step_add_up(stage):
    for split, joint in run_distributed(W.two_backwards, 2, stage):
        assert torch.allclose(split, joint, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_second_gradient_after_its_bucket_was_reduced_is_a_clear_error():
    message = run_distributed(W.reentrant_twice, 1)[0]
    assert "got a second gradient in one backward pass" in message and "use_reentrant" in message


@pytest.mark.slow
def test_a_weight_read_outside_its_module_with_the_overlapped_gather_is_a_clear_error():
    message = run_distributed(W.stale_use, 1)[0]
    assert message.startswith("a.weight was used before its updated value arrived")
    assert "overlap_param_gather" in message


def _hybrid_cases(tmp_path) -> dict[str, dict]:
    base = dict(ep=2, stage=2, sharded=True, micro=1, gas=2, clip=0.5, steps=10, bucket=3000, scheduler=True)

    def case(group=None, overlap=False, **extra):
        return dict(base, **extra, sharded_options={"shard_group_size": group, "overlap_param_gather": overlap})

    full, hybrid = str(tmp_path / "full"), str(tmp_path / "hybrid")
    return {
        "full": case(save_at=5, save_dir=full),
        "full overlapped": case(overlap=True),
        "group 2": case(2),
        "group 2 overlapped": case(2, True, save_at=5, save_dir=hybrid),
        "group 4 overlapped": case(4, True),
        "group 1 overlapped": case(1, True),
        "ZeRO-1 group 2 overlapped": case(2, True, stage=1),
        "ZeRO-1 full": case(stage=1),
        "full, NaN at step 4": case(nan_at=4, nan_rank=3),
        "group 2 overlapped, NaN at step 4": case(2, True, nan_at=4, nan_rank=3),
        "bf16 full": case(dtype="bf16", steps=5),
        "bf16 group 2 overlapped": case(2, True, dtype="bf16", steps=5),
        # resumed at step 5 on another shard group size, both ways
        "group 2 from full": case(2, True, load=full),
        "group 1 from group 2": case(1, False, load=hybrid),
        "full from group 2": case(None, True, load=hybrid),
        "group 3": case(3, expect_error=True),
        # every EP exchange: full sharding against shard groups of 2 with the overlapped gather
        **{
            f"{label} {kind}": case(*args, steps=5, **layout)
            for label, layout in EXCHANGES.items()
            for kind, args in (("full", ()), ("group 2 overlapped", (2, True)))
        },
    }


EXCHANGES = {
    "deduplicated in 2 chunks": {"exchange": {"dedup": True, "chunks": 2}},
    "allgather": {"exchange": {"dispatch": "allgather"}},
    "hierarchical EP 4": {"ep": 4, "exchange": {"node_size": 2, "dedup": True}},
}


@pytest.mark.slow
def test_hybrid_sharding_and_the_overlapped_gather_train_as_full_sharding(tmp_path):
    """4 processes, EP 2 (dense state over 4 ranks, experts' over EDP groups of 2), 10 steps with
    accumulation, clipping and an LR schedule, in one launch: shard groups of 1, 2 and 4 ranks and
    the parameter all-gather overlapped with the next forward pass or not give the losses of full
    sharding within float32 rounding (the overlap bitwise), with the state bytes predicted; a NaN
    skips the step alike; a checkpoint of one group size resumes on another."""
    cases = _hybrid_cases(tmp_path)
    runs = run_distributed(W.hybrid_runs, WORLD, cases)
    first = runs[0]

    def losses(name):
        return first[name]["losses"]

    def close(a, b, tol=2e-6):
        return _rel(losses(a), losses(b)) < tol

    assert losses("full")[10] < losses("full")[1] - 0.3  # the run learns: the comparison means something
    # the overlap moves when the parameters arrive, not what they are
    assert losses("full overlapped") == losses("full")
    assert losses("group 2 overlapped") == losses("group 2")
    assert first["group 2 overlapped"]["digest"] == first["group 2"]["digest"]
    for name in ("group 2", "group 4 overlapped", "group 1 overlapped"):
        assert close(name, "full"), name
    assert close("ZeRO-1 group 2 overlapped", "ZeRO-1 full")
    for r in runs:  # every replica of a shard holds the same values: the dense weights agree everywhere
        assert torch.equal(r["group 2 overlapped"]["first_param"], first["group 2 overlapped"]["first_param"])
    # the last step's gather was still on its way when the run stopped; state_dict() waited for it
    assert first["group 2 overlapped"]["gather"]["pending"] > 0 and first["group 2"]["gather"]["pending"] == 0
    # state bytes: 12 per element (fp32 master, two moments), dense over the shard group (at most 4),
    # experts over theirs (at most the EDP group of 2): every element held by replicas-many ranks
    model = W.tiny_model()
    expert = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    dense = sum(p.numel() for p in model.parameters()) - expert
    for name, dense_shard, expert_shard in [
        ("full", 4, 2),
        ("group 2", 2, 2),
        ("group 4 overlapped", 4, 2),
        ("group 1 overlapped", 1, 1),
    ]:
        per_rank = {r[name]["state_bytes"]["optimizer_state"] for r in runs}
        assert per_rank == {12 * (dense // dense_shard + expert // 2 // expert_shard)}, (name, per_rank)
    # a NaN on one rank skips the step everywhere, and the skipped step gathers nothing new
    for name in ("full, NaN at step 4", "group 2 overlapped, NaN at step 4"):
        assert [r[name]["skipped_steps"] for r in runs] == [1] * WORLD
    assert close("group 2 overlapped, NaN at step 4", "full, NaN at step 4")
    assert _rel(losses("bf16 group 2 overlapped"), losses("bf16 full")) < 2e-2
    # resume across shard group sizes: steps 6-10 as the runs that never stopped
    for name, source in [
        ("group 2 from full", "full"),
        ("group 1 from group 2", "group 2 overlapped"),
        ("full from group 2", "group 2 overlapped"),
    ]:
        assert sorted(losses(name)) == [6, 7, 8, 9, 10]
        assert _rel(losses(name), {k: losses(source)[k] for k in losses(name)}) < 2e-6, name
    # only a shard's first replica saves it: the manifest's index still covers every element once, and
    # no resume opens every optimizer file. In shard groups of 2, ranks 2 and 3 replicate the dense
    # state of 0 and 1 and save none of it; a rank with all its state (S = 1) opens the files of the
    # dense shards (0, 1) and of its own EP rank's expert shards (0, 2 or 1, 3).
    _assert_the_manifest_holds_every_element_once(
        json.loads((tmp_path / "hybrid" / "global_step5" / "meta.json").read_text())
    )
    opened = {
        name: [sorted(f for f in r[name]["opened"] if f.startswith("optim_")) for r in runs]
        for name in ("group 2 from full", "group 1 from group 2", "full from group 2")
    }
    assert opened["group 1 from group 2"] == [[f"optim_rank{q:05d}.pt" for q in (0, 1, 2 + r % 2)] for r in range(4)]
    assert all(len(files) < 4 for per_rank in opened.values() for files in per_rank), opened
    for label in EXCHANGES:
        assert close(f"{label} group 2 overlapped", f"{label} full"), label
    assert first["group 3"]["error"] == (
        "LayoutError: shard group size 3 does not divide the 4 ranks of the data-parallel group (dense)"
    )

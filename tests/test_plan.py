"""The layout planner: its model of Mula against the real model, its memory model against real
runs, the time model's rules, the search, the configs it writes, the scaling report, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from distributed import run_distributed
from train_workers import ROOT, pretrain_worker, tiny_config

from ds_optimus.config import OptimusConfig
from ds_optimus.hf_models.mula import PRESETS, MulaConfig, MulaForCausalLM
from ds_optimus.parallel.traffic import expected_groups_hit
from ds_optimus.plan import (
    BUILTIN,
    Cluster,
    ClusterError,
    Layout,
    LayoutError,
    ModelShape,
    estimate_memory,
    estimate_time,
    evaluate,
    get_cluster,
    layout_config,
    search,
)
from ds_optimus.plan.__main__ import main as plan_main
from ds_optimus.plan.layout import hierarchy_node_size
from ds_optimus.plan.measure import measurement, measuring_config
from ds_optimus.plan.scaling import device_counts, efficiency, scaling
from ds_optimus.plan.search import candidate_layouts
from ds_optimus.plan.timing import Exchange, all_to_all_time, exchange_steps, overlapped
from ds_optimus.train.components import enable_activation_checkpointing, resolve_batch_sizes

TINY = dict(seq_len=128, dtype="fp32", overlap_comm=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


# -- the model -------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_dense_and_expert_split_is_the_real_models(preset):
    with torch.device("meta"):  # the real module's parameters, without their memory
        model = MulaForCausalLM(MulaConfig.from_preset(preset))
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    shape = ModelShape.from_preset(preset)
    assert (shape.dense_params, shape.expert_params) == (dense, expert)


def _saved_bytes(preset: str, dtype: torch.dtype, checkpointing: bool, batch: int = 4, seq: int = 64) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward pass."""
    torch.manual_seed(0)
    model = MulaForCausalLM(MulaConfig.from_preset(preset)).to(dtype)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize("preset", ["mula-tiny-moe", "mula-tiny-dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "ckpt"])
def test_activation_bytes_match_the_tensors_autograd_saves(preset, dtype, checkpointing):
    batch, seq = 4, 64
    measured = _saved_bytes(preset, dtype, checkpointing, batch, seq)
    shape = ModelShape.from_preset(preset)
    a = torch.empty((), dtype=dtype).element_size()
    predicted = batch * seq * shape.saved_bytes_per_token(a, checkpointing)
    # routing at random init is not perfectly even, and RoPE tables are per position, not per token
    assert abs(predicted / measured - 1) < 0.03, (predicted, measured)


# -- memory against real runs --------------------------------------------------------------------

MEMORY_RUNS = [
    dict(world=1, ep=1, zero=0, sharded=False, micro=8),
    dict(world=2, ep=2, zero=1, micro=8),
    dict(world=2, ep=1, zero=2, micro=4, accumulation=2),
    dict(world=2, ep=1, zero=1, sharded=False, micro=8, bucket_size=5_000_000),
    dict(world=4, ep=4, zero=2, micro=8),
    dict(world=4, ep=2, zero=1, micro=8, checkpointing=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", MEMORY_RUNS, ids=lambda s: Layout(**s).describe().replace(" ", "-"))
def test_memory_model_matches_every_ranks_measured_peak(tmp_path, spec, cache, monkeypatch):
    # the config `measure_layout` runs, on the shared worker processes rather than through a launcher
    # of its own (test_cli_measure_runs_the_top_layout_on_this_machine runs that path)
    monkeypatch.setenv("DS_OPTIMUS_MEASURE_CACHE", str(cache))
    layout = Layout(**{**TINY, **spec})
    config = measuring_config(layout, "mula-tiny-moe", tmp_path, steps=3, memory_steps=2)
    measured = measurement(layout, run_distributed(pretrain_worker, layout.world, config)[0], 2)
    estimate = estimate_memory(ModelShape.from_preset("mula-tiny-moe"), layout)
    assert len(measured.peak_bytes) == layout.world
    for peak in measured.peak_bytes:
        assert abs(estimate.peak / peak - 1) < 0.10, (estimate.as_dict(), measured.peak_bytes)
    if layout.sharded:  # once the engine is built: the weights and the sharded optimizer's states
        states = estimate.weights + estimate.optimizer_state
        for held in measured.initialized_bytes:
            assert abs(states / held - 1) < 0.05, (states, measured.initialized_bytes)


def test_memory_model_follows_the_layout():
    shape = ModelShape.from_preset("mula-7b-a1b")
    base = Layout(world=64, ep=8, zero=1, micro=2, accumulation=8)
    m = estimate_memory(shape, base)
    # 16 bytes per parameter of fp32 master, moments and reduced gradient, sharded over DP and EDP
    assert m.optimizer_state == pytest.approx(16 * (shape.dense_params / 64 + shape.expert_params / 8 / 8))
    assert m.weights == pytest.approx(2 * (shape.dense_params + shape.expert_params / 8))
    assert estimate_memory(shape, base.with_(ep=16)).static < m.static
    assert estimate_memory(shape, base.with_(zero=2)).gradients < m.gradients  # no full-size buckets
    assert estimate_memory(shape, base.with_(micro=4, accumulation=4)).activations == pytest.approx(2 * m.activations)
    ckpt = estimate_memory(shape, base.with_(checkpointing=True))
    assert ckpt.activations < m.activations / 3 and ckpt.peak < m.peak
    # with a small vocabulary the loss's gradients are small and the peak is inside the last MoE
    # layer, where its all-to-all buffers (send and receive rows) sit on top of the activations
    small = dataclasses.replace(shape, vocab=512)
    inside = estimate_memory(small, base)
    assert inside.moment == "all-to-all of the last MoE layer"
    assert inside.all_to_all == 2 * 2 * 4096 * shape.top_k * shape.hidden * 2
    assert inside.peak > inside.start_of_backward
    # DeepSpeed ZeRO-0 keeps full fp32 master weights, moments and gradients on every rank
    z0 = estimate_memory(shape, base.with_(zero=0, sharded=False))
    assert z0.optimizer_state == pytest.approx(16 * (shape.dense_params + shape.expert_params / 8))


# -- time ---------------------------------------------------------------------------------------

def test_time_model_rules():
    h100 = BUILTIN["h100"]
    shape = ModelShape.from_preset("mula-7b-a1b")
    base = Layout(world=64, ep=8, zero=1, micro=2, accumulation=8)
    t = estimate_time(shape, base, h100)
    assert estimate_time(shape, base.with_(ep=1), h100).all_to_all == 0.0
    # recomputation: the layers' forward (a third of their FLOPs) once more, not the LM head's (7 % here)
    extra = estimate_time(shape, base.with_(checkpointing=True), h100).compute / t.compute - 1
    assert 0.28 < extra < 1 / 3
    # ZeRO-2 reduces at every micro-batch, ZeRO-1 once per step
    assert estimate_time(shape, base.with_(zero=2), h100).grad_reduce >= t.grad_reduce
    # EP inside a node runs on NVLink; across nodes on the NICs
    inside = all_to_all_time(1e9, 8, h100, False)
    across = all_to_all_time(1e9, 16, h100, False)
    assert across > 5 * inside
    # the two-step exchange pays less latency when the group spans many nodes
    many = all_to_all_time(1e6, 512, h100, False)
    assert all_to_all_time(1e6, 512, h100, True) < many
    # pipeline bubble: (pp - 1) micro-batch slots of fill and drain
    pp = estimate_time(shape, base.with_(pp=4, ep=2), h100)
    assert pp.bubble > 0 and pp.bubble >= 3 * pp.compute / 8


def _uniform_top_k(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Expert ids of uniform routing: `top_k` distinct experts per token, every subset alike."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices


def _distinct(ids: torch.Tensor, groups: int, experts: int) -> torch.Tensor:
    """Per token, which of `groups` equal groups of consecutive experts its ids fall in ([T, groups])."""
    hit = torch.zeros(ids.shape[0], groups, dtype=torch.bool)
    return hit.scatter_(1, ids // (experts // groups), True)


@pytest.mark.parametrize("experts, top_k, groups", [(64, 8, 4), (256, 8, 16)])
def test_expected_groups_hit_matches_simulated_routing(experts, top_k, groups):
    # the rows per token the deduplicated exchange sends: distinct ranks among a token's experts
    ids = _uniform_top_k(200_000, experts, top_k)
    measured = _distinct(ids, groups, experts).sum(1).double().mean().item()
    assert expected_groups_hit(experts, top_k, groups) == pytest.approx(measured, rel=0.01)


def test_hierarchical_dedup_rows_match_simulated_routing():
    # 2 nodes of 8 ranks, 64 experts, top-8, from rank 0: rows to the other node (once per node hit)
    # and rows fanned out inside each node hit to the ranks other than the rail's (local index 0)
    experts, top_k, ep, n = 64, 8, 16, 8
    ids = _uniform_top_k(200_000, experts, top_k, seed=1)
    ranks = _distinct(ids, ep, experts).view(-1, ep // n, n)  # [T, node, local index]
    inter = ranks[:, 1:].any(dim=2).sum(1).double().mean().item()
    inside = ranks[:, :, 1:].sum((1, 2)).double().mean().item()
    (between_on, between_off), (fan_out, fan_off) = exchange_steps(Exchange(1.0, 1.0, experts, top_k, dedup=True),
                                                                   ep, n, True)
    assert between_on == fan_off == 0.0
    assert between_off == pytest.approx(inter, rel=0.01) and fan_out == pytest.approx(inside, rel=0.01)


def test_dedup_sends_fewer_rows_and_takes_less_time():
    h100 = BUILTIN["h100"]
    olmoe = ModelShape.from_preset("mula-7b-a1b")  # 64 experts, top-8
    inside = Layout(world=8, ep=4, micro=2, accumulation=4)
    slot, dedup = (estimate_time(olmoe, inside.with_(dedup=d), h100) for d in (False, True))
    assert 0 < dedup.all_to_all < slot.all_to_all
    assert dedup.compute == slot.compute
    # two nodes, hierarchical: per slot a token's rows for the other node are 4 of its 8; deduplicated,
    # one row if any of its experts is there
    per_slot = exchange_steps(Exchange(1.0, 1.0, 64, 8), 16, 8, True)
    deduplicated = exchange_steps(Exchange(1.0, 1.0, 64, 8, dedup=True), 16, 8, True)
    assert per_slot[0][1] == pytest.approx(4.0)
    assert per_slot[0][1] >= 3 * deduplicated[0][1]
    # flat per slot sends the same 4 rows per token off the node: the saving is the dedup's
    assert exchange_steps(Exchange(1.0, 1.0, 64, 8), 16, 8, False)[0][1] == pytest.approx(4.0)


def test_hierarchical_sub_nodes_where_groups_are_not_aligned_to_nodes():
    assert hierarchy_node_size(16, 12) == 4  # Aurora: sub-nodes of 4 tiles, 3 to a node
    assert hierarchy_node_size(32, 8) == 8 and hierarchy_node_size(8, 8) is None
    assert hierarchy_node_size(4, 12) is None and hierarchy_node_size(7, 12) is None
    # EP 16 over 12-tile nodes: 4 sub-nodes, 3 others; by the unaligned rule a rank has 6 of its group
    # on its node, so 10 of the 12 ranks of the other sub-nodes (10/12 of their rows) are off-node
    (on, off), (fan_out, fan_off) = exchange_steps(Exchange(1.0, 1.0, 256, 8), 16, 12, True)
    assert (on + off, off / (on + off)) == (pytest.approx(6.0), pytest.approx(10 / 12))
    assert fan_out == pytest.approx(8 * 3 / 4) and fan_off == 0.0
    aurora = get_cluster("aurora")
    # EP 8 over 12-tile nodes: every third group straddles two nodes, half of a rank's peers off-node
    nic = aurora.inter_node_gbps * 1e9 * aurora.comm_efficiency
    assert all_to_all_time(1e9, 8, aurora, False) == pytest.approx(0.5e9 / nic + 7 * 15e-6)
    layouts = candidate_layouts(ModelShape.from_preset("mula-220b-a10b"), aurora, 384, 768, 4096)
    hier = {lay.ep for lay in layouts if lay.hierarchical}
    # EP sizes dividing the 240 experts and the 384 ranks whose groups leave a 12-tile node
    assert hier == {e for e in range(2, 385) if 240 % e == 0 and 384 % e == 0 and 12 % e != 0} == {8, 16, 24, 48}
    assert {(lay.dedup, lay.chunks) for lay in layouts if lay.ep > 1} == {(False, 1), (True, 1), (True, 2), (True, 4)}
    assert {(lay.dedup, lay.chunks) for lay in layouts if lay.ep == 1} == {(False, 1)}
    # a machine whose ranks share its cores overlaps nothing: no chunks are tried there
    cpu = dataclasses.replace(aurora, shared_compute=True)
    assert max(lay.chunks for lay in candidate_layouts(ModelShape.from_preset("mula-tiny-moe"), cpu, 2, 2, 128,
                                                         dtype="fp32")) == 1


def test_overlap_hides_the_exchange_under_the_experts_only():
    for a in (0.0, 0.5, 1.0, 2.0, 5.0):
        for b in (0.0, 0.7, 1.0, 3.0):
            exposed = [overlapped(a, b, c) for c in (1, 2, 4, 8)]
            assert exposed[0] == pytest.approx(a)
            assert all(x >= y - 1e-12 for x, y in zip(exposed, exposed[1:], strict=False))
            assert min(exposed) >= max(0.0, a - b) - 1e-12
    aurora = BUILTIN["aurora"]
    shape = ModelShape.from_preset("mula-220b-a10b")
    base = Layout(world=384, ep=16, zero=2, micro=2, checkpointing=True, hierarchical=True, dedup=True)
    one, four = estimate_time(shape, base, aurora), estimate_time(shape, base.with_(chunks=4), aurora)
    assert four.all_to_all < one.all_to_all and four.compute == one.compute
    assert four.all_to_all >= max(0.0, one.all_to_all - one.experts)
    assert four.all_to_all + four.all_to_all_hidden > one.all_to_all  # four times the latency
    # chunks=1 is the un-overlapped exchange: 6 per MoE layer (forward, backward, recomputation)
    rows = Exchange(2 * 4096, shape.hidden * 2, shape.experts, shape.top_k, dedup=True, meta_bytes=8 * (2 + 4))
    plain = shape.moe_layers * (6 * all_to_all_time(rows, 16, aurora, True)
                                + 2 * all_to_all_time(4.0 * shape.experts, 16, aurora, True))
    assert one.all_to_all == pytest.approx(plain) and one.all_to_all_hidden == 0.0
    # cutting an exchange into chunks pays its latency once per chunk
    latency = all_to_all_time(rows, 16, aurora, True, chunks=2) - all_to_all_time(rows, 16, aurora, True)
    assert latency == pytest.approx(3 * 8e-6 + 3 * 15e-6)


def test_layout_exchange_options():
    lay = Layout(world=384, ep=16, hierarchical=True, dedup=True, chunks=4)
    assert lay.describe().endswith("hier dedup ovl4")
    assert Layout(**json.loads(json.dumps(lay.to_json()))) == lay
    with pytest.raises(LayoutError, match="chunks 2 needs dedup"):
        Layout(world=8, ep=8, chunks=2).check(experts=64)
    with pytest.raises(LayoutError, match="chunks must be a positive integer"):
        Layout(world=8, ep=8, dedup=True, chunks=0).check(experts=64)
    with pytest.raises(LayoutError, match="dedup must be true or false"):
        Layout(world=8, ep=8, dedup="auto").check(experts=64)


# -- search -------------------------------------------------------------------------------------

def test_search_returns_fitting_valid_layouts_fastest_first():
    shape = ModelShape.from_preset("mula-7b-a1b")
    cluster = BUILTIN["h100"]
    plans, tried = search(shape, cluster, 64, 1024, 4096)
    assert tried > len(plans) > 10
    steps = [p.time.step for p in plans]
    assert all(a <= b * 1.02 for a, b in zip(steps, steps[1:], strict=False))  # ordered, up to the 2 % tie band
    assert steps[0] <= min(steps) * 1.02
    for plan in plans:
        lay = plan.layout
        assert plan.memory.peak <= cluster.usable_bytes
        assert shape.experts % lay.ep == 0 and lay.dp % lay.ep == 0 and lay.global_batch == 1024
    # what did not fit is really too big: the full-state ZeRO-0 with everything replicated
    z0 = evaluate(shape, Layout(world=64, ep=1, zero=0, sharded=False, micro=8, accumulation=2), cluster)
    assert not z0.fits
    assert all(p.layout != z0.layout for p in plans)


def test_planned_config_is_a_valid_config_for_its_world_size():
    shape = ModelShape.from_preset("mula-7b-a1b")
    cluster = BUILTIN["h100"]
    best = search(shape, cluster, 64, 1024, 4096)[0][0]
    config = layout_config(best.layout, "mula-7b-a1b", cluster)
    opt = OptimusConfig.from_ds_config(config)
    assert opt.expert_parallel.size == best.layout.ep
    assert opt.sharded_optimizer.enabled == best.layout.sharded
    assert opt.train.recompute == best.layout.checkpointing  # a bool or the parts recomputed
    assert config["zero_optimization"]["stage"] == best.layout.zero
    micro, accumulation = resolve_batch_sizes(dict(config), 64)
    assert (micro, accumulation) == (best.layout.micro, best.layout.accumulation)
    with pytest.raises(LayoutError, match="pipeline"):
        layout_config(best.layout.with_(pp=2), "mula-7b-a1b", cluster)


@pytest.mark.parametrize("cluster, ep, node_size", [("aurora", 16, 4), ("h100", 16, 8)])
def test_planned_config_carries_the_exchange(cluster, ep, node_size):
    cluster = BUILTIN[cluster]
    base = Layout(world=384, ep=ep, zero=2, micro=2, checkpointing=True)
    for layout, want in [(base, {"size": ep, "node_size": None, "dedup": False, "chunks": 1}),
                         (base.with_(hierarchical=True, dedup=True, chunks=4),
                          {"size": ep, "node_size": node_size, "dedup": True, "chunks": 4})]:
        config = layout_config(layout, "mula-220b-a10b", cluster)
        assert config["optimus"]["expert_parallel"] == want
        parsed = OptimusConfig.from_ds_config(json.loads(json.dumps(config))).expert_parallel
        assert (parsed.size, parsed.node_size, parsed.dedup, parsed.chunks) == tuple(want.values())


def test_layout_and_cluster_errors_are_one_line(tmp_path):
    with pytest.raises(LayoutError, match="does not divide the 64 experts"):
        Layout(world=48, ep=48).check(experts=64)
    with pytest.raises(LayoutError, match="sharded optimizer is ZeRO stage 1 or 2"):
        Layout(world=2, zero=0, sharded=True).check()
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({**BUILTIN["h100"].to_json(), "nic": 3}))
    with pytest.raises(ClusterError, match="unknown cluster key 'nic'"):
        get_cluster(str(bad))
    bad.write_text(json.dumps({**BUILTIN["h100"].to_json(), "comm_efficiency": 1.5}))
    with pytest.raises(ClusterError, match="comm_efficiency"):
        get_cluster(str(bad))
    with pytest.raises(ClusterError, match="no cluster named 'dgx'"):
        get_cluster("dgx")


def test_user_cluster_from_json(tmp_path):
    mine = {"name": "a100", "device": "A100 80GB", "devices_per_node": 8, "memory_gib": 80, "peak_tflops": 312,
            "intra_node_gbps": 300, "inter_node_gbps": 25}
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(mine))
    cluster = get_cluster(str(path))
    assert isinstance(cluster, Cluster) and cluster.peak_tflops == 312
    shape = ModelShape.from_preset("mula-7b-a1b")
    slower = search(shape, cluster, 64, 1024, 4096)[0][0]
    faster = search(shape, BUILTIN["h100"], 64, 1024, 4096)[0][0]
    assert slower.tokens_per_s < faster.tokens_per_s


# -- scaling ------------------------------------------------------------------------------------

def test_scaling_report_of_mula_220b_on_aurora(tmp_path):
    shape = ModelShape.from_preset("mula-220b-a10b")
    aurora = BUILTIN["aurora"]
    counts = device_counts(384, 12288)
    assert counts == [384, 768, 1536, 3072, 6144, 12288]
    points = scaling(shape, aurora, counts, 2, 4096)
    effs = efficiency(points)
    assert all(p.plan is not None for p in points) and effs[0] == 1.0
    # above 1 where more replicas shard the optimizer state enough for a cheaper recomputation to fit
    # (from 1,536 tiles the attention's instead of the MoE block's)
    assert all(0.5 < e <= 1.15 for e in effs)
    assert effs[-1] < 0.99 * max(effs)  # tapered global links and stragglers cost something at 1,024 nodes
    png, out = tmp_path / "s.png", tmp_path / "s.json"
    code = plan_main(["--model", "mula-220b-a10b", "--cluster", "aurora", "--devices", "384", "--global-batch", "768",
                      "--scale", "384:12288", "--png", str(png), "--json", str(out), "--reference-efficiency", "0.9"])
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    report = json.loads(out.read_text())
    assert [row["devices"] for row in report["scaling"]] == counts
    assert report["scaling"][-1]["efficiency"] == pytest.approx(effs[-1])


# -- the command line ---------------------------------------------------------------------------

def test_cli_plans_7b_on_64_h100_and_writes_a_runnable_config(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = plan_main(["--model", "mula-7b-a1b", "--cluster", "h100", "--devices", "64", "--top", "5",
                      "--write", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "layouts tried" in text and "tokens/s" in text and "MFU" in text
    # the first row is within 2 % of the fastest but not it: the output says so
    assert re.search(r"^note: row 1 is not the fastest: .* is predicted \d\.\d% faster; layouts within 2% of each "
                     r"other are ranked by the sharded optimizer first", text, re.M), text
    config = json.loads(out.read_text())
    assert config["optimus"]["model"]["preset"] == "mula-7b-a1b"
    assert config["train_batch_size"] == 1024
    assert config["optimus"]["train"]["peak_tflops"] == 989.0
    OptimusConfig.from_ds_config(config)


def test_cli_writes_a_config_per_device_count_with_scale_and_each_passes_the_check(tmp_path, capsys):
    from ds_optimus.plan.preflight import check_run

    code = plan_main(["--model", "mula-7b-a1b", "--cluster", "h100", "--devices", "16", "--global-batch", "256",
                      "--scale", "16:64", "--write", str(tmp_path / "mula-7b.json")])
    text = capsys.readouterr().out
    assert code == 0
    written = sorted(tmp_path.glob("*.json"))
    assert [p.name for p in written] == ["mula-7b-16.json", "mula-7b-32.json", "mula-7b-64.json"], text
    for path, devices in zip(written, (16, 32, 64), strict=True):
        assert f"wrote {path} (dp{devices} " in text
        config = json.loads(path.read_text())
        assert config["train_batch_size"] == 16 * devices  # weak scaling: 16 sequences per device
        lines = check_run(config, devices, "h100")  # what the planner writes, the check accepts
        assert any(line.startswith(f"layout    {devices} ranks (--world)") for line in lines)


def test_cli_errors_are_one_line(capsys):
    done = subprocess.run([sys.executable, "-m", "ds_optimus.plan", "--cluster", "nowhere"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # the real command line, once
    assert done.returncode == 2 and done.stderr.startswith("ds_optimus.plan: error: no cluster named 'nowhere'")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for argv, message in [
        (["--model", "mula-3b"], "unknown Mula preset 'mula-3b'"),
        (["--model", "mula-220b-a10b", "--cluster", "h100", "--devices", "8"], "no layout of mula-220b-a10b fits"),
        (["--scale", "64-128"], "--scale takes N:M"),
        (["--devices", "48", "--global-batch", "1000"], "does not divide over the data-parallel ranks"),
        (["--devices", "64", "--measure", "2"], "--measure runs the layouts on this machine"),
    ]:
        assert plan_main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ds_optimus.plan: error: ") and message in lines[0], lines


@pytest.mark.slow
def test_cli_measure_runs_the_top_layout_on_this_machine(tmp_path, cache):
    os.environ["DS_OPTIMUS_MEASURE_CACHE"] = str(cache)
    out = tmp_path / "m.json"
    code = plan_main(["--model", "mula-tiny-moe", "--cluster", "local", "--devices", "2", "--optimizer", "sharded",
                      "--measure", "1", "--measure-steps", "3", "--json", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["measured"][0]
    assert abs(row["predicted_peak_bytes"] / row["measured_peak_bytes"] - 1) < 0.10
    assert row["measured_step_s"] > 0 and len(row["measured_peak_bytes_per_rank"]) == 2


# -- the training options the planner uses ----------------------------------------------------

@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_losses(tmp_path, cache):
    # whole layers, and the parts of each (the MoE block's replay repeats its all-to-alls at EP 2)
    losses, peaks = [], []
    for ckpt in (False, True, ["moe", "attention", "norms"]):
        config = tiny_config(tmp_path / str(len(losses)), cache, expert_parallel={"size": 2},
                             train={"steps": 3, "eval_interval": 0, "activation_checkpointing": ckpt,
                                    "measure_memory_steps": 2})
        config["optimus"]["checkpoint"] = {"interval": 0, "keep_last": 1}
        summary = run_distributed(pretrain_worker, 2, config)[0]
        losses.append([summary["losses"][s] for s in sorted(summary["losses"])])
        assert [m["peak_bytes"] > m["marks"]["initialized"] > 0 for m in summary["memory"]] == [True, True]
        peaks.append([m["peak_bytes"] for m in summary["memory"]])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and losses[0] == pytest.approx(losses[2], rel=1e-6)
    assert all(parts < none for parts, none in zip(peaks[2], peaks[0], strict=True)), peaks

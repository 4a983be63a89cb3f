"""Expert parallelism on several CPU processes (gloo): EP=1/2/4 and the hierarchical exchange give
the single-process outputs and gradients; global-batch load balancing; DeepSpeed ZeRO reduces expert
gradients over the expert-data-parallel group; layout errors are one line."""

import needs
import pytest
import torch
from distributed import run_distributed
from ep_workers import (
    bad_layout,
    deepspeed_sgd_step,
    dispatcher_edge_cases,
    ep_exchange_variants,
    ep_forward_backward,
    global_batch_aux_loss,
    reference_aux_loss,
    reference_forward_backward,
    reference_sgd_step,
)

from ds_optimus.parallel import check_layout

pytestmark = pytest.mark.slow


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def reference():
    return reference_forward_backward({})


def _check_against_reference(results, ref, tol):
    for r in results:
        assert rel(r["logits"], ref["logits"][r["rows"]]) <= tol
        assert set(r["grads"]) == set(ref["grads"])
        for name, grad in r["grads"].items():
            assert rel(grad, ref["grads"][name]) <= tol, name


@pytest.mark.parametrize("world, ep_size", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_single_process(world, ep_size, reference):
    results = run_distributed(ep_forward_backward, world, ep_size, None, {})
    _check_against_reference(results, reference, 1e-5)


@pytest.mark.parametrize("reentrant", [True, False])
def test_expert_parallel_under_activation_checkpointing(reentrant, reference):
    """Recomputation repeats the exchanges. The overlapped exchange keeps no layer's rows between the
    forward and backward passes (that is what checkpointing is for): the backward pass uses the
    recomputation's; without checkpointing all 4 layers keep theirs."""
    config = {"optimus": {"expert_parallel": {"size": 2, "dedup": True, "chunks": 2}}}
    results = run_distributed(ep_forward_backward, 2, config, None, {"checkpointing": reentrant})
    _check_against_reference(results, reference, 1e-5)
    assert all(r["kept_runs"] == 0 and r["runs"] == 4 for r in results)
    plain = run_distributed(ep_forward_backward, 2, config, None, {})
    assert all(r["kept_runs"] == r["runs"] == 4 for r in plain)


def test_hierarchical_per_slot_exchange_equals_flat(reference):
    flat = run_distributed(
        ep_forward_backward, 4, {"optimus": {"expert_parallel": {"size": 4, "dedup": False}}}, None, {}
    )
    config = {"optimus": {"expert_parallel": {"size": 4, "node_size": 2, "dedup": False}}}  # two "nodes" of two
    hier = run_distributed(ep_forward_backward, 4, config, None, {})
    _check_against_reference(hier, reference, 1e-5)
    for f, h in zip(flat, hier, strict=True):  # same rows in the same order: bitwise the same
        assert torch.equal(f["logits"], h["logits"])
        assert all(torch.equal(f["grads"][n], h["grads"][n]) for n in f["grads"])


def test_hierarchical_exchanges_with_unequal_node_count_and_size():
    """6 ranks as 3 nodes of 2 or 2 nodes of 3, per slot and deduplicated: node count and node size
    differ, so any mix-up of the two in the exchanges' bookkeeping shows."""
    overrides = {"num_experts": 12}
    ref = reference_forward_backward(overrides, batch=12)
    variants = [
        {"model": overrides, "expert_parallel": {"size": 6, "node_size": n, "dedup": d}}
        for n in (2, 3)
        for d in (False, True)
    ]
    results = run_distributed(ep_exchange_variants, 6, variants, 12)
    for i, variant in enumerate(variants):
        assert all(r[i]["dedup"] == variant["expert_parallel"]["dedup"] for r in results)
        _check_against_reference([r[i] for r in results], ref, 1e-5)


# Routings: as the router spreads them; every token's slots on rank 0's experts (0 and 1: the other
# ranks receive nothing); slots dropped past an expert's capacity.
ROUTINGS = {
    "spread": {},
    "all on one rank": {"bias": {0: 10.0, 1: 10.0}},
    "capacity": {"model": {"moe_capacity_factor": 0.5}},
}
EXCHANGES = [{"dedup": False}, {"dedup": True}, {"dedup": True, "chunks": 3}]


@pytest.mark.parametrize(
    "world, layout",
    [(2, {"size": 2}), (4, {"size": 4}), (4, {"size": 4, "node_size": 2})],
    ids=["ep2", "ep4", "ep4-hierarchical-2x2"],
)
def test_deduplicated_exchange_equals_per_slot(world, layout):
    """Outputs and every gradient within float32 rounding of the per-slot exchange, chunked or not;
    with every slot on one rank it sends top_k (2) times fewer hidden rows: exactly, per rank, in the
    flat exchange; between the two nodes in the hierarchical one."""
    variants = [
        {**routing, "expert_parallel": {**layout, **exchange}}
        for routing in ROUTINGS.values()
        for exchange in EXCHANGES
    ]
    results = run_distributed(ep_exchange_variants, world, variants)
    for i, routing in enumerate(ROUTINGS):
        per_slot, *deduplicated = ([r[len(EXCHANGES) * i + j] for r in results] for j in range(len(EXCHANGES)))
        for dedup in deduplicated:
            for a, b in zip(dedup, per_slot, strict=True):
                assert a["dedup"] and not b["dedup"]
                assert rel(a["logits"], b["logits"]) <= 1e-5, routing
                for name, grad in b["grads"].items():
                    assert rel(a["grads"][name], grad) <= 1e-5, (routing, name)
            if routing == "all on one rank":
                if "node_size" in layout:
                    assert (
                        sum(b["rows_between_nodes"] for b in per_slot)
                        == 2 * sum(a["rows_between_nodes"] for a in dedup)
                        > 0
                    )
                else:
                    assert [b["rows_sent"] for b in per_slot] == [2 * a["rows_sent"] for a in dedup]
            else:
                assert sum(a["rows_sent"] for a in dedup) < sum(b["rows_sent"] for b in per_slot)


def test_bfloat16_expert_parallel_is_as_close_to_float32_as_one_process():
    """bf16 under EP 2. The per-slot exchange moves rows bitwise, so it stays within 2 % of the same
    bf16 model on one process. The deduplicated one also rounds each rank's partial sums to bf16
    before they travel back (as DeepEP's combine does), which can flip later routing decisions: it
    is held to the float32 model instead, no further from it than one bf16 process is."""
    truth = reference_forward_backward({})
    ref = reference_forward_backward({"dtype": "bfloat16"})
    variants = [{"model": {"dtype": "bfloat16"}, "expert_parallel": {"size": 2, "dedup": d}} for d in (False, True)]
    results = run_distributed(ep_exchange_variants, 2, variants)

    def worst(run, against):
        return max(rel(run["grads"][n].float(), against["grads"][n].float()) for n in against["grads"])

    one_process = worst(ref, truth)
    for per_slot, dedup in results:
        assert per_slot["logits"].dtype == dedup["logits"].dtype == torch.bfloat16
        assert rel(per_slot["logits"].float(), ref["logits"][per_slot["rows"]].float()) <= 2e-2
        assert worst(per_slot, ref) <= 2e-2
        assert rel(dedup["logits"].float(), truth["logits"][dedup["rows"]].float()) <= 2e-2
        assert worst(dedup, truth) <= 1.25 * one_process


def test_global_batch_load_balancing_over_ranks():
    ref = reference_aux_loss()
    results = run_distributed(global_batch_aux_loss, 2)
    for r in results:
        torch.testing.assert_close(r["aux"], ref["aux"], rtol=1e-5, atol=1e-7)
        for name, grad in r["grads"].items():
            assert rel(grad, ref["grads"][name]) <= 1e-5, name


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_reduces_expert_gradients_over_edp(stage):
    """4 ranks at EP=2: ZeRO must average dense gradients over all ranks and expert gradients over the
    expert-data-parallel pairs {0,2} and {1,3}; one SGD step then equals the single-process step."""
    needs.module("deepspeed", "pip install -e .")
    ref = reference_sgd_step(world=4)
    results = run_distributed(deepspeed_sgd_step, 4, 2, stage)
    for r in results:
        # the engine registers the EDP group the experts declare, when it meets the model
        assert r["has_moe_layers"] and r["registered"] == [False, True]
        assert set(r["params"]) == set(ref)
        for name, value in r["params"].items():
            assert rel(value, ref[name]) <= 1e-5, name
        # DeepSpeed's own MoE checkpointing would save one rank's expert shard for all: refused.
        assert r["checkpoint_refused"].startswith("DeepSpeed's own checkpoints cannot hold a ds_optimus")


def test_layout_errors_are_one_line():
    with pytest.raises(ValueError, match=r"^expert parallel size 3 does not divide the world size 4$"):
        check_layout(4, 3)
    with pytest.raises(ValueError, match=r"^node size 3 does not divide the expert parallel size 4$"):
        check_layout(4, 4, node_size=3)
    messages = run_distributed(bad_layout, 4, 4, {"num_experts": 6})
    assert messages == ["expert parallel size 4 does not divide the number of experts 6"] * 4


def test_export_pretrained_of_an_expert_parallel_model_writes_the_full_experts(tmp_path):
    """export_pretrained on every rank: one folder holding all 8 experts, complete when any rank
    returns, reloading to the sharded model's logits; a plain save_pretrained of the sharded model is
    a one-line refusal naming export_pretrained, and writes nothing."""
    from ep_workers import global_batch, save_expert_parallel
    from transformers import AutoModelForCausalLM

    results = run_distributed(save_expert_parallel, 2, 2, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape[0] == loaded.config.num_experts == 8
    ids, _ = global_batch(4, 2, 10, loaded.config.vocab_size)
    torch.testing.assert_close(loaded(ids).logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1]["logits"], results[0]["logits"])
    assert [r["complete"] for r in results] == [True, True]
    for r in results:
        assert not r["plain_written"]
        assert r["refused"] == (
            "save_pretrained: model.layers.0.mlp.experts holds 4 of its 8 experts "
            "(expert-parallel); export on every rank with "
            "ds_optimus.parallel.export_pretrained(model, folder)"
        )


@pytest.mark.parametrize("node_size", [None, 2], ids=["flat", "hierarchical-2x2"])
def test_deduplicated_exchange_with_ranks_and_chunks_that_have_no_tokens(node_size):
    """Hand-made routing at EP 4 (8 experts, top-3 with dropped slots): a rank sending nothing,
    ranks with fewer tokens than chunks, and expert weights without gradients, against the sum on
    one rank with every expert."""
    cases = [{"node_size": node_size, "chunks": c, "tokens": [0, 5, 2, 7]} for c in (1, 3)]
    cases.append({"node_size": node_size, "chunks": 3, "tokens": [4, 0, 1, 6], "frozen": True})
    cases.append({"node_size": node_size, "chunks": 2, "tokens": [3, 3, 3, 3], "copying_hook": True})
    results = run_distributed(dispatcher_edge_cases, 4, cases)
    for rank, per_case in enumerate(results):
        for case, diffs in zip(cases[:-1], per_case[:-1], strict=True):
            assert max(diffs.values()) <= 1e-5, (rank, case, diffs)
        # the overlapped exchange's forward state hangs on a saved tensor, which such a hook copies
        assert per_case[-1]["error"].startswith(
            "the overlapped expert-parallel exchange lost its forward state: a saved-tensor hook copied it"
        )


def test_auto_picks_the_exchange_that_sends_fewer_bytes():
    from ds_optimus.parallel.traffic import dedup_sends_fewer_bytes, expected_groups_hit

    # 8 experts, top-2, EP 2: a token reaches 1.57 ranks on average instead of sending 2 rows
    assert expected_groups_hit(8, 2, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert dedup_sends_fewer_bytes(8, 2, 2, row_bytes=4 * 128)
    # one expert per rank: every slot is its own destination, and the ids and weights are extra
    assert expected_groups_hit(4, 2, 4) == pytest.approx(2)
    assert not dedup_sends_fewer_bytes(4, 2, 4, row_bytes=4 * 128)
    # OLMoE-shaped: 64 experts, top-8, EP 4 -> 3.66 of 8 rows
    assert expected_groups_hit(64, 8, 4) == pytest.approx(3.659, abs=1e-3)


def test_the_exchange_benchmark_runs_and_counts_fewer_bytes():
    """`benchmarks/ep_dispatch.py --dry-run` (64 tokens per rank, one repeat) on 4 processes."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "ep_dispatch.py"
    run = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--no-deepspeed"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r"dedup sends ([\d.]+)x fewer bytes per rank .* ([\d.]+)x fewer bytes between nodes", run.stdout)
    assert found and float(found[1]) > 1.5 and float(found[2]) > 2.5, run.stdout[-2000:]

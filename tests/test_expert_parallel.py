"""Expert parallelism on several CPU processes (gloo): EP=1/2/4 and the hierarchical exchange give
the single-process outputs and gradients; global-batch load balancing; DeepSpeed ZeRO reduces expert
gradients over the expert-data-parallel group; layout errors are one line."""

import pytest
import torch
from distributed import run_distributed
from ep_workers import (
    bad_layout,
    deepspeed_sgd_step,
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
    results = run_distributed(ep_forward_backward, 2, 2, None, {"checkpointing": reentrant})
    _check_against_reference(results, reference, 1e-5)


def test_hierarchical_exchange_equals_flat(reference):
    flat = run_distributed(ep_forward_backward, 4, 4, None, {})
    config = {"optimus": {"expert_parallel": {"size": 4, "node_size": 2}}}  # two "nodes" of two ranks
    hier = run_distributed(ep_forward_backward, 4, config, None, {})
    _check_against_reference(hier, reference, 1e-5)
    for f, h in zip(flat, hier, strict=True):  # same rows in the same order: bitwise the same
        assert torch.equal(f["logits"], h["logits"])
        assert all(torch.equal(f["grads"][n], h["grads"][n]) for n in f["grads"])


@pytest.mark.parametrize("node_size", [2, 3])
def test_hierarchical_exchange_with_unequal_node_count_and_size(node_size):
    """6 ranks as 3 nodes of 2 or 2 nodes of 3: node count and node size differ, so any mix-up of
    the two in the exchange's bookkeeping shows."""
    overrides = {"num_experts": 12}
    ref = reference_forward_backward(overrides, batch=12)
    results = run_distributed(ep_forward_backward, 6, 6, node_size, overrides, 12)
    _check_against_reference(results, ref, 1e-5)


def test_bfloat16_expert_parallel_matches_single_process_bfloat16():
    """Against the same bf16 model on one process with Mula's eager experts (the exchange is bitwise,
    so only the rounding order of the summed gradients differs)."""
    ref = reference_forward_backward({"dtype": "bfloat16"})
    results = run_distributed(ep_forward_backward, 2, 2, None, {"dtype": "bfloat16"})
    for r in results:
        assert r["logits"].dtype == torch.bfloat16
        assert rel(r["logits"].float(), ref["logits"][r["rows"]].float()) <= 2e-2
        for name, grad in r["grads"].items():
            assert rel(grad.float(), ref["grads"][name].float()) <= 2e-2, name


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
    pytest.importorskip("deepspeed")
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
        assert r["refused"] == ("save_pretrained: model.layers.0.mlp.experts holds 4 of its 8 experts "
                                "(expert-parallel); export on every rank with "
                                "ds_optimus.parallel.export_pretrained(model, folder)")
